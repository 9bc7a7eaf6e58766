"""OpenAI-compatible HTTP endpoint on the edge: the SDK as a local server.

An application that speaks the OpenAI API switches to speculative edge-cloud decoding by
changing its base URL::

    specrelay edge-serve --url https://cloud:8000 --api-key sr_live_... --port 8080
    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or Server-Sent
Events with ``stream: true``: ``data: {...}`` chunks then ``data: [DONE]``),
``GET /v1/models``, ``GET /health``.

Request fields: ``model`` (accepted, not checked: the response names the served model),
``messages`` / ``prompt``, ``temperature`` (0..2, default 1 as in OpenAI; 0 = greedy,
token-for-token the target's output), ``top_p`` (0..1; 0 means greedy), ``max_tokens``
(``max_completion_tokens`` for chat; defaults: chat ``default_max_tokens``, completions
16 as in OpenAI), ``stop`` (string or up to 4 strings), ``seed`` (random when omitted),
``n`` (1 only), ``stream``, ``stream_options.include_usage``. Fields OpenAI defines but
this server does not implement are accepted only with their neutral value (``null``,
``n: 1``, penalties 0, ``logprobs: false``, ...); anything else, and any unknown field,
is a 400 in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.

Responses carry exact ``usage`` (``prompt_tokens`` = the prompt ids sent to the cloud,
``completion_tokens`` = every committed token, the EOS token included) and
``finish_reason`` ``"stop"`` (EOS or a stop string) or ``"length"``.

Extension fields (ignored by OpenAI clients, readable e.g. as
``resp.choices[0].model_extra["verified"]``):

* ``choices[i].verified`` (bool): every token of the choice (for a stream chunk: of that
  chunk) was verified by the cloud target; ``false`` when the client runs with
  ``on_cloud_loss="draft_only"`` and some tokens came from the draft alone while the
  cloud was unreachable.
* ``choices[i].verified_tokens`` / ``unverified_tokens`` (non-streaming responses).
* ``specrelay`` (top level, non-streaming and the final stream chunk): acceptance rate,
  TPOT, target passes per token of the request.

Chat prompts: the tokenizer's chat template when it has one (``add_generation_prompt``);
a tokenizer without a template (e.g. the tiny test tokenizers) gets the fallback
``"<role>: <content>\\n"`` per message followed by ``"assistant:"``, encoded without
special tokens (:func:`chat_prompt_ids`). Completions prompts are encoded as plain text
without special tokens (a list of token ids is passed through).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from edge_sdk.client import EdgeClient, GenerationResult
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.transport import RemoteError

__all__ = ["OpenAIRequest", "BadRequest", "chat_prompt_ids", "create_openai_app",
           "create_edge_app", "parse_chat_request", "parse_completion_request", "edge_serve"]

CLIENT = web.AppKey("specrelay_edge_client", EdgeClient)
SETTINGS = web.AppKey("specrelay_openai_settings", dict)

MAX_STOP = 4
CHAT_ROLES = {"system", "developer", "user", "assistant"}

# fields a request may carry; value = the neutral values accepted for unimplemented ones
_COMMON = {"model", "temperature", "top_p", "max_tokens", "stop", "seed", "n", "stream",
           "stream_options", "user"}
_NEUTRAL = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}), "metadata": (None, {}),
    "store": (None, False), "service_tier": (None, "auto", "default"),
}
_NEUTRAL_COMPLETION = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logprobs": (None, 0), "logit_bias": (None, {}), "echo": (None, False),
    "suffix": (None, ""), "best_of": (None, 1),
}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL)
COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_NEUTRAL_COMPLETION)


class BadRequest(Exception):
    """A request the endpoint refuses; rendered as OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _error_response(e: BadRequest) -> web.Response:
    return web.json_response(e.body(), status=e.status)


# ---------------------------------------------------------------------------- prompts

