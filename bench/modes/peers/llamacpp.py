"""llama.cpp as a peer engine, in process through ``xllamacpp`` (llama.cpp's C++
server compiled into a Python extension; it also listens on ``127.0.0.1``, on a free
port, unused):

* ``llamacpp-ar`` (baseline) — the target GGUF alone;
* ``llamacpp-spec`` — llama.cpp's own draft-model speculative decoding
  (``COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE``, the run's draft GGUF as the draft model,
  llama.cpp's default draft length and thresholds unless ``mode_options`` say
  otherwise: ``n_max``, ``n_min``, ``p_min``).

llama.cpp runs the GGUF files themselves (Q4_K_M for the Qwen presets), so its greedy
tokens may part from the target's at near-ties.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import ClassVar

from bench.modes.base import BenchRequest, RunSetup
from bench.modes.peers.engine import (PeerMode, commit_tokens, engines, model_only,
                                      no_link_metrics, require_xllamacpp, src_name, state)
from bench.modes.registry import register_mode

__all__ = ["LlamaCppARMode", "LlamaCppSpecMode"]


def _gguf(src, role: str) -> Path:
    """The GGUF file of a model source. Raises ValueError (one line) when there is none."""
    from edge_sdk.models import resolve

    what = f"llama.cpp needs a GGUF {role} (preset, .gguf path or dir::file.gguf)"
    if not isinstance(src, str):
        raise ValueError(f"{what}; got {src_name(src)}")
    src = model_only(src)
    spec = resolve(src)
    if not spec.gguf_file:
        raise ValueError(f"{what}; {src!r} is not a GGUF checkpoint")
    if spec.truncate_layers:
        raise ValueError(f"{what}; {src!r} is truncated to {spec.truncate_layers} layers, "
                         "which llama.cpp cannot do")
    path = Path(spec.path) / spec.gguf_file
    if not path.is_file():
        raise ValueError(f"{what}; {path} does not exist")
    return path


def _draft_params(x, p, run: RunSetup, opts: dict, threads: int) -> dict:
    """Turn on draft-simple speculative decoding in ``CommonParams`` ``p`` with the
    run's draft GGUF and ``threads``; ``opts`` may set ``n_max``, ``n_min``, ``p_min``.
    Returns the settings for ``engine_config``. Raises ValueError without a GGUF draft."""
    draft = _gguf(run.draft, "draft")
    sp = p.speculative
    sp.types = [x.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
    d = sp.draft
    d.mparams.path = str(draft)
    d.n_gpu_layers = 0
    d.cpuparams.n_threads = threads
    d.cpuparams_batch.n_threads = threads
    for k in ("n_max", "n_min", "p_min"):
        if k in opts:
            setattr(d, k, type(getattr(d, k))(opts[k]))
    return dict(draft=draft.name, speculative="draft-simple", n_max=d.n_max,
                n_min=d.n_min, p_min=round(float(d.p_min), 4))


class _LlamaCppMode(PeerMode):
    """llama.cpp through ``xllamacpp.Server`` (in process). One server per mode and run:
    ``CommonParams`` with the target GGUF, ``n_parallel=1``, the peers' thread count
    for prompt and generation (``cpuparams``, ``cpuparams_batch``), no GPU layers; the
    speculative mode adds ``speculative.types = [COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]``
    and the draft GGUF (``speculative.draft.mparams``, same threads). Requests go to
    ``Server.handle_completions`` (OpenAI completions JSON, the prompt as token ids, not
    streamed: with speculative decoding only a non-streamed answer carries the id of
    every token, via ``n_probs=1``; ``cache_prompt=False``: every request prefills its
    whole prompt). TTFT = wall time - llama.cpp's ``predicted_ms`` (first -> last
    token), TPOT from ``predicted_ms``; no per-token times."""

    engine = "llama.cpp"
    n_ctx: ClassVar[int] = 4096

    @classmethod
    def check(cls, run: RunSetup) -> None:
        require_xllamacpp()
        _gguf(run.target, "target")
        if cls.uses_draft:
            _gguf(run.draft, "draft")

    @property
    def _key(self) -> str:
        return "llama-spec" if self.uses_draft else "llama-ar"

    def _opts(self) -> dict:
        return dict(self.ctx.options or {})

    def _load(self) -> None:
        if self._key in engines:
            return
        x = require_xllamacpp()
        run, _ = state()
        opts = self._opts()
        threads = int(run.peer_threads)
        target = _gguf(run.target, "target")
        p = x.CommonParams()
        p.model.path = str(target)
        p.n_ctx = int(opts.get("n_ctx", self.n_ctx))
        p.n_parallel = 1
        p.n_gpu_layers = 0
        p.cpuparams.n_threads = threads
        p.cpuparams_batch.n_threads = threads
        p.hostnames = ["127.0.0.1"]
        p.port = 0
        p.n_threads_http = 1
        p.verbosity = int(opts.get("verbosity", 1))
        cfg = {"engine": self.engine, "version": getattr(x, "__version__", "?"),
               "threads": threads, "cpus": sorted(os.sched_getaffinity(0)),
               "model": target.name, "n_ctx": p.n_ctx}
        if self.uses_draft:
            cfg.update(_draft_params(x, p, run, opts, threads))
        t0 = time.perf_counter()
        server = x.Server(p)
        cfg["load_s"] = round(time.perf_counter() - t0, 3)
        engines[self._key] = (server, cfg)

    def _body(self, req: BenchRequest, n_ctx: int) -> dict:
        sc = self.ctx.sampling
        return {"prompt": list(req.prompt_ids), "n_predict": int(self.ctx.max_new_tokens),
                "stream": False, "cache_prompt": False, "n_probs": 1,
                "post_sampling_probs": True, "seed": int(req.seed),
                "temperature": float(sc.temperature), "top_k": int(sc.top_k),
                "top_p": float(sc.top_p), "min_p": 0.0, "typical_p": 1.0,
                "repeat_penalty": float(sc.repetition_penalty), "repeat_last_n": int(n_ctx),
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
                "xtc_probability": 0.0}

    def _generate(self, req: BenchRequest):
        from edge_sdk.models import eos_ids

        server, cfg = engines[self._key]
        t0 = time.perf_counter()
        ret = server.handle_completions(self._body(req, cfg["n_ctx"]))
        wall = time.perf_counter() - t0
        if isinstance(ret, (str, bytes)):
            ret = json.loads(ret)
        if not isinstance(ret, dict) or "error" in ret or not ret.get("choices"):
            err = ret.get("error", ret) if isinstance(ret, dict) else ret
            raise RuntimeError(f"{self.name}: llama.cpp refused the request: {err}")
        choice = ret["choices"][0]
        # the token ids: one logprobs entry per generated token (drafted ones included)
        ids = [int(c["id"]) for c in (choice.get("logprobs") or {}).get("content") or ()]
        n_usage = int((ret.get("usage") or {}).get("completion_tokens", len(ids)))
        if not ids or len(ids) != n_usage:
            raise RuntimeError(f"{self.name}: llama.cpp returned {len(ids)} token ids for "
                               f"{n_usage} tokens")
        tok = self.ctx.tokenizer
        ids, _, text, finish = commit_tokens(tok, ids, [], self.ctx.max_new_tokens,
                                       eos_ids(None, tok))
        tm = dict(ret.get("timings") or {})
        n = len(ids)
        # llama.cpp's timings: prompt_ms = prefill (ends with the first token),
        # predicted_ms = first token -> last token; TTFT = our wall time minus the latter
        decode_s = min(wall, float(tm.get("predicted_ms", 0.0)) / 1e3) if n > 1 else 0.0
        engine_s = float(tm.get("prompt_ms", 0.0)) / 1e3 + decode_s
        drafted = int(tm.get("draft_n", 0) or 0)
        accepted = int(tm.get("draft_n_accepted", 0) or 0)
        # draft-simple: the prefill pass gives the first token, every later target pass
        # gives its accepted drafts + 1, so target passes = tokens - accepted drafts
        passes = max(1, n - accepted) if self.uses_draft else n
        m = {"committed_tokens": n, "wall_s": wall, "ttft_s": wall - decode_s,
             "decode_s": decode_s}
        m.update(no_link_metrics(wall, min(engine_s, wall) or wall, len(req.prompt_ids)))
        m.update(drafted_tokens=drafted, accepted_tokens=accepted,
                 wasted_draft_tokens=max(0, drafted - accepted),
                 rounds=passes if self.uses_draft else 0, target_passes=passes,
                 engine_timings=tm, engine_config=cfg)
        return ids, text, finish or choice.get("finish_reason") or "length", m


@register_mode
class LlamaCppARMode(_LlamaCppMode):
    """llama.cpp, target GGUF alone."""

    name = "llamacpp-ar"
    description = ("peer: llama.cpp (xllamacpp) target GGUF alone, peer CPUs/threads "
                   "(default: the cloud's), no network")
    baseline = True


@register_mode
class LlamaCppSpecMode(_LlamaCppMode):
    """llama.cpp's draft-model speculative decoding (draft-simple)."""

    name = "llamacpp-spec"
    description = ("peer: llama.cpp draft-model speculative decoding (draft-simple, "
                   "draft GGUF), peer CPUs/threads (default: the cloud's), no network")
    uses_draft = True
    gain_baseline = "llamacpp-ar"
