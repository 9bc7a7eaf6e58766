"""Streaming target-only generation: ``POST /v1/sessions/{id}/generate``.

The *cloud-AR* baseline of the benchmark (and a plain "cloud LLM" API): the cloud
generates autoregressively with the target alone, one target forward pass per token,
and streams every token to the client as soon as it is sampled.

Flow: create a session as usual (``POST /v1/sessions`` with ``prompt_ids`` or
``prompt``, ``sampling``, ``seed``, ``max_new_tokens``), then ``POST
/v1/sessions/{id}/generate``. The request body is optional: an empty body, or a msgpack
(``application/x-msgpack``) / JSON (``application/json``) map with

* ``max_new_tokens`` (int >= 1, tokens): at most this many tokens (default: the
  session's ``max_new_tokens``, which is also the upper bound).

The response is streamed with chunked transfer encoding. Its items depend on the
``Accept`` header:

* default — ``application/x-msgpack-seq``: a sequence of concatenated msgpack arrays
  (read them with ``msgpack.Unpacker``);
* ``application/x-ndjson`` — one JSON array per line.

Items::

    [MSG_TOKEN=5, token_id, target_s, near_tie]
        one generated token; target_s = seconds of target compute spent on it;
        near_tie (bool, greedy) = the target's top-2 logit gap was below the dtype's
        near-tie gap (``sampling.NEAR_TIE_GAP``)
    [MSG_DONE=6, finish_reason, n_tokens, target_s_total, target_passes]
        end of stream; finish_reason is "eos", "length", "context_full" or
        "rate_limited"; target_s_total in seconds

Generation uses the session's sampling config (the same processors as verification,
from ``edge_sdk.protocol.sampling``): greedy sessions produce exactly the tokens of
target-only speculative rounds (blocks of depth 0). Sampled tokens come from a
generator seeded by the session seed and the confirmed length, so a run is replayable.
The session stays consistent (confirmed prefix extended, KV invariant kept), so blocks
can be verified after a stream. A session waiting for a correction token is refused
(409). Every generated token is charged to the caller's verified-token rate limit.

Only :func:`register` is public; ``cloud_api.app.create_app`` calls it.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import torch
from aiohttp import web

from cloud_api.context import SERVICE, owner
from cloud_api.sessions import ApiError, Session
from edge_sdk.protocol import rng
from edge_sdk.protocol import sampling as S
from edge_sdk.protocol import wire

__all__ = ["register", "MSG_TOKEN", "MSG_DONE", "STREAM_MSGPACK", "STREAM_NDJSON"]

MSG_TOKEN, MSG_DONE = 5, 6
STREAM_MSGPACK = "application/x-msgpack-seq"
STREAM_NDJSON = "application/x-ndjson"


def _generator(s: Session) -> torch.Generator:
    """Seeded by (session seed, confirmed length): replaying a stream redraws the same."""
    return rng.generator(s.seed, rng.STREAM_DECODE, len(s.tokens))


def _step(verifier, s: Session, gen: torch.Generator) -> tuple[int, float, bool]:
    """One target pass: the next token after the confirmed sequence (runs on the
    target executor). Extends the session; returns (token id, seconds, near-tie)."""
    t0 = time.perf_counter()
    logits = s.kv.sync(s.tokens)[-1]                                # [V]
    tok, _ = S.sample_next(logits, s.cfg, s.tokens, gen)
    tie = s.cfg.greedy and bool(verifier.tie_offsets(
        S.process_next(logits, s.cfg, s.tokens)[None]))
    # the cache now holds the old confirmed sequence = new sequence minus its last token
    s.tokens.append(tok)
    s.check_kv()
    dt = time.perf_counter() - t0
    verifier.passes += 1
    verifier.target_seconds += dt
    return tok, dt, tie


async def _read_options(request: web.Request) -> dict:
    body = await request.read()
    if not body:
        return {}
    if request.content_type == "application/json":
        try:
            m = json.loads(body)
        except ValueError:
            raise ApiError(400, "bad_request", "body is not valid JSON", "body") from None
    else:
        m = wire.unpack(body)
    if not isinstance(m, dict):
        raise ApiError(400, "bad_request", "body must be a map", "body")
    unknown = set(m) - {"max_new_tokens"}
    if unknown:
        raise ApiError(422, "bad_field", "unknown field", sorted(map(str, unknown))[0])
    return m


def _limit(s: Session, opts: dict) -> int:
    n = opts.get("max_new_tokens", s.max_new_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ApiError(422, "bad_field", "max_new_tokens must be an integer >= 1",
                       "max_new_tokens")
    return min(n, s.max_new_tokens) if s.max_new_tokens else n


def _charge(request: web.Request) -> bool:
    """Charge one token to the caller's verified-token rate limit (when it has one).
    False when refused (RateLimitExceeded / QuotaExceeded end the stream)."""
    limiter, key = request.get("ratelimiter"), request.get("api_key")
    if limiter is None or key is None:
        return True
    try:
        limiter.consume_tokens(key, 1)
        return True
    except Exception:  # noqa: BLE001 - any refusal ends the stream
        return False


async def _open_stream(request: web.Request, ndjson: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": STREAM_NDJSON if ndjson
                                       else STREAM_MSGPACK,
                                       "Cache-Control": "no-store"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


async def _stream_tokens(request: web.Request, svc, s: Session, limit: int,
                         write) -> tuple[int, float, str]:
    """Generate and ``await write(item)`` up to ``limit`` tokens. Returns (tokens,
    target seconds, finish reason). A client that goes away makes ``write`` raise
    (ConnectionResetError): the loop stops there and the session stays consistent."""
    loop = asyncio.get_running_loop()
    gen = _generator(s)
    eos = set(svc.eos)
    n, total_s = 0, 0.0
    while n < limit:
        if len(s.tokens) + 1 > svc.verifier.max_context:
            return n, total_s, "context_full"
        if n and not _charge(request):
            return n, total_s, "rate_limited"
        tok, dt, tie = await loop.run_in_executor(svc.executor, _step, svc.verifier, s, gen)
        n += 1
        total_s += dt
        await write([MSG_TOKEN, tok, dt, tie])
        if tok in eos:
            return n, total_s, "eos"
    return n, total_s, "length"


async def generate(request: web.Request) -> web.StreamResponse:
    """``POST /v1/sessions/{sid}/generate``: stream target-only tokens (module doc)."""
    svc = request.app[SERVICE]
    s: Session = svc.sessions.get(request.match_info["sid"], owner(request))
    if s.kv is None:
        raise ApiError(501, "not_supported", "target-only streaming needs the target in "
                       "this process (this server verifies through a scoring engine)",
                       "path")
    limit = _limit(s, await _read_options(request))
    ndjson = STREAM_NDJSON in request.headers.get("Accept", "")
    limiter, key = request.get("ratelimiter"), request.get("api_key")
    async with svc.lock(s.id):
        if s.awaiting:
            raise ApiError(409, "correction_pending", "the session is waiting for the "
                           "correction token of its last block", "session_id",
                           state=s.state())
        if limiter is not None and key is not None:
            limiter.consume_tokens(key, 1)   # before prepare: a refusal is a 429 JSON
        resp = await _open_stream(request, ndjson)

        async def write(item: list) -> None:
            await resp.write((json.dumps(item) + "\n").encode() if ndjson
                             else msgpack.packb(item))

        n, total_s, reason = await _stream_tokens(request, svc, s, limit, write)
        enforce = getattr(svc.sessions, "enforce", None)   # KV budgets, where the store
        if enforce is not None:                             # has them: the cache grew
            enforce(keep=s.id)
        await write([MSG_DONE, reason, n, total_s, n])
        await resp.write_eof()
        return resp


def register(app: web.Application) -> None:
    """Add ``POST /v1/sessions/{sid}/generate`` to a verification app (the app must
    hold a :class:`cloud_api.app.CloudService` under ``SERVICE``)."""
    app.router.add_post("/v1/sessions/{sid}/generate", generate)
