"""``specrelay serve --replicas N`` / ``--ray-address``: the signed ingress in front of
N verifier replicas on Ray Serve (:mod:`cloud_api.replicas`). Needs the ``[ray]``
extra: a missing ``ray`` module ends in the one-line error naming it."""

from __future__ import annotations

import os

import click

__all__ = ["serve_replicated"]


def _describe(ray_address: str | None, n: int, dead: int = 0) -> str:
    where = f"Ray cluster {ray_address}" if ray_address else "a local Ray cluster"
    return (f"{n} verifier replica{'' if n == 1 else 's'} on {where}, Ray Serve "
            "application specrelay-verifier")


def serve_replicated(*, model: str, dtype: str, threads: int | None, replicas: int,
                     ray_address: str | None, max_batch: int, max_wait_ms: float,
                     store, metrics_address, unauth_rpm: int,
                     free_rows: int | None = None) -> tuple:
    """Connect to Ray (``ray_address``; None: start a local cluster), deploy (or find,
    by Serve application name) ``replicas`` replicas loading ``model`` each, and build
    the ingress app. On an existing cluster the Serve application and the shared state
    outlive this process (the next ingress worker finds them; they end with the
    cluster or ``serve.delete``); on a local one they end with this process.
    Returns ``(app, description)``. Raises ModuleNotFoundError (no ``[ray]`` extra),
    click.ClickException (a replica failed to load the target, or the replicas found
    on the cluster serve another model: another name, spec, dtype, config or
    weights)."""
    from cloud_api.replicas import cluster
    from cloud_api.replicas.ingress import create_replicated_app
    from cloud_api.replicas.shared_state import RayStorage, SharedNonceCache, ingress_state

    if os.path.exists(model):     # one name for the folder, whatever each worker's cwd
        model = os.path.abspath(model)
    cluster.connect(ray_address)
    click.echo(f"starting {_describe(ray_address, replicas)} ({model}); each loads the "
               "target", err=True)
    try:
        client, info = cluster.start_replicas(
            model, replicas, num_cpus=threads or 1, dtype=dtype, threads=threads,
            max_batch=max_batch, max_wait_s=max_wait_ms / 1000, free_rows=free_rows)
    except cluster.ReplicaMismatch as e:   # replicas found on the cluster: another model
        raise click.ClickException(str(e)) from None
    except Exception as e:   # noqa: BLE001 - a replica's load error, in one line
        raise click.ClickException(f"a verifier replica failed to start: "
                                   f"{str(e).strip().splitlines()[-1]}") from None
    shared = {}
    if store is not None:
        state = ingress_state(detached=ray_address is not None)
        shared = {"nonce_cache": SharedNonceCache(state), "storage": RayStorage(handle=state)}
    app = create_replicated_app(client, info, key_store=store,
                                unauth_per_window=unauth_rpm or None,
                                metrics_address=metrics_address, **shared)
    return app, _describe(ray_address, replicas)
