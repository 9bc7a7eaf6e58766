"""The bench harness: the process layout and the run loop.

Layout (one machine, loopback)::

    bench process (edge core)                      server process (cloud core)
    ┌────────────────────────────────┐             ┌──────────────────────────────┐
    │ drafter + EdgeClient / stream  │──HTTP──▶ LinkEmulatorThread ──▶ aiohttp app │
    │ (the mode under test)          │◀─────────   (profile)   ◀──── │ target model │
    └────────────────────────────────┘             └──────────────────────────────┘

* The **cloud** (:class:`~bench.cloud_process.CloudServerProcess`) runs the target in a
  spawned process pinned to its own CPU(s).
* The **edge** (draft model, client, mode logic) runs in the bench process, pinned to
  the other CPU(s) for the duration of :func:`run_bench` (restored afterwards).
* The **link emulator** (:class:`~bench.linkem.LinkEmulatorThread`, one per
  profile) proxies the SDK's real HTTP traffic between them.
* Edge contention: :mod:`bench.contention`. The cells and their order:
  :mod:`bench.cells`; measuring one cell: :mod:`bench.cell_run`.

:func:`run_bench` returns the ``results.json`` object (``report.validate_results``) and,
given ``out_dir``, writes ``results.json``, ``summary.md``, the PNG plots and
``requests.jsonl`` (one line per request: ids, token ids, metrics).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.cell_run import Shared, measure_cells, warmup
from bench.cells import (encode_requests, is_concurrent, concurrency_values, plan_cells,
                         profile, sampling_config)
from bench.cloud_process import CloudServerProcess, load_source, split_cpus
from bench.config import BenchConfig
from bench.contention import SlowdownDrafter, contention
from bench.modes import RunSetup, get_mode
from bench.report.identity import greedy_divergences
from bench.report.labels import workload_label
from bench.report.outputs import write_outputs
from bench.report.ratios import (adaptive_ratios, best_fixed, best_peer, compute_ratios,
                                 peer_ratios, pipeline_ratios, ratio_specs,
                                 strongest_baselines)
from bench.report.schema import validate_results
from specrelay_data.workloads import load_workload

__all__ = ["run_bench"]


@dataclass
class _Run:
    """A :class:`BenchConfig` resolved: mode classes, profiles, sampling configs, the
    prompts per workload, the draft source and each side's CPUs and threads."""

    cfg: BenchConfig
    mode_classes: list
    profiles: list
    samplings: dict
    prompt_sets: dict
    draft_src: object
    cloud_cpus: list
    edge_cpus: list
    cloud_threads: int
    edge_threads: int
    peer_cpus: list
    peer_threads: int


def _resolve(cfg: BenchConfig) -> _Run:
    """Check and resolve ``cfg``. Raises ValueError for unknown modes, profiles,
    sampling variants or workloads and for ``edge_slowdown < 1``."""
    mode_classes = [get_mode(m) for m in cfg.modes]
    profiles = [profile(p) for p in cfg.profiles]
    samplings = {s: sampling_config(s) for s in cfg.sampling}
    if cfg.edge_slowdown < 1.0:
        raise ValueError("edge_slowdown must be >= 1")
    if cfg.prompt_sets is not None:
        prompt_sets = {w: list(ps) for w, ps in cfg.prompt_sets.items()}
    else:
        prompt_sets = {w: load_workload(w, cfg.prompts, cfg.seed) for w in cfg.workloads}
    from edge_sdk.models import default_draft, resolve_dtype

    cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype))
    draft_src = cfg.draft
    if draft_src is None:
        draft_src = default_draft(cfg.target if isinstance(cfg.target, str) else None)
    cloud_cpus, edge_cpus = split_cpus(cfg.cloud_cpus, cfg.edge_cpus)
    cloud_threads = cfg.cloud_threads or len(cloud_cpus)
    if cfg.peer_cpus:
        peer_cpus = sorted({int(c) for c in cfg.peer_cpus})
        bad = sorted(set(peer_cpus) - os.sched_getaffinity(0))
        if bad:
            raise ValueError(f"peer_cpus: CPU {bad[0]} is not available (available: "
                             f"{sorted(os.sched_getaffinity(0))})")
        peer_threads = cfg.peer_threads or len(peer_cpus)
    else:
        peer_cpus, peer_threads = list(cloud_cpus), cfg.peer_threads or cloud_threads
    return _Run(cfg, mode_classes, profiles, samplings, prompt_sets, draft_src, cloud_cpus,
                edge_cpus, cloud_threads, cfg.edge_threads or len(edge_cpus),
                peer_cpus, peer_threads)


