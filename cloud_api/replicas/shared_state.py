"""Ingress state shared by every ingress worker: the nonce (replay) cache and the
rate-limit windows, held by one Ray actor.

Why a Ray actor: a deployment with replicas already runs Ray, so the shared store
costs no further service to operate (Redis would be one more); the actor serialises
its calls, so ``check_and_add`` and the moving-window ``acquire_entry`` are atomic
across workers. The windows stay ``limits``' own algorithm: :class:`RayStorage` is a
``limits`` storage (URI ``ray://ACTOR_NAME``) whose entries live in the actor's
``MemoryStorage``; an operator with Redis passes a ``redis://`` URI instead
(``limits.storage.storage_from_string``), and the nonce cache then stays per process.

Costs: a nonce check is one awaited actor call per signed request; a rate-limit
check is one to three blocking actor calls (``limits``' interface is synchronous),
each well under a millisecond on one host.
"""

from __future__ import annotations

import ray
from limits.storage import MemoryStorage, MovingWindowSupport, Storage

from cloud_api.auth import NonceCache

__all__ = ["IngressState", "RayStorage", "SharedNonceCache", "ingress_state",
           "STATE_ACTOR"]

STATE_ACTOR = "specrelay-ingress-state"
"""Default name of the shared-state actor (in the ``specrelay`` Ray namespace)."""

_STORAGE_CALLS = frozenset({"incr", "get", "get_expiry", "check", "reset", "clear",
                            "acquire_entry", "get_moving_window"})


class IngressState:
    """The actor's state: a :class:`cloud_api.auth.NonceCache` and a ``limits``
    ``MemoryStorage``. Args: nonce_ttl_s (seconds, >= 2 x the auth skew),
    max_entries (nonces held in all)."""

    def __init__(self, nonce_ttl_s: float = 600, max_entries: int = 200_000):
        self.nonces = NonceCache(nonce_ttl_s, max_entries)
        self.storage = MemoryStorage()

    def check_and_add(self, key_id: str, nonce: str, now: float) -> bool | None:
        """:meth:`cloud_api.auth.NonceCache.check_and_add`, for every worker at once."""
        return self.nonces.check_and_add(key_id, nonce, now)

    def storage_call(self, method: str, args: tuple, kwargs: dict):
        """One ``limits`` storage method on the shared ``MemoryStorage``. Raises
        ValueError for a method that is not a storage call."""
        if method not in _STORAGE_CALLS:
            raise ValueError(f"not a storage call: {method}")
        return getattr(self.storage, method)(*args, **kwargs)


def ingress_state(name: str = STATE_ACTOR, detached: bool = False, **kw):
    """The named shared-state actor, created on first use (``get_if_exists``: every
    ingress worker that asks for ``name`` gets the same one; ``detached``: it outlives
    the process that created it). Needs ``ray.init``."""
    return ray.remote(IngressState).options(
        name=name, get_if_exists=True, num_cpus=0, max_concurrency=1,
        lifetime="detached" if detached else None).remote(**kw)


class SharedNonceCache:
    """A nonce cache whose entries live in the shared actor: ``check_and_add`` returns
    an awaitable (the auth middleware awaits it). Fails closed: an unreachable actor
    answers None (the middleware's 503 with ``Retry-After``), never "fresh".
    Args: handle of the actor."""

    def __init__(self, handle):
        self.handle = handle

    async def check_and_add(self, key_id: str, nonce: str, now: float) -> bool | None:
        try:
            return await self.handle.check_and_add.remote(key_id, nonce, now)
        except ray.exceptions.RayError:
            return None


class RayStorage(Storage, MovingWindowSupport):
    """``limits`` storage ``ray://ACTOR_NAME``: entries in the shared actor (moving
    window strategy). Raises ValueError (through ``ray.get_actor``) when no actor of
    that name is running."""

    STORAGE_SCHEME = ["ray"]

    def __init__(self, uri: str | None = None, wrap_exceptions: bool = False,
                 handle=None, **options):
        super().__init__(uri, wrap_exceptions, **options)
        if handle is None:
            name = (uri or "").split("://", 1)[-1] or STATE_ACTOR
            handle = ray.get_actor(name, namespace=options.get("namespace"))
        self.handle = handle

    @property
    def base_exceptions(self):
        return (ray.exceptions.RayError,)

    def _call(self, method: str, *args, **kwargs):
        return ray.get(self.handle.storage_call.remote(method, args, kwargs))

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        return self._call("incr", key, expiry, amount=amount)

    def get(self, key: str) -> int:
        return self._call("get", key)

    def get_expiry(self, key: str) -> float:
        return self._call("get_expiry", key)

    def check(self) -> bool:
        return self._call("check")

    def reset(self) -> int | None:
        return self._call("reset")

    def clear(self, key: str) -> None:
        return self._call("clear", key)

    def acquire_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        return self._call("acquire_entry", key, limit, expiry, amount)

    def get_moving_window(self, key: str, limit: int, expiry: int) -> tuple[float, int]:
        return self._call("get_moving_window", key, limit, expiry)
