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

from cloud_api.replicas.replica import SLOTS, VerifierReplica, target_name, unwrap
from cloud_api.replicas.router import ReplicaRouter

__all__ = ["NAMESPACE", "connect", "ReplicaMismatch", "mismatch", "start_replicas", "replica_name"]

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
    loaded it. Returns ``(router, info)``, ``info`` the first replica's ``info()``
    less its slot (vocab_size, max_block, tokenizer_hash, model, config_sha,
    weights_sha), on which all agree.

    Args:
        target: model spec or picklable factory
            (:func:`cloud_api.replicas.replica.load_target`).
        n: replicas, 1..SLOTS. num_cpus: CPUs Ray reserves for each.
        detached: replicas outlive this process (several ingress workers on a shared
            cluster; they end with the cluster or ``ray.kill``); otherwise they end
            with it.
        service_kw: :class:`VerifierReplica` options (dtype, threads, max_batch, ...).
    Raises:
        ValueError: ``n`` out of range.
        ReplicaMismatch: replicas that disagree on the model (:func:`mismatch`:
            vocabulary, block size, tokenizer, config or weights).
        ray.exceptions.RayActorError: a replica died while loading (its error inside).
    """
    if not 1 <= n <= SLOTS:
        raise ValueError(f"replicas must be in [1, {SLOTS}]")
    handles = {i: _spawn(target, i, num_cpus, prefix, detached, service_kw)
               for i in range(n)}
    infos = [unwrap(r) for r in await asyncio.gather(
        *(h.info.remote() for h in handles.values()))]
    why = mismatch(infos, {"model": target_name(target),
                           "dtype": service_kw.get("dtype", "float32")})
    if why:
        raise ReplicaMismatch(why)
    return ReplicaRouter(handles), {k: v for k, v in infos[0].items() if k != "slot"}


class ReplicaMismatch(ValueError):
    """Replicas of one deployment serve different models (the message says how)."""


IDENTITY = ("vocab_size", "max_block", "tokenizer_hash", "config_sha", "weights_sha")
"""The ``info()`` fields on which every replica of a deployment must agree."""


def mismatch(infos: list[dict], expect: dict) -> str | None:
    """None when every replica's ``info()`` has the ``expect``-ed values (model name,
    dtype: what this ingress was asked to serve) and agrees with the first one's on
    :data:`IDENTITY`; else a one-line reason naming the replica and the field (a
    replica found by name on the cluster was started with another model, dtype or
    max_block)."""
    first = infos[0]
    for info in infos:
        for field, want in expect.items():
            if info.get(field) != want:
                return (f"verifier replica {info['slot']} on the cluster serves {field} "
                        f"{info.get(field)!r}, not the {want!r} asked for: stop it "
                        "(ray.kill, or restart the cluster) or serve what it serves")
    for info in infos[1:]:
        for field in IDENTITY:
            if info.get(field) != first.get(field):
                return (f"verifier replica {info['slot']} serves a different model than "
                        f"replica {first['slot']}: {field} {info.get(field)} != "
                        f"{first.get(field)} ({info.get('model')} vs {first.get('model')});"
                        " replicas of that name already on the cluster were started with "
                        "another target: kill them (ray.kill) or restart the cluster")
    return None
