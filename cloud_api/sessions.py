"""Per-session state on the cloud: confirmed prefix, target KV cache, replay cache."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import torch

from edge_sdk.kvmodel import KVModel
from edge_sdk.protocol.sampling import SamplingConfig


class ApiError(Exception):
    """An error with an HTTP status and a JSON body ``{"error": {...}}``."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.extra = (
            status, code, message, field, extra)

    def body(self) -> dict:
        err = {"code": self.code, "message": self.message}
        if self.field:
            err["field"] = self.field
        err.update(self.extra)
        return {"error": err}


@dataclass
class Session:
    """One generation request's state on the cloud.

    ``tokens`` is the confirmed sequence (prompt + committed). While ``awaiting`` the
    edge owes the correction token of the last block (``pending_commit``); the
    confirmed length the edge sees is then ``len(tokens) + 1``. KV invariant: the target
    cache holds exactly the confirmed sequence minus its last token.
    """

    id: int
    owner: str | None
    cfg: SamplingConfig
    seed: int
    mode: str
    support_k: int
    n_proposals: int
    max_new_tokens: int
    kv: KVModel
    tokens: list[int]
    prompt_len: int
    next_seq: int = 0
    awaiting: bool = False
    last: tuple | None = None          # (block_seq, body digest, response bytes)
    pending_p: tuple | None = None     # (block_seq, p row float64 [V]) for corrections
    created: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)

    @property
    def base_len(self) -> int:
        return len(self.tokens) + int(self.awaiting)

    def state(self) -> dict:
        return {"session_id": str(self.id), "base_len": self.base_len,
                "next_block_seq": self.next_seq, "awaiting_correction": self.awaiting,
                "prompt_len": self.prompt_len, "config_id": self.cfg.config_id,
                "generated": len(self.tokens) - self.prompt_len,
                "sampling": self.cfg.to_dict(), "mode": self.mode}

    def generator(self, block_seq: int) -> torch.Generator:
        """Per-block RNG: replays of a block (same seed, same seq) draw identically."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + block_seq) % (2**63))

    def check_kv(self) -> None:
        expected = self.tokens if self.awaiting else self.tokens[:-1]
        if self.kv.ids != expected:
            raise AssertionError("target KV cache does not match the confirmed prefix")


class SessionStore:
    """Sessions by id with a TTL and a count limit (oldest idle evicted first)."""

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 256):
        self.ttl_s, self.max_sessions = ttl_s, max_sessions
        self._s: dict[int, Session] = {}
        self.evictions = 0

    def new_id(self) -> int:
        while True:
            sid = secrets.randbits(32)
            if sid and sid not in self._s:
                return sid

    def add(self, s: Session) -> None:
        self.expire()
        while len(self._s) >= self.max_sessions:
            oldest = min(self._s.values(), key=lambda x: x.touched)
            self.remove(oldest.id)
            self.evictions += 1
        self._s[s.id] = s

    def get(self, sid_text: str, owner: str | None = None) -> Session:
        """Raises ApiError 404 for unknown, expired or foreign sessions."""
        self.expire()
        try:
            s = self._s[int(sid_text)]
        except (KeyError, ValueError):
            raise ApiError(404, "session_not_found", "unknown or expired session",
                           "session_id") from None
        if s.owner != owner:
            raise ApiError(404, "session_not_found", "unknown or expired session",
                           "session_id")
        s.touched = time.monotonic()
        return s

    def remove(self, sid: int) -> None:
        self._s.pop(sid, None)

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [k for k, s in self._s.items() if now - s.touched > self.ttl_s]:
            self.remove(sid)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._s)
