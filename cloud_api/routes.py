"""The route handlers of the verification API: each decodes its request, calls the
:class:`cloud_api.service.CloudService` under ``app[SERVICE]`` and encodes the answer
(msgpack, or JSON for a JSON request). :func:`cloud_api.app.create_app` mounts them."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from cloud_api.context import MSGPACK, SERVICE
from cloud_api.context import owner as _owner
from cloud_api.service import CloudService
from cloud_api.sessions import ApiError
from edge_sdk.protocol import frames, wire

log = logging.getLogger("cloud_api")


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


async def verify(request: web.Request) -> web.StreamResponse:
    """Verify one block. A request whose ``Accept`` names ``wire.STREAM_SEQ`` gets a
    streamed answer (FSD): the early verdict as soon as the exit layer has run, then
    the final verdict (or the final alone: a duplicate, no early exit)."""
    _msgpack_body(request)
    svc: CloudService = request.app[SERVICE]
    limiter, key = request.get("ratelimiter"), request.get("api_key")
    charge = None
    if limiter is not None and key is not None:
        charge = limiter.charge_for(key)
    args = (request.match_info["sid"], await request.read(), _owner(request), charge)
    if wire.STREAM_SEQ not in request.headers.get("Accept", ""):
        return web.Response(body=await svc.verify(*args), content_type=MSGPACK)
    return await _verify_streamed(request, svc, args)


async def _verify_streamed(request: web.Request, svc: CloudService, args) -> web.StreamResponse:
    """The streamed verify answer. An error before the early verdict is an ordinary
    4xx/5xx JSON answer; after it (the status line is sent) it is a stream-error item."""
    early: asyncio.Queue = asyncio.Queue()
    final = asyncio.ensure_future(svc.verify(*args, on_early=early.put_nowait))
    first = asyncio.ensure_future(early.get())
    await asyncio.wait({final, first}, return_when=asyncio.FIRST_COMPLETED)
    if not first.done():
        first.cancel()
    resp = web.StreamResponse(headers={"Content-Type": wire.STREAM_SEQ,
                                       "Cache-Control": "no-store"})
    if not first.cancelled() and first.done():
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(first.result())
    try:
        out = await final
    except ApiError as e:
        if not resp.prepared:
            raise
        out = frames.stream_error(e.status, e.body()["error"])
    except wire.WireError as e:
        if not resp.prepared:
            raise
        out = frames.stream_error(400, {"code": "bad_request", "message": e.message,
                                      "field": e.field})
    except Exception:
        if not resp.prepared:
            raise
        log.exception("verify failed after its early verdict was sent")
        out = frames.stream_error(500, {"code": "internal", "message": "verification failed"})
    if not resp.prepared:
        resp.content_length = len(out)
        await resp.prepare(request)
    await resp.write(out)
    await resp.write_eof()
    return resp


async def correction(request: web.Request) -> web.Response:
    _msgpack_body(request)
    svc: CloudService = request.app[SERVICE]
    out = await svc.correction(request.match_info["sid"], await request.read(),
                               _owner(request))
    return web.Response(body=out, content_type=MSGPACK)


async def get_session(request: web.Request) -> web.Response:
    svc: CloudService = request.app[SERVICE]
    return web.json_response(await svc.state(request.match_info["sid"], _owner(request)))


async def delete_session(request: web.Request) -> web.Response:
    await request.app[SERVICE].remove(request.match_info["sid"], _owner(request))
    return web.json_response({"deleted": True})


async def key_info(request: web.Request) -> web.Response:
    """``GET /v1/key``: the key that signed the request (id, name, scopes, limits and
    tokens used; never the secret), or ``{"auth": "off"}`` on a server run without keys.
    Clients call it to check a key before loading a model: 200 means accepted, and the
    auth middleware answers a refused key 401/403 before this handler runs."""
    key = request.get("api_key")
    if key is None:
        return web.json_response({"auth": "off", "key_id": None})
    return web.json_response({
        "auth": "on", "key_id": key.key_id, "name": key.name,
        "scopes": sorted(key.scopes), "rpm": key.rpm, "tpm": key.tpm,
        "quota": key.quota, "used_tokens": key.used_tokens})


async def healthz(request: web.Request) -> web.Response:
    svc: CloudService = request.app[SERVICE]
    return web.json_response(await svc.health())


def add_routes(app: web.Application) -> None:
    """Mount the session and health routes on ``app``."""
    app.router.add_post("/v1/sessions", create_session)
    app.router.add_post("/v1/sessions/{sid}/verify", verify)
    app.router.add_post("/v1/sessions/{sid}/correction", correction)
    app.router.add_get("/v1/sessions/{sid}", get_session)
    app.router.add_delete("/v1/sessions/{sid}", delete_session)
    app.router.add_get("/v1/key", key_info)
    app.router.add_get("/healthz", healthz)
