"""Session-affine routing over verifier replicas (Ray actor handles).

* Affinity: a session id names its replica's slot (:func:`~cloud_api.replicas.replica.
  slot_of`), so every request of a session goes to the replica holding its KV cache,
  from any ingress worker, without a shared table.
* Placement: a new session goes to the live replica with the fewest open sessions
  (asked of every replica at create time, so several ingress workers agree).
* Failover: a replica whose call fails with a Ray actor error is marked dead; its
  sessions answer 404 ``session_evicted``, on which the edge SDK re-creates them from
  the confirmed prefix on a live replica (exact: the confirmed prefix is all a session
  is). A create that meets a dead replica is placed on another one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from cloud_api.replicas.replica import slot_of, unwrap
from cloud_api.sessions import ApiError

__all__ = ["ReplicaRouter", "ReplicaGone"]

log = logging.getLogger("cloud_api.replicas")


class ReplicaGone(Exception):
    """The replica of a slot is dead (its actor died or was killed)."""


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return RayActorError, ActorDiedError, ActorUnavailableError


def _evicted() -> ApiError:
    return ApiError(404, "session_evicted", "the verifier replica holding this session "
                    "is gone: re-create it from the confirmed prefix", "session_id")


class ReplicaRouter:
    """Routes calls to replicas by slot. ``handles``: slot -> Ray actor handle of a
    :class:`cloud_api.replicas.replica.VerifierReplica`; ``call_timeout_s``: seconds a
    call may take (queue wait + target pass) before it answers 503."""

    CREATES_REMEMBERED = 4096   # (owner, request_id) -> slot: a retried create
                                # goes where its first attempt went

    def __init__(self, handles: dict[int, object], call_timeout_s: float = 300.0):
        self.handles = dict(handles)
        self.call_timeout_s = call_timeout_s
        self.dead: set[int] = set()
        self._creates: OrderedDict = OrderedDict()
        self._placing: dict[int, int] = {}    # slot -> creates in flight from here
        self._errors = _actor_errors()

    @property
    def live(self) -> list[int]:
        return sorted(s for s in self.handles if s not in self.dead)

    def mark_dead(self, slot: int) -> None:
        if slot not in self.dead:
            log.warning("verifier replica %d is gone; its sessions will be re-created",
                        slot)
            self.dead.add(slot)

    async def call(self, slot: int, method: str, *args):
        """``handle.method(*args)`` on ``slot``, unwrapped. Raises ReplicaGone (dead or
        unknown slot), ApiError (the replica's refusal; 503 ``replica_timeout`` past
        ``call_timeout_s``: a retry is answered from the replay cache)."""
        h = self.handles.get(slot)
        if h is None or slot in self.dead:
            raise ReplicaGone(slot)
        try:
            reply = await asyncio.wait_for(getattr(h, method).remote(*args),
                                           self.call_timeout_s)
        except self._errors:
            self.mark_dead(slot)
            raise ReplicaGone(slot) from None
        except asyncio.TimeoutError:
            raise ApiError(503, "replica_timeout", f"the verifier replica did not answer "
                           f"in {self.call_timeout_s:g} s: retry", "session_id") from None
        return unwrap(reply)

    async def for_session(self, sid: str, method: str, *args):
        """Call ``method(sid, *args)`` on the replica of session ``sid``. Raises
        ApiError 404 ``session_not_found`` (not an id of ours) or ``session_evicted``
        (its replica is gone), or the replica's ApiError."""
        slot = slot_of(sid)
        if slot is None or slot not in self.handles:
            raise ApiError(404, "session_not_found", "unknown or expired session",
                           "session_id")
        try:
            return await self.call(slot, method, sid, *args)
        except ReplicaGone:
            raise _evicted() from None

    async def broadcast(self, method: str) -> dict[int, object]:
        """``method()`` of every live replica: slot -> value (dead ones left out)."""
        async def one(slot):
            try:
                return slot, await self.call(slot, method)
            except ReplicaGone:
                return slot, None

        got = await asyncio.gather(*(one(s) for s in self.live))
        return {s: v for s, v in got if v is not None}

    async def least_loaded(self) -> int:
        """The live slot with the fewest open sessions, counting the creates this
        router has in flight there (a burst of creates spreads instead of herding onto
        one replica; ties: lowest slot). Raises ApiError 503 ``no_replica`` when none
        is alive."""
        stats = await self.broadcast("stats")
        if not stats:
            raise ApiError(503, "no_replica", "no verifier replica is alive")
        return min(stats, key=lambda s: (stats[s]["sessions"] + self._placing.get(s, 0),
                                         s))

    async def create(self, body: dict, owner: str | None) -> dict:
        """Create a session on the least-loaded live replica (a retried create with a
        known ``request_id`` on the replica of its first attempt). Raises ApiError."""
        rid = body.get("request_id") if isinstance(body, dict) else None
        key = None if not isinstance(rid, str) else (owner, rid)
        for _ in range(len(self.handles) + 1):
            slot = self._creates.get(key) if key else None
            if slot is None or slot in self.dead:
                slot = await self.least_loaded()
            if key:
                self._remember(key, slot)
            self._placing[slot] = self._placing.get(slot, 0) + 1
            try:
                return await self.call(slot, "create", body, owner)
            except ReplicaGone:
                continue                 # placed on another live replica
            finally:
                self._placing[slot] -= 1
        raise ApiError(503, "no_replica", "no verifier replica is alive")

    def _remember(self, key, slot: int) -> None:
        self._creates[key] = slot
        self._creates.move_to_end(key)
        while len(self._creates) > self.CREATES_REMEMBERED:
            self._creates.popitem(last=False)
