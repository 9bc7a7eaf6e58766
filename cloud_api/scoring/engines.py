"""The scoring backend of ``specrelay serve --backend sglang|vllm``: an engine's scorer
and a :class:`~cloud_api.scoring.verifier.ScoringVerifier` shaped like the target
(vocabulary and context from its config), built without loading the target's weights.

The engine must serve the same checkpoint as ``--model`` (the tokenizer and config
read here); nothing can check that from the engine's scores alone, so the start-up
line names both."""

from __future__ import annotations

from cloud_api.scoring.sglang import SGLangScorer
from cloud_api.scoring.verifier import ScoringVerifier
from cloud_api.scoring.vllm import VLLMScorer

__all__ = ["ENGINES", "DEFAULT_TOP_N", "engine_verifier", "make_scorer", "target_shape"]

ENGINES = ("sglang", "vllm")
DEFAULT_TOP_N = 20
"""Top-N logprobs asked per position: exact for greedy and top_k <= N (vLLM's default
``--max-logprobs`` is 20)."""


def make_scorer(engine: str, url: str, top_n: int = DEFAULT_TOP_N,
                served_model: str | None = None, timeout_s: float = 60.0):
    """The scorer of ``engine`` at ``url`` (``http(s)://HOST:PORT``). ``served_model``:
    vLLM's served model name (required for vllm). Raises ValueError: an unknown engine,
    a URL that is not http(s), top_n < 1, vllm without a model name."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine URL must be http://HOST:PORT or https://..., not {url!r}")
    if top_n < 1:
        raise ValueError("top_n must be >= 1")
    if engine == "sglang":
        return SGLangScorer(url, top_n, timeout_s)
    if engine == "vllm":
        if not served_model:
            raise ValueError("vLLM needs its served model name")
        return VLLMScorer(url, served_model, top_n, timeout_s)
    raise ValueError(f"unknown scoring engine {engine!r}: one of {', '.join(ENGINES)}")


def target_shape(model: str) -> tuple[int, int]:
    """``(vocab_size, max_context)`` of model spec ``model`` (preset, folder, HF id,
    .gguf) from its config alone, offline. Raises FileNotFoundError / OSError / ValueError
    (unknown model, no config)."""
    from transformers import AutoConfig

    from edge_sdk.models import OFFLINE, resolve

    spec = resolve(model)
    kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
    cfg = AutoConfig.from_pretrained(spec.path, **kw, **OFFLINE)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(cfg.vocab_size), int(getattr(cfg, "max_position_embeddings", 4096))


def engine_verifier(engine: str, url: str, model: str, top_n: int = DEFAULT_TOP_N,
                    served_model: str | None = None, dtype: str = "bfloat16"):
    """``(ScoringVerifier, tokenizer)`` for ``model`` scored by ``engine`` at ``url``;
    ``dtype``: the engine's compute dtype (near-tie reporting). Raises what
    :func:`make_scorer` and :func:`target_shape` raise."""
    from edge_sdk.models import load_tokenizer

    scorer = make_scorer(engine, url, top_n, served_model)
    vocab, context = target_shape(model)
    return ScoringVerifier(scorer, vocab, context, dtype=dtype), load_tokenizer(model)
