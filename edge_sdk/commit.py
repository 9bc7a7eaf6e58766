"""Token-by-token commit with EOS, stop strings and the length cap (SPEC §1, CASES 2, 6).

Speculative rounds hand over several tokens at once; they are committed one at a time
so a stop condition inside a block ends generation right there: nothing after it is
emitted or counted.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class Committer:
    """Accumulates generated tokens and decides when generation ends.

    ``token_ids`` counts every committed token (EOS included, as usage counts it);
    ``text`` never contains a stop string or anything after it. ``finish_reason`` is
    ``"stop"`` (EOS or stop string) or ``"length"`` (``max_new_tokens`` reached).
    """

    def __init__(self, tokenizer, max_new_tokens: int, eos_ids: Iterable[int] = (),
                 stop: Sequence[str] = ()):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.tok = tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos = set(int(e) for e in eos_ids)
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    def _decode(self) -> str:
        return self.tok.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Commit one token; returns the new text it adds ("" when none).
        Raises RuntimeError if generation already finished."""
        if self.done:
            raise RuntimeError("commit after finish")
        self.token_ids.append(int(token))
        if int(token) in self.eos:
            self.finish_reason = "stop"
            return ""
        before = self.text
        text = self._decode()
        for s in self.stop:
            i = text.find(s, max(0, len(before) - len(s)))
            if i >= 0:
                text = text[:i]
                self.finish_reason = "stop"
        if not self.done and len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        # an incomplete UTF-8 sequence decodes to U+FFFD: hold it back until complete
        if not self.done and text.endswith("\ufffd"):
            return ""
        self.text = text
        return text[len(before):] if text.startswith(before) else text

    def push_many(self, tokens: Iterable[int]) -> tuple[list[int], str]:
        """Commit tokens in order until a stop; returns (committed ids, new text)."""
        taken, delta = [], ""
        for t in tokens:
            if self.done:
                break
            delta += self.push(t)
            taken.append(int(t))
        return taken, delta
