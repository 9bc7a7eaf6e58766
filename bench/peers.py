"""Peer engines in ``specrelay bench``: llama.cpp and transformers, measured in the same run.

Registered bench modes (imported on the first :func:`bench.modes.get_mode` /
``mode_names`` lookup, never by ``import edge_sdk``):

* ``llamacpp-ar`` (baseline) — llama.cpp, the target GGUF alone, greedy/sampled as the
  run asks, through ``xllamacpp`` (llama.cpp's C++ server compiled into a Python
  extension, in process; it also listens on ``127.0.0.1``, on a free port, unused).
* ``llamacpp-spec`` — llama.cpp's own draft-model speculative decoding
  (``COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE``, the run's draft GGUF as the draft model,
  llama.cpp's default draft length and thresholds unless ``mode_options`` say
  otherwise: ``n_max``, ``n_min``, ``p_min``).
* ``hf-ar`` (baseline) — transformers ``model.generate`` with the target alone.
* ``hf-assisted`` — transformers assisted generation, ``generate(...,
  assistant_model=draft)`` (transformers' default assistant schedule).

The transformers pair is loaded with :func:`edge_sdk.models.load_model` in the run's
``--dtype`` (the same weights and dtype as our cloud's target); llama.cpp runs the GGUF
files themselves (Q4_K_M for the Qwen presets), so its greedy tokens may part from the
target's at near-ties: peers are left out of ``greedy_outputs_identical`` and reported in
``config.peer_greedy_agreement`` instead (:func:`greedy_agreement`).

Fairness: the same encoded prompts (the runner applies the chat template with
:func:`edge_sdk.models.encode_prompt`), ``max_new_tokens`` and sampling as our modes;
every peer computation runs on ONE worker thread pinned to the cloud's CPUs
(``RunSetup.cloud_cpus``, ``os.sched_setaffinity`` on that thread) with the cloud's
thread count (llama.cpp ``n_threads`` for target and draft, torch threads for
transformers); the threads llama.cpp / OpenMP start from it inherit its CPUs. Peers do
not cross the link emulator: they measure a single box, so their numbers repeat in every
profile up to noise. Models load once per bench run, on first use (the warm-up
request), and are freed by :meth:`~bench.modes.BenchMode.teardown_run`.

Metrics: the report's per-request fields (``committed_tokens``, ``wall_s``, ``ttft_s``,
``decode_s``; transformers: ``token_times_s`` from its streamer; llama.cpp: TTFT and
TPOT from its own timings; throughput = tokens / wall time, prefill included, as for
our modes) plus ``engine_timings``: llama.cpp's own ``timings``
(``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``prompt_per_second``,
``predicted_per_second``, ``draft_n``, ``draft_n_accepted``), transformers' target and
draft forward counts. Run level (:meth:`_PeerMode.run_metrics`): ``engine_prompt_tok_s``
and ``engine_eval_tok_s`` (llama.cpp's prompt / eval tokens per second over the cell),
``engine_config`` (engine, threads, CPUs, models, speculative settings). Speculative
gain rows (``llamacpp-spec`` / ``llamacpp-ar``, ``hf-assisted`` / ``hf-ar``) come from
:func:`bench.runner.ratio_specs` (``gain_baseline``).

Install: ``pip install -c constraints.txt -e ".[bench]"`` (the ``xllamacpp`` wheel).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from bench.modes import (BenchMode, BenchRequest, RequestRecord, RunSetup,
                                  register_mode)
from edge_sdk.kvmodel import common_prefix

__all__ = ["PeerUnavailable", "require_xllamacpp", "INSTALL_HINT", "LlamaCppARMode",
           "LlamaCppSpecMode", "HFARMode", "HFAssistedMode", "greedy_agreement",
           "summary_md", "gain_pairs", "PEER_MODES"]

INSTALL_HINT = "pip install -c constraints.txt -e '.[bench]'"


class PeerUnavailable(ImportError):
    """A peer engine's package is not installed (message: one line, with the fix)."""


