"""WISV: opt-in *semantic* (lossy) acceptance on the verifier (Wireless-Informed Semantic
Verification, the WISV paper §III).

At a greedy block's first mismatch (draft token ``d`` != the target's argmax ``t``) a small
decision head reads the target's own hidden state at that position plus a few scalars of
the target's distribution and outputs P("accepting d keeps the task outcome"); the draft
token is accepted when that probability clears a threshold that relaxes as the link the
edge reports worsens. Verification then goes on along the draft (the pass already holds
the rows after ``d``). Never on unless a session asks for ``acceptance="semantic"``;
every response counts the tokens accepted that way.

Mechanism pieces: :mod:`.features` (the head's inputs), :mod:`.head` (the classifier and
its file + manifest), :mod:`.threshold` (the channel-aware threshold).
"""
