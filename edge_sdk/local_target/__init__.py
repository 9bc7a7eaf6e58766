"""The target on the device under a memory budget (CATS): resident + streamed layers
(:mod:`.runner`), storage emulation (:mod:`.storage`), the budget and cost model
(:mod:`.budget`) and self-speculative cascaded decoding (:mod:`.cats`)."""
