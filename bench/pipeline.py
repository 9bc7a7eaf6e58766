"""Multi-request bench support: the confirmed-prefix pipeline and its baselines
(AsymSpec §IV-C and §V).

The concurrent modes themselves (``pipeline``, ``no-pipeline``, ``runahead``,
``standard-sd-concurrent``) live in :mod:`bench.modes`; this module holds what
they and the runner share, and imports nothing from the bench modes:

* operating-point labels: a concurrent run at concurrency C on profile P is reported
  under the profile label ``P@cC`` (``weak@c8``), so runs stay unique per
  (mode, profile, workload) and ratio rows compare modes at the same profile *and*
  concurrency (the ``results.json`` schema has no other slot for it);
* :class:`BusyExecutor`, the edge's one draft worker, counting busy seconds (edge
  utilisation = busy seconds / makespan);
* :func:`scrape_server` — the cloud's own counters from ``GET /metrics``
  (``specrelay_target_passes_total``: a batched pass counts once;
  ``specrelay_target_seconds_total``; the ``specrelay_batch_size`` histogram);
* :func:`concurrent_metrics` — the run-level metrics of a concurrent cell;
* :func:`pipeline_ratios` — ``pipeline`` against the strongest baseline and the
  strong→weak throughput change.

Run-level metrics added for concurrent runs (all in the run's ``metrics`` dict; the
``results.json`` schema allows extra keys):

==================== =====================================================================
``concurrency``      C, requests in flight
``network_profile``  the link profile's name (the run's ``profile`` is ``name@cC``)
``makespan_s``       first request start → last request end (s); throughput uses it
``target_passes_per_token`` server passes (batched pass counted once) / committed tokens
``verify_rounds_per_token`` verification rounds (blocks) / committed tokens
``server_target_passes``, ``server_target_seconds``, ``server_batches`` deltas of the
                     cloud's counters over the run
``mean_batch_size``  blocks per target pass (server histogram sum / count)
``edge_busy_s``      seconds the edge draft worker was busy (proactive steps included)
``edge_utilisation`` edge_busy_s / makespan_s
``cloud_utilisation`` server target seconds / makespan_s (verification passes only; prompt
                     prefills are not in ``specrelay_target_seconds_total``)
``edge_cpu_utilisation`` CPU seconds of the whole edge (bench) process — draft worker,
                     event loop/HTTP client and the link emulator thread — / makespan_s
``cloud_cpu_utilisation`` CPU seconds of the whole cloud process (target passes, prefills,
                     HTTP server, msgpack) / makespan_s (Linux ``/proc``; else absent)
``runahead_wasted_tokens`` draft tokens drafted ahead of an unresolved block and thrown
                     away (NPDG misses); 0 for modes that never run ahead
``server_max_batch`` the cloud's max batch during the run
==================== =====================================================================
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

from bench import report

__all__ = [
    "DEFAULT_CONCURRENCY", "CONCURRENT_BASELINES", "STRONGEST", "point_label", "split_point",
    "BusyExecutor", "process_cpu_s", "parse_prometheus", "scrape_server", "cell_prompts", "requests_per_cell",
    "concurrent_metrics", "pipeline_ratios", "strongest_baselines", "summary_md",
]

DEFAULT_CONCURRENCY = 8
"""Concurrency of the concurrent modes when none is configured."""

CONCURRENT_BASELINES = ("no-pipeline", "runahead", "standard-sd-concurrent")
"""The baselines ``pipeline`` is compared against at the same profile and concurrency."""

STRONGEST = "strongest-baseline"
"""Baseline name of the ratio rows against the best of :data:`CONCURRENT_BASELINES`."""

_POINT = re.compile(r"^(?P<profile>.+)@c(?P<c>\d+)$")


def point_label(profile: str, concurrency: int) -> str:
    """``weak``, 8 → ``weak@c8`` (the ``profile`` label of a concurrent run)."""
    return f"{profile}@c{int(concurrency)}"


def split_point(label: str) -> tuple[str, int | None]:
    """``weak@c8`` → ("weak", 8); a plain profile label → (label, None)."""
    m = _POINT.match(label)
    return (m["profile"], int(m["c"])) if m else (label, None)


# --------------------------------------------------------------------------- edge worker


class BusyExecutor(ThreadPoolExecutor):
    """The edge's single draft worker (one thread): every submitted call is timed and
    :attr:`busy_s` accumulates the seconds the worker spent running them."""

    def __init__(self, name: str = "draft"):
        super().__init__(1, thread_name_prefix=name)
        self.busy_s = 0.0
        self.calls = 0

    def submit(self, fn, /, *args, **kwargs):
        def timed():
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:                       # one worker thread: no concurrent update
                self.busy_s += time.perf_counter() - t0
                self.calls += 1

        return super().submit(timed)


# --------------------------------------------------------------------------- server counters


def process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) of process ``pid`` (None: this one);
    None when it cannot be read (no ``/proc``)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_SERVER_SERIES = {
    "specrelay_target_passes_total": "passes",
    "specrelay_target_seconds_total": "target_s",
    "specrelay_batch_size_sum": "batch_blocks",
    "specrelay_batch_size_count": "batches",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: ``{sample name: value}``
    (``prometheus_client``'s parser; counters keep their ``_total`` suffix)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: float(s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def scrape_server(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The cloud's verification counters from ``{url}/metrics`` (public, unsigned):
    ``passes`` (target passes, a batch once), ``target_s`` (target seconds),
    ``batch_blocks`` and ``batches`` (batch-size histogram sum and count)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        samples = parse_prometheus(r.read().decode("utf-8", "replace"))
    return {k: samples.get(series, 0.0) for series, k in _SERVER_SERIES.items()}


# --------------------------------------------------------------------------- requests


def requests_per_cell(prompts: int, concurrency: int) -> int:
    """Requests in a concurrent cell: whole waves of C, at least ``prompts``
    (``C * ceil(prompts / C)``), so every lane stays busy until the last wave."""
    c = max(1, int(concurrency))
    return c * max(1, math.ceil(int(prompts) / c))


def cell_prompts(prompts: Sequence, n: int, more: Sequence | None = None) -> list:
    """``n`` prompts for a concurrent cell: the first ``n`` of ``more`` (a longer list
    from the same workload, same order) or of ``prompts``, cycled when too short (a
    repeated prompt's id suffixed ``#k``, the k-th repeat)."""
    src = list(more) if more is not None and len(more) > len(prompts) else list(prompts)
    if not src:
        return []
    out = []
    for i in range(n):
        p, k = src[i % len(src)], i // len(src)
        out.append(p if k == 0 else dataclasses.replace(p, id=f"{p.id}#{k}"))
    return out


# --------------------------------------------------------------------------- run metrics


def concurrent_metrics(m: dict, per_request: Sequence[dict], *, concurrency: int,
                       profile: str, edge_busy_s: float | None,
                       server_before: dict | None, server_after: dict | None,
                       link_delta: tuple[int, int] | None, server_max_batch: int | None,
                       edge_cpu_s: float | None = None,
                       cloud_cpu_s: float | None = None) -> dict:
    """Complete the ``report.aggregate`` metrics ``m`` of a concurrent cell (in place;
    also returned) with the fields of the module docstring."""
    n = m["committed_tokens"]
    starts = [r.get("start_s") for r in per_request]
    ends = [r.get("end_s") for r in per_request]
    span = (max(ends) - min(starts)) if per_request and None not in starts + ends else \
        sum(r["wall_s"] for r in per_request)
    m.update(concurrency=int(concurrency), network_profile=profile, makespan_s=span,
             server_max_batch=server_max_batch,
             verify_rounds_per_token=(m["rounds"] / n) if n else None,
             runahead_wasted_tokens=sum(int(r.get("proactive_wasted_tokens", 0) or 0)
                                        for r in per_request))
    for key, cpu in (("edge", edge_cpu_s), ("cloud", cloud_cpu_s)):
        if cpu is not None:
            m[f"{key}_cpu_s"] = cpu
            m[f"{key}_cpu_utilisation"] = cpu / span if span > 0 else None
    if edge_busy_s is not None:
        m["edge_busy_s"] = edge_busy_s
        m["edge_utilisation"] = edge_busy_s / span if span > 0 else None
    if server_before is not None and server_after is not None:
        d = {k: server_after[k] - server_before.get(k, 0.0) for k in server_after}
        m.update(server_target_passes=int(round(d["passes"])),
                 server_target_seconds=d["target_s"], server_batches=int(round(d["batches"])),
                 mean_batch_size=(d["batch_blocks"] / d["batches"]) if d["batches"] else None,
                 cloud_utilisation=d["target_s"] / span if span > 0 else None)
        # the server's count: one batched pass serves several requests
        m["target_passes_per_token"] = d["passes"] / n if n else None
        m["target_seconds_per_token"] = d["target_s"] / n if n else None
    if link_delta is not None:
        up, down = link_delta
        m["link_uplink_bytes_per_token"] = up / n if n else None
        m["link_downlink_bytes_per_token"] = down / n if n else None
    return m


# --------------------------------------------------------------------------- ratios


def _index(runs: Iterable[dict]) -> dict:
    return {(r["mode"], r["profile"], r["workload"]): r["metrics"] for r in runs}


def strongest_baselines(runs: Sequence[dict], metric: str = "throughput_tok_s",
                        baselines: Sequence[str] = CONCURRENT_BASELINES) -> dict[str, str]:
    """``{"profile|workload": baseline mode}``: the best baseline (highest ``metric``)
    of every concurrent operating point where at least one baseline ran."""
    idx, out = _index(runs), {}
    for (mode, prof, w), m in idx.items():
        if mode != "pipeline":
            continue
        best = None
        for b in baselines:
            v = (idx.get((b, prof, w)) or {}).get(metric)
            if isinstance(v, (int, float)) and (best is None or v > best[1]):
                best = (b, v)
        if best is not None:
            out[f"{prof}|{w}"] = best[0]
    return out


def pipeline_ratios(runs: Sequence[dict], mode: str = "pipeline",
                    baselines: Sequence[str] = CONCURRENT_BASELINES,
                    strong: str = "strong", weak: str = "weak") -> list[dict]:
    """Ratio rows (``report.compute_ratios`` shape, > 1: ``mode`` is better):

    * ``throughput_tok_s`` of ``mode`` against ``strongest-baseline`` — per workload the
      best throughput among ``baselines`` at the same profile label (profile and
      concurrency), geometric mean over workloads — for every concurrent profile label;
    * ``target_passes_per_token`` of ``mode`` against the strongest baseline (reduction);
    * the strong→weak change for every mode with concurrent runs: metric ``throughput_tok_s``,
      profile ``weak@cC``, baseline ``<mode>@strong@cC``, value = throughput on weak /
      throughput on strong (1.0 = unchanged; 0.95 = 5 % lower on the weak link).
    """
    idx = _index(runs)
    profiles, workloads = [], sorted({w for (_, _, w) in idx})
    for r in runs:
        if r["profile"] not in profiles and split_point(r["profile"])[1] is not None:
            profiles.append(r["profile"])
    def strongest(metric: str):
        """The ``metric`` of the baseline with the best throughput at (profile, workload)."""
        def value(prof: str, w: str):
            bvs = [((idx.get((b, prof, w)) or {}).get("throughput_tok_s"), b)
                   for b in baselines]
            best = max(((bv, b) for bv, b in bvs if isinstance(bv, (int, float))),
                       default=None)
            return None if best is None else idx[(best[1], prof, w)].get(metric)
        return value

    rows = []
    for metric, higher in (("throughput_tok_s", True), ("target_passes_per_token", False)):
        for prof in profiles:
            row = report.ratio_row(idx, prof, workloads, metric, mode, STRONGEST, higher,
                                   strongest(metric))
            if row is not None:
                rows.append(row)
    modes = list(dict.fromkeys(r["mode"] for r in runs
                               if split_point(r["profile"])[1] is not None))
    for md in modes:
        for prof in profiles:
            p, c = split_point(prof)
            if p != weak:
                continue
            sp = point_label(strong, c)
            row = report.ratio_row(
                idx, prof, workloads, "throughput_tok_s", md, f"{md}@{sp}", True,
                lambda _p, w, md=md, sp=sp: (idx.get((md, sp, w)) or {}).get("throughput_tok_s"))
            if row is not None:
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- summary


_SUMMARY_COLS = [
    ("n_requests", "requests", 1.0, "{:.0f}"), ("throughput_tok_s", "tok/s", 1.0, "{:.2f}"),
    ("target_passes_per_token", "passes/tok", 1.0, "{:.3f}"),
    ("mean_batch_size", "mean batch", 1.0, "{:.2f}"),
    ("edge_utilisation", "edge util", 1.0, "{:.2f}"),
    ("cloud_utilisation", "cloud util", 1.0, "{:.2f}"),
    ("edge_cpu_utilisation", "edge CPU", 1.0, "{:.2f}"),
    ("cloud_cpu_utilisation", "cloud CPU", 1.0, "{:.2f}"),
    ("mean_accepted_length", "tokens/round", 1.0, "{:.2f}"),
    ("runahead_wasted_tokens", "runahead wasted", 1.0, "{:.0f}"),
]


def summary_md(results: dict) -> str:
    """Markdown for summary.md: the concurrent runs' utilisation and pass counts."""
    runs = [r for r in results["runs"] if split_point(r["profile"])[1] is not None]
    if not runs:
        return ""

    lines = ["", "## Concurrent runs (confirmed-prefix pipeline and baselines)", "",
             "profile = network profile @ c<concurrency>; throughput over the makespan; "
             "passes/tok from the server's counter (a batched pass counts once); edge util "
             "= draft-worker busy s / makespan; cloud util = target s / makespan; edge/cloud "
             "CPU = CPU s of the whole edge/cloud process / makespan.", ""]
    lines += report.runs_table(runs, _SUMMARY_COLS)
    sb = results.get("config", {}).get("strongest_baseline") or {}
    if sb:
        lines += ["", "Strongest baseline per operating point: "
                  + ", ".join(f"{k} → {v}" for k, v in sb.items()), ""]
    return "\n".join(lines) + "\n"
