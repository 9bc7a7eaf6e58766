"""OpenAI response bodies of one generation: the envelope (id, object, created, model),
the non-streamed completion, stream chunks, usage, the ``specrelay`` extension, and
upstream errors in OpenAI's error shape."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from edge_sdk.client import EdgeClient, GenerationResult
from edge_sdk.openai_server.request import BadRequest, OpenAIRequest, prompt_param
from edge_sdk.transport import RemoteError


def error_response(e: BadRequest) -> web.Response:
    return web.json_response(e.body(), status=e.status)


#: the cloud's wire field -> the OpenAI field a client of this endpoint set
_OPENAI_PARAM = {"max_new_tokens": "max_tokens"}
#: the cloud's wire fields that carry the prompt (named by :func:`prompt_param`)
_PROMPT_FIELDS = {"prompt", "prompt_ids", "prompt_packed"}


def upstream_error(e: Exception, kind: str = "chat") -> BadRequest:
    """An error from the cloud (or reaching it) in OpenAI's shape; a refused field is
    named as the OpenAI request names it (``max_tokens``; ``messages`` for a chat and
    ``prompt`` for a completion: the prompt)."""
    if isinstance(e, RemoteError):
        msg = f"cloud verification API: {e}"
        if e.status == 429:
            return BadRequest(msg, None, 429, "rate_limit_error", e.code)
        if e.status in (401, 403):
            return BadRequest(msg + " (check the edge server's --api-key)", None, 502,
                              "server_error", e.code)
        if 400 <= e.status < 500:
            param = (prompt_param(kind) if e.field in _PROMPT_FIELDS
                     else _OPENAI_PARAM.get(e.field, e.field))
            return BadRequest(f"cloud verification API: {e.describe(param)}", param, 400,
                              "invalid_request_error", e.code)
        return BadRequest(msg, None, 502, "server_error", e.code)
    if isinstance(e, ValueError):
        return BadRequest(str(e), None, 400)
    return BadRequest(f"cloud verification API unreachable: {type(e).__name__}: {e}", None,
                      503, "server_error", "upstream_unavailable")


def usage(req: OpenAIRequest, res: GenerationResult) -> dict:
    n = len(res.token_ids)
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
            "total_tokens": len(req.prompt_ids) + n}


def extension(res: GenerationResult) -> dict:
    """The ``specrelay`` field: acceptance rate, mean accepted length, TTFT/TPOT
    (seconds) and target passes per token of the request, its ``acceptance``
    (``exact``/``semantic``), ``semantic_accepted_tokens`` and ``exact`` (False when the
    output is not exactly the target's: semantic acceptances, WISV, or draft-only
    tokens)."""
    m = res.metrics
    out = {k: m.get(k) for k in ("acceptance_rate", "mean_accepted_length", "ttft_s",
                                 "tpot_s", "target_passes_per_token")}
    out.update(acceptance=res.acceptance, semantic_accepted_tokens=res.semantic_accepted_tokens,
               exact=res.exact_target_output)
    return out


class Run:
    """One request's generation: streamed events, then the result. Counts the verified
    and unverified (draft-only, cloud unreachable) tokens."""

    def __init__(self, client: EdgeClient, req: OpenAIRequest):
        acceptance = req.acceptance
        if acceptance is None and not req.sampling.greedy:
            acceptance = "exact"     # a semantic default applies to greedy requests only
        self.gen = client.stream(prompt_ids=req.prompt_ids, sampling=req.sampling,
                                 max_new_tokens=req.max_tokens, stop=req.stop, seed=req.seed,
                                 acceptance=acceptance)
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


_OBJECT = {"chat": ("chat.completion", "chat.completion.chunk"),
           "completion": ("text_completion", "text_completion")}


@dataclass(frozen=True)
class Envelope:
    """What every body of one response shares."""

    kind: str          # "chat" | "completion"
    rid: str
    created: int       # Unix seconds
    model: str

    def base(self, chunk: bool) -> dict:
        return {"id": self.rid, "object": _OBJECT[self.kind][chunk], "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def completion(self, req: OpenAIRequest, run: Run, res: GenerationResult) -> dict:
        """The non-streamed response body."""
        choice: dict = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": res.text, "refusal": None}
        else:
            choice["text"] = res.text
        choice.update({"logprobs": None, "finish_reason": res.finish_reason,
                       "verified": run.unverified == 0, "verified_tokens": run.verified,
                       "unverified_tokens": run.unverified})
        out = self.base(False)
        out.update({"choices": [choice], "usage": usage(req, res),
                    "specrelay": extension(res)})
        return out

    def chunk(self, text: str | None, verified: bool, finish: str | None = None,
              role: bool = False, include_usage: bool = False) -> dict:
        """One stream chunk (``usage: null`` in each when the client asked for usage)."""
        c = self.base(True)
        ch: dict = {"index": 0}
        if self.kind == "chat":
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
        if include_usage:
            c["usage"] = None
        return c

    def usage_chunk(self, req: OpenAIRequest, res: GenerationResult) -> dict:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        u = self.base(True)
        u.update({"choices": [], "usage": usage(req, res)})
        return u
