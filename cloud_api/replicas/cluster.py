"""Connect to Ray (or start a local cluster) and spawn verifier replicas.

Replicas are plain Ray actors, not a Ray Serve deployment: every request of a session
must reach the one replica holding its KV cache, and a dead replica must be seen as
dead (its sessions re-created elsewhere), not hidden behind a restart. Serve's request
path chooses a replica per request (affinity needs a custom request router keyed on
the request's arguments) and restarts dead replicas under the same name; with actors
the ingress holds one handle per slot and both properties are explicit.
"""

from __future__ import annotations

import asyncio

import ray

from cloud_api.replicas.replica import SLOTS, VerifierReplica, unwrap
from cloud_api.replicas.router import ReplicaRouter

__all__ = ["NAMESPACE", "connect", "start_replicas", "replica_name"]

NAMESPACE = "specrelay"


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """``ray.init``: join the cluster at ``address`` (``HOST:PORT`` or ``auto``), or
    start a local one (``num_cpus`` CPUs; None: all) when ``address`` is None. A second
    call in the same process is a no-op."""
    if ray.is_initialized():
        return
    ray.init(address=address, num_cpus=None if address else num_cpus,
             include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             configure_logging=False)


def replica_name(slot: int, prefix: str = "specrelay-verifier") -> str:
    return f"{prefix}-{slot}"


def _spawn(target, slot: int, num_cpus: float, prefix: str, detached: bool,
           service_kw: dict):
    """A replica actor of ``slot`` (named, so other ingress workers find it; detached:
    it outlives the process that started it)."""
    actor = ray.remote(VerifierReplica).options(
        name=replica_name(slot, prefix), get_if_exists=True, num_cpus=num_cpus,
        max_concurrency=1000, max_restarts=0,
        lifetime="detached" if detached else None)
    return actor.remote(target, slot, **service_kw)


async def start_replicas(target, n: int, *, num_cpus: float = 1.0,
                         prefix: str = "specrelay-verifier", detached: bool = False,
                         **service_kw) -> tuple[ReplicaRouter, dict]:
    """Spawn (or find, by name) ``n`` replicas of ``target`` and wait until each has
    loaded it. Returns ``(router, info)``, ``info`` the replicas' common
    vocab_size / max_block / tokenizer_hash.

    Args:
        target: model spec or picklable factory
            (:func:`cloud_api.replicas.replica.load_target`).
        n: replicas, 1..SLOTS. num_cpus: CPUs Ray reserves for each.
        detached: replicas outlive this process (several ingress workers on a shared
            cluster; they end with the cluster or ``ray.kill``); otherwise they end
            with it.
        service_kw: :class:`VerifierReplica` options (dtype, threads, max_batch, ...).
    Raises:
        ValueError: ``n`` out of range, or replicas that disagree on the target.
        ray.exceptions.RayActorError: a replica died while loading (its error inside).
    """
    if not 1 <= n <= SLOTS:
        raise ValueError(f"replicas must be in [1, {SLOTS}]")
    handles = {i: _spawn(target, i, num_cpus, prefix, detached, service_kw)
               for i in range(n)}
    infos = [unwrap(r) for r in await asyncio.gather(
        *(h.info.remote() for h in handles.values()))]
    common = [{k: v for k, v in i.items() if k != "slot"} for i in infos]
    if any(c != common[0] for c in common):
        raise ValueError("replicas serve different targets (vocabulary, block size or "
                         "tokenizer differ)")
    return ReplicaRouter(handles), common[0]
