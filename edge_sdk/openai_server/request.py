"""Validation of OpenAI chat and completions request bodies into :class:`OpenAIRequest`.

Fields OpenAI defines but this server does not implement are accepted only with their
neutral value; anything else, and any unknown field, raises :class:`BadRequest` (a 400
in OpenAI's error shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge_sdk.generation import request_seed, request_stop
from edge_sdk.openai_server.prompts import chat_prompt_ids
from edge_sdk.protocol.limits import MAX_NEW_TOKENS
from edge_sdk.protocol.sampling import SamplingConfig

__all__ = ["BadRequest", "OpenAIRequest", "parse_chat_request", "parse_completion_request",
           "CHAT_FIELDS", "COMPLETION_FIELDS", "CHAT_ROLES", "MAX_STOP",
           "check_prompt_length", "prompt_param"]

MAX_STOP = 4
CHAT_ROLES = {"system", "developer", "user", "assistant"}

# fields a request may carry; value = the neutral values accepted for unimplemented ones
_COMMON = {"model", "temperature", "top_p", "max_tokens", "stop", "seed", "n", "stream",
           "stream_options", "user", "acceptance"}
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
    acceptance: str | None = None    # exact | semantic (WISV); None: the server's default


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


def _temperature_top_p(body: dict) -> tuple[float, float]:
    """``temperature`` (0..2, default 1) and ``top_p`` (0..1; 0: greedy)."""
    temperature = _opt_number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _opt_number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0        # an empty nucleus: the argmax only
    return temperature, top_p


def _max_tokens(body: dict, default_max: int, names: tuple[str, ...]) -> int:
    """The last of ``names`` the body sets (an integer in ``1..MAX_NEW_TOKENS``), else
    ``default_max``."""
    max_tokens = default_max
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or not 1 <= v <= MAX_NEW_TOKENS:
            raise BadRequest(f"{name} must be an integer in 1..{MAX_NEW_TOKENS}", name)
        max_tokens = v
    return max_tokens


def _stop(body: dict) -> list[str]:
    """``stop``: a string or up to :data:`MAX_STOP` strings; empty ones are dropped
    (:func:`edge_sdk.generation.request_stop`)."""
    try:
        stop = request_stop(body.get("stop"))
    except ValueError as e:
        raise BadRequest(str(e), "stop") from None
    if len(stop) > MAX_STOP:
        raise BadRequest(f"stop takes at most {MAX_STOP} sequences", "stop")
    return stop


def _seed(body: dict) -> int:
    """``seed`` in ``0 .. 2**63 - 1``; a fresh one when omitted
    (:func:`edge_sdk.generation.request_seed`)."""
    try:
        return request_seed(body.get("seed"))
    except ValueError as e:
        raise BadRequest(str(e), "seed") from None


def _streaming(body: dict) -> tuple[bool, bool]:
    """``(stream, include_usage)``; ``n`` must be 1 (checked first, as OpenAI does)."""
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
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
    return bool(stream), include_usage


def _acceptance(body: dict, sampling: SamplingConfig) -> str | None:
    """``acceptance`` (specrelay extension): ``exact``, ``semantic`` (WISV, lossy;
    greedy requests only) or absent (None: the endpoint's default)."""
    v = body.get("acceptance")
    if v is None:
        return None
    if v not in ("exact", "semantic"):
        raise BadRequest("acceptance must be 'exact' or 'semantic'", "acceptance")
    if v == "semantic" and not sampling.greedy:
        raise BadRequest("acceptance 'semantic' needs greedy decoding (temperature 0)",
                         "acceptance")
    return v


def _check_strings(body: dict, names: tuple[str, ...] = ("user", "model")) -> None:
    for name in names:
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"{name} must be a string", name)


def _common(body: dict, prompt_ids: list[int], kind: str, default_max: int,
            max_names: tuple[str, ...]) -> OpenAIRequest:
    """The fields chat and completions share, validated in a fixed order (the first bad
    one is reported)."""
    temperature, top_p = _temperature_top_p(body)
    max_tokens = _max_tokens(body, default_max, max_names)
    stop = _stop(body)
    seed = _seed(body)
    stream, include_usage = _streaming(body)
    _check_strings(body)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    return OpenAIRequest(kind, prompt_ids, sampling, max_tokens, stop, seed, stream,
                         include_usage, _acceptance(body, sampling))


def prompt_param(kind: str) -> str:
    """The OpenAI field that carries the prompt of a ``kind`` request."""
    return "messages" if kind == "chat" else "prompt"


def check_prompt_length(req: OpenAIRequest, max_context: int | None) -> OpenAIRequest:
    """Refuse a prompt the target's context cannot hold (``max_context`` tokens, as the
    cloud's ``/healthz`` states it; None: unknown, no check) before any drafting or
    upload: 400 naming ``messages`` (chat) or ``prompt``. Returns ``req``."""
    if max_context and len(req.prompt_ids) >= max_context:
        raise BadRequest(f"the prompt is {len(req.prompt_ids)} tokens; the model's "
                         f"context holds {max_context}, the prompt included",
                         prompt_param(req.kind), code="context_length_exceeded")
    return req


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


def _clean_message(m, i: int) -> dict:
    """``{"role", "content"}`` of message ``i`` (``developer`` is a ``system`` turn)."""
    if not isinstance(m, dict):
        raise BadRequest("each message must be an object", f"messages[{i}]")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise BadRequest(f"role must be one of {sorted(CHAT_ROLES)}",
                         f"messages[{i}].role")
    if m.get("tool_calls") or m.get("function_call"):
        raise BadRequest("tool calls are not supported", f"messages[{i}]")
    return {"role": "system" if role == "developer" else role,
            "content": _content_text(m.get("content"), i)}


def parse_chat_request(body: Any, tokenizer, default_max_tokens: int = 256) -> OpenAIRequest:
    """Validate a ``/v1/chat/completions`` body. Raises :class:`BadRequest`."""
    _check_fields(body, CHAT_FIELDS, _NEUTRAL)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list", "messages")
    clean = [_clean_message(m, i) for i, m in enumerate(msgs)]
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
    elif isinstance(p, list) and p and all(_is_int(t) and 0 <= t < vocab for t in p):
        ids = list(p)
    else:
        raise BadRequest("prompt must be a string or a non-empty list of token ids "
                         "(one prompt only)", "prompt")
    return _common(body, ids, "completion", 16, ("max_tokens",))
