"""Scorer over vLLM's OpenAI-compatible ``POST /v1/completions`` with
``prompt_logprobs``.

One request per verification batch: ``prompt`` = for each block the token ids
``context + block + [pad]``, ``max_tokens`` 1, ``prompt_logprobs`` = N. Each choice's
``prompt_logprobs[j]`` maps token ids to ``{"logprob", "rank", ...}`` for the
distribution predicting prompt position j (raw, temperature 1: the top N plus the
prompt token itself); rows ``len(context) .. len(context) + g`` are the block's g + 1
positions. Honest cost: until vLLM reads the prefix cache for requests with prompt
logprobs, every round re-prefills the whole context (fine for short contexts, slow for
long ones); prefer SGLang (:mod:`cloud_api.scoring.sglang`).

Checked against a fake engine that answers in this format; a live vLLM server is not
part of the test suite.
"""

from __future__ import annotations

from cloud_api.scoring.http import post_json
from cloud_api.scoring.verifier import ScoringError

__all__ = ["VLLMScorer"]


class VLLMScorer:
    """Args: url (``http://HOST:PORT`` of ``vllm serve``), model (its served model
    name), top_n (entries per position, <= the server's ``--max-logprobs``), timeout_s
    (seconds per request), pad_id (the token appended for the bonus row)."""

    def __init__(self, url: str, model: str, top_n: int = 20, timeout_s: float = 60.0,
                 pad_id: int = 0):
        self.url, self.model, self.top_n = url.rstrip("/"), model, int(top_n)
        self.timeout_s, self.pad_id = timeout_s, int(pad_id)

    def request_body(self, rows: list[tuple[list[int], list[int]]]) -> dict:
        return {"model": self.model, "max_tokens": 1, "temperature": 0.0,
                "prompt": [list(c) + list(b) + [self.pad_id] for c, b in rows],
                "prompt_logprobs": self.top_n}

    def score(self, rows: list[tuple[list[int], list[int]]]) -> list[list[dict[int, float]]]:
        """Per row the g + 1 position scores. Raises ScoringError."""
        out = post_json(self.url + "/v1/completions", self.request_body(rows),
                        self.timeout_s)
        try:
            choices = sorted(out["choices"], key=lambda c: c.get("index", 0))
        except (KeyError, TypeError, AttributeError):
            raise ScoringError("vLLM's answer has no choices") from None
        if len(choices) != len(rows):
            raise ScoringError("vLLM answered a different number of prompts")
        return [self._rows(ch, len(c), len(b) + 1) for ch, (c, b) in zip(choices, rows)]

    @staticmethod
    def _rows(choice, start: int, n: int) -> list[dict[int, float]]:
        try:
            tops = choice["prompt_logprobs"][start:start + n]
            rows = [{int(t): float(v["logprob"]) for t, v in top.items()} for top in tops]
        except (KeyError, TypeError, AttributeError, ValueError):
            raise ScoringError("vLLM's answer has no usable prompt_logprobs") from None
        if len(rows) != n:
            raise ScoringError("vLLM scored fewer positions than asked")
        return rows
