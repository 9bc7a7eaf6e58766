"""The ingress in front of verifier replicas: the same signed aiohttp API as
:func:`cloud_api.app.create_app` (routes, JSON errors, auth, rate limits, metrics), with
:class:`RoutedService` under ``app[SERVICE]`` in place of a local
:class:`cloud_api.service.CloudService`.

Differences from one server, all allowed by the protocol (AsymSpec §IV-B):
a streamed verify request (``Accept: application/x-msgpack-seq``) gets the final
verdict alone, in the streamed content type (the early item is optional); the
target-only stream ``POST /v1/sessions/{id}/generate`` answers 501 ``not_supported``;
``max_sessions_per_key`` applies per replica. Everything else is the replica's own
answer, passed through: a session create advertises the replica's ``max_tree_rows``
and ``free_rows``, a verify body's sibling ``alts`` and the ``sibling`` verdict cross
unchanged (sibling trees work through the ingress as on one server).
"""

from __future__ import annotations

import logging

from aiohttp import web

from cloud_api.app import _middlewares, _mount_metrics
from cloud_api.context import SERVICE
from cloud_api.keys import QuotaExceeded
from cloud_api.ratelimit import RateLimitExceeded
from cloud_api.replicas.client import ReplicaClient
from cloud_api.routes import add_routes
from cloud_api.sessions import ApiError
from edge_sdk.protocol import wire

__all__ = ["RoutedService", "create_replicated_app"]

log = logging.getLogger("cloud_api.replicas")


class RoutedService:
    """The route-facing calls of :class:`cloud_api.service.CloudService`, answered by
    the Serve replicas through a :class:`cloud_api.replicas.client.ReplicaClient`.
    ``info``: the replicas' common ``vocab_size``, ``max_block`` and
    ``tokenizer_hash``."""

    def __init__(self, replicas: ReplicaClient, info: dict):
        self.replicas, self.info = replicas, info

    async def start(self, app=None) -> None:
        """Nothing to start: the replicas run their own queues."""

    async def stop(self, app=None) -> None:
        """The replicas outlive an ingress worker (others may still use them)."""

    async def create(self, body: dict, owner: str | None) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "bad_request", "body must be a map", "body")
        return await self.replicas.create(body, owner)

    async def verify(self, sid: str, body: bytes, owner: str | None, charge=None,
                     on_early=None) -> bytes:
        """Verify one block on its session's replica. ``charge``: a
        :class:`cloud_api.ratelimit.TokenCharge` (or any ``charge(n)``): the block's
        n = g + 1 tokens are promised before the pass (``charge.can``) and charged
        after it; a block the budget cannot cover is refused (429 / 403) unless the
        replica answers it from its replay cache. ``on_early`` is never called (the
        early verdict is optional). Raises ApiError / WireError (bad body: 400)."""
        req = wire.VerifyRequest.decode(body, self.info["vocab_size"],
                                        self.info["max_block"])
        n = len(req.tokens) + 1
        can = getattr(charge, "can", None)
        may = charge is None or can is None or can(n)
        out, due = await self.replicas.for_session(sid, "verify", body, owner, may)
        if out is None:                 # needs the budget it could not be promised
            charge(due)                 # raises 429 / 403; passes if the window freed
            out, due = await self.replicas.for_session(sid, "verify", body, owner, True)
            due = 0 if out is None else due - n   # charged already
        if due > 0 and charge is not None:
            self._charge_after(charge, due)
        return out

    @staticmethod
    def _charge_after(charge, n: int) -> None:
        """Charge a block that ran; a concurrent request of the same key may have taken
        the window since ``can`` (then the key is over by at most this block)."""
        try:
            charge(n)
        except (RateLimitExceeded, QuotaExceeded):
            log.info("verified-token budget overrun by %d tokens (concurrent blocks)", n)

    async def correction(self, sid: str, body: bytes, owner: str | None) -> bytes:
        return await self.replicas.for_session(sid, "correction", body, owner)

    async def state(self, sid: str, owner: str | None) -> dict:
        return await self.replicas.for_session(sid, "state", owner)

    async def remove(self, sid: str, owner: str | None) -> None:
        await self.replicas.for_session(sid, "remove", owner)

    async def health(self) -> dict:
        """``GET /healthz``: status, sessions over the replicas that answered, replica
        counts (``replicas_dead``: registered but not answering: dead, restarting, or
        slower than the probe timeout)."""
        live = await self.replicas.live_slots()
        stats = await self.replicas.broadcast("stats", live)
        return {"status": "ok" if stats else "no_replica",
                "sessions": sum(s["sessions"] for s in stats.values()),
                "replicas": len(stats), "replicas_dead": max(0, len(live) - len(stats)),
                "vocab_size": self.info["vocab_size"],
                "tokenizer_hash": self.info["tokenizer_hash"]}


async def _generate_not_supported(request: web.Request) -> web.Response:
    raise ApiError(501, "not_supported", "target-only streaming is not served by "
                   "verifier replicas: use a single server (specrelay serve "
                   "--replicas 1)", "path")


def create_replicated_app(replicas: ReplicaClient, info: dict, *, key_store=None,
                          rate_window_s: int = 60, unauth_per_window: int | None = 600,
                          nonce_cache=None, storage=None,
                          client_max_size: int = wire.MAX_BODY_BYTES,
                          metrics_address: tuple[str, int] | None = None) -> web.Application:
    """The ingress app over the Serve replicas ``replicas`` calls.

    Args:
        replicas, info: the replicas' client and their common ``info()`` (vocab_size,
            max_block, tokenizer_hash): :func:`cloud_api.replicas.cluster.start_replicas`.
        key_store, rate_window_s, unauth_per_window, client_max_size, metrics_address:
            as :func:`cloud_api.app.create_app`.
        nonce_cache, storage: the replay cache and ``limits`` storage shared by every
            ingress worker (:mod:`cloud_api.replicas.shared_state`); None: this
            worker's own (one worker only, or sticky routing).
    """
    from cloud_api.metrics import METRICS, ApiMetrics

    metrics = ApiMetrics()
    app = web.Application(middlewares=_middlewares(metrics, key_store, rate_window_s,
                                                   unauth_per_window, nonce_cache,
                                                   storage),
                          client_max_size=client_max_size)
    app[SERVICE] = RoutedService(replicas, info)
    app[METRICS] = metrics
    _mount_metrics(app, metrics_address)
    add_routes(app)
    app.router.add_post("/v1/sessions/{sid}/generate", _generate_not_supported)
    return app
