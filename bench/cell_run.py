"""Measuring the cells of a bench run: one link emulator per profile, one asyncio run
per cell, the cloud's max batch and counters around concurrent cells, edge contention
(:mod:`bench.contention`) per cell, and each cell's ``runs`` row and request records."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from bench.cells import Cell
from bench.cloud_process import CloudServerProcess, process_cpu_s, scrape_server
from bench.config import BenchConfig
from bench.contention import EdgeLoad, SlowdownDrafter
from bench.linkem import LinkEmulatorThread, Profile
from bench.modes import EdgeContext, RequestRecord
from bench.report.cell_metrics import (concurrent_metrics, depth_summary, early_timing,
                                       proactive_timing, proactive_totals, request_totals)
from bench.report.labels import point_label, workload_label

__all__ = ["Shared", "warmup", "measure_cells"]


@dataclass
class Shared:
    """What every cell of a run shares: the config, the cloud (process and handshake),
    the tokenizer and signer, sampling configs by name, the edge CPUs, the drafter
    (``slowed``: under contention, for the profiles ``contended`` says), and the cloud's
    default max batch."""

    cfg: BenchConfig
    cloud: CloudServerProcess
    info: dict
    tok: object
    signer: object
    samplings: dict
    edge_cpus: list
    base_drafter: object
    slowed: object
    contended: Callable[[str], bool]
    default_batch: int


async def _run_cell(mode_cls, ctx: EdgeContext, reqs, on_done,
                    sink: dict | None = None) -> list[RequestRecord]:
    mode = mode_cls(ctx)
    await mode.open()
    try:
        return await mode.run(reqs, on_done)
    finally:
        await mode.close()
        if sink is not None:           # run-level measurements of concurrent modes
            sink.update(getattr(mode, "cell_metrics", None) or {})


def warmup(sh: Shared, mode_classes, reqs: dict) -> dict[str, float]:
    """One short, unmeasured request straight to the server per warm-up group of
    ``mode_classes`` (:meth:`~bench.modes.base.BenchMode.warmup_key` and the mode's
    options): warms kernels, allocators, HTTP connections and engines loaded on first use
    on both sides, once for every code path the modes measure. Returns the seconds each
    warmed mode took, by mode name."""
    cfg = sh.cfg
    first = next(iter(reqs.values()))
    if not first:
        return {}
    req = dataclasses.replace(first[0], prompt_ids=first[0].prompt_ids[-32:])
    prof = Profile("warmup", None, None)
    seen, took = set(), {}
    for mcls in mode_classes:
        opts = dict(cfg.mode_options.get(mcls.name, {}))
        key = (mcls.warmup_key(), json.dumps(opts, sort_keys=True, default=repr))
        if key in seen:
            continue
        seen.add(key)
        samp = cfg.sampling[0]
        if getattr(mcls, "greedy_only", False):          # wisv: its greedy cells only
            if "greedy" not in sh.samplings:
                continue
            samp = "greedy"
        ctx = EdgeContext(sh.cloud.url, sh.tok, sh.base_drafter if mcls.needs_drafter else None,
                          sh.signer, prof, sh.samplings[samp],
                          min(4, cfg.max_new_tokens), cfg.depth, None, opts)
        t0 = time.perf_counter()
        asyncio.run(_run_cell(mcls, ctx, [req], None))
        took[mcls.name] = time.perf_counter() - t0
    return took


def _digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


class _progress:
    """rich progress bar (or nothing) with ``describe`` and ``advance``."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self.p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self.p = Progress(TextColumn("{task.description}"), BarColumn(),
                              MofNCompleteColumn(), TimeElapsedColumn(), transient=False)
            self.p.__enter__()
            self.task = self.p.add_task("bench", total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=text)

    def advance(self) -> None:
        if self.p is not None:
            self.p.advance(self.task)

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.__exit__(*exc)


@dataclass
class _Outcome:
    """A measured cell before its metrics: records, the mode's run-level measurements
    (``sink``), the cloud's counters before/after and CPU seconds (concurrent cells),
    the max batch set for it and the drafter's slowed forwards."""

    recs: list
    sink: dict
    before: dict | None = None
    after: dict | None = None
    cloud_cpu_s: float | None = None
    max_batch: int | None = None
    slowed_calls: int = 0


def _context(sh: Shared, cell: Cell, prof: Profile, port: int, link, drafter) -> EdgeContext:
    cfg, mcls, conc = sh.cfg, cell.mode, cell.concurrency
    return EdgeContext(
        f"http://127.0.0.1:{port}", sh.tok, drafter if mcls.needs_drafter else None,
        sh.signer, prof, sh.samplings[cell.sampling], cell.max_new_tokens,
        cfg.depth if conc is None else (cfg.concurrent_depth or cfg.depth),
        link, dict(cfg.mode_options.get(mcls.name, {})), conc or 1)


