"""Token-by-token commit with EOS, stop strings and the length cap.

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
        self._shown = ""       # prefix of ``text`` already returned by push()
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

        The returned pieces always concatenate to a prefix of the final ``text``: text
        that may still turn into a stop string (or an incomplete UTF-8 sequence) is held
        back until it is decided, and flushed when generation finishes.
        Raises RuntimeError if generation already finished."""
        if self.done:
            raise RuntimeError("commit after finish")
        self.token_ids.append(int(token))
        if int(token) in self.eos:
            self.finish_reason = "stop"
            return self._emit()
        text = self._decode()
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            text = text[:min(cuts)]
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        self.text = text
        return self._emit()

    def _emit(self) -> str:
        """The part of ``text`` that can be shown now and has not been shown yet."""
        safe = self.text
        if not self.done:
            # an incomplete UTF-8 sequence decodes to U+FFFD: hold it back until complete
            safe = safe.rstrip("\ufffd")
            held = 0   # longest tail that is a proper prefix of a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(safe)), held, -1):
                    if safe.endswith(s[:k]):
                        held = k
                        break
            safe = safe[:len(safe) - held]
        if not safe.startswith(self._shown):
            return ""   # decoding rewrote text already shown (rare tokenizer cleanup)
        delta, self._shown = safe[len(self._shown):], safe
        return delta

    def push_many(self, tokens: Iterable[int]) -> tuple[list[int], str]:
        """Commit tokens in order until a stop; returns (committed ids, new text)."""
        taken, delta = [], ""
        for t in tokens:
            if self.done:
                break
            delta += self.push(t)
            taken.append(int(t))
        return taken, delta