def fallback_chat_text(messages: list[dict]) -> str:
    """The chat formatting used when the tokenizer has no chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (list of ``{"role", "content"}``) ready for the assistant's
    turn: the tokenizer's chat template, else :func:`fallback_chat_text`."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return [int(i) for i in ids]
    ids = tokenizer.encode(fallback_chat_text(msgs), add_special_tokens=False)
    return [int(i) for i in ids] or [int(tokenizer.bos_token_id or 0)]


# ---------------------------------------------------------------------------- parsing

@dataclass
class OpenAIRequest:
    """A validated chat or completions request."""

    kind: str                    # "chat" | "completion"
    prompt_ids: list[int]
    sampling: SamplingConfig
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    stream: bool = False
    include_usage: bool = False


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_fields(body: Any, allowed: set[str], neutral: dict) -> None:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for k, v in body.items():
        if k not in allowed:
            raise BadRequest(f"Unrecognized request argument supplied: {k}", k)
        if k in neutral and v not in neutral[k]:
            raise BadRequest(f"{k}={v!r} is not supported by the specrelay edge endpoint "
                             f"(accepted: {[x for x in neutral[k] if x is not None]} or null)",
                             k)


def _opt_number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be a number between {lo} and {hi}", name)
    return float(v)


def _common(body: dict, prompt_ids: list[int], kind: str, default_max: int,
            max_names: tuple[str, ...]) -> OpenAIRequest:
    temperature = _opt_number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _opt_number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0        # an empty nucleus: the argmax only
    max_tokens = default_max
    for name in max_names:
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise BadRequest(f"{name} must be an integer >= 1", name)
        max_tokens = v
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise BadRequest(f"stop takes at most {MAX_STOP} sequences", "stop")
    stop = [s for s in stop if s]
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2 ** 31)
    elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
        raise BadRequest("seed must be a non-negative integer", "seed")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
        raise BadRequest("only n=1 is supported", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise BadRequest("stream_options accepts only include_usage", "stream_options")
        if not stream:
            raise BadRequest("stream_options is only allowed with stream=true",
                             "stream_options")
        include_usage = bool(opts.get("include_usage", False))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user must be a string", "user")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    return OpenAIRequest(kind, prompt_ids, SamplingConfig(temperature=temperature, top_p=top_p),
                         max_tokens, stop, int(seed), bool(stream), include_usage)


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest("only text content parts are supported",
                                 f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest("content must be a string or a list of text parts",
                     f"messages[{i}].content")


def parse_chat_request(body: Any, tokenizer, default_max_tokens: int = 256) -> OpenAIRequest:
    """Validate a ``/v1/chat/completions`` body. Raises :class:`BadRequest`."""
    _check_fields(body, CHAT_FIELDS, _NEUTRAL)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"role must be one of {sorted(CHAT_ROLES)}",
                             f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call"):
            raise BadRequest("tool calls are not supported", f"messages[{i}]")
        clean.append({"role": "system" if role == "developer" else role,
                      "content": _content_text(m.get("content"), i)})
    return _common(body, chat_prompt_ids(tokenizer, clean), "chat", default_max_tokens,
                   ("max_tokens", "max_completion_tokens"))


def parse_completion_request(body: Any, tokenizer) -> OpenAIRequest:
    """Validate a ``/v1/completions`` body (prompt: string, [string], token ids or
    [token ids]; one prompt only). Raises :class:`BadRequest`."""
    _check_fields(body, COMPLETION_FIELDS, _NEUTRAL_COMPLETION)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    vocab = len(tokenizer)
    if isinstance(p, str):
        ids = [int(i) for i in tokenizer.encode(p, add_special_tokens=False)]
        if not ids:
            ids = [int(tokenizer.bos_token_id or 0)]
    elif isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p):
        ids = list(p)
    else:
        raise BadRequest("prompt must be a string or a non-empty list of token ids "
                         "(one prompt only)", "prompt")
    return _common(body, ids, "completion", 16, ("max_tokens",))


# ---------------------------------------------------------------------------- serving

def _upstream_error(e: Exception) -> BadRequest:
    """An error from the cloud (or reaching it) in OpenAI's shape."""
    if isinstance(e, RemoteError):
        msg = f"cloud verification API: {e}"
        if e.status == 429:
            return BadRequest(msg, None, 429, "rate_limit_error", e.code)
        if e.status in (401, 403):
            return BadRequest(msg + " (check the edge server's --api-key)", None, 502,
                              "server_error", e.code)
        if 400 <= e.status < 500:
            param = "messages" if e.field == "prompt" else e.field
            return BadRequest(msg, param, 400, "invalid_request_error", e.code)
        return BadRequest(msg, None, 502, "server_error", e.code)
    if isinstance(e, ValueError):
        return BadRequest(str(e), None, 400)
    return BadRequest(f"cloud verification API unreachable: {type(e).__name__}: {e}", None,
                      503, "server_error", "upstream_unavailable")


def _usage(req: OpenAIRequest, res: GenerationResult) -> dict:
    n = len(res.token_ids)
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
            "total_tokens": len(req.prompt_ids) + n}


def _extension(res: GenerationResult) -> dict:
    m = res.metrics
    return {k: m.get(k) for k in ("acceptance_rate", "mean_accepted_length", "ttft_s",
                                  "tpot_s", "target_passes_per_token")}


