"""aiohttp application: the signed verification API (AsymSpec §IV-B).

Routes:
    POST   /v1/sessions                    create a session, prefill the target KV cache
    POST   /v1/sessions/{id}/verify        verify one draft block (msgpack array)
    POST   /v1/sessions/{id}/correction    larger top-K support or the full p of the
                                           block awaiting its correction token
    GET    /v1/sessions/{id}               confirmed state (JSON)
    DELETE /v1/sessions/{id}
    GET    /healthz
Every bad input gets a 4xx JSON body ``{"error": {"code", "message", "field"}}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

from cloud_api import stream
from cloud_api.batcher import VerifyQueue
from cloud_api.context import MSGPACK, SERVICE, owner
from cloud_api.sessions import ApiError, Session, SessionStore
from cloud_api.verifier import Verifier
from edge_sdk.kvmodel import KVModel
from edge_sdk.models import encode_prompt, eos_ids, tokenizer_fingerprint
from edge_sdk.protocol import wire
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

log = logging.getLogger("specrelay.cloud")
_owner = owner


def _json_error(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """ApiError/WireError -> 4xx JSON; aiohttp's own 4xx -> JSON; nothing leaks a 500
    for bad input."""
    try:
        return await handler(request)
    except ApiError as e:
        return _json_error(e)
    except wire.WireError as e:
        return _json_error(ApiError(400, "bad_request", e.message, e.field))
    except web.HTTPRequestEntityTooLarge:
        return _json_error(ApiError(413, "body_too_large", "request body too large", "body"))
    except web.HTTPException as e:
        if e.status >= 400:
            return _json_error(ApiError(e.status, e.reason.lower().replace(" ", "_"),
                                        e.reason))
        raise


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes one token costs: layers x 2 (K, V) x kv_heads x head_dim x dtype."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * heads * head_dim * next(model.parameters()).element_size()


class CloudService:
    """Owns the target model, the sessions and the verification queue."""

    def __init__(self, model, tokenizer, *, max_block: int = MAX_DRAFT_TOKENS, max_batch: int = 8,
                 max_wait_s: float = 0.0, session_ttl_s: float = 600.0,
                 max_sessions: int = 256, max_sessions_per_key: int = 64,
                 kv_budget_bytes: int | None = None, threads: int | None = None,
                 metrics=None):
        self.model, self.tokenizer = model, tokenizer
        self.verifier = Verifier(model, max_block)
        self.sessions = SessionStore(session_ttl_s, max_sessions, max_sessions_per_key,
                                     kv_budget_bytes, kv_bytes_per_token(model))
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="target")
        self.queue = VerifyQueue(self.verifier, self.executor, max_batch, max_wait_s,
                                 metrics.observe_batch if metrics else None)
        self.eos = eos_ids(model, tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.threads = threads
        self.metrics = metrics
        self._locks: dict[int, asyncio.Lock] = {}

    async def start(self, app=None) -> None:
        if self.threads:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, torch.set_num_threads, self.threads)
        self.queue.start()

    async def stop(self, app=None) -> None:
        await self.queue.stop()
        self.executor.shutdown(wait=True)

    def lock(self, sid: int) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    async def create(self, body: dict, owner: str | None) -> dict:
        V = self.verifier.vocab_size
        m = wire.decode_session_request(body, V, self.verifier.max_context)
        if m["vocab_size"] is not None and m["vocab_size"] != V:
            raise ApiError(422, "vocab_mismatch", f"draft vocabulary {m['vocab_size']} does "
                           f"not match the target's {V}: draft and target must share a "
                           "tokenizer", "vocab_size")
        fp = m["tokenizer_hash"]
        if fp is not None and fp != self.fingerprint:
            raise ApiError(422, "tokenizer_mismatch", "the draft's tokenizer differs from "
                           "the target's: draft and target must share a tokenizer",
                           "tokenizer_hash")
        ids = m.get("prompt_ids") or encode_prompt(self.tokenizer, m["prompt"], m["chat"])
        if len(ids) >= self.verifier.max_context:
            raise ApiError(422, "context_full", "prompt exceeds the model context", "prompt")
        self.sessions.check_owner_limit(owner)   # before spending a prefill
        s = Session(self.sessions.new_id(), owner, m["sampling"], m["seed"], m["mode"],
                    m["support_k"], m["n_proposals"], m["max_new_tokens"],
                    KVModel(self.model), list(ids), len(ids))
        loop = asyncio.get_running_loop()
        prefill_s = await loop.run_in_executor(self.executor, self.verifier.prefill, s)
        self.sessions.add(s)
        if self.metrics is not None:
            self.metrics.sessions.set(len(self.sessions))
            self.metrics.evictions.set(self.sessions.evictions)
        return {**s.state(), "prompt_ids": ids, "vocab_size": V,
                "max_block": self.verifier.max_block, "eos_token_ids": self.eos,
                "prefill_s": prefill_s}

    async def verify(self, sid: str, body: bytes, owner: str | None, charge=None) -> bytes:
        """Verify one block. ``charge(n)`` meters the block's n = g + 1 tokens before the
        target pass (it raises to refuse; a duplicate is answered without charge)."""
        s = self.sessions.get(sid, owner)
        async with self.lock(s.id):
            digest = hashlib.sha256(body).digest()
            req = wire.VerifyRequest.decode(body, self.verifier.vocab_size,
                                            self.verifier.max_block)
            seen = s.replay.get(req.block_seq)
            if seen is not None:
                if seen[0] == digest:     # a retry: same decisions, same draws
                    return seen[1]
                raise ApiError(409, "block_seq_reused",
                               "block_seq already answered with different content",
                               "block_seq", state=s.state())
            self.verifier.check(s, req)   # stale blocks are refused before any charge
            if charge is not None:
                charge(len(req.tokens) + 1)
            resp = await self.queue.submit(s, req)
            self.sessions.enforce(keep=s.id)   # the block grew the KV cache
            out = resp.encode()
            if self.metrics is not None:
                self.metrics.observe_verify(resp, len(req.tokens))
            s.remember(req.block_seq, digest, out, req.pending_commit is not None)
            return out

    async def correction(self, sid: str, body: bytes, owner: str | None) -> bytes:
        s = self.sessions.get(sid, owner)
        async with self.lock(s.id):
            req = wire.CorrectionRequest.decode(body, self.verifier.vocab_size)
            out = self.verifier.correction(s, req).encode()
            if self.metrics is not None:
                self.metrics.corrections.labels(
                    "full_fetch" if req.k is None else "support_fetch").inc()
            return out

    def delete(self, sid: str, owner: str | None) -> None:
        s = self.sessions.get(sid, owner)
        self.sessions.remove(s.id)
        self._locks.pop(s.id, None)


async def _read_control(request: web.Request) -> dict:
    body = await request.read()
    if request.content_type == "application/json":
        try:
            return json.loads(body)
        except (ValueError, RecursionError):   # RecursionError: absurdly deep nesting
            raise ApiError(400, "bad_request", "body is not valid JSON", "body") from None
    return wire.unpack(body)


def _reply(request: web.Request, obj: dict, status: int = 200) -> web.Response:
    if request.content_type == "application/json":
        return web.json_response(obj, status=status)
    return web.Response(body=wire.pack(obj), status=status, content_type=MSGPACK)


async def create_session(request: web.Request) -> web.Response:
    svc: CloudService = request.app[SERVICE]
    body = await _read_control(request)
    return _reply(request, await svc.create(body, _owner(request)), 201)


def _msgpack_body(request: web.Request) -> None:
    """Raises ApiError 415 unless the body is declared msgpack (or left untyped)."""
    if request.content_type not in (MSGPACK, "application/octet-stream"):
        raise ApiError(415, "unsupported_media_type", f"the body must be msgpack "
                       f"({MSGPACK}), not {request.content_type}", "content-type")


async def verify(request: web.Request) -> web.Response:
    _msgpack_body(request)
    svc: CloudService = request.app[SERVICE]
    limiter, key = request.get("ratelimiter"), request.get("api_key")
    charge = None
    if limiter is not None and key is not None:
        charge = lambda n: limiter.consume_tokens(key, n)  # noqa: E731
    out = await svc.verify(request.match_info["sid"], await request.read(), _owner(request),
                           charge)
    return web.Response(body=out, content_type=MSGPACK)


async def correction(request: web.Request) -> web.Response:
    _msgpack_body(request)
    svc: CloudService = request.app[SERVICE]
    out = await svc.correction(request.match_info["sid"], await request.read(),
                               _owner(request))
    return web.Response(body=out, content_type=MSGPACK)


async def get_session(request: web.Request) -> web.Response:
    svc: CloudService = request.app[SERVICE]
    return web.json_response(svc.sessions.get(request.match_info["sid"],
                                              _owner(request)).state())


async def delete_session(request: web.Request) -> web.Response:
    request.app[SERVICE].delete(request.match_info["sid"], _owner(request))
    return web.json_response({"deleted": True})


async def healthz(request: web.Request) -> web.Response:
    svc: CloudService = request.app[SERVICE]
    return web.json_response({"status": "ok", "sessions": len(svc.sessions),
                              "vocab_size": svc.verifier.vocab_size,
                              "tokenizer_hash": svc.fingerprint})


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
            session_ttl_s, max_sessions, threads).
    """
    from cloud_api.metrics import METRICS, ApiMetrics, metrics_handler, metrics_middleware

    metrics = ApiMetrics()
    mws = [metrics_middleware(metrics), error_middleware]
    if key_store is not None:
        from cloud_api.auth import auth_middleware
        from cloud_api.ratelimit import (RateLimiter, ratelimit_middleware,
                                         unauthenticated_ip_middleware)

        if unauth_per_window is not None:
            mws.append(unauthenticated_ip_middleware(unauth_per_window,
                                                     window_s=rate_window_s))
        mws += [auth_middleware(key_store),
                ratelimit_middleware(RateLimiter(window_s=rate_window_s, store=key_store))]
    app = web.Application(middlewares=[*mws, *middlewares],
                          client_max_size=client_max_size)
    svc = CloudService(model, tokenizer, metrics=metrics, **service_kw)
    app[SERVICE] = svc
    app[METRICS] = metrics
    if metrics_address is None:
        app.router.add_get("/metrics", metrics_handler)
    else:
        from cloud_api.metrics import serve_metrics_on

        serve_metrics_on(app, *metrics_address)
    app.on_startup.append(svc.start)
    app.on_cleanup.append(svc.stop)
    app.router.add_post("/v1/sessions", create_session)
    app.router.add_post("/v1/sessions/{sid}/verify", verify)
    app.router.add_post("/v1/sessions/{sid}/correction", correction)
    app.router.add_get("/v1/sessions/{sid}", get_session)
    app.router.add_delete("/v1/sessions/{sid}", delete_session)
    app.router.add_get("/healthz", healthz)
    stream.register(app)  # POST .../generate
    return app
