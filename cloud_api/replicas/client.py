"""The ingress's calls on the verifier replicas, through a Serve ``DeploymentHandle``.

Every call carries its routing key as the handle's ``session_id`` option (the session
id, or ``slot:K`` for one replica's ``info`` / ``stats``); the deployment's
:class:`~cloud_api.replicas.router.SessionRouter` picks the replica from it. Errors:

* a replica that died before or during the call (Ray actor errors, Serve's
  ``ReplicaUnavailableError``) is :class:`ReplicaGone`: for a session call the answer
  is 404 ``session_evicted`` (the SDK re-creates the session from its confirmed
  prefix); a create is placed again (on a live replica);
* a call past ``call_timeout_s`` (queue wait + target pass, or no replica at all while
  Serve restarts them) answers 503 ``replica_timeout`` (retryable: a retried block is
  answered from the replica's replay cache); the call itself is not cancelled;
* a deployment Serve could not deploy (or one deleted under us) answers 503
  ``no_replica``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import ray

from cloud_api.replicas.replica import slot_of, unwrap
from cloud_api.replicas.router import session_key, slot_key
from cloud_api.sessions import ApiError

__all__ = ["ReplicaClient", "ReplicaGone"]

log = logging.getLogger("cloud_api.replicas")


class ReplicaGone(Exception):
    """The replica a call reached died before answering."""


def _gone_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return RayActorError, ActorUnavailableError, ReplicaUnavailableError


def _evicted() -> ApiError:
    return ApiError(404, "session_evicted", "the verifier replica holding this session "
                    "is gone: re-create it from the confirmed prefix", "session_id")


class ReplicaClient:
    """Calls on the ``verifier`` deployment. ``handle``: its DeploymentHandle;
    ``registry``: its :class:`~cloud_api.replicas.registry.ReplicaRegistry` actor
    handle (which slots are live); ``call_timeout_s``: seconds a call may take before
    it answers 503; ``app``: the Serve application's name."""

    CREATES_REMEMBERED = 4096   # (owner, request_id) -> slot: a retried create
                                # goes where its first attempt went
    PROBE_TIMEOUT_S = 5.0       # seconds a /healthz or identity ``info``/``stats`` waits

    def __init__(self, handle, registry, call_timeout_s: float = 300.0,
                 app: str = "specrelay-verifier"):
        self.handle, self.registry, self.app = handle, registry, app
        self.call_timeout_s = call_timeout_s
        self._creates: OrderedDict = OrderedDict()
        self._gone = _gone_errors()

    async def call(self, key: str, method: str, *args, timeout_s: float | None = None):
        """``method(*args)`` on the replica the router picks for ``key``, unwrapped.
        Raises ReplicaGone, ApiError (the replica's refusal; 503 ``replica_timeout``
        past ``timeout_s`` (default ``call_timeout_s``); 503 ``no_replica`` when the
        deployment is unavailable)."""
        from ray.serve.exceptions import DeploymentUnavailableError

        limit = self.call_timeout_s if timeout_s is None else timeout_s
        response = self.handle.options(method_name=method, session_id=key).remote(*args)

        async def answer():
            return await response

        task = asyncio.ensure_future(answer())
        try:
            reply = await asyncio.wait_for(asyncio.shield(task), limit)
        except asyncio.TimeoutError:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise ApiError(503, "replica_timeout", f"the verifier replica did not answer "
                           f"in {limit:g} s: retry", "session_id") from None
        except DeploymentUnavailableError:
            raise ApiError(503, "no_replica", "the verifier deployment is unavailable",
                           "session_id") from None
        except Exception as e:
            if self._is_gone(e):
                raise ReplicaGone(key) from None
            raise
        return unwrap(reply)

    def _is_gone(self, e: BaseException) -> bool:
        """A Ray actor error (or a task error caused by one): the replica died."""
        return isinstance(e, self._gone) or isinstance(getattr(e, "cause", None),
                                                        self._gone)

    async def for_session(self, sid: str, method: str, *args):
        """Call ``method(sid, *args)`` on the replica of session ``sid``. Raises
        ApiError 404 ``session_not_found`` (not an id of ours) or ``session_evicted``
        (its replica is gone), or the replica's ApiError."""
        if slot_of(sid) is None:
            raise ApiError(404, "session_not_found", "unknown or expired session",
                           "session_id")
        try:
            return await self.call(session_key(sid), method, sid, *args)
        except ReplicaGone:
            log.warning("the verifier replica of session %s is gone; it will be "
                        "re-created", sid)
            raise _evicted() from None

    async def live_slots(self) -> dict[int, tuple[int, str]]:
        """slot -> ``(generation, Serve actor name)`` of the live replicas ({} when
        the registry actor cannot be reached)."""
        try:
            return await self.registry.live.remote()
        except ray.exceptions.RayError:
            log.warning("the replica registry of %s is unreachable", self.app)
            return {}

    async def broadcast(self, method: str, slots=None) -> dict[int, object]:
        """``method(slot)`` of every live replica (or of ``slots``): slot -> value (a
        replica that is gone, restarting or slower than PROBE_TIMEOUT_S left out)."""
        async def one(slot):
            try:
                return slot, await self.call(slot_key(slot), method, slot,
                                             timeout_s=self.PROBE_TIMEOUT_S)
            except (ReplicaGone, ApiError):
                return slot, None

        slots = await self.live_slots() if slots is None else slots
        got = await asyncio.gather(*(one(s) for s in slots))
        return {s: v for s, v in got if v is not None}

    async def create(self, body: dict, owner: str | None) -> dict:
        """Create a session on the least-loaded live replica (the router's choice; a
        retried create with a known ``request_id`` on the replica of its first
        attempt). Raises ApiError (503 ``no_replica`` after a replica died under each
        of several attempts)."""
        rid = body.get("request_id") if isinstance(body, dict) else None
        key = None if not isinstance(rid, str) else (owner, rid)
        for _ in range(3):
            slot = self._creates.get(key) if key else None
            try:
                made = await self.call("" if slot is None else slot_key(slot), "create",
                                       body, owner)
            except ReplicaGone:
                self._creates.pop(key, None)
                continue                 # placed again, on a live replica
            if key:
                self._remember(key, slot_of(made["session_id"]))
            return made
        raise ApiError(503, "no_replica", "no verifier replica stayed alive to create "
                       "the session: retry", "session_id")

    def _remember(self, key, slot: int) -> None:
        self._creates[key] = slot
        self._creates.move_to_end(key)
        while len(self._creates) > self.CREATES_REMEMBERED:
            self._creates.popitem(last=False)


def actor_of(name: str):
    """The Serve replica actor called ``name`` (``info()["replica"]``), for operators
    and tests. Raises ValueError when it is gone."""
    return ray.get_actor(name, namespace="serve")