def require_xllamacpp():
    """The ``xllamacpp`` module. Raises :class:`PeerUnavailable` (one line) if missing."""
    try:
        import xllamacpp
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "xllamacpp":
            raise PeerUnavailable(f"xllamacpp failed to import ({e}); reinstall: "
                                  f"{INSTALL_HINT}") from None
        raise PeerUnavailable("the llamacpp-* bench modes need xllamacpp (llama.cpp), "
                              f"which is not installed: {INSTALL_HINT}") from None
    except ImportError as e:
        raise PeerUnavailable(f"xllamacpp failed to import ({e}); reinstall: "
                              f"{INSTALL_HINT}") from None
    return xllamacpp


# --------------------------------------------------------------------------- run state

_lock = threading.Lock()
_run: RunSetup | None = None
_worker: ThreadPoolExecutor | None = None
_engines: dict[str, object] = {}     # "llama-ar", "llama-spec", "hf-target", "hf-draft"


def _pin(cpus: tuple[int, ...]) -> None:
    if cpus:
        os.sched_setaffinity(0, set(cpus))       # 0 = the calling thread (Linux)


def _setup(run: RunSetup) -> None:
    global _run, _worker
    with _lock:
        if _run is run:
            return
    _teardown()
    with _lock:
        _run = run
        _worker = ThreadPoolExecutor(1, thread_name_prefix="specrelay-peer",
                                     initializer=_pin, initargs=(tuple(run.cloud_cpus),))


def _teardown() -> None:
    """Free every engine (llama.cpp servers are destroyed on the worker thread) and stop
    the worker."""
    global _run, _worker
    with _lock:
        worker, _run, _worker = _worker, None, None
    if worker is not None:
        worker.submit(_engines.clear).result()
        worker.shutdown(wait=True)
    _engines.clear()
    gc.collect()


def _state() -> tuple[RunSetup, ThreadPoolExecutor]:
    if _run is None or _worker is None:
        raise RuntimeError("peer bench modes run inside run_bench (call "
                           "setup_run(RunSetup(...)) first when driving them directly)")
    return _run, _worker


def _with_threads(n: int, fn, *args):
    import torch

    torch.set_num_threads(n)                    # on the worker: the cloud's count
    return fn(*args)


async def _on_worker(fn, *args):
    """Run ``fn(*args)`` on the pinned worker thread with the cloud's torch thread count;
    the caller's torch thread count is restored afterwards."""
    import torch

    run, worker = _state()
    threads = torch.get_num_threads()
    try:
        return await asyncio.get_running_loop().run_in_executor(
            worker, functools.partial(_with_threads, int(run.cloud_threads), fn, *args))
    finally:
        torch.set_num_threads(threads)


def _src_name(src) -> str:
    return src if isinstance(src, str) else getattr(src, "__qualname__", repr(src))


def _model_only(src):
    """The model of a draft spec without our runtime suffix (``name+onnx-int4`` ->
    ``name``): a peer runs the same model on its own engine."""
    if isinstance(src, str):
        from edge_sdk.drafters.runtime import split_runtime

        return split_runtime(src)[0]
    return src


def _gguf(src, role: str) -> Path:
    """The GGUF file of a model source. Raises ValueError (one line) when there is none."""
    from edge_sdk.models import resolve

    what = f"llama.cpp needs a GGUF {role} (preset, .gguf path or dir::file.gguf)"
    if not isinstance(src, str):
        raise ValueError(f"{what}; got {_src_name(src)}")
    src = _model_only(src)
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


def _no_link_metrics(wall_s: float, engine_s: float, prompt_len: int) -> dict:
    """The per-request fields every peer reports the same way (no network, no edge)."""
    verify = min(engine_s, wall_s)
    return {"uplink_bytes": 0, "downlink_bytes": 0, "link_uplink_bytes": 0,
            "link_downlink_bytes": 0, "http_exchanges": 0, "draft_seconds": 0.0,
            "target_seconds": engine_s, "tv_budget_spent": 0.0,
            "correction_mode_counts": {"bounded": 0, "proposal": 0, "full": 0},
            "prompt_tokens": prompt_len,
            "breakdown_s": {"draft": 0.0, "upload": 0.0, "wait": max(0.0, wall_s - verify),
                            "verify": verify, "download": 0.0}}