def _run_one(sh: Shared, cell: Cell, prof: Profile, ctx: EdgeContext, drafter,
             advance) -> _Outcome:
    """Run one cell under its edge load; a concurrent cell at its max batch (restored
    after), between two reads of the cloud's counters and CPU seconds."""
    cfg, conc, cloud = sh.cfg, cell.concurrency, sh.cloud
    load = EdgeLoad(cfg.edge_load if sh.contended(prof.name) else 0, sh.edge_cpus,
                    cfg.slowdown_at_s)
    if isinstance(drafter, SlowdownDrafter):
        drafter.restart_clock()
    slowed0 = getattr(drafter, "slowed_calls", 0)
    mb = None if conc is None else cell.mode.server_max_batch(conc, sh.default_batch)
    out = _Outcome([], {}, max_batch=mb)
    if conc is not None:
        if mb is not None:
            cloud.set_max_batch(mb)
        out.before = scrape_server(cloud.url)
        cpu0 = process_cpu_s(sh.info["pid"])
    load.start()
    try:
        out.recs = asyncio.run(_run_cell(cell.mode, ctx, cell.requests, advance, out.sink))
    finally:
        load.stop()
        if conc is not None and mb is not None:
            cloud.set_max_batch(sh.default_batch)
    if conc is not None:
        cpu1 = process_cpu_s(sh.info["pid"])
        out.after = scrape_server(cloud.url)
        out.cloud_cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    out.slowed_calls = getattr(drafter, "slowed_calls", 0) - slowed0
    return out


def _metrics(sh: Shared, cell: Cell, prof: Profile, out: _Outcome) -> dict:
    """The cell's ``metrics``: aggregate and link bytes, concurrent extras, the
    drafter's slowed forwards, proactive timing, depths, the mode's own run metrics."""
    per = [r.metrics for r in out.recs]
    m = request_totals(per)
    if cell.concurrency is not None:
        concurrent_metrics(
            m, per, concurrency=cell.concurrency, profile=prof.name,
            edge_busy_s=out.sink.get("edge_busy_s"), server_before=out.before,
            server_after=out.after, link_delta=out.sink.get("link_delta"),
            server_max_batch=out.max_batch or sh.default_batch,
            edge_cpu_s=out.sink.get("edge_cpu_s"), cloud_cpu_s=out.cloud_cpu_s)
    m["draft_slowed_calls"] = out.slowed_calls
    m.update(proactive_timing(per), **early_timing(per), **depth_summary(per))
    m.update(cell.mode.run_metrics(per))
    m.update(proactive_totals(per))
    return m


def _records(cell: Cell, plabel: str, label: str, recs: list) -> list[dict]:
    """``requests.jsonl`` lines of a cell: ids, finish reason, token ids and digest,
    metrics."""
    return [{"mode": cell.mode.name, "profile": plabel, "workload": label,
             "prompt_id": r.request.prompt_id, "seed": r.request.seed,
             "finish_reason": r.finish_reason, "token_ids": r.token_ids,
             "output_sha": _digest(r.token_ids), "metrics": r.metrics} for r in recs]


def measure_cells(sh: Shared, profiles: Sequence[Profile], cells: Sequence[Cell],
                  progress: bool) -> tuple[list[dict], list[dict]]:
    """Measure ``cells`` profile by profile, each profile behind its own link emulator.
    Returns ``(runs rows, request records)`` in cell order."""
    cfg = sh.cfg
    runs: list[dict] = []
    records: list[dict] = []
    with _progress(progress, sum(len(c.requests) for c in cells)) as bar:
        for prof in profiles:
            with LinkEmulatorThread("127.0.0.1", sh.info["port"], prof, seed=cfg.seed) as em:
                stats = em.stats
                link = (lambda st=stats: (st.uplink_bytes, st.downlink_bytes))
                drafter = sh.slowed if sh.contended(prof.name) else sh.base_drafter
                for cell in (c for c in cells if c.profile == prof.name):
                    label = workload_label(cell.workload, cell.sampling, cfg.sampling)
                    plabel = (prof.name if cell.concurrency is None
                              else point_label(prof.name, cell.concurrency))
                    bar.describe(f"{cell.mode.name} | {plabel} | {label}")
                    ctx = _context(sh, cell, prof, em.port, link, drafter)
                    out = _run_one(sh, cell, prof, ctx, drafter, lambda r: bar.advance())
                    runs.append({"mode": cell.mode.name, "profile": plabel,
                                 "workload": label, "metrics": _metrics(sh, cell, prof, out)})
                    records += _records(cell, plabel, label, out.recs)
    return runs, records
