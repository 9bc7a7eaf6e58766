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
  TPOT, target passes per token of the request, and WISV's flags: ``acceptance``
  (``exact``/``semantic``), ``semantic_accepted_tokens`` and ``exact`` (``false`` when
  the output is not exactly the target's).
* request field ``acceptance``: ``"exact"`` or ``"semantic"`` (WISV's lossy semantic
  acceptance, greedy requests only; the cloud needs a decision head loaded). Absent:
  the endpoint's default (``edge-serve --acceptance``, exact unless set; a semantic
  default applies to greedy requests only).

Chat prompts: the tokenizer's chat template when it has one (``add_generation_prompt``);
a tokenizer without a template (e.g. the tiny test tokenizers) gets the fallback
``"<role>: <content>\\n"`` per message followed by ``"assistant:"``, encoded without
special tokens (:func:`chat_prompt_ids`). Completions prompts are encoded as plain text
without special tokens (a list of token ids is passed through).

Modules: ``prompts`` (chat prompt ids), ``request`` (validation), ``responses`` (OpenAI
bodies, upstream errors), ``sse`` (streaming), ``app`` (routes and the app factories).
"""


from edge_sdk.openai_server.app import create_edge_app, create_openai_app
from edge_sdk.openai_server.prompts import chat_prompt_ids, fallback_chat_text
from edge_sdk.openai_server.request import (BadRequest, OpenAIRequest, parse_chat_request,
                                            parse_completion_request)

__all__ = ["OpenAIRequest", "BadRequest", "chat_prompt_ids", "create_openai_app",
           "create_edge_app", "parse_chat_request", "parse_completion_request",
           "fallback_chat_text"]