def _commit(tok, ids: Sequence[int], times: Sequence[float], max_new: int, eos):
    """Our :class:`~edge_sdk.commit.Committer` over an engine's tokens (same EOS / length
    rules and text as our modes): ``(token_ids, times, text, finish_reason)``."""
    from edge_sdk.commit import Committer

    c = Committer(tok, max_new, eos)
    for t in ids:
        if c.done:
            break
        c.push(int(t))
    n = len(c.token_ids)
    return list(c.token_ids), list(times[:n]), c.text, c.finish_reason


def _timing_fields(times: list[float], wall_s: float) -> dict:
    n = len(times)
    t_first = times[0] if times else wall_s
    return {"committed_tokens": n, "wall_s": wall_s, "ttft_s": t_first,
            "decode_s": (times[-1] - t_first) if n > 1 else 0.0, "token_times_s": times}


class _PeerMode(BenchMode):
    """A peer engine's mode: one generation per request on the pinned worker thread.

    Class attributes: ``engine`` (label), ``uses_draft`` (the run's draft is the
    engine's draft model), ``gain_baseline`` (the same engine's target-only mode: the
    denominator of this mode's speculative gain)."""

    peer: ClassVar[bool] = True
    needs_drafter: ClassVar[bool] = False
    engine: ClassVar[str] = ""
    uses_draft: ClassVar[bool] = False
    gain_baseline: ClassVar[str | None] = None

    @classmethod
    def setup_run(cls, run: RunSetup) -> None:
        cls.check(run)
        _setup(run)

    @classmethod
    def teardown_run(cls) -> None:
        _teardown()

    @classmethod
    def check(cls, run: RunSetup) -> None:
        """Raise ImportError / ValueError (one line) when the mode cannot run."""

    async def open(self) -> None:
        await _on_worker(self._load)

    def _load(self) -> None:
        """Load (once per run) what the mode needs; runs on the worker thread."""

    def _generate(self, req: BenchRequest):
        """``(token_ids, text, finish_reason, metrics)``; runs on the worker thread."""
        raise NotImplementedError

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        ids, text, finish, m = await _on_worker(self._generate, req)
        return RequestRecord(req, m, ids, text, finish)

    @classmethod
    def run_metrics(cls, per_request: Sequence[dict]) -> dict:
        out = {"engine_config": dict(per_request[0].get("engine_config") or {})}
        tm = [r.get("engine_timings") or {} for r in per_request]

        def tot(k):
            return sum(float(t.get(k, 0) or 0) for t in tm)

        if tot("prompt_ms") > 0:
            out["engine_prompt_tok_s"] = tot("prompt_n") / tot("prompt_ms") * 1e3
        if tot("predicted_ms") > 0:
            out["engine_eval_tok_s"] = tot("predicted_n") / tot("predicted_ms") * 1e3
        for k in ("prompt_n", "predicted_n", "draft_n", "draft_n_accepted",
                  "target_forwards", "draft_forwards"):
            if any(k in t for t in tm):
                out[f"engine_{k}"] = int(tot(k))
        return out


# --------------------------------------------------------------------------- llama.cpp


class _LlamaCppMode(_PeerMode):
    """llama.cpp through ``xllamacpp.Server`` (in process). One server per mode and run:
    ``CommonParams`` with the target GGUF, ``n_parallel=1``, the cloud's thread count
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
        if self._key in _engines:
            return
        x = require_xllamacpp()
        run, _ = _state()
        opts = self._opts()
        threads = int(run.cloud_threads)
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
            cfg.update(draft=draft.name, speculative="draft-simple", n_max=d.n_max,
                       n_min=d.n_min, p_min=round(float(d.p_min), 4))
        t0 = time.perf_counter()
        server = x.Server(p)
        cfg["load_s"] = round(time.perf_counter() - t0, 3)
        _engines[self._key] = (server, cfg)

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

        server, cfg = _engines[self._key]
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
        ids, _, text, finish = _commit(tok, ids, [], self.ctx.max_new_tokens,
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
        m.update(_no_link_metrics(wall, min(engine_s, wall) or wall, len(req.prompt_ids)))
        m.update(drafted_tokens=drafted, accepted_tokens=accepted,
                 wasted_draft_tokens=max(0, drafted - accepted),
                 rounds=passes if self.uses_draft else 0, target_passes=passes,
                 engine_timings=tm, engine_config=cfg)
        return ids, text, finish or choice.get("finish_reason") or "length", m


@register_mode
class LlamaCppARMode(_LlamaCppMode):
    """llama.cpp, target GGUF alone."""

    name = "llamacpp-ar"
    description = ("peer: llama.cpp (xllamacpp) target GGUF alone, cloud CPUs/threads, "
                   "no network")
    baseline = True


@register_mode
class LlamaCppSpecMode(_LlamaCppMode):
    """llama.cpp's draft-model speculative decoding (draft-simple)."""

    name = "llamacpp-spec"
    description = ("peer: llama.cpp draft-model speculative decoding (draft-simple, "
                   "draft GGUF), cloud CPUs/threads, no network")
    uses_draft = True
    gain_baseline = "llamacpp-ar"


