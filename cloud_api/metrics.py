"""Prometheus metrics for the verification API (``GET /metrics``).

Each app gets its own ``CollectorRegistry`` (several apps can live in one process).
Names are the edge metrics' names where a counter exists for them.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from cloud_api.context import SERVICE

METRICS = web.AppKey("metrics", object)
access_log = logging.getLogger("specrelay.access")


class ApiMetrics:
    """The counters, gauges and histograms of one app."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specrelay_requests_total", "HTTP requests",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("specrelay_request_seconds", "HTTP request latency (s)",
                                 ["endpoint"], registry=r,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1,
                                          2.5, 5, 10))
        self.bytes = Counter("specrelay_body_bytes_total", "Body bytes by direction",
                             ["direction"], registry=r)
        self.drafted = Counter("specrelay_drafted_tokens_total", "Draft tokens verified",
                               registry=r)
        self.accepted = Counter("specrelay_accepted_tokens_total",
                                "Draft tokens the target accepted", registry=r)
        self.bonus = Counter("specrelay_bonus_tokens_total", "Bonus tokens drawn", registry=r)
        self.corrections = Counter("specrelay_corrections_total",
                                   "Rejections by how the correction was served",
                                   ["kind"], registry=r)
        self.passes = Counter("specrelay_target_passes_total", "Target forward passes",
                              registry=r)
        self.target_seconds = Counter("specrelay_target_seconds_total",
                                      "Target compute time (s)", registry=r)
        self.batch_size = Histogram("specrelay_batch_size", "Blocks per verification batch",
                                    registry=r, buckets=(1, 2, 4, 8, 16, 32))
        self.early_verdicts = Counter(
            "specrelay_early_verdicts_total", "FSD early verdicts streamed, by whether the "
            "final verdict matched them (early_verdict_hit_rate = hit / all)", ["outcome"],
            registry=r)
        self.semantic_accepted = Counter(
            "specrelay_semantic_accepted_tokens_total", "Draft tokens accepted "
            "semantically (WISV, lossy: they differ from the target's choice)", registry=r)
        self.sessions = Gauge("specrelay_sessions", "Open sessions", registry=r)
        self.evictions = Gauge("specrelay_session_evictions", "Sessions evicted (TTL/limit)",
                               registry=r)

    def observe_batch(self, size: int) -> None:
        """One target pass over ``size`` blocks (a batched pass counts once)."""
        self.batch_size.observe(size)
        self.passes.inc()

    def observe_verify(self, resp, g: int) -> None:
        """Count one verified block of depth ``g`` (a VerifyResponse)."""
        self.drafted.inc(g)
        self.accepted.inc(resp.accepted)
        self.semantic_accepted.inc(resp.semantic_accepted)
        self.target_seconds.inc(resp.target_s)
        if g == 0:
            pass                        # a plain target step: neither bonus nor correction
        elif resp.next_token is not None and resp.accepted == g:
            self.bonus.inc()
        elif resp.next_token is not None:
            self.corrections.labels("cloud_drawn").inc()
        else:
            self.corrections.labels("staged").inc()


def _endpoint(request: web.Request) -> str:
    route = request.match_info.route
    info = route.resource.canonical if route.resource is not None else "unmatched"
    return f"{request.method} {info}"


def metrics_middleware(m: ApiMetrics):
    """Counts requests by endpoint and status, latency and body bytes, and writes one
    structured (JSON) access-log line per request on ``specrelay.access``: endpoint,
    status, seconds, body sizes and the API key *id* — never bodies, prompts, headers
    or secrets."""

    @web.middleware
    async def mw(request: web.Request, handler):
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if isinstance(resp, web.Response) and isinstance(resp.body, bytes):
                m.bytes.labels("out").inc(len(resp.body))
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            ep = _endpoint(request)
            dt = time.perf_counter() - t0
            m.requests.labels(ep, str(status)).inc()
            m.latency.labels(ep).observe(dt)
            m.bytes.labels("in").inc(request.content_length or 0)
            if access_log.isEnabledFor(logging.INFO):
                key = request.get("api_key")
                access_log.info(json.dumps({
                    "endpoint": ep, "status": status, "seconds": round(dt, 6),
                    "bytes_in": request.content_length or 0,
                    "key_id": getattr(key, "key_id", None),
                    "session": request.match_info.get("sid")}))

    return mw


async def metrics_handler(request: web.Request) -> web.Response:
    m: ApiMetrics = request.app[METRICS]
    svc = request.app.get(SERVICE)
    if getattr(svc, "sessions", None) is not None:   # gauges follow deletes, expiry and
        # evictions (an ingress in front of verifier replicas holds no sessions itself)
        svc.sessions.expire()
        m.sessions.set(len(svc.sessions))
        m.evictions.set(svc.sessions.evictions)
    return web.Response(body=generate_latest(m.registry),
                        headers={"content-type": CONTENT_TYPE_LATEST})


def serve_metrics_on(app: web.Application, host: str, port: int) -> None:
    """Serve ``GET /metrics`` of ``app`` on a listener of its own at ``host:port``,
    opened when ``app`` starts and closed at its cleanup (same event loop)."""
    side = web.Application()
    side[METRICS] = app[METRICS]
    side[SERVICE] = app.get(SERVICE)
    side.router.add_get("/metrics", metrics_handler)
    state = {}

    async def start(_parent: web.Application) -> None:
        runner = web.AppRunner(side, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        state["runner"] = runner

    async def stop(_parent: web.Application) -> None:
        if "runner" in state:
            await state.pop("runner").cleanup()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