class _Run:
    """One request's generation: streamed events, then the result."""

    def __init__(self, client: EdgeClient, req: OpenAIRequest):
        self.gen = client.stream(prompt_ids=req.prompt_ids, sampling=req.sampling,
                                 max_new_tokens=req.max_tokens, stop=req.stop, seed=req.seed)
        self.it = self.gen.__aiter__()
        self.verified = self.unverified = 0

    async def next(self):
        """The next TokenEvent, or None at the end."""
        try:
            ev = await self.it.__anext__()
        except StopAsyncIteration:
            return None
        if ev.verified:
            self.verified += 1
        else:
            self.unverified += 1
        return ev

    async def close(self) -> None:
        await self.it.aclose()


async def _json_body(request: web.Request):
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None


def _base(kind: str, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}[kind][chunk]
    return {"id": rid, "object": obj, "created": created, "model": model,
            "system_fingerprint": None}


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    client = request.app[CLIENT]
    try:
        body = await _json_body(request)
        tok = client.tokenizer
        req = (parse_chat_request(body, tok, settings["default_max_tokens"]) if kind == "chat"
               else parse_completion_request(body, tok))
    except BadRequest as e:
        return _error_response(e)
    except ValueError as e:      # SamplingConfig and the like
        return _error_response(BadRequest(str(e)))
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created, model = int(time.time()), settings["model_name"]
    if req.stream:
        return await _stream(request, client, req, kind, rid, created, model)
    try:
        run = _Run(client, req)
    except ValueError as e:
        return _error_response(BadRequest(str(e)))
    try:
        while await run.next() is not None:
            pass
    except Exception as e:  # noqa: BLE001 - mapped to an OpenAI error
        return _error_response(_upstream_error(e))
    finally:
        await run.close()
    res = run.gen.result()
    choice: dict = {"index": 0}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": res.text, "refusal": None}
    else:
        choice["text"] = res.text
    choice.update({"logprobs": None, "finish_reason": res.finish_reason,
                   "verified": run.unverified == 0, "verified_tokens": run.verified,
                   "unverified_tokens": run.unverified})
    out = _base(kind, rid, created, model, False)
    out.update({"choices": [choice], "usage": _usage(req, res),
                "specrelay": _extension(res)})
    return web.json_response(out)