# --------------------------------------------------------------------------- transformers


class _TimingStreamer:
    """transformers streamer recording when each chunk of new tokens arrives (the first
    ``put`` is the prompt)."""

    def __init__(self, t0: float):
        self.t0, self.prompt_seen = t0, False
        self.times: list[float] = []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter() - self.t0
        self.times.extend([now] * int(value.numel()))

    def end(self) -> None:
        pass


def _hf_load(src, dtype: str):
    from edge_sdk.models import load_model

    if callable(src):
        return src()
    return load_model(src, dtype=dtype)


class _HFMode(_PeerMode):
    """transformers ``generate`` on the pair loaded by :func:`edge_sdk.models.load_model`
    in the run's dtype (target shared by ``hf-ar`` and ``hf-assisted``). Greedy:
    ``do_sample=False``, no repetition penalty unless the run sets one; sampled runs:
    ``do_sample=True`` with the run's temperature / top-k / top-p, seeded per request.
    EOS = the target's (:func:`edge_sdk.models.eos_ids`), as our cloud uses."""

    engine = "transformers"

    def _load(self) -> None:
        run, _ = _state()
        if "hf-target" not in _engines:
            t0 = time.perf_counter()
            _engines["hf-target"] = (*_hf_load(run.target, run.dtype),
                                     time.perf_counter() - t0)
        if self.uses_draft and "hf-draft" not in _engines:
            t0 = time.perf_counter()
            _engines["hf-draft"] = (*_hf_load(_model_only(run.draft), run.dtype),
                                    time.perf_counter() - t0)

    def _generate(self, req: BenchRequest):
        import torch
        import transformers

        from edge_sdk.models import eos_ids

        run, _ = _state()
        model, _tok, load_s = _engines["hf-target"]
        draft = _engines["hf-draft"][0] if self.uses_draft else None
        tok = self.ctx.tokenizer
        sc = self.ctx.sampling
        eos = eos_ids(model, tok)
        kw = {"max_new_tokens": int(self.ctx.max_new_tokens), "eos_token_id": eos or None,
              "pad_token_id": (eos or [0])[0],
              "repetition_penalty": float(sc.repetition_penalty)}
        if sc.greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            torch.manual_seed(int(req.seed))
            kw.update(do_sample=True, temperature=float(sc.temperature),
                      top_k=int(sc.top_k), top_p=float(sc.top_p))
        if draft is not None:
            kw["assistant_model"] = draft
        counts = {"target": 0, "draft": 0}
        hooks = [model.register_forward_hook(
            lambda *_: counts.__setitem__("target", counts["target"] + 1))]
        if draft is not None:
            hooks.append(draft.register_forward_hook(
                lambda *_: counts.__setitem__("draft", counts["draft"] + 1)))
        x = torch.tensor([list(req.prompt_ids)], dtype=torch.long)
        t0 = time.perf_counter()
        streamer = _TimingStreamer(t0)
        try:
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), streamer=streamer,
                                     **kw)
        finally:
            for h in hooks:
                h.remove()
        wall = time.perf_counter() - t0
        new = out[0, x.shape[1]:].tolist()
        times = streamer.times[:len(new)]
        times += [wall] * (len(new) - len(times))
        ids, times, text, finish = _commit(tok, new, times, self.ctx.max_new_tokens, eos)
        if not ids:
            raise RuntimeError(f"{self.name}: generate returned no tokens")
        wall = times[-1]
        n = len(ids)
        passes = counts["target"]
        drafted = counts["draft"] if draft is not None else 0
        # assisted: every target pass verifies one candidate block and yields its
        # accepted drafts + 1 token, so accepted = tokens - target passes (derived)
        accepted = min(drafted, max(0, n - passes)) if draft is not None else 0
        cfg = {"engine": self.engine, "version": transformers.__version__,
               "threads": int(run.cloud_threads), "cpus": sorted(os.sched_getaffinity(0)),
               "model": _src_name(run.target), "dtype": run.dtype,
               "load_s": round(load_s, 3)}
        if draft is not None:
            # transformers' assistant settings (its defaults unless the draft's generation
            # config sets them; the "heuristic" schedule carries over between requests)
            cfg["draft"] = _src_name(run.draft)
            for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                      "assistant_confidence_threshold"):
                v = getattr(draft.generation_config, k, None)
                if v is not None:
                    cfg[k] = v
        m = _timing_fields(times, wall)
        m.update(_no_link_metrics(wall, wall, len(req.prompt_ids)))
        m.update(drafted_tokens=drafted, accepted_tokens=accepted,
                 wasted_draft_tokens=max(0, drafted - accepted),
                 rounds=passes if draft is not None else 0, target_passes=passes,
                 engine_timings={"target_forwards": passes, "draft_forwards": drafted},
                 engine_config=cfg)
        return ids, text, finish or "length", m


