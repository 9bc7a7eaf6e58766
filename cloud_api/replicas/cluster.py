"""Connect to Ray (or start a local cluster) and run the verifier replicas on Ray Serve.

The replicas are one Serve deployment (``verifier``, ``num_replicas`` N) in a Serve
application of its own (default ``specrelay-verifier``, no HTTP route: Serve's proxy is
off, the signed aiohttp ingress calls it through a ``DeploymentHandle``). Its request
router is :class:`~cloud_api.replicas.router.SessionRouter` (session affinity by slot,
creates to the least loaded replica). Serve restarts a replica that dies; the new one
registers for a slot and a new generation, so the dead one's sessions answer 404
``session_evicted`` and the edge SDK re-creates them (:mod:`cloud_api.replicas.router`).

An application of that name already on the cluster is reused, never redeployed, when
its replicas serve what was asked (model, spec fingerprint, dtype) and agree among
themselves (:data:`IDENTITY`); otherwise it is refused (:class:`ReplicaMismatch`). Of
several ingress workers starting at once, one deploys (the registry's claim) and the
others wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import ray

from cloud_api.replicas.replica import SLOTS, spec_sha, target_name

log = logging.getLogger(__name__)

__all__ = ["APP", "NAMESPACE", "IDENTITY", "ReplicaMismatch", "connect", "mismatch",
           "shutdown", "start_replicas", "stop_replicas"]

NAMESPACE = "specrelay"
APP = "specrelay-verifier"
DEPLOYMENT = "verifier"
START_S = 900.0
"""Seconds an application may take to reach RUNNING (every replica loads the target)."""

SERVE_OPTIONS = {
    "max_ongoing_requests": 1000,     # sessions x blocks in flight; the queue batches
    "health_check_period_s": 1.0,     # a dead replica is replaced within seconds
    "health_check_timeout_s": 30.0,
    "graceful_shutdown_wait_loop_s": 0.5,
    "graceful_shutdown_timeout_s": 2.0,
    "max_constructor_retry_count": 2,  # a target that cannot load fails the deploy fast
}
ROUTING = {"request_routing_stats_period_s": 1.0, "request_routing_stats_timeout_s": 10.0,
           "request_router_kwargs": {"affinity_wait_s": 2.0}}


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """``ray.init``: join the cluster at ``address`` (``HOST:PORT`` or ``auto``), or
    start a local one (``num_cpus`` CPUs; None: all) when ``address`` is None; then
    start Serve without its HTTP proxy. A second call in the same process is a no-op.
    A local cluster whose raylet misses Ray's fixed 30 s registration wait (a loaded
    machine) is started once more before the error is raised."""
    from ray import serve

    for attempt in (1, 2):
        if ray.is_initialized():
            break
        try:
            ray.init(address=address, num_cpus=None if address else num_cpus,
                     include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception here
            if address is not None or attempt == 2 or "timed out during startup" not in str(e):
                raise
            log.warning("local Ray node timed out during startup; starting it again")
            ray.shutdown()
    serve.start(proxy_location="Disabled")


def shutdown() -> None:
    """Serve's and Ray's shutdown (this process's local cluster ends with it)."""
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def _app_status(app: str) -> str | None:
    from ray import serve

    found = serve.status().applications.get(app)
    return None if found is None else str(getattr(found.status, "value", found.status))


def _deploy(target, n: int, app: str, num_cpus: float, service_kw: dict):
    """``serve.run`` of the verifier deployment (blocks until RUNNING). Raises
    RuntimeError with Serve's reason when a replica cannot start."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cloud_api.replicas.registry import registry_name
    from cloud_api.replicas.replica import VerifierReplica
    from cloud_api.replicas.router import ROUTER_CLASS

    dep = serve.deployment(VerifierReplica, name=DEPLOYMENT).options(
        num_replicas=n, ray_actor_options={"num_cpus": num_cpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                                  **ROUTING),
        **SERVE_OPTIONS)
    serve.run(dep.bind(target, registry_name(app), **service_kw), name=app,
              route_prefix=None)


def _deploy_once(target, n: int, app: str, num_cpus: float, service_kw: dict,
                 reg) -> None:
    """Deploy ``app`` unless it is running or another ingress worker is deploying it
    (the registry's claim), then wait until it is RUNNING. Raises RuntimeError (Serve's
    reason, or the state it ended in)."""
    token = uuid.uuid4().hex
    if _app_status(app) in (None, "DEPLOY_FAILED") and ray.get(
            reg.claim_deploy.remote(token, START_S)):
        try:
            _deploy(target, n, app, num_cpus, service_kw)
        finally:
            reg.release_deploy.remote(token)
    deadline = time.monotonic() + START_S
    while (st := _app_status(app)) != "RUNNING":
        waiting = st not in (None, "DEPLOY_FAILED", "DELETING") or (
            st is None and ray.get(reg.deploying.remote()))
        if not waiting or time.monotonic() > deadline:
            raise RuntimeError(f"the Serve application {app} is {st or 'gone'}")
        time.sleep(0.5)


def start_replicas(target, n: int, *, app: str = APP, num_cpus: float = 1.0,
                   call_timeout_s: float = 300.0, **service_kw) -> tuple:
    """Deploy (or find, by application name) ``n`` replicas of ``target`` on Serve and
    wait until each has loaded it. Returns ``(client, info)``: a
    :class:`~cloud_api.replicas.client.ReplicaClient` and the first replica's
    ``info()`` less slot, generation and actor name (vocab_size, max_block,
    tokenizer_hash, model, spec_sha, config_sha, weights_sha, dtype), on which all
    agree. Not from inside an event loop (Serve's deploy blocks).

    Args:
        target: model spec or picklable factory
            (:func:`cloud_api.replicas.replica.load_target`).
        n: replicas, 1..SLOTS (an application found running keeps its own count).
        app: the Serve application's name (several ingress workers that name the same
            one share its replicas).
        num_cpus: CPUs Ray reserves for each replica.
        call_timeout_s: seconds a call may take before it answers 503.
        service_kw: :class:`~cloud_api.replicas.replica.VerifierReplica` options
            (dtype, threads, max_batch, ...).
    Raises:
        ValueError: ``n`` out of range.
        ReplicaMismatch: the replicas found serve another model (another name, spec,
            dtype) or disagree among themselves (:func:`mismatch`).
        RuntimeError: a replica could not load the target (Serve's reason inside).
    """
    from ray import serve

    from cloud_api.replicas.client import ReplicaClient
    from cloud_api.replicas.registry import registry

    if not 1 <= n <= SLOTS:
        raise ValueError(f"replicas must be in [1, {SLOTS}]")
    expect = {"model": target_name(target), "spec_sha": spec_sha(target),
              "dtype": service_kw.get("dtype", "float32")}
    reg = registry(app)                     # before any replica asks it for a slot
    _deploy_once(target, n, app, num_cpus, service_kw, reg)
    client = ReplicaClient(serve.get_deployment_handle(DEPLOYMENT, app_name=app), reg,
                           call_timeout_s, app)
    infos = asyncio.run(_infos(client))
    why = mismatch(infos, expect, app) if infos else f"no replica of {app} answered"
    if why:
        raise ReplicaMismatch(why)
    hidden = ("slot", "generation", "replica")
    return client, {k: v for k, v in infos[0].items() if k not in hidden}


async def _infos(client) -> list[dict]:
    """Every live replica's ``info()``, by slot."""
    got = await client.broadcast("info")
    return [got[s] for s in sorted(got)]


def stop_replicas(app: str = APP) -> None:
    """Delete the Serve application ``app`` and its slot registry (its sessions end)."""
    from ray import serve

    from cloud_api.replicas.registry import NAMESPACE as REG_NS, registry_name

    serve.delete(app)
    try:
        ray.kill(ray.get_actor(registry_name(app), namespace=REG_NS))
    except ValueError:
        pass


class ReplicaMismatch(ValueError):
    """Replicas of one deployment serve different models (the message says how)."""


IDENTITY = ("vocab_size", "max_block", "tokenizer_hash", "config_sha", "weights_sha")
"""The ``info()`` fields on which every replica of a deployment must agree."""


def mismatch(infos: list[dict], expect: dict, app: str = APP) -> str | None:
    """None when every replica's ``info()`` has the ``expect``-ed values (model name,
    spec fingerprint, dtype: what this ingress was asked to serve) and agrees with the
    first one's on :data:`IDENTITY`; else a one-line reason naming the replica and the
    field (an application found on the cluster was started with another model, dtype
    or spec; or replicas loaded different files, e.g. a model folder that differs
    between nodes)."""
    first = infos[0]
    for info in infos:
        for field, want in expect.items():
            if info.get(field) != want:
                return (f"verifier replica {info['slot']} of the Serve application {app} "
                        f"serves {field} {info.get(field)!r}, not the {want!r} asked "
                        f"for: stop it (serve.delete({app!r}), or restart the cluster) "
                        "or serve what it serves")
    for info in infos[1:]:
        for field in IDENTITY:
            if info.get(field) != first.get(field):
                return (f"verifier replica {info['slot']} serves a different model than "
                        f"replica {first['slot']}: {field} {info.get(field)} != "
                        f"{first.get(field)} ({info.get('model')} vs {first.get('model')});"
                        " the replicas loaded different files (a model folder that "
                        f"differs between nodes?): fix them and serve.delete({app!r})")
    return None