async def _stream(request, client, req: OpenAIRequest, kind, rid, created, model):
    try:
        run = _Run(client, req)
    except ValueError as e:
        return _error_response(BadRequest(str(e)))
    # start generating before sending headers, so a refused request is a plain error
    try:
        first = await run.next()
    except Exception as e:  # noqa: BLE001
        await run.close()
        return _error_response(_upstream_error(e))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await resp.write(f"data: {data}\n\n".encode())

    def chunk(text: str | None, verified: bool, finish: str | None = None, role=False):
        c = _base(kind, rid, created, model, True)
        ch: dict = {"index": 0}
        if kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            ch["delta"] = delta
        else:
            ch["text"] = text or ""
        ch.update({"logprobs": None, "finish_reason": finish, "verified": verified})
        c["choices"] = [ch]
        if req.include_usage:
            c["usage"] = None
        return c

    try:
        if kind == "chat":
            await send(chunk("", True, role=True))
        ev, pending_verified = first, True
        while ev is not None:
            pending_verified = pending_verified and ev.verified
            if ev.text:        # held-back text is sent with the token that releases it
                await send(chunk(ev.text, pending_verified))
                pending_verified = True
            ev = await run.next()
        res = run.gen.result()
        last = chunk(None if kind == "chat" else "", run.unverified == 0, res.finish_reason)
        last["specrelay"] = _extension(res)
        await send(last)
        if req.include_usage:
            u = _base(kind, rid, created, model, True)
            u.update({"choices": [], "usage": _usage(req, res)})
            await send(u)
        await send("[DONE]")
    except (ConnectionResetError, asyncio.CancelledError):
        raise                           # the client went away: just stop generating
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-stream
        try:
            await send(_upstream_error(e).body())
        except ConnectionResetError:
            pass
    finally:
        await run.close()
    return resp


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

    from edge_sdk.transport import TLSVerifyError

    t = request.app[CLIENT].transport
    cloud = {"url": t.base_url, "reachable": False, "key": "unknown"}
    try:
        await asyncio.wait_for(t.request("GET", "/healthz"), 5.0)
        cloud["reachable"] = True
        try:         # a signed no-op: an unknown session is 404 once the key is accepted
            await asyncio.wait_for(t.request("GET", "/v1/sessions/0"), 5.0)
        except RemoteError as e:
            cloud["key"] = ("accepted" if e.status == 404 else
                            f"refused ({e.status} {e.code})")
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
        return _error_response(BadRequest(e.reason, None, e.status,
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


def create_edge_app(url: str, drafter, tokenizer, *, signer=None, depth: int = 4,
                    model_name: str = "specrelay", default_max_tokens: int = 256,
                    **client_kw) -> web.Application:
    """:func:`create_openai_app` for ``EdgeClient(url, drafter, tokenizer, ...)``."""
    return create_openai_app(
        lambda: EdgeClient(url, drafter, tokenizer, depth=depth, signer=signer, chat=False,
                           **client_kw),
        model_name=model_name, default_max_tokens=default_max_tokens)


# ---------------------------------------------------------------------------- CLI

try:
    import click
except ImportError:  # pragma: no cover - click is a dependency of the CLI
    click = None

if click is not None:
    @click.command("edge-serve")
    @click.option("--url", default="http://127.0.0.1:8000", show_default=True,
                  help="The cloud verification API (specrelay serve).")
    @click.option("--api-key", envvar="SPECRELAY_API_KEY", default=None,
                  help="Key for the cloud API (env SPECRELAY_API_KEY); omit for an "
                       "--insecure-no-auth server.")
    @click.option("--draft", default=None, help="Draft model (default: the demo draft).")
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--port", default=8080, show_default=True)
    @click.option("--depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=6, show_default=True,
                  help="Draft depth gamma (tokens per block).")
    @click.option("--model-name", default="specrelay", show_default=True,
                  help="The model name reported to OpenAI clients.")
    @click.option("--default-max-tokens", default=256, show_default=True,
                  help="Chat max_tokens when a request gives none.")
    @click.option("--on-cloud-loss", type=click.Choice(["wait", "draft_only"]),
                  default="wait", show_default=True,
                  help="wait: retry until the cloud is back (never unverified tokens); "
                       "draft_only: continue with the draft, tokens flagged verified=false.")
    @click.option("--proactive", type=click.Choice(["off", "ipdg", "npdg"]),
                  default="ipdg", show_default=True,
                  help="Draft the next block while one is verified (off: stop-and-wait).")
    @click.option("--send-ahead/--no-send-ahead", default=True, show_default=True,
                  help="Send a proactive block before the previous verdict (pipelined "
                       "verification; needs --proactive ipdg|npdg).")
    @click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False), default=None,
                  help="CA certificate to trust for an https:// cloud URL.")
    @click.option("--offline-timeout", type=click.FloatRange(min=0.0), default=10.0,
                  show_default=True, help="Seconds a request waits for an unreachable "
                  "cloud before it is answered 503 (with --on-cloud-loss wait).")
    def edge_serve(url, api_key, draft, host, port, depth, model_name, default_max_tokens,
                   on_cloud_loss, proactive, send_ahead, ca_cert, offline_timeout):
        """Serve an OpenAI-compatible API on the edge (draft here, verify in the cloud).

        Point an OpenAI client at http://HOST:PORT/v1 (any api_key)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import ssl

        from exporters.onnx.first_use import build_drafter
        from edge_sdk.protocol.signing import Signer

        if draft is None:
            from edge_sdk.models import default_draft
            draft = default_draft()
        # the draft's runtime and dtype never touch exactness
        drafter, tok = build_drafter(draft, dtype="auto",
                                     echo=lambda m: click.echo(m, err=True))
        if tok is None:
            from edge_sdk.models import DEFAULT_TARGET, load_tokenizer

            tok = load_tokenizer(DEFAULT_TARGET)
        signer = Signer.from_api_key(api_key) if api_key else None
        app = create_edge_app(url, drafter, tok, signer=signer, depth=depth,
                              model_name=model_name, default_max_tokens=default_max_tokens,
                              on_cloud_loss=on_cloud_loss, proactive=proactive,
                              send_ahead=send_ahead and proactive != "off",
                              offline_timeout_s=offline_timeout,
                              ssl_context=(ssl.create_default_context(cafile=ca_cert)
                                           if ca_cert else None))
        click.echo(f"OpenAI-compatible endpoint on http://{host}:{port}/v1 "
                   f"(draft {draft}, cloud {url})", err=True)
        # SIGTERM: stop accepting, give in-flight requests a short grace period, then
        # cancel them (a request waiting out --offline-timeout must not hold the exit)
        web.run_app(app, host=host, port=port, print=None, shutdown_timeout=3.0)
else:  # pragma: no cover
    edge_serve = None
