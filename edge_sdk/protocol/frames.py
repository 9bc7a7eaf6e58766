"""The items of a streamed verify answer (FSD; ``Accept: application/x-msgpack-seq``):
the early verdict, then the final verify response or a stream error. The layout is in
:mod:`edge_sdk.protocol.wire`'s docstring; every reader validates like the other
decoders and raises :class:`~edge_sdk.protocol.wire.WireError` naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack

from edge_sdk.protocol.wire import (MAX_BODY_BYTES, MSG_EARLY, MSG_STREAM_ERROR,
                                    MSG_VERIFY_OK, VerifyResponse, WireError, _int, pack)

__all__ = ["EarlyVerdict", "StreamReader", "stream_error"]


@dataclass
class EarlyVerdict:
    """FSD's provisional verdict of a block, read at an early exit of the target before
    the pass ends: ``accepted`` drafts and the ``next_token`` that would follow them
    (None: a sampled rejection, whose correction is drawn on the edge). Advisory: the
    final :class:`VerifyResponse` alone decides."""

    block_seq: int
    accepted: int
    next_token: int | None
    layer: int
    t_early: float              # seconds from the start of the pass

    def to_list(self) -> list:
        return [MSG_EARLY, self.block_seq, self.accepted, self.next_token, self.layer,
                float(self.t_early)]

    def encode(self) -> bytes:
        return pack(self.to_list())

    @classmethod
    def from_list(cls, m, vocab_size: int = 2**32) -> "EarlyVerdict":
        """Validate an unpacked early-verdict array. Raises WireError naming the field."""
        if not isinstance(m, list) or len(m) != 6 or m[0] != MSG_EARLY:
            raise WireError("body", "not an early verdict")
        nxt = None if m[3] is None else _int(m[3], "next_token", 0, vocab_size - 1)
        t = m[5]
        if not isinstance(t, float) or not math.isfinite(t) or t < 0:
            raise WireError("t_early", "expected a non-negative float")
        return cls(_int(m[1], "block_seq"), _int(m[2], "accepted", 0, 1 << 16), nxt,
                   _int(m[4], "layer", 1, 1 << 16), t)


def stream_error(status: int, error: dict) -> bytes:
    """The item that ends a streamed answer whose pass failed after its early verdict."""
    return pack([MSG_STREAM_ERROR, int(status), error])


class StreamReader:
    """Incremental reader of a streamed verify answer (:data:`STREAM_SEQ`).

    :meth:`feed` takes the next chunk of the body and returns the complete items in it:
    :class:`EarlyVerdict`, :class:`VerifyResponse`, or ``(status, error dict)`` for a
    stream error. Raises WireError for anything else, or past ``MAX_BODY_BYTES``.
    """

    def __init__(self, vocab_size: int = 2**32):
        self.vocab_size, self.size = vocab_size, 0
        self._u = msgpack.Unpacker(raw=False, strict_map_key=True,
                                   max_buffer_size=MAX_BODY_BYTES,
                                   max_bin_len=MAX_BODY_BYTES, max_str_len=1 << 20,
                                   max_array_len=1 << 20, max_map_len=1 << 10)

    def feed(self, chunk: bytes) -> list:
        self.size += len(chunk)
        if self.size > MAX_BODY_BYTES:
            raise WireError("body", f"larger than {MAX_BODY_BYTES} bytes")
        try:
            self._u.feed(chunk)
            items = list(self._u)
        except Exception as e:  # msgpack raises several unrelated types
            raise WireError("body", f"not valid msgpack ({type(e).__name__})") from None
        return [self._item(m) for m in items]

    def _item(self, m):
        kind = m[0] if isinstance(m, list) and m else None
        if kind == MSG_EARLY:
            return EarlyVerdict.from_list(m, self.vocab_size)
        if kind == MSG_VERIFY_OK:
            return VerifyResponse.from_list(m)
        if kind == MSG_STREAM_ERROR and len(m) == 3 and isinstance(m[2], dict):
            return _int(m[1], "status", 400, 599), m[2]
        raise WireError("body", "unexpected item in a streamed verify answer")
