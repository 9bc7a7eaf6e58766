"""Streamed responses as Server-Sent Events: ``data: {...}`` chunks, then the final
chunk (finish reason, ``specrelay`` extension), the usage chunk when asked for, and
``data: [DONE]``. Generation starts before the headers go out, so a refused request is
a plain JSON error; an error after that is reported in-stream."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from edge_sdk.client import EdgeClient
from edge_sdk.openai_server.request import BadRequest, OpenAIRequest
from edge_sdk.openai_server.responses import (Envelope, Run, error_response, extension,
                                              upstream_error)

__all__ = ["stream_response"]


class _Sender:
    """Writes SSE events to a prepared response."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp

    async def __call__(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await self.resp.write(f"data: {data}\n\n".encode())


async def _events(send: _Sender, run: Run, first, req: OpenAIRequest,
                  env: Envelope) -> None:
    """Every event of one stream, the first token event ``first`` already drawn."""
    usage_nulls = req.include_usage
    if env.kind == "chat":
        await send(env.chunk("", True, role=True, include_usage=usage_nulls))
    ev, pending_verified = first, True
    while ev is not None:
        pending_verified = pending_verified and ev.verified
        if ev.text:        # held-back text is sent with the token that releases it
            await send(env.chunk(ev.text, pending_verified, include_usage=usage_nulls))
            pending_verified = True
        ev = await run.next()
    res = run.gen.result()
    last = env.chunk(None if env.kind == "chat" else "", run.unverified == 0,
                     res.finish_reason, include_usage=usage_nulls)
    last["specrelay"] = extension(res)
    await send(last)
    if req.include_usage:
        await send(env.usage_chunk(req, res))
    await send("[DONE]")


async def stream_response(request: web.Request, client: EdgeClient, req: OpenAIRequest,
                          env: Envelope) -> web.StreamResponse:
    """The SSE response of ``req`` (or a JSON error if the generation cannot start)."""
    try:
        run = Run(client, req)
    except ValueError as e:
        return error_response(BadRequest(str(e)))
    try:
        first = await run.next()
    except Exception as e:  # noqa: BLE001
        await run.close()
        return error_response(upstream_error(e, req.kind))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    send = _Sender(resp)
    try:
        await _events(send, run, first, req, env)
    except (ConnectionResetError, asyncio.CancelledError):
        raise                           # the client went away: just stop generating
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-stream
        try:
            await send(upstream_error(e, req.kind).body())
        except ConnectionResetError:
            pass
    finally:
        await run.close()
    return resp