def _setup_modes(run: _Run) -> list:
    """``setup_run`` of every mode of the run, once each; the modes set up (in order).
    A failure tears down those already set up and propagates."""
    cfg = run.cfg
    setup = RunSetup(cfg.target, run.draft_src, cfg.dtype, tuple(run.peer_cpus),
                     run.peer_threads)
    set_up: list = []
    try:
        for mcls in dict.fromkeys(run.mode_classes):
            mcls.setup_run(setup)
            set_up.append(mcls)
    except BaseException:
        for mcls in reversed(set_up):
            mcls.teardown_run()
        raise
    return set_up


def _load_draft(run: _Run, log: Callable[[str], None]):
    """``(drafter, tokenizer)`` of the edge: a spec string (optional runtime suffix,
    ``qwen2.5-coder-0.5b+onnx-int4``) through the SDK's drafter builder, else a callable
    model source wrapped in a :class:`TorchDrafter`."""
    cfg = run.cfg
    if isinstance(run.draft_src, str):
        from exporters.onnx.first_use import build_drafter

        drafter, tok = build_drafter(run.draft_src, dtype=cfg.dtype,
                                     threads=run.edge_threads, echo=log)
        if tok is None:
            from edge_sdk.models import load_tokenizer

            tok = load_tokenizer(cfg.target)
        return drafter, tok
    from edge_sdk.drafters.torch import TorchDrafter

    dmodel, tok = load_source(run.draft_src, cfg.dtype, run.edge_threads)
    return TorchDrafter(dmodel), tok


def _name(src) -> str:
    if isinstance(src, str):
        return src
    return getattr(src, "__qualname__", None) or getattr(getattr(src, "func", None),
                                                         "__qualname__", repr(src))


def _measure(run: _Run, cloud: CloudServerProcess, progress: bool,
             log: Callable[[str], None]) -> tuple[list, list, dict]:
    """Load the edge, wait for the cloud, warm up and measure every cell (the caller
    pins the edge and stops the cloud). Returns ``(runs, records, edge facts)``."""
    cfg = run.cfg
    log(f"edge: loading draft {_name(run.draft_src)} on CPUs {run.edge_cpus} "
        f"({run.edge_threads} threads); cloud: target {_name(cfg.target)} on CPUs "
        f"{run.cloud_cpus} ({run.cloud_threads} threads)")
    t0 = time.perf_counter()
    base_drafter, tok = _load_draft(run, log)
    draft_load_s = time.perf_counter() - t0
    factor, contended = contention(cfg.edge_slowdown, [p.name for p in run.profiles])
    slowed = (SlowdownDrafter(base_drafter, factor, cfg.slowdown_at_s)
              if factor > 1.0 else base_drafter)
    info = cloud.wait_ready()
    signer = cloud.signer()
    log(f"cloud ready on port {info['port']} (target loaded in {info['load_s']:.1f} s; "
        f"auth={'ephemeral key' if cfg.auth else 'off'})")
    pairs = [(w, s) for w in run.prompt_sets for s in cfg.sampling]
    reqs = {(w, s): encode_requests(tok, run.prompt_sets[w],
                                    workload_label(w, s, cfg.sampling), cfg.seed)
            for w, s in pairs}
    shared = Shared(cfg, cloud, info, tok, signer, run.samplings, run.edge_cpus,
                    base_drafter, slowed, contended,
                    int(info.get("max_batch", cfg.server_kw.get("max_batch", 8))))
    if cfg.warmup:
        t0 = time.perf_counter()
        took = warmup(shared, run.mode_classes, reqs)
        log(f"warm-up: {len(took)} requests for {len(run.mode_classes)} modes in "
            f"{time.perf_counter() - t0:.1f} s ("
            + ", ".join(f"{m} {s:.1f}" for m, s in took.items()) + ")")
    cells = plan_cells(cfg, run.mode_classes, run.profiles, pairs, run.prompt_sets, tok, reqs)
    runs, records = measure_cells(shared, run.profiles, cells, progress)
    runner = getattr(base_drafter, "runner", None)      # an ONNX draft's prompt prefill
    draft_prefill = None if runner is None else (
        "graph" if runner.prefill is None else "torch")
    return runs, records, {"factor": factor, "contended": contended,
                           "draft_load_s": draft_load_s, "info": info,
                           "draft_prefill": draft_prefill}


