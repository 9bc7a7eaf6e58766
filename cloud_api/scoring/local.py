"""A scorer over a local HF causal LM: its top-N raw logprobs, the way an engine
returns them (tests; the conformance check of the scoring path against the torch
verifier on the same model)."""

from __future__ import annotations

import torch

__all__ = ["ModelScorer"]


class ModelScorer:
    """Scores with ``model`` (full forward per row, no cache). ``top_n``: entries per
    position (the engine's ``top_logprobs_num``)."""

    def __init__(self, model, top_n: int = 20):
        self.model, self.top_n = model, int(top_n)
        self.calls = 0

    @torch.no_grad()
    def score(self, rows: list[tuple[list[int], list[int]]]) -> list[list[dict[int, float]]]:
        self.calls += 1
        out = []
        for context, block in rows:
            ids = torch.tensor([context + block])
            logits = self.model(ids).logits[0, len(context) - 1:].float()   # [g+1, V]
            lp = torch.log_softmax(logits.double(), dim=-1)
            top = torch.topk(lp, min(self.top_n, lp.shape[-1]), dim=-1)
            out.append([dict(zip(i.tolist(), v.tolist()))
                        for v, i in zip(top.values, top.indices)])
        return out