@register_mode
class HFARMode(_HFMode):
    """transformers greedy/sampled ``generate``, target alone."""

    name = "hf-ar"
    description = ("peer: transformers generate, target alone (--dtype), cloud "
                   "CPUs/threads, no network")
    baseline = True


@register_mode
class HFAssistedMode(_HFMode):
    """transformers assisted generation with the run's draft as assistant model."""

    name = "hf-assisted"
    description = ("peer: transformers assisted generation (assistant_model=draft, "
                   "--dtype), cloud CPUs/threads, no network")
    uses_draft = True
    gain_baseline = "hf-ar"


PEER_MODES = ("llamacpp-ar", "llamacpp-spec", "hf-ar", "hf-assisted")


# --------------------------------------------------------------------------- reporting


def gain_pairs() -> dict[str, str]:
    """``{speculative peer mode: its engine's target-only mode}``."""
    from bench.modes import MODES

    return {n: c.gain_baseline for n, c in MODES.items()
            if getattr(c, "peer", False) and getattr(c, "gain_baseline", None)}


def greedy_agreement(records: Sequence[dict], greedy_labels: set[str],
                     peer_names: set[str]) -> dict:
    """Per peer mode, how its greedy tokens compare with the target's: the first
    non-peer mode's output for the same (profile, workload, prompt) (our modes are
    exact, so any of them is the target's greedy output). ``{mode: {"reference",
    "prompts", "identical", "mean_common_prefix", "min_common_prefix", "mean_tokens",
    "identical_to_engine_ar"}}`` (the last: speculative peers against their own
    engine's target-only mode, None without it)."""
    ref: dict[tuple, tuple[str, list]] = {}
    own: dict[tuple, list] = {}
    for r in records:
        if r["workload"] not in greedy_labels:
            continue
        key = (r["profile"], r["workload"], r["prompt_id"])
        if r["mode"] in peer_names:
            own[(r["mode"],) + key] = r["token_ids"]
        else:
            ref.setdefault(key, (r["mode"], r["token_ids"]))
    pairs = gain_pairs()
    out: dict[str, dict] = {}
    for (mode, *key), ids in own.items():
        key = tuple(key)
        a = out.setdefault(mode, {"reference": None, "prompts": 0, "identical": 0,
                                  "prefix": [], "tokens": [], "engine_ar": []})
        if key in ref:
            ref_mode, ref_ids = ref[key]
            a["reference"] = ref_mode
            a["prompts"] += 1
            a["identical"] += int(list(ids) == list(ref_ids))
            a["prefix"].append(common_prefix(ids, ref_ids))
            a["tokens"].append(len(ids))
        ar = own.get((pairs.get(mode),) + key)
        if ar is not None:
            a["engine_ar"].append(list(ar) == list(ids))
    for a in out.values():
        pre, toks, ear = a.pop("prefix"), a.pop("tokens"), a.pop("engine_ar")
        a["mean_common_prefix"] = float(np.mean(pre)) if pre else None
        a["min_common_prefix"] = min(pre) if pre else None
        a["mean_tokens"] = float(np.mean(toks)) if toks else None
        a["identical_to_engine_ar"] = all(ear) if ear else None
    return out


