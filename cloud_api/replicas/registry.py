"""Which verifier replica holds which slot: one small Ray actor per deployment.

A replica registers once, at start-up (:func:`register`), and gets the lowest slot no
live replica holds plus that slot's next generation (1..255, cycling). Liveness is
asked of the holders themselves (Ray's ``__ray_ready__`` on each holder's actor), so a
replica that died, was killed or failed while loading frees its slot without anyone
telling the registry. The routers never call the registry: each replica publishes its
slot and generation as Serve replica metadata, which the Serve controller broadcasts
to every handle with the replica set. The ingress asks :meth:`ReplicaRegistry.live`
for /healthz and the identity check (which slots to ask).

It also serialises deployment: of several ingress workers that find no application,
the one that :meth:`ReplicaRegistry.claim_deploy` deploys and the others wait for it
(a second ``serve.run`` of the same application would roll every replica: Serve gives
each imperative deploy a new version).

The actor is named (``<app>-registry`` in the ``specrelay`` namespace) and detached: it
lives as long as the cluster or until :func:`cloud_api.replicas.cluster.stop_replicas`
kills it with the deployment.
"""

from __future__ import annotations

import asyncio
import time

import ray

__all__ = ["ReplicaRegistry", "registry", "registry_name", "register"]

NAMESPACE = "specrelay"
PING_S = 5.0
"""Seconds a holder may take to answer the liveness ping (a slower one counts as live:
busy, not dead)."""


def registry_name(app: str) -> str:
    return f"{app}-registry"


class ReplicaRegistry:
    """slot -> (generation, holder actor handle, holder's Serve actor name)."""

    def __init__(self, slots: int = 256, generations: int = 256):
        self.slots, self.generations = slots, generations
        self._holders: dict[int, tuple[int, object, str]] = {}
        self._last_gen: dict[int, int] = {}
        self._deployer: tuple[str, float] | None = None   # (token, monotonic claim time)

    def claim_deploy(self, token: str, stale_s: float) -> bool:
        """True when the caller (``token``) may deploy: nobody claimed, or the claim
        is older than ``stale_s`` seconds (its deployer died)."""
        now = time.monotonic()
        if self._deployer is None or now - self._deployer[1] > stale_s:
            self._deployer = (token, now)
        return self._deployer[0] == token

    def release_deploy(self, token: str) -> None:
        """End ``token``'s claim (deployed, or failed)."""
        if self._deployer is not None and self._deployer[0] == token:
            self._deployer = None

    def deploying(self) -> bool:
        """Whether a deploy is claimed and not released."""
        return self._deployer is not None

    async def register(self, holder, name: str) -> tuple[int, int]:
        """``(slot, generation)`` for the replica ``holder`` (its actor handle; ``name``
        its Serve actor name). Raises RuntimeError when every slot has a live holder."""
        await self._drop_dead()
        for slot, (_, _, held_by) in self._holders.items():
            if held_by == name:                     # the same replica asking again
                return slot, self._holders[slot][0]
        free = [s for s in range(self.slots) if s not in self._holders]
        if not free:
            raise RuntimeError(f"all {self.slots} replica slots are held by live replicas")
        slot = free[0]
        gen = self._last_gen.get(slot, 0) % (self.generations - 1) + 1
        self._last_gen[slot] = gen
        self._holders[slot] = (gen, holder, name)
        return slot, gen

    async def live(self) -> dict[int, tuple[int, str]]:
        """slot -> ``(generation, Serve actor name)`` of every live holder."""
        await self._drop_dead()
        return {s: (g, n) for s, (g, _, n) in self._holders.items()}

    async def _drop_dead(self) -> None:
        async def alive(handle) -> bool:
            try:
                await asyncio.wait_for(handle.__ray_ready__.remote(), PING_S)
            except asyncio.TimeoutError:
                return True
            except ray.exceptions.RayError:
                return False
            return True

        held = dict(self._holders)
        ok = await asyncio.gather(*(alive(h) for _, h, _ in held.values()))
        for (s, entry), up in zip(held.items(), ok):
            if not up and self._holders.get(s) is entry:   # not re-taken meanwhile
                del self._holders[s]


def registry(app: str):
    """The registry actor of deployment ``app``, created on first use (named, detached,
    no CPU). Needs ``ray.init``."""
    return ray.remote(ReplicaRegistry).options(
        name=registry_name(app), namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
        lifetime="detached", max_concurrency=64).remote()


def register(name: str) -> tuple[int, int, str]:
    """Called in a replica's constructor: ``(slot, generation, Serve actor name)`` from
    the registry actor ``name``. Raises RuntimeError (no free slot), ValueError (no
    such actor)."""
    from ray import serve

    me = serve.get_replica_context().replica_id.to_full_id_str()
    handle = ray.get_actor(name, namespace=NAMESPACE)
    slot, gen = ray.get(handle.register.remote(
        ray.get_runtime_context().current_actor, me))
    return slot, gen, me
