"""The OpenAI-compatible aiohttp app around an :class:`EdgeClient`: routes, the health
check of the cloud behind it, and the app factories."""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from aiohttp import web

from edge_sdk.client import EdgeClient
from edge_sdk.defaults import DEFAULT_DEPTH
from edge_sdk.openai_server.request import (BadRequest, check_prompt_length,
                                            parse_chat_request, parse_completion_request)
from edge_sdk.openai_server.responses import Envelope, Run, error_response, upstream_error
from edge_sdk.openai_server.sse import stream_response
from edge_sdk.transport import RemoteError

__all__ = ["CLIENT", "SETTINGS", "create_openai_app", "create_edge_app"]

CLIENT = web.AppKey("specrelay_edge_client", EdgeClient)
SETTINGS = web.AppKey("specrelay_openai_settings", dict)


async def _json_body(request: web.Request):
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None


async def _max_context(app: web.Application) -> int | None:
    """The target's context in tokens, read once from the cloud's ``/healthz`` (None
    while the cloud cannot say: an older server, or none reachable; asked again
    next time)."""
    settings = app[SETTINGS]
    if settings.get("max_context") is None:
        import asyncio

        try:
            data, _ = await asyncio.wait_for(
                app[CLIENT].transport.request("GET", "/healthz"), 5.0)
            settings["max_context"] = int(json.loads(data)["max_context"])
        except Exception:  # noqa: BLE001 - best effort: the cloud still checks
            return None
    return settings["max_context"]


async def _parse(request: web.Request, kind: str):
    """The validated request; a prompt longer than the target's context is refused
    here, before the draft's prefill. Raises BadRequest (SamplingConfig's ValueError
    too)."""
    settings, tok = request.app[SETTINGS], request.app[CLIENT].tokenizer
    body = await _json_body(request)
    try:
        req = (parse_chat_request(body, tok, settings["default_max_tokens"])
               if kind == "chat" else parse_completion_request(body, tok))
    except ValueError as e:      # SamplingConfig and the like
        raise BadRequest(str(e)) from None
    return check_prompt_length(req, await _max_context(request.app))


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    client = request.app[CLIENT]
    try:
        req = await _parse(request, kind)
    except BadRequest as e:
        return error_response(e)
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    env = Envelope(kind, rid, int(time.time()), request.app[SETTINGS]["model_name"])
    if req.stream:
        return await stream_response(request, client, req, env)
    try:
        run = Run(client, req)
    except ValueError as e:
        return error_response(BadRequest(str(e)))
    try:
        while await run.next() is not None:
            pass
    except Exception as e:  # noqa: BLE001 - mapped to an OpenAI error
        return error_response(upstream_error(e, kind))
    finally:
        await run.close()
    return web.json_response(env.completion(req, run, run.gen.result()))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completion")


async def models(request: web.Request) -> web.Response:
    name = request.app[SETTINGS]["model_name"]
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "specrelay"}]})


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 ``ok`` when the cloud answers and accepts this server's key,
    else 503 ``degraded`` with the reason (``cloud.reachable``, ``cloud.key``)."""
    import asyncio

    import aiohttp

    from edge_sdk.transport import TLSVerifyError, key_refusal

    t = request.app[CLIENT].transport
    cloud = {"url": t.base_url, "reachable": False, "key": "unknown"}
    try:
        await asyncio.wait_for(t.request("GET", "/healthz"), 5.0)
        cloud["reachable"] = True
        try:
            refused = await key_refusal(t)
            cloud["key"] = ("accepted" if refused is None else
                            f"refused ({refused.status} {refused.code})")
        except RemoteError as e:
            cloud["key"] = f"unchecked ({e.status} {e.code})"
    except RemoteError as e:
        cloud["error"] = f"/healthz answered {e.status}"
    except (TLSVerifyError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        cloud["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    ok = cloud["reachable"] and cloud["key"] == "accepted"
    return web.json_response({"status": "ok" if ok else "degraded", "cloud": cloud},
                             status=200 if ok else 503)


@web.middleware
async def _errors(request: web.Request, handler):
    """aiohttp's own errors (404, 405, body too large) in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(BadRequest(e.reason, None, e.status,
                                         "invalid_request_error"))


def create_openai_app(client_factory: Callable[[], EdgeClient], *,
                      model_name: str = "specrelay",
                      default_max_tokens: int = 256) -> web.Application:
    """The OpenAI-compatible app around an :class:`EdgeClient`.

    Args:
        client_factory: builds the EdgeClient; called once at startup inside the app's
            event loop (the client's HTTP session belongs to that loop) and closed at
            cleanup. The client must hold the tokenizer shared by draft and target.
        model_name: the ``model`` reported in responses and ``/v1/models``.
        default_max_tokens: chat completions' ``max_tokens`` when the request has none.
    """
    app = web.Application(middlewares=[_errors])
    app[SETTINGS] = {"model_name": model_name, "default_max_tokens": default_max_tokens}

    async def start(app):
        app[CLIENT] = client_factory()

    async def stop(app):
        await app[CLIENT].close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def create_edge_app(url: str, drafter, tokenizer, *, signer=None, depth: int = DEFAULT_DEPTH,
                    model_name: str = "specrelay", default_max_tokens: int = 256,
                    **client_kw) -> web.Application:
    """:func:`create_openai_app` for ``EdgeClient(url, drafter, tokenizer, ...)``."""
    return create_openai_app(
        lambda: EdgeClient(url, drafter, tokenizer, depth=depth, signer=signer, chat=False,
                           **client_kw),
        model_name=model_name, default_max_tokens=default_max_tokens)