def _geo(vals: list[float]) -> float | None:
    vals = [v for v in vals if isinstance(v, (int, float)) and v > 0]
    return float(np.exp(np.mean(np.log(vals)))) if vals else None


def summary_md(results: dict) -> str:
    """Markdown appended to summary.md: the peer runs with their engines' own timings,
    and the speculative gain of every engine (ours: our speculative modes / ``cloud-ar``;
    each peer: its speculative mode / its target-only mode) with absolute tok/s."""
    from bench import report
    from bench.modes import MODES

    def is_peer(mode: str) -> bool:
        return bool(getattr(MODES.get(mode), "peer", False))

    runs = [r for r in results["runs"] if is_peer(r["mode"])]
    if not runs:
        return ""
    cfg = results.get("config", {})
    lines = ["", "## Peer engines (same prompts, tokens and cloud cores; no network)", "",
             f"Peers run on the cloud's CPUs {cfg.get('cloud_cpus')} with "
             f"{cfg.get('cloud_threads')} thread(s); transformers in dtype "
             f"`{cfg.get('dtype')}`, llama.cpp on the GGUF files. engine prompt/eval tok/s: "
             "llama.cpp's own timings.", ""]
    lines += report.runs_table(runs, [
        ("throughput_tok_s", "tok/s", 1.0, "{:.2f}"), ("ttft_s", "TTFT (ms)", 1e3, "{:.1f}"),
        ("tpot_s", "TPOT (ms)", 1e3, "{:.1f}"),
        ("engine_prompt_tok_s", "engine prompt tok/s", 1.0, "{:.1f}"),
        ("engine_eval_tok_s", "engine eval tok/s", 1.0, "{:.2f}"),
        ("acceptance_rate", "acceptance", 1.0, "{:.3f}"),
        ("target_passes_per_token", "target passes/tok", 1.0, "{:.3f}")])
    pairs = gain_pairs()
    idx, _, _ = report.run_index(results["runs"])
    rows = [r for r in results["ratios"] if r["metric"] == "throughput_tok_s" and (
        pairs.get(r["mode"]) == r["baseline"]
        or (r["baseline"] == "cloud-ar" and not is_peer(r["mode"])))]
    lines += ["", "### Speculative gain (speculative tok/s / the same engine's "
              "target-only tok/s)", ""]
    if rows:
        lines += ["| engine | speculative | target-only | profile | spec tok/s | "
                  "target-only tok/s | gain |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            ws = sorted({w for (m, p, w) in idx if m == r["mode"] and p == r["profile"]})
            spec = _geo([(idx.get((r["mode"], r["profile"], w)) or {}).get("throughput_tok_s")
                         for w in ws])
            base = _geo([(idx.get((r["baseline"], r["profile"], w)) or {}).get(
                "throughput_tok_s") for w in ws])
            eng = (MODES[r["mode"]].engine if is_peer(r["mode"])
                   else "specrelay (edge + cloud, emulated link)")
            f = (lambda v: "–" if v is None else f"{v:.2f}")
            lines.append(f"| {eng} | {r['mode']} | {r['baseline']} | {r['profile']} | "
                         f"{f(spec)} | {f(base)} | {r['value']:.3f}× |")
    else:
        lines.append("(no speculative / target-only pair ran)")
    agree = cfg.get("peer_greedy_agreement") or {}
    if agree:
        def one(m: str, a: dict) -> str:
            r1 = (lambda v: "–" if v is None else f"{v:.1f}")
            txt = (f"{m}: {a['identical']}/{a['prompts']} identical to {a['reference']}, "
                   f"common prefix {r1(a['mean_common_prefix'])} of "
                   f"{r1(a['mean_tokens'])} tokens")
            if a.get("identical_to_engine_ar") is not None:
                txt += f", identical to its engine's target-only: {a['identical_to_engine_ar']}"
            return txt

        lines += ["", "Greedy agreement of the peers with the target's tokens: "
                  + "; ".join(one(m, a) for m, a in agree.items()) + "."]
    return "\n".join(lines) + "\n"
