"""transformers as a peer engine: ``hf-ar`` (baseline; ``model.generate`` with the
target alone) and ``hf-assisted`` (assisted generation, ``generate(...,
assistant_model=draft)``, transformers' default assistant schedule).

The pair is loaded with :func:`edge_sdk.models.load_model` in the run's ``--dtype``
(the same weights and dtype as our cloud's target).
"""
from __future__ import annotations

import os
import time

from bench.modes.base import BenchRequest
from bench.modes.peers.engine import (PeerMode, commit_tokens, engines, model_only,
                                      no_link_metrics, src_name, state, timing_fields)
from bench.modes.registry import register_mode

__all__ = ["HFARMode", "HFAssistedMode"]


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


class _HFMode(PeerMode):
    """transformers ``generate`` on the pair loaded by :func:`edge_sdk.models.load_model`
    in the run's dtype (target shared by ``hf-ar`` and ``hf-assisted``). Greedy:
    ``do_sample=False``, no repetition penalty unless the run sets one; sampled runs:
    ``do_sample=True`` with the run's temperature / top-k / top-p, seeded per request.
    EOS = the target's (:func:`edge_sdk.models.eos_ids`), as our cloud uses."""

    engine = "transformers"

    def _load(self) -> None:
        run, _ = state()
        if "hf-target" not in engines:
            t0 = time.perf_counter()
            engines["hf-target"] = (*_hf_load(run.target, run.dtype),
                                    time.perf_counter() - t0)
        if self.uses_draft and "hf-draft" not in engines:
            t0 = time.perf_counter()
            engines["hf-draft"] = (*_hf_load(model_only(run.draft), run.dtype),
                                   time.perf_counter() - t0)

    def _kwargs(self, req: BenchRequest, eos: list, draft) -> dict:
        """``generate`` options: greedy or seeded sampling as the run asks, our EOS."""
        import torch

        sc = self.ctx.sampling
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
        return kw

    @staticmethod
    def _timed_generate(model, draft, prompt_ids, kw: dict):
        """``(new token ids, their emission times (s), wall s, forward counts)`` of one
        ``generate`` call; forward hooks count the target's and the draft's passes."""
        import torch

        counts = {"target": 0, "draft": 0}
        hooks = [model.register_forward_hook(
            lambda *_: counts.__setitem__("target", counts["target"] + 1))]
        if draft is not None:
            hooks.append(draft.register_forward_hook(
                lambda *_: counts.__setitem__("draft", counts["draft"] + 1)))
        x = torch.tensor([list(prompt_ids)], dtype=torch.long)
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
        return new, times, wall, counts

    def _engine_config(self, run, draft, load_s: float) -> dict:
        import transformers

        cfg = {"engine": self.engine, "version": transformers.__version__,
               "threads": int(run.peer_threads), "cpus": sorted(os.sched_getaffinity(0)),
               "model": src_name(run.target), "dtype": run.dtype,
               "load_s": round(load_s, 3)}
        if draft is not None:
            # transformers' assistant settings (its defaults unless the draft's generation
            # config sets them; the "heuristic" schedule carries over between requests)
            cfg["draft"] = src_name(run.draft)
            for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                      "assistant_confidence_threshold"):
                v = getattr(draft.generation_config, k, None)
                if v is not None:
                    cfg[k] = v
        return cfg

    def _generate(self, req: BenchRequest):
        from edge_sdk.models import eos_ids

        run, _ = state()
        model, _tok, load_s = engines["hf-target"]
        draft = engines["hf-draft"][0] if self.uses_draft else None
        tok = self.ctx.tokenizer
        eos = eos_ids(model, tok)
        kw = self._kwargs(req, eos, draft)
        new, times, wall, counts = self._timed_generate(model, draft, req.prompt_ids, kw)
        ids, times, text, finish = commit_tokens(tok, new, times, self.ctx.max_new_tokens, eos)
        if not ids:
            raise RuntimeError(f"{self.name}: generate returned no tokens")
        wall = times[-1]
        n = len(ids)
        passes = counts["target"]
        drafted = counts["draft"] if draft is not None else 0
        # assisted: every target pass verifies one candidate block and yields its
        # accepted drafts + 1 token, so accepted = tokens - target passes (derived)
        accepted = min(drafted, max(0, n - passes)) if draft is not None else 0
        m = timing_fields(times, wall)
        m.update(no_link_metrics(wall, wall, len(req.prompt_ids)))
        m.update(drafted_tokens=drafted, accepted_tokens=accepted,
                 wasted_draft_tokens=max(0, drafted - accepted),
                 rounds=passes if draft is not None else 0, target_passes=passes,
                 engine_timings={"target_forwards": passes, "draft_forwards": drafted},
                 engine_config=self._engine_config(run, draft, load_s))
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
                   "--dtype), peer CPUs/threads (default: the cloud's), no network")
    uses_draft = True
    gain_baseline = "hf-ar"
