"""Scorer over SGLang's native ``POST /generate`` (input logprobs).

One request per verification batch: ``input_ids`` = for each block ``context + block +
[pad]``, ``logprob_start_len`` = ``len(context)``, ``top_logprobs_num`` = N,
``return_logprob``, one new token (ignored). ``meta_info.input_top_logprobs`` then
holds, from position ``len(context)`` on, the top-N ``[logprob, token_id, text]`` of
the distribution *predicting* each position: the g + 1 rows after ``context +
block[:i]`` (the pad only makes room for the bonus row, so every row is an input
logprob: raw, temperature 1). The shared prefix stays in SGLang's radix cache, so a
round prefills only the new tokens.

Checked against a fake engine that answers in this format; a live SGLang server is
not part of the test suite.
"""

from __future__ import annotations

from cloud_api.scoring.http import post_json
from cloud_api.scoring.verifier import ScoringError

__all__ = ["SGLangScorer"]


class SGLangScorer:
    """Args: url (``http://HOST:PORT`` of ``sglang.launch_server``), top_n (entries per
    position, <= the server's ``--max-top-logprobs-num`` if set), timeout_s (seconds per
    request), pad_id (the token appended for the bonus row)."""

    def __init__(self, url: str, top_n: int = 20, timeout_s: float = 60.0, pad_id: int = 0):
        self.url, self.top_n = url.rstrip("/"), int(top_n)
        self.timeout_s, self.pad_id = timeout_s, int(pad_id)

    def request_body(self, rows: list[tuple[list[int], list[int]]]) -> dict:
        """The ``/generate`` body of a batch of ``(context, block)`` rows."""
        return {"input_ids": [list(c) + list(b) + [self.pad_id] for c, b in rows],
                "logprob_start_len": [len(c) for c, _ in rows],
                "top_logprobs_num": self.top_n, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}

    def score(self, rows: list[tuple[list[int], list[int]]]) -> list[list[dict[int, float]]]:
        """Per row the g + 1 position scores (token id -> logprob). Raises ScoringError
        (unreachable, an HTTP error, or an answer not in the documented shape)."""
        out = post_json(self.url + "/generate", self.request_body(rows), self.timeout_s)
        out = out if isinstance(out, list) else [out]
        if len(out) != len(rows):
            raise ScoringError("SGLang answered a different number of sequences")
        return [self._rows(item, len(b) + 1) for item, (_, b) in zip(out, rows)]

    @staticmethod
    def _rows(item, n: int) -> list[dict[int, float]]:
        try:
            tops = item["meta_info"]["input_top_logprobs"][:n]
            rows = [{int(t[1]): float(t[0]) for t in top} for top in tops]
        except (KeyError, TypeError, IndexError, ValueError):
            raise ScoringError("SGLang's answer has no usable input_top_logprobs") from None
        if len(rows) != n:
            raise ScoringError("SGLang scored fewer positions than asked")
        return rows
