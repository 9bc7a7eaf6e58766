"""Session-affine request routing for the ``verifier`` Serve deployment.

:class:`SessionRouter` is a Ray Serve ``RequestRouter`` (``ray.serve.request_router``):
Serve builds one inside every ``DeploymentHandle`` of the deployment, in every ingress
process, and feeds it the running replicas (long-poll broadcast from the controller,
with each replica's metadata and routing stats). It keeps no per-session table:

* **Affinity.** A session id names ``(slot, generation)`` of the replica that created
  it (:func:`cloud_api.replicas.replica.placement_of`); each replica publishes its own
  pair as Serve replica metadata (:meth:`~cloud_api.replicas.replica.VerifierReplica.
  record_replica_metadata`), so the router maps slot -> replica from the broadcast it
  already gets, identically in every process. The ingress passes the session id as the
  request's ``session_id`` option (:func:`session_key`); the router ranks that replica
  only. Slot-addressed calls (``info`` / ``stats`` of one replica) carry
  :func:`slot_key`.
* **A replica that is gone.** Serve restarts a dead replica; the new one registers
  again and may get the old slot, never the old generation. A session whose
  ``(slot, generation)`` the router has seen but which no running replica holds now
  is sent to any replica, which answers 404 ``session_evicted`` (the edge SDK then
  re-creates it from the confirmed prefix: exact). A pair the router has never seen
  (a replica newer than this router's last broadcast) waits up to
  ``affinity_wait_s`` for the broadcast first. A slot-addressed call whose slot no
  replica holds goes to any replica, which answers 503 ``replica_unavailable``. No
  request waits for a replica that will not come back.
* **Placement.** A create (``call_method == "create"`` without a slot key) goes to the
  replica with the fewest open sessions: the count each replica reported in its
  routing stats (:meth:`~cloud_api.replicas.replica.VerifierReplica.
  record_routing_stats`, every ``request_routing_stats_period_s``, stamped ``at``)
  plus the creates this router placed there since ``at`` (in flight included), so a
  burst of simultaneous creates spreads instead of herding; ties: lowest slot. Several
  ingress processes agree to within one stats period. The rest rank as Serve's queue
  length choice would (any replica).

Requests are matched to the replica chosen for them (no FIFO mixin: a replica chosen
for one session is never handed to another request).
"""

from __future__ import annotations

import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cloud_api.replicas.replica import placement_of

__all__ = ["ROUTER_CLASS", "SessionRouter", "session_key", "slot_key"]

ROUTER_CLASS = "cloud_api.replicas.router:SessionRouter"
SLOT_PREFIX = "slot:"
PLACED_KEPT_S = 300.0       # placements older than this no longer count


def session_key(sid: str) -> str:
    """The ``session_id`` handle option of a call on session ``sid``."""
    return str(sid)


def slot_key(slot: int) -> str:
    """The ``session_id`` handle option of a call meant for the replica of ``slot``."""
    return f"{SLOT_PREFIX}{int(slot)}"


def _slot_of_key(key: str) -> int | None:
    if not key.startswith(SLOT_PREFIX):
        return None
    try:
        return int(key[len(SLOT_PREFIX):])
    except ValueError:
        return None


class SessionRouter(RequestRouter):
    """Serve request router: session affinity by slot, creates to the least loaded
    replica (module doc). Kwargs (``RequestRouterConfig.request_router_kwargs``):
    ``affinity_wait_s`` (seconds a request for an unseen ``(slot, generation)``
    waits for the replica broadcast; default 2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._by_slot: dict[int, RunningReplica] = {}
        self._seen: set[tuple[int, int]] = set()
        self._placed: dict[str, tuple[int, float]] = {}   # request id -> (slot, time)
        self.affinity_wait_s = 2.0

    def initialize_state(self, affinity_wait_s: float = 2.0, **_) -> None:
        self.affinity_wait_s = float(affinity_wait_s)

    @property
    def max_num_routing_tasks(self) -> int:
        """A few more routing tasks than Serve's 2 per replica: a request waiting out
        ``affinity_wait_s`` must not hold up the others."""
        return min(self.max_num_routing_tasks_cap, 2 * len(self._replicas) + 8)

    # -- the replica set ------------------------------------------------------------
    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        by_slot = {}
        for r in replicas:
            meta = r.replica_metadata
            if "slot" in meta and "generation" in meta:
                by_slot[meta["slot"]] = r
                self._seen.add((meta["slot"], meta["generation"]))
        self._by_slot = by_slot

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._by_slot = {s: r for s, r in self._by_slot.items()
                         if r.replica_id != replica_id}

    @staticmethod
    def _placement(r: RunningReplica) -> tuple[int, int]:
        meta = r.replica_metadata
        return meta.get("slot", -1), meta.get("generation", -1)

    # -- choosing ---------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        """Ranks for ``pending_request`` (module doc). ``[]`` only while an unseen
        ``(slot, generation)`` waits for the broadcast (Serve backs off and asks
        again)."""
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas] if candidate_replicas else []
        pending_request.routing_context.should_backoff = True
        meta = pending_request.metadata
        key = meta.session_id or ""
        slot = _slot_of_key(key)
        if slot is not None:
            r = self._by_slot.get(slot)
            if r is not None:
                return [[r]]
            return (self._by_load(candidate_replicas, pending_request)
                    if meta.call_method == "create" else [candidate_replicas])
        if key:
            return self._for_session(key, candidate_replicas, pending_request)
        if meta.call_method == "create":
            return self._by_load(candidate_replicas, pending_request)
        return [candidate_replicas]

    def _for_session(self, key: str, candidates, pending_request) -> list:
        where = placement_of(key)
        if where is None:                     # not an id: any replica says 404
            return [candidates]
        r = self._by_slot.get(where[0])
        if r is not None and self._placement(r) == where:
            return [[r]]
        waited = time.time() - pending_request.created_at
        if where in self._seen or waited >= self.affinity_wait_s:
            return [candidates]               # its replica is gone: 404 evicted
        return []

    def _by_load(self, candidates, pending_request) -> list:
        """Candidates with a slot, fewest open sessions first (one per rank); the
        first one is recorded as this request's placement."""
        now = time.time()
        for rid, (_, t) in list(self._placed.items()):
            if now - t > PLACED_KEPT_S:
                del self._placed[rid]
        rid = pending_request.metadata.internal_request_id
        self._placed.pop(rid, None)           # a re-choice replaces the placement
        ranked = sorted((r for r in candidates if "slot" in r.replica_metadata),
                        key=lambda r: (self._load(r), r.replica_metadata["slot"]))
        if not ranked:
            return [candidates]
        self._placed[rid] = (ranked[0].replica_metadata["slot"], now)
        return [[r] for r in ranked]

    def _load(self, r: RunningReplica) -> int:
        """Open sessions of ``r``: its last routing stats plus this router's creates
        placed there since they were counted."""
        stats = r.routing_stats or {}
        at = float(stats.get("at", 0.0))
        slot = r.replica_metadata["slot"]
        mine = sum(1 for s, t in self._placed.values() if s == slot and t >= at)
        return int(stats.get("sessions", 0)) + mine

    def on_request_routed(self, pending_request: PendingRequest, replica_id,
                          result) -> None:
        """Correct a create's recorded placement when Serve sent it elsewhere (the
        first rank refused it)."""
        rid = pending_request.metadata.internal_request_id
        if rid in self._placed:
            r = self._replicas.get(replica_id)
            if r is not None and "slot" in r.replica_metadata:
                self._placed[rid] = (r.replica_metadata["slot"], self._placed[rid][1])
