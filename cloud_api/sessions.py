"""Per-session state on the cloud: confirmed prefix, target KV cache, replay cache."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

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
    cache holds exactly the confirmed sequence minus its last token (semantically
    accepted drafts are confirmed tokens like any other).
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
    replay: dict = field(default_factory=dict)   # block_seq -> (body digest, response)
    pending_p: tuple | None = None     # (block_seq, p row float64 [V]) for corrections
    created: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)
    #: ``exact`` (the target's output) or ``semantic`` (WISV, lossy: greedy blocks may
    #: have mismatching drafts accepted by the decision head)
    acceptance: str = "exact"

    @property
    def base_len(self) -> int:
        return len(self.tokens) + int(self.awaiting)

    def state(self) -> dict:
        """The session's confirmed state (``acceptance`` only for semantic sessions:
        an exact session's answers are what they were before WISV)."""
        out = {"session_id": str(self.id), "base_len": self.base_len,
               "next_block_seq": self.next_seq, "awaiting_correction": self.awaiting,
               "prompt_len": self.prompt_len, "config_id": self.cfg.config_id,
               "generated": len(self.tokens) - self.prompt_len,
               "sampling": self.cfg.to_dict(), "mode": self.mode}
        if self.acceptance != "exact":
            out["acceptance"] = self.acceptance
        return out

    REPLAY_BLOCKS = 2   # answers kept for retries: the last block and one sent ahead

    def remember(self, block_seq: int, digest: bytes, out: bytes,
                 saw_previous: bool = False) -> None:
        """Keep the answer to ``block_seq`` for retries: the last ``REPLAY_BLOCKS``
        answers, only the last when the block shows the edge read the one before it
        (``saw_previous``: it carried that block's correction token)."""
        if saw_previous:
            self.replay.clear()
        self.replay[block_seq] = (digest, out)
        while len(self.replay) > self.REPLAY_BLOCKS:
            self.replay.pop(min(self.replay))

    def check_kv(self) -> None:
        expected = self.tokens if self.awaiting else self.tokens[:-1]
        if self.kv.ids != expected:
            raise AssertionError("target KV cache does not match the confirmed prefix")


class SessionStore:
    """Sessions by id with a TTL, a count limit, a per-key limit and a KV memory budget.

    Over the count limit or the memory budget the least recently used sessions are
    evicted; an evicted session answers 404 ``session_evicted`` (the SDK re-creates it
    from its confirmed prefix). Args: ttl_s (seconds idle), max_sessions,
    max_sessions_per_key, kv_budget_bytes (None = unlimited), kv_bytes_per_token.
    """

    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 256,
                 max_sessions_per_key: int = 64, kv_budget_bytes: int | None = None,
                 kv_bytes_per_token: int = 0):
        self.ttl_s, self.max_sessions = ttl_s, max_sessions
        self.max_per_key, self.kv_budget = max_sessions_per_key, kv_budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self._s: dict[int, Session] = {}
        self._evicted: dict[int, None] = {}   # recent evictions, for a clear error
        self.evictions = 0

    def new_id(self) -> int:
        while True:
            sid = secrets.randbits(32)
            if sid and sid not in self._s:
                return sid

    def kv_bytes(self) -> int:
        return sum(len(s.tokens) for s in self._s.values()) * self.kv_bytes_per_token

    def check_owner_limit(self, owner: str | None) -> None:
        """Raises ApiError 429 when ``owner`` already has the most sessions allowed."""
        self.expire()
        if sum(1 for x in self._s.values() if x.owner == owner) >= self.max_per_key:
            raise ApiError(429, "too_many_sessions",
                           f"at most {self.max_per_key} open sessions per key", "session")

    def add(self, s: Session) -> None:
        """Register a session. Raises ApiError 429 when its key has too many."""
        self.check_owner_limit(s.owner)
        self._s[s.id] = s
        self.enforce(keep=s.id)

    def enforce(self, keep: int | None = None) -> None:
        """Evict least recently used sessions beyond the count or memory budget."""
        def over() -> bool:
            return len(self._s) > self.max_sessions or (
                self.kv_budget is not None and self.kv_bytes() > self.kv_budget)

        while over() and len(self._s) > 1:
            victim = min((x for x in self._s.values() if x.id != keep),
                         key=lambda x: x.touched)
            self.evict(victim.id)

    def evict(self, sid: int) -> None:
        self.remove(sid)
        self._evicted[sid] = None
        while len(self._evicted) > 4096:
            self._evicted.pop(next(iter(self._evicted)))
        self.evictions += 1

    def get(self, sid_text: str, owner: str | None = None) -> Session:
        """Raises ApiError 404 for unknown, expired, evicted or foreign sessions."""
        self.expire()
        try:
            sid = int(sid_text)
        except ValueError:
            sid = -1
        s = self._s.get(sid)
        if s is None or s.owner != owner:
            if sid in self._evicted:
                raise ApiError(404, "session_evicted", "session was evicted (idle, memory "
                               "or count limit): re-create it from the confirmed prefix",
                               "session_id")
            raise ApiError(404, "session_not_found", "unknown or expired session",
                           "session_id")
        s.touched = time.monotonic()
        return s

    def remove(self, sid: int) -> None:
        self._s.pop(sid, None)

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [k for k, s in self._s.items() if now - s.touched > self.ttl_s]:
            self.evict(sid)

    def __len__(self) -> int:
        return len(self._s)
