"""aiohttp application: the signed verification API (AsymSpec §IV-B).

Routes (handlers in :mod:`cloud_api.routes`, the service in :mod:`cloud_api.service`):
    POST   /v1/sessions                    create a session, prefill the target KV cache
    POST   /v1/sessions/{id}/verify        verify one draft block (msgpack array; with
                                           Accept x-msgpack-seq: FSD's early verdict,
                                           then the final one, streamed)
    POST   /v1/sessions/{id}/correction    larger top-K support or the full p of the
                                           block awaiting its correction token
    GET    /v1/sessions/{id}               confirmed state (JSON)
    DELETE /v1/sessions/{id}
    GET    /healthz
Every bad input gets a 4xx JSON body ``{"error": {"code", "message", "field"}}``.
"""

from __future__ import annotations

from aiohttp import web

from cloud_api import stream
from cloud_api.context import SERVICE
from cloud_api.routes import add_routes
from cloud_api.service import CloudService
from cloud_api.sessions import ApiError
from edge_sdk.protocol import wire

__all__ = ["SERVICE", "CloudService", "create_app", "error_middleware"]


def _json_error(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """ApiError/WireError -> 4xx JSON; aiohttp's own 4xx -> JSON; a body cut off by a
    connection reset -> 400 ``incomplete_body``; nothing leaks a 500 for bad input."""
    try:
        return await handler(request)
    except ApiError as e:
        return _json_error(e)
    except wire.WireError as e:
        return _json_error(ApiError(400, "bad_request", e.message, e.field))
    except web.HTTPRequestEntityTooLarge:
        return _json_error(ApiError(413, "body_too_large", "request body too large", "body"))
    except ConnectionResetError:
        if request.content.is_eof():
            raise                  # the body had arrived: not a request cut mid-body
        # the client reset the connection mid-body: a 4xx for the logs and metrics,
        # not aiohttp's 500 with a traceback (nobody reads the answer)
        return _json_error(ApiError(400, "incomplete_body", "the connection was reset "
                                    "before the request body arrived", "body"))
    except web.HTTPException as e:
        if e.status >= 400:
            return _json_error(ApiError(e.status, e.reason.lower().replace(" ", "_"),
                                        e.reason))
        raise


def _middlewares(metrics, key_store, rate_window_s: int,
                 unauth_per_window: int | None, nonce_cache=None, storage=None) -> list:
    """Metrics outermost, then the JSON errors, then (with a key store) the per-IP budget
    of unauthenticated requests, signature verification and the per-key rate limits.
    ``nonce_cache`` / ``storage``: a replay cache and a ``limits`` storage shared by
    several ingress workers (default: this process's own)."""
    from cloud_api.metrics import metrics_middleware

    mws = [metrics_middleware(metrics), error_middleware]
    if key_store is not None:
        from cloud_api.auth import auth_middleware
        from cloud_api.ratelimit import (RateLimiter, ratelimit_middleware,
                                         unauthenticated_ip_middleware)

        if unauth_per_window is not None:
            mws.append(unauthenticated_ip_middleware(unauth_per_window,
                                                     window_s=rate_window_s,
                                                     storage=storage))
        mws += [auth_middleware(key_store, nonce_cache=nonce_cache),
                ratelimit_middleware(RateLimiter(window_s=rate_window_s, store=key_store,
                                                 storage=storage))]
    return mws


def _mount_metrics(app: web.Application, address: tuple[str, int] | None) -> None:
    """``GET /metrics`` on the API port, or on its own listener at ``address``."""
    from cloud_api.metrics import metrics_handler, serve_metrics_on

    if address is None:
        app.router.add_get("/metrics", metrics_handler)
    else:
        serve_metrics_on(app, *address)


def create_app(model, tokenizer, *, key_store=None, rate_window_s: int = 60,
               unauth_per_window: int | None = 600, middlewares=(),
               client_max_size: int = wire.MAX_BODY_BYTES,
               metrics_address: tuple[str, int] | None = None,
               **service_kw) -> web.Application:
    """Build the verification app around a loaded target model.

    Args:
        model, tokenizer: the target (HF causal LM, eval mode).
        key_store: a :class:`cloud_api.keys.KeyStore`; when given every /v1 request must
            be signed by a key with the ``verify`` scope and is rate limited per key.
            None serves without authentication (local development only).
        rate_window_s: window (seconds) of the per-key rpm/tpm limits.
        unauth_per_window: with a key store, the per-IP budget of unauthenticated
            requests (refused signatures, public paths) per ``rate_window_s``
            (:func:`cloud_api.ratelimit.unauthenticated_ip_middleware`); None: no limit.
        middlewares: extra aiohttp middlewares (auth, rate limits) run after the
            JSON error middleware.
        client_max_size: body limit in bytes (larger bodies get 413 JSON).
        metrics_address: ``(host, port)`` to serve ``GET /metrics`` on its own listener
            (started and stopped with this app) instead of on the API port, so the API
            port can face the internet while the metrics stay on a private interface.
        service_kw: :class:`CloudService` options (max_block, max_batch, max_wait_s,
            session_ttl_s, max_sessions, threads, early_head: an
            :class:`cloud_api.early_exit.ExitHead` for FSD's streamed early verdicts,
            semantic: a :class:`cloud_api.wisv.serving.SemanticAcceptance` for WISV's
            opt-in semantic acceptance, free_rows: the pass rows advertised as free).
    """
    from cloud_api.metrics import METRICS, ApiMetrics

    metrics = ApiMetrics()
    app = web.Application(middlewares=[*_middlewares(metrics, key_store, rate_window_s,
                                                     unauth_per_window),
                                       *middlewares],
                          client_max_size=client_max_size)
    svc = CloudService(model, tokenizer, metrics=metrics, **service_kw)
    app[SERVICE] = svc
    app[METRICS] = metrics
    _mount_metrics(app, metrics_address)
    app.on_startup.append(svc.start)
    app.on_cleanup.append(svc.stop)
    add_routes(app)
    stream.register(app)  # POST .../generate
    return app
