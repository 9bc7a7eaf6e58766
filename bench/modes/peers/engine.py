"""What every peer engine mode shares: the run state (one worker thread pinned to the
peers' CPUs with their thread count, the engines loaded once per run), the per-request
fields every peer reports the same way, and :class:`PeerMode`.

Fairness: every peer computation runs on ONE worker thread pinned to the peers' CPUs
(``RunSetup.peer_cpus``, ``os.sched_setaffinity`` on that thread) with their thread
count (``RunSetup.peer_threads``): by default the cloud's CPUs and thread count, so a
peer gets what our target gets; ``--peer-cpus 0,1 --peer-threads 2`` gives a peer both
cores of a 2-core box, against our 1 cloud + 1 edge core. The threads llama.cpp /
OpenMP start from the worker inherit its CPUs.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Sequence

from bench.modes.base import BenchMode, BenchRequest, RequestRecord, RunSetup

__all__ = ["INSTALL_HINT", "PeerUnavailable", "require_xllamacpp", "engines", "state",
           "on_worker", "src_name", "model_only", "no_link_metrics", "commit_tokens",
           "timing_fields", "PeerMode"]

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


_lock = threading.Lock()
_run: RunSetup | None = None
_worker: ThreadPoolExecutor | None = None
engines: dict[str, object] = {}     # "llama-ar", "llama-spec", "hf-target", "hf-draft"


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
                                     initializer=_pin, initargs=(tuple(run.peer_cpus),))


def _teardown() -> None:
    """Free every engine (llama.cpp servers are destroyed on the worker thread) and stop
    the worker."""
    global _run, _worker
    with _lock:
        worker, _run, _worker = _worker, None, None
    if worker is not None:
        worker.submit(engines.clear).result()
        worker.shutdown(wait=True)
    engines.clear()
    gc.collect()


def state() -> tuple[RunSetup, ThreadPoolExecutor]:
    """The run's :class:`RunSetup` and its pinned worker. Raises RuntimeError outside a
    run (before ``setup_run``)."""
    if _run is None or _worker is None:
        raise RuntimeError("peer bench modes run inside run_bench (call "
                           "setup_run(RunSetup(...)) first when driving them directly)")
    return _run, _worker


def _with_threads(n: int, fn, *args):
    import torch

    torch.set_num_threads(n)                    # on the worker: the peers' count
    return fn(*args)


async def on_worker(fn, *args):
    """Run ``fn(*args)`` on the pinned worker thread with the peers' torch thread count;
    the caller's torch thread count is restored afterwards."""
    import torch

    run, worker = state()
    threads = torch.get_num_threads()
    try:
        return await asyncio.get_running_loop().run_in_executor(
            worker, functools.partial(_with_threads, int(run.peer_threads), fn, *args))
    finally:
        torch.set_num_threads(threads)


def src_name(src) -> str:
    return src if isinstance(src, str) else getattr(src, "__qualname__", repr(src))


def model_only(src):
    """The model of a draft spec without our runtime suffix (``name+onnx-int4`` ->
    ``name``): a peer runs the same model on its own engine."""
    if isinstance(src, str):
        from edge_sdk.drafters.runtime import split_runtime

        return split_runtime(src)[0]
    return src


def no_link_metrics(wall_s: float, engine_s: float, prompt_len: int) -> dict:
    """The per-request fields every peer reports the same way (no network, no edge)."""
    verify = min(engine_s, wall_s)
    return {"uplink_bytes": 0, "downlink_bytes": 0, "link_uplink_bytes": 0,
            "link_downlink_bytes": 0, "http_exchanges": 0, "draft_seconds": 0.0,
            "target_seconds": engine_s, "tv_budget_spent": 0.0,
            "correction_mode_counts": {"bounded": 0, "proposal": 0, "full": 0},
            "prompt_tokens": prompt_len,
            "breakdown_s": {"draft": 0.0, "upload": 0.0, "wait": max(0.0, wall_s - verify),
                            "verify": verify, "download": 0.0}}


def commit_tokens(tok, ids: Sequence[int], times: Sequence[float], max_new: int, eos):
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


def timing_fields(times: list[float], wall_s: float) -> dict:
    n = len(times)
    t_first = times[0] if times else wall_s
    return {"committed_tokens": n, "wall_s": wall_s, "ttft_s": t_first,
            "decode_s": (times[-1] - t_first) if n > 1 else 0.0, "token_times_s": times}


class PeerMode(BenchMode):
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
        await on_worker(self._load)

    def _load(self) -> None:
        """Load (once per run) what the mode needs; runs on the worker thread."""

    def _generate(self, req: BenchRequest):
        """``(token_ids, text, finish_reason, metrics)``; runs on the worker thread."""
        raise NotImplementedError

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        ids, text, finish, m = await on_worker(self._generate, req)
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