def _config(run: _Run, runs: list, edge: dict, divergences: dict, t_begin: float) -> dict:
    """The ``config`` object of ``results.json``."""
    import torch

    cfg, info = run.cfg, edge["info"]
    return {
        "target": _name(cfg.target), "draft": _name(run.draft_src),
        "modes": [m.name for m in run.mode_classes],
        "profiles": [p.to_dict() for p in run.profiles],
        "workloads": list(run.prompt_sets), "sampling": {s: run.samplings[s].to_dict()
                                                         for s in cfg.sampling},
        "prompts_per_workload": {w: len(p) for w, p in run.prompt_sets.items()},
        "max_new_tokens": cfg.max_new_tokens, "depth": cfg.depth, "seed": cfg.seed,
        "concurrent_depth": cfg.concurrent_depth or cfg.depth,
        "dtype": cfg.dtype, "auth": cfg.auth, "packed_linears": info.get("packed_linears"),
        "row_invariant": info.get("row_invariant"),
        "draft_prefill": edge.get("draft_prefill"),
        "server_max_wait_s": cfg.server_kw.get("max_wait_s", 0.0),
        "cloud_cpus": run.cloud_cpus, "edge_cpus": run.edge_cpus,
        "cloud_threads": run.cloud_threads, "edge_threads": run.edge_threads,
        "peer_cpus": run.peer_cpus, "peer_threads": run.peer_threads,
        "edge_slowdown": edge["factor"],
        "slowdown_at_s": cfg.slowdown_at_s, "edge_load": cfg.edge_load,
        "contended_profiles": [p.name for p in run.profiles if edge["contended"](p.name)],
        "best_fixed": best_fixed(runs),
        "best_peer": best_peer(runs),
        "concurrency": (concurrency_values(cfg)
                        if any(is_concurrent(m) for m in run.mode_classes) else None),
        "concurrent_profiles": cfg.concurrent_profiles,
        "concurrent_workloads": cfg.concurrent_workloads,
        "concurrent_max_new_tokens": cfg.concurrent_max_new_tokens or cfg.max_new_tokens,
        "server_max_batch_default": info.get("max_batch"),
        "strongest_baseline": strongest_baselines(runs),
        "target_load_s": round(info["load_s"], 3),
        "draft_load_s": round(edge["draft_load_s"], 3),
        "greedy_outputs_identical": (None if not divergences["compared"] else
                                     divergences["identical"] == divergences["compared"]),
        "greedy_divergences": divergences,
        "bench_wall_s": round(time.perf_counter() - t_begin, 1),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, python "
                f"{platform.python_version()}, torch {torch.__version__})",
    }


def _results(run: _Run, runs: list, records: list, edge: dict, t_begin: float) -> dict:
    """The ``results.json`` object: config, runs and every ratio row."""
    cfg = run.cfg
    greedy = {workload_label(w, "greedy", cfg.sampling) for w in run.prompt_sets}
    ratios = (compute_ratios(runs, ratio_specs([m.name for m in run.mode_classes]))
              + adaptive_ratios(runs) + pipeline_ratios(runs) + peer_ratios(runs))
    config = _config(run, runs, edge, greedy_divergences(records, greedy), t_begin)
    peer_names = {m.name for m in run.mode_classes if getattr(m, "peer", False)}
    if peer_names:
        from bench.report.identity import greedy_agreement

        config["peer_greedy_agreement"] = greedy_agreement(records, greedy, peer_names)
    return {"config": config, "runs": runs, "ratios": ratios}


def run_bench(cfg: BenchConfig, out_dir: str | Path | None = None, progress: bool = True,
              log: Callable[[str], None] | None = None) -> dict:
    """Measure every (profile, workload × sampling, mode) cell of ``cfg``.

    Returns the ``results.json`` object; with ``out_dir`` also writes ``results.json``,
    ``summary.md``, ``throughput.png``, ``latency_breakdown.png``,
    ``acceptance_hist.png`` and ``requests.jsonl`` there.
    Raises ValueError for unknown modes/profiles/workloads/sampling variants and
    RuntimeError when the cloud process cannot start.
    """
    import torch

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    t_begin = time.perf_counter()
    run = _resolve(cfg)
    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    set_up = _setup_modes(run)
    cloud = CloudServerProcess(run.cfg.target, run.cloud_cpus, run.cloud_threads,
                               run.cfg.auth, run.cfg.dtype, run.cfg.server_kw).launch()
    try:
        os.sched_setaffinity(0, set(run.edge_cpus))
        torch.set_num_threads(run.edge_threads)
        runs, records, edge = _measure(run, cloud, progress, log)
    finally:
        cloud.stop()
        for mcls in reversed(set_up):
            mcls.teardown_run()
        os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)
    results = _results(run, runs, records, edge, t_begin)
    validate_results(results)
    if out_dir is not None:
        write_outputs(results, records, out_dir)
    return results
