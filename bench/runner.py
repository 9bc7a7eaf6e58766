"""Benchmark runner: the process layout and the measurement loop.

Layout (one machine, loopback)::

    bench process (edge core)                      server process (cloud core)
    ┌────────────────────────────────┐             ┌──────────────────────────────┐
    │ drafter + EdgeClient / stream  │──HTTP──▶ LinkEmulatorThread ──▶ aiohttp app │
    │ (the mode under test)          │◀─────────   (profile)   ◀──── │ target model │
    └────────────────────────────────┘             └──────────────────────────────┘

* The **cloud** runs in a separate process (``multiprocessing`` *spawn*), pinned to its
  own CPU(s) with ``os.sched_setaffinity`` and a fixed torch thread count. It loads the
  target once, creates an ephemeral API key in an in-memory key store
  (``SQLiteKeyStore(":memory:")``) and hands the raw key and its port to the bench over
  the process pipe (``auth=False`` serves without authentication instead).
* The **edge** (draft model, client, mode logic) runs in the bench process, pinned to
  the other CPU(s) for the duration of :func:`run_bench` (restored afterwards).
* The **link emulator** (:class:`~bench.linkem.LinkEmulatorThread`, one per
  profile) proxies the SDK's real HTTP traffic between them.

Edge contention: ``edge_slowdown=F, slowdown_at_s=T`` wraps the drafter in
:class:`SlowdownDrafter` (every draft forward started ``T`` seconds or more after the
start of a run takes ``F`` times as long); ``edge_load=N`` starts ``N`` busy-loop
processes pinned to the edge CPU(s) at ``T`` (:class:`EdgeLoad`). A *run* is one
(mode, profile, workload) cell; the contention clock restarts with every run.

:func:`run_bench` returns the ``results.json`` object (``report.validate_results``) and,
given ``out_dir``, writes ``results.json``, ``summary.md``, the PNG plots and
``requests.jsonl`` (one line per request: ids, token ids, metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from bench import adaptive as A
from bench import pipeline as P
from bench import report
from bench.linkem import PROFILES, LinkEmulatorThread, Profile
from bench.modes import (BenchRequest, EdgeContext, RequestRecord, RunSetup,
                                  get_mode)
from bench.workloads import Prompt, load_workload
from edge_sdk.drafters.base import Drafter
from edge_sdk.metrics import classify_divergence

__all__ = [
    "BenchConfig", "run_bench", "CloudServerProcess", "SlowdownDrafter", "EdgeLoad",
    "SAMPLING_PRESETS", "QUICK", "split_cpus", "load_source", "ratio_specs",
]

SAMPLING_PRESETS = {"greedy": {"temperature": 0.0}, "sample": {"temperature": 0.7, "top_p": 0.9}}
"""Sampling variants by name (``SamplingConfig`` fields)."""


@dataclass
class BenchConfig:
    """What to measure. Times in seconds, lengths in tokens.

    Attributes:
        modes: registered mode names (``bench.modes.MODES``).
        profiles: profile names of ``linkem.PROFILES`` or :class:`Profile` objects.
        workloads: ``"mtbench"`` / ``"humaneval"``.
        sampling: variants from :data:`SAMPLING_PRESETS` (``"greedy"``, ``"sample"``).
        prompts: prompts per workload. seed: prompt shuffle and request seeds.
        max_new_tokens: tokens generated per request. depth: draft depth gamma.
        concurrent_depth: draft depth of the concurrent modes (None: ``depth``).
        target, draft: model sources: a ``load_model`` spec string (preset, path,
            ``name@N``) or a picklable zero-argument callable returning
            ``(model, tokenizer)``; ``draft=None`` picks the CLI's default draft.
        dtype: torch dtype name for both models.
        cloud_cpus, edge_cpus: CPU ids for each side (None: split what is available).
        cloud_threads, edge_threads: torch threads per side (None: number of CPUs).
        auth: sign requests with an ephemeral key (False: unauthenticated server).
        edge_slowdown: factor (>= 1) on each draft forward after ``slowdown_at_s``.
        slowdown_at_s: seconds after the start of each run when contention starts.
        edge_load: busy processes pinned to the edge CPUs from ``slowdown_at_s`` on.
        warmup: one short unmeasured request per mode before measuring.
        prompt_sets: explicit prompts per workload name (tests); overrides loading.
        server_kw: extra ``create_app``/``CloudService`` options (max_batch, ...).
        mode_options: per-mode options (``EdgeContext.options``), by mode name.
        concurrency: requests in flight for the concurrent modes (``pipeline``,
            ``no-pipeline``, ``runahead``, ``standard-sd-concurrent``,
            ``pipeline-standard``: ``concurrent = True``); each runs once
            per value, reported under the profile label ``<profile>@c<C>``, with
            ``C * ceil(prompts / C)`` requests per cell. None: [8]. Sequential modes
            ignore it.
        concurrent_profiles, concurrent_workloads: restrict the concurrent modes to
            these profiles / workloads (None: all of the run's).
        concurrent_max_new_tokens: tokens per request in concurrent cells (None:
            ``max_new_tokens``).
    """

    modes: list = field(default_factory=lambda: ["cloud-ar", "standard-sd", "specrelay",
                                                 "sr-ahead"])
    profiles: list = field(default_factory=lambda: list(PROFILES))
    workloads: list = field(default_factory=lambda: ["mtbench", "humaneval"])
    sampling: list = field(default_factory=lambda: ["greedy", "sample"])
    prompts: int = 5
    seed: int = 0
    max_new_tokens: int = 64
    depth: int = 4
    target: object = "qwen2.5-coder-1.5b"
    draft: object = None
    dtype: str = "auto"
    cloud_cpus: Sequence[int] | None = None
    edge_cpus: Sequence[int] | None = None
    cloud_threads: int | None = None
    edge_threads: int | None = None
    auth: bool = True
    edge_slowdown: float = 1.0
    slowdown_at_s: float = 0.0
    edge_load: int = 0
    warmup: bool = True
    prompt_sets: dict | None = None
    server_kw: dict = field(default_factory=dict)
    mode_options: dict = field(default_factory=dict)
    concurrency: list | None = None
    concurrent_profiles: list | None = None
    concurrent_workloads: list | None = None
    concurrent_max_new_tokens: int | None = None
    concurrent_depth: int | None = None
    mode_profiles: dict | None = None
    mode_workloads: dict | None = None


_QUICK_BASIC = ["cloud-ar", "standard-sd", "specrelay", "sr-ahead"]
_QUICK_ADAPTIVE = ["caac", "fixed-3", "fixed-5"]          # medium and medium+slow
_QUICK_PROACTIVE = ["stop-and-wait", "ipdg", "npdg"]      # medium, at --depth
_QUICK_PEERS = ["llamacpp-ar", "llamacpp-spec"]
_QUICK_CONCURRENT = ["pipeline", "no-pipeline", "runahead", "standard-sd-concurrent"]
QUICK = dict(modes=_QUICK_BASIC + _QUICK_ADAPTIVE + _QUICK_PROACTIVE + _QUICK_PEERS
             + _QUICK_CONCURRENT,
             profiles=["medium", "medium+slow", "weak"],
             workloads=["humaneval"],
             sampling=["greedy"], prompts=4, max_new_tokens=32, concurrency=[8],
             concurrent_profiles=["weak"], concurrent_workloads=["humaneval"],
             concurrent_max_new_tokens=16, concurrent_depth=1,
             edge_slowdown=3.0, slowdown_at_s=3.0,
             mode_profiles={**{m: ["medium"] for m in _QUICK_BASIC + _QUICK_PROACTIVE
                               + _QUICK_PEERS},
                            **{m: ["medium", "medium+slow"] for m in _QUICK_ADAPTIVE}},
             mode_workloads=None)
"""``--quick`` settings (the default pair; <= 10 minutes on 2 quiet CPU cores): 4 greedy
HumanEval prompts x 32 tokens per cell. The basic modes, IPDG / NPDG / stop-and-wait
(at ``--depth``) and the llama.cpp peers on ``medium``; CAAC and fixed depths 3 and 5 on
``medium`` and ``medium+slow`` (3x slower draft forwards from 3 s into each run); the
confirmed-prefix pipeline and its baselines at 8 concurrent requests x 16 tokens, depth 1,
on ``weak``. Ratio rows: uplink vs standard-sd, specrelay vs cloud-ar, caac vs
best-fixed, ipdg vs npdg / stop-and-wait, pipeline vs the strongest baseline, and each
peer's speculative gain."""


def ratio_specs(modes: Sequence[str]) -> list[tuple[str, str, str, bool]]:
    """``compute_ratios`` specs: every non-baseline mode against every baseline mode of
    the run, for ``throughput_tok_s`` (higher is better) and, against ``standard-sd``,
    ``uplink_bytes_per_token`` (lower is better). Peer engines (``peer = True``,
    :mod:`bench.peers`) are not paired with our modes: each peer's speculative
    mode gets one row against its own engine's target-only mode (``gain_baseline``), its
    *speculative gain* (e.g. ``llamacpp-spec`` / ``llamacpp-ar``, beside ``specrelay`` /
    ``cloud-ar``)."""
    specs = []
    modes = [m for m in modes if not getattr(get_mode(m), "adaptive", False)]
    peers = [m for m in modes if getattr(get_mode(m), "peer", False)]
    base = [m for m in modes if get_mode(m).baseline and m not in peers]
    for m in modes:
        if get_mode(m).baseline or m in peers:
            continue
        for b in base:
            if b == "standard-sd":
                specs.append(("uplink_bytes_per_token", m, b, False))
        for b in base:
            specs.append(("throughput_tok_s", m, b, True))
    for m in peers:
        gain_base = getattr(get_mode(m), "gain_baseline", None)
        if gain_base in modes:
            specs.append(("throughput_tok_s", m, gain_base, True))
    return specs


# --------------------------------------------------------------------------- models


def load_source(src, dtype: str = "float32", threads: int | None = None):
    """Load ``(model, tokenizer)`` from a spec string or a zero-argument callable."""
    if callable(src):
        return src()
    from edge_sdk.models import load_model

    return load_model(src, dtype=dtype, threads=threads)


def split_cpus(cloud: Sequence[int] | None = None,
               edge: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """CPU ids for (cloud, edge): the given ones, else the first available CPU for the
    cloud and the rest for the edge (both share everything on a 1-CPU machine)."""
    avail = sorted(os.sched_getaffinity(0))
    if cloud is None and edge is None:
        if len(avail) < 2:
            return avail, avail
        return avail[:1], avail[1:]
    if cloud is None:
        cloud = [c for c in avail if c not in set(edge)] or avail
    if edge is None:
        edge = [c for c in avail if c not in set(cloud)] or avail
    return list(cloud), list(edge)


# --------------------------------------------------------------------------- cloud process


def _server_main(conn, target, dtype: str, cpus, threads: int, auth: bool,
                 server_kw: dict) -> None:
    """Entry of the spawned cloud process: pin, load, serve, handshake, wait for stop."""
    try:
        if cpus:
            os.sched_setaffinity(0, set(cpus))
        import torch

        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        model, tok = load_source(target, dtype, threads)
        load_s = time.perf_counter() - t0
        from edge_sdk.kvmodel import KVModel

        KVModel(model).forward([0, 1, 2, 3])                 # warm the kernels
        store, raw_key = None, None
        if auth:
            from cloud_api.local import ephemeral_key_store

            store, raw_key = ephemeral_key_store("bench-ephemeral", rpm=10**9, tpm=10**12)
        asyncio.run(_serve(conn, model, tok, store, raw_key, threads, load_s, server_kw))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        try:
            conn.send({"error": traceback.format_exc()})
        except Exception:  # noqa: BLE001
            pass


async def _serve(conn, model, tok, store, raw_key, threads, load_s, server_kw) -> None:
    from aiohttp import web

    from cloud_api.app import SERVICE, create_app

    app = create_app(model, tok, key_store=store, threads=threads, **server_kw)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    queue = app[SERVICE].queue
    conn.send({"port": port, "raw_key": raw_key, "load_s": load_s, "pid": os.getpid(),
               "vocab_size": int(model.config.vocab_size), "max_batch": queue.max_batch})
    loop = asyncio.get_running_loop()
    while True:
        try:
            msg = await loop.run_in_executor(None, conn.recv)   # "stop", a command, or EOF
        except (EOFError, OSError):
            break
        if isinstance(msg, dict) and "max_batch" in msg:     # bench control: batching
            queue.max_batch = max(1, int(msg["max_batch"]))   # read by the next batch
            conn.send({"max_batch": queue.max_batch})
            continue
        break
    await runner.cleanup()


class CloudServerProcess:
    """The verification API in a spawned process pinned to ``cpus``.

    Args:
        target: model source (spec string or picklable callable → (model, tokenizer)).
        cpus: CPU ids for the process (None: not pinned).
        threads: torch threads (default: number of CPUs, else 1).
        auth: create an ephemeral signed key (see :attr:`raw_key`); False serves
            without authentication.
        dtype: torch dtype name. server_kw: ``create_app`` options.
        startup_timeout_s: seconds to wait for the model load and the handshake.

    ``with CloudServerProcess("smollm2-135m", cpus=[0]) as cloud: cloud.url``.
    """

    def __init__(self, target, cpus: Sequence[int] | None = None, threads: int | None = None,
                 auth: bool = True, dtype: str = "float32", server_kw: dict | None = None,
                 startup_timeout_s: float = 900.0):
        self.cpus = list(cpus) if cpus else None
        self.threads = threads or (len(self.cpus) if self.cpus else 1)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, name="specrelay-bench-cloud",
                                args=(child, target, dtype, self.cpus, self.threads, auth,
                                      dict(server_kw or {})), daemon=True)
        self._child = child
        self.timeout = startup_timeout_s
        self.info: dict | None = None

    def launch(self) -> "CloudServerProcess":
        """Start the process without waiting (see :meth:`wait_ready`)."""
        self.proc.start()
        self._child.close()
        return self

    def wait_ready(self) -> dict:
        """Block until the server listens; returns the handshake dict
        (``port``, ``raw_key``, ``load_s``, ``pid``, ``vocab_size``).
        Raises RuntimeError (with the child's traceback) on failure or timeout."""
        if self.info is None:
            if not self._conn.poll(self.timeout):
                self.stop()
                raise RuntimeError(f"cloud server did not start within {self.timeout} s")
            try:
                msg = self._conn.recv()
            except EOFError:
                raise RuntimeError("cloud server process died during startup") from None
            if "error" in msg:
                self.stop()
                raise RuntimeError("cloud server failed to start:\n" + msg["error"])
            self.info = msg
        return self.info

    def start(self) -> "CloudServerProcess":
        self.launch()
        self.wait_ready()
        return self

    @property
    def port(self) -> int:
        return self.wait_ready()["port"]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (direct, not through an emulator)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def raw_key(self) -> str | None:
        """The ephemeral API key (None without auth). Never logged or written out."""
        return self.wait_ready()["raw_key"]

    def signer(self):
        """A :class:`Signer` for the ephemeral key, or None without auth."""
        from edge_sdk.protocol.signing import Signer

        return Signer.from_api_key(self.raw_key) if self.raw_key else None

    def set_max_batch(self, n: int, timeout: float = 30.0) -> int:
        """Set the server's verification max batch (blocks per target pass) from the
        next batch on; returns the value in force. Raises RuntimeError without an
        answer within ``timeout`` s."""
        self.wait_ready()
        self._conn.send({"max_batch": int(n)})
        if not self._conn.poll(timeout):
            raise RuntimeError("cloud server did not answer the max_batch command")
        return int(self._conn.recv()["max_batch"])

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to shut down; kill it if it does not within ``timeout`` s."""
        if self.proc.pid is None:
            return
        try:
            self._conn.send("stop")
        except (OSError, ValueError, BrokenPipeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()

    def __enter__(self) -> "CloudServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- contention


class SlowdownDrafter(Drafter):
    """Wraps a :class:`Drafter`; once ``at_s`` seconds have passed since the last
    :meth:`restart_clock`, every draft forward (``sync``/``step``) is followed by a sleep
    of ``(factor - 1)`` times its measured duration, so it takes ``factor`` times as
    long (emulated edge contention, e.g. a robot's other workloads).

    Attributes: ``slowed_calls`` (forwards slowed), ``added_s`` (seconds slept).
    """

    def __init__(self, inner: Drafter, factor: float, at_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
        if factor < 1.0:
            raise ValueError("slowdown factor must be >= 1")
        if at_s < 0:
            raise ValueError("slowdown_at_s must be >= 0 s")
        self.inner, self.factor, self.at_s, self.clock = inner, float(factor), float(at_s), clock
        self.vocab_size = inner.vocab_size
        self.t0 = clock()
        self.slowed_calls = 0
        self.added_s = 0.0

    def restart_clock(self) -> None:
        """Start counting ``at_s`` from now (called at the start of every run)."""
        self.t0 = self.clock()

    @property
    def active(self) -> bool:
        """True once the slowdown applies."""
        return self.factor > 1.0 and self.clock() - self.t0 >= self.at_s

    def _timed(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        if self.active:
            extra = (self.factor - 1.0) * (time.perf_counter() - t)
            time.sleep(extra)
            self.slowed_calls += 1
            self.added_s += extra
        return out

    def sync(self, context):
        return self._timed(self.inner.sync, context)

    def step(self, token: int):
        return self._timed(self.inner.step, token)

    def cache_len(self) -> int:
        return self.inner.cache_len()

    def fork(self) -> "SlowdownDrafter":
        """A fork of the inner drafter under the same contention clock."""
        f = SlowdownDrafter(self.inner.fork(), self.factor, self.at_s, self.clock)
        f.t0 = self.t0
        return f


class EdgeLoad:
    """``n`` busy-loop processes pinned to ``cpus`` (competing edge workloads), started
    ``at_s`` seconds after :meth:`start` and killed by :meth:`stop`."""

    def __init__(self, n: int, cpus: Sequence[int] | None, at_s: float = 0.0):
        self.n, self.cpus, self.at_s = int(n), list(cpus) if cpus else None, float(at_s)
        self.procs: list[subprocess.Popen] = []
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def _spawn(self) -> None:
        pin = f"os.sched_setaffinity(0, {set(self.cpus)!r})\n" if self.cpus else ""
        code = f"import os\n{pin}while True:\n    pass\n"
        with self._lock:
            if self._stopped:
                return
            for _ in range(self.n):
                self.procs.append(subprocess.Popen([sys.executable, "-c", code],
                                                   stdin=subprocess.DEVNULL))

    def start(self) -> "EdgeLoad":
        self._stopped = False
        if self.n <= 0:
            return self
        if self.at_s <= 0:
            self._spawn()
        else:
            self._timer = threading.Timer(self.at_s, self._spawn)
            self._timer.daemon = True
            self._timer.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
            for p in self.procs:
                p.kill()
            for p in self.procs:
                p.wait()
            self.procs = []


# --------------------------------------------------------------------------- the loop


def _sampling(name: str):
    from edge_sdk.protocol.sampling import SamplingConfig

    try:
        return SamplingConfig(**SAMPLING_PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown sampling variant {name!r}; choose from "
                         f"{sorted(SAMPLING_PRESETS)}") from None


def _profile(p) -> Profile:
    """A profile by name; ``<name>+slow`` is that link under edge contention
    (:mod:`bench.adaptive`)."""
    if isinstance(p, Profile):
        return p
    base, slow = A.split_contention(p)
    try:
        prof = PROFILES[base]
    except KeyError:
        raise ValueError(f"unknown profile {p!r}; choose from {list(PROFILES)} "
                         f"(+ '{A.SLOW_SUFFIX}' for the edge-contention variant)") from None
    return dataclasses.replace(prof, name=p) if slow else prof


def _requests(tok, prompts: list[Prompt], label: str, seed: int) -> list[BenchRequest]:
    from edge_sdk.models import encode_prompt

    return [BenchRequest(p.id, label, tuple(encode_prompt(tok, p.text, p.kind == "chat")),
                         seed * 1000 + i) for i, p in enumerate(prompts)]


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


def _run_metrics(records: list[RequestRecord]) -> dict:
    per = [r.metrics for r in records]
    m = report.aggregate(per)
    n = m["committed_tokens"]
    for k in ("link_uplink_bytes", "link_downlink_bytes"):
        tot = sum(r.get(k, 0) or 0 for r in per)
        m[k + "_per_token"] = tot / n if n else None
    m["wall_s_total"] = sum(r["wall_s"] for r in per)
    m["prompt_tokens_mean"] = sum(r.get("prompt_tokens", 0) for r in per) / len(per)
    return m


def _is_concurrent(mode_cls) -> bool:
    return bool(getattr(mode_cls, "concurrent", False))


def _concurrency(cfg: BenchConfig) -> list[int]:
    vals = [int(c) for c in (cfg.concurrency or [P.DEFAULT_CONCURRENCY])]
    if not vals or min(vals) < 1:
        raise ValueError("concurrency values must be >= 1")
    return list(dict.fromkeys(vals))


def _jobs(cfg: BenchConfig, mode_classes, profiles, cells, prompt_sets, tok, reqs) -> list:
    """The run's cells in order: ``(profile name, workload, sampling, mode class,
    concurrency or None, requests, max_new_tokens)``. Sequential modes run the
    workload's prompts one after another; concurrent modes run once per concurrency
    value C on ``C * ceil(prompts / C)`` requests (more prompts from the same workload,
    else the prompts cycled)."""
    conc = _concurrency(cfg)
    max_new_c = cfg.concurrent_max_new_tokens or cfg.max_new_tokens
    cprof = set(cfg.concurrent_profiles) if cfg.concurrent_profiles else None
    cwork = set(cfg.concurrent_workloads) if cfg.concurrent_workloads else None
    mprof, mwork = cfg.mode_profiles or {}, cfg.mode_workloads or {}
    more: dict = {}
    jobs = []
    for prof in profiles:
        for (w, s) in cells:
            for mcls in mode_classes:
                if (mcls.name in mprof and prof.name not in mprof[mcls.name]) or \
                        (mcls.name in mwork and w not in mwork[mcls.name]):
                    continue
                if not _is_concurrent(mcls):
                    jobs.append((prof.name, w, s, mcls, None, reqs[(w, s)],
                                 cfg.max_new_tokens))
                    continue
                if (cprof is not None and prof.name not in cprof) or \
                        (cwork is not None and w not in cwork):
                    continue
                for c in conc:
                    n = P.requests_per_cell(len(prompt_sets[w]), c)
                    if cfg.prompt_sets is None and n > len(prompt_sets[w]) and w not in more:
                        more[w] = load_workload(w, None, cfg.seed)
                    prompts = P.cell_prompts(prompt_sets[w], n, more.get(w))
                    jobs.append((prof.name, w, s, mcls, c, _requests(
                        tok, prompts, _label(w, s, cfg.sampling), cfg.seed), max_new_c))
    return jobs


def _digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


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
    mode_classes = [get_mode(m) for m in cfg.modes]
    profiles = [_profile(p) for p in cfg.profiles]
    samplings = {s: _sampling(s) for s in cfg.sampling}
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
    edge_threads = cfg.edge_threads or len(edge_cpus)

    old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    run_setup = RunSetup(cfg.target, draft_src, cfg.dtype, tuple(cloud_cpus), cloud_threads)
    set_up: list = []                  # modes whose setup_run ran (teardown_run at the end)
    try:
        for mcls in dict.fromkeys(mode_classes):
            mcls.setup_run(run_setup)
            set_up.append(mcls)
    except BaseException:
        for mcls in reversed(set_up):
            mcls.teardown_run()
        raise
    cloud = CloudServerProcess(cfg.target, cloud_cpus, cloud_threads, cfg.auth, cfg.dtype,
                               cfg.server_kw).launch()
    records_out: list[dict] = []
    runs: list[dict] = []
    try:
        os.sched_setaffinity(0, set(edge_cpus))
        torch.set_num_threads(edge_threads)
        log(f"edge: loading draft {_name(draft_src)} on CPUs {edge_cpus} "
            f"({edge_threads} threads); cloud: target {_name(cfg.target)} on CPUs "
            f"{cloud_cpus} ({cloud_threads} threads)")
        t0 = time.perf_counter()
        if isinstance(draft_src, str):
            # a spec with an optional runtime suffix (``qwen2.5-coder-0.5b+onnx-int4``)
            from exporters.onnx.first_use import build_drafter

            base_drafter, tok = build_drafter(draft_src, dtype=cfg.dtype,
                                              threads=edge_threads, echo=log)
            if tok is None:
                from edge_sdk.models import load_tokenizer

                tok = load_tokenizer(cfg.target)
        else:
            from edge_sdk.drafters.torch import TorchDrafter

            dmodel, tok = load_source(draft_src, cfg.dtype, edge_threads)
            base_drafter = TorchDrafter(dmodel)
        draft_load_s = time.perf_counter() - t0
        # contention: only the "+slow" profile variants when the run has any, else all
        variants = any(A.split_contention(p.name)[1] for p in profiles)
        factor = (cfg.edge_slowdown if cfg.edge_slowdown > 1.0 else
                  A.DEFAULT_SLOWDOWN if variants else 1.0)
        slowed = (SlowdownDrafter(base_drafter, factor, cfg.slowdown_at_s)
                  if factor > 1.0 else base_drafter)

        def contended(pname: str) -> bool:
            return factor > 1.0 and (not variants or A.split_contention(pname)[1])

        drafter = base_drafter
        info = cloud.wait_ready()
        signer = cloud.signer()
        log(f"cloud ready on port {info['port']} (target loaded in {info['load_s']:.1f} s; "
            f"auth={'ephemeral key' if cfg.auth else 'off'})")
        cells = [(w, s) for w in prompt_sets for s in cfg.sampling]
        reqs = {(w, s): _requests(tok, prompt_sets[w], _label(w, s, cfg.sampling), cfg.seed)
                for w, s in cells}
        if cfg.warmup:
            _warmup(mode_classes, cloud, tok, drafter, signer, cfg, reqs)
        jobs = _jobs(cfg, mode_classes, profiles, cells, prompt_sets, tok, reqs)
        total = sum(len(j[5]) for j in jobs)
        default_batch = int(info.get("max_batch", cfg.server_kw.get("max_batch", 8)))
        with _progress(progress, total) as bar:
            for prof in profiles:
                with LinkEmulatorThread("127.0.0.1", info["port"], prof, seed=cfg.seed) as em:
                    stats = em.stats
                    link = (lambda st=stats: (st.uplink_bytes, st.downlink_bytes))
                    drafter = slowed if contended(prof.name) else base_drafter
                    for (_, w, s, mcls, conc, cell_reqs, max_new) in (
                            j for j in jobs if j[0] == prof.name):
                        label = _label(w, s, cfg.sampling)
                        plabel = prof.name if conc is None else P.point_label(prof.name, conc)
                        bar.describe(f"{mcls.name} | {plabel} | {label}")
                        ctx = EdgeContext(
                            f"http://127.0.0.1:{em.port}", tok,
                            drafter if mcls.needs_drafter else None, signer, prof,
                            samplings[s], max_new,
                            cfg.depth if conc is None else (cfg.concurrent_depth or cfg.depth),
                            link,
                            dict(cfg.mode_options.get(mcls.name, {})), conc or 1)
                        load = EdgeLoad(cfg.edge_load if contended(prof.name) else 0,
                                        edge_cpus, cfg.slowdown_at_s)
                        if isinstance(drafter, SlowdownDrafter):
                            drafter.restart_clock()
                        slowed0 = getattr(drafter, "slowed_calls", 0)
                        mb = None if conc is None else mcls.server_max_batch(conc, default_batch)
                        sink: dict = {}
                        before = None
                        if conc is not None:
                            if mb is not None:
                                cloud.set_max_batch(mb)
                            before = P.scrape_server(cloud.url)
                            cloud_cpu0 = P.process_cpu_s(info["pid"])
                        load.start()
                        try:
                            recs = asyncio.run(_run_cell(mcls, ctx, cell_reqs,
                                                         lambda r: bar.advance(), sink))
                        finally:
                            load.stop()
                            if conc is not None and mb is not None:
                                cloud.set_max_batch(default_batch)
                        m = _run_metrics(recs)
                        if conc is not None:
                            cloud_cpu1 = P.process_cpu_s(info["pid"])
                            P.concurrent_metrics(
                                m, [r.metrics for r in recs], concurrency=conc,
                                profile=prof.name, edge_busy_s=sink.get("edge_busy_s"),
                                server_before=before, server_after=P.scrape_server(cloud.url),
                                link_delta=sink.get("link_delta"),
                                server_max_batch=mb or default_batch,
                                edge_cpu_s=sink.get("edge_cpu_s"),
                                cloud_cpu_s=(None if cloud_cpu0 is None or cloud_cpu1 is None
                                             else cloud_cpu1 - cloud_cpu0))
                        m["draft_slowed_calls"] = getattr(drafter, "slowed_calls", 0) - slowed0
                        per = [r.metrics for r in recs]
                        m.update(A.proactive_timing(per), **A.depth_summary(per))
                        m.update(mcls.run_metrics(per))
                        for k in ("proactive_late_steps", "proactive_wasted_tokens",
                                  "proactive_drafted_tokens"):
                            m[k] = sum(p.get(k, 0) or 0 for p in per)
                        runs.append({"mode": mcls.name, "profile": plabel,
                                     "workload": label, "metrics": m})
                        for r in recs:
                            records_out.append({
                                "mode": mcls.name, "profile": plabel, "workload": label,
                                "prompt_id": r.request.prompt_id, "seed": r.request.seed,
                                "finish_reason": r.finish_reason, "token_ids": r.token_ids,
                                "output_sha": _digest(r.token_ids), "metrics": r.metrics})
    finally:
        cloud.stop()
        for mcls in reversed(set_up):
            mcls.teardown_run()
        os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)

    peer_names = {m.name for m in mode_classes if getattr(m, "peer", False)}
    divergences = greedy_divergences(
        records_out, {_label(w, "greedy", cfg.sampling) for w in prompt_sets})
    ratios = (report.compute_ratios(runs, ratio_specs([m.name for m in mode_classes]))
              + A.adaptive_ratios(runs) + P.pipeline_ratios(runs))
    config = {
        "target": _name(cfg.target), "draft": _name(draft_src),
        "modes": [m.name for m in mode_classes], "profiles": [p.to_dict() for p in profiles],
        "workloads": list(prompt_sets), "sampling": {s: samplings[s].to_dict()
                                                     for s in cfg.sampling},
        "prompts_per_workload": {w: len(p) for w, p in prompt_sets.items()},
        "max_new_tokens": cfg.max_new_tokens, "depth": cfg.depth, "seed": cfg.seed,
        "concurrent_depth": cfg.concurrent_depth or cfg.depth,
        "dtype": cfg.dtype, "auth": cfg.auth,
        "server_max_wait_s": cfg.server_kw.get("max_wait_s", 0.0),
        "cloud_cpus": cloud_cpus, "edge_cpus": edge_cpus, "cloud_threads": cloud_threads,
        "edge_threads": edge_threads, "edge_slowdown": factor,
        "slowdown_at_s": cfg.slowdown_at_s, "edge_load": cfg.edge_load,
        "contended_profiles": [p.name for p in profiles if contended(p.name)],
        "best_fixed": A.best_fixed(runs),
        "concurrency": _concurrency(cfg) if any(_is_concurrent(m) for m in mode_classes)
        else None,
        "concurrent_profiles": cfg.concurrent_profiles,
        "concurrent_workloads": cfg.concurrent_workloads,
        "concurrent_max_new_tokens": cfg.concurrent_max_new_tokens or cfg.max_new_tokens,
        "server_max_batch_default": info.get("max_batch"),
        "strongest_baseline": P.strongest_baselines(runs),
        "target_load_s": round(info["load_s"], 3), "draft_load_s": round(draft_load_s, 3),
        "greedy_outputs_identical": (None if not divergences["compared"] else
                                     divergences["identical"] == divergences["compared"]),
        "greedy_divergences": divergences,
        "bench_wall_s": round(time.perf_counter() - t_begin, 1),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "host": f"{platform.node()} ({os.cpu_count()} CPUs, python "
                f"{platform.python_version()}, torch {torch.__version__})",
    }
    if peer_names:
        from bench import peers

        config["peer_greedy_agreement"] = peers.greedy_agreement(
            records_out, {_label(w, "greedy", cfg.sampling) for w in prompt_sets},
            peer_names)
    results = {"config": config, "runs": runs, "ratios": ratios}
    report.validate_results(results)
    if out_dir is not None:
        write_outputs(results, records_out, out_dir)
    return results


def write_outputs(results: dict, records: list[dict], out_dir: str | Path) -> list[Path]:
    """Write results.json, summary.md, the plots and requests.jsonl; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [report.write_results(results, out / "results.json"),
             report.write_summary_md(results, out / "summary.md")]
    with open(paths[-1], "a", encoding="utf-8") as f:
        f.write(_extra_summary(results))
        f.write(A.summary_md(results))
        f.write(P.summary_md(results))
        if any(getattr(get_mode(m), "peer", False) for m in results["config"].get("modes", ())
               if _known_mode(m)):
            from bench import peers

            f.write(peers.summary_md(results))
    paths += report.write_plots(results, out)
    req = out / "requests.jsonl"
    with open(req, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    paths.append(req)
    return paths


def _known_mode(name: str) -> bool:
    try:
        get_mode(name)
    except ValueError:
        return False
    return True


def _extra_summary(results: dict) -> str:
    """Markdown appended to summary.md: latency breakdown and link-level bytes."""
    def ms(v):
        return "–" if v is None else f"{v * 1e3:.1f}"

    lines = ["", "## Latency breakdown (ms per committed token)", "",
             "draft = edge draft compute; verify = target compute; upload/download = link "
             "model (bytes x 8 / bandwidth + RTT/2 per exchange); wait = the rest "
             "(prefill, queueing, stalls, HTTP).", "",
             "| mode | profile | workload | " + " | ".join(report.BREAKDOWN_PHASES)
             + " | total |", "|" + "---|" * (4 + len(report.BREAKDOWN_PHASES))]
    for r in results["runs"]:
        bd = r["metrics"]["breakdown_s"]
        lines.append(f"| {r['mode']} | {r['profile']} | {r['workload']} | "
                     + " | ".join(ms(bd[p]) for p in report.BREAKDOWN_PHASES)
                     + f" | {ms(sum(bd.values()))} |")
    lines += ["", "## Bytes per committed token", "",
              "Protocol = message bodies (the shared metrics); link = every byte the link "
              "emulator carried (HTTP and signing headers included).", ""]
    lines += report.runs_table(results["runs"], [
        ("uplink_bytes_per_token", "protocol up", 1.0, "{:.1f}"),
        ("downlink_bytes_per_token", "protocol down", 1.0, "{:.1f}"),
        ("link_uplink_bytes_per_token", "link up", 1.0, "{:.1f}"),
        ("link_downlink_bytes_per_token", "link down", 1.0, "{:.1f}")])
    return "\n".join(lines) + "\n"


def _same_engine(r: dict) -> bool:
    """False for a peer engine's record (``BenchMode.peer``: other kernels, other
    numerics; outside the identity check, see ``config.peer_greedy_agreement``)."""
    try:
        return not getattr(get_mode(r["mode"]), "peer", False)
    except ValueError:          # a record of a mode this process does not know
        return True


def greedy_divergences(records: list[dict], greedy_labels: set[str]) -> dict:
    """Greedy identity with near-ties counted, per request against the reference of its
    (profile, workload, prompt): the ``cloud-ar`` record (the target alone) when there is
    one, else the first mode's.

    A diverging request is a *near-tie divergence* when, at the first differing index,
    either run's target choice was a near-tie (``near_tie_positions``: top-2 logit gap
    below ``sampling.NEAR_TIE_GAP`` of the target dtype), else a *hard divergence*
    (which would be a bug). Returns counts ``compared``, ``identical``,
    ``near_tie_divergences``, ``hard_divergences`` and up to 10 ``examples``
    (mode, profile, workload, prompt_id, index).
    """
    groups: dict[tuple, list] = {}
    for r in records:
        if r["workload"] in greedy_labels and _same_engine(r):
            groups.setdefault((r["profile"], r["workload"], r["prompt_id"]), []).append(r)
    out = {"compared": 0, "identical": 0, "near_tie_divergences": 0, "hard_divergences": 0,
           "examples": []}
    for key, rs in groups.items():
        ref = next((r for r in rs if r["mode"] == "cloud-ar"), rs[0])
        for r in rs:
            if r is ref:
                continue
            out["compared"] += 1
            i, kind = classify_divergence(
                ref["token_ids"], ref["metrics"].get("near_tie_positions") or [],
                r["token_ids"], r["metrics"].get("near_tie_positions") or [])
            if kind == "identical":
                out["identical"] += 1
                continue
            kind = f"{kind}_divergences"
            out[kind] += 1
            if len(out["examples"]) < 10:
                out["examples"].append({"mode": r["mode"], "profile": key[0],
                                        "workload": key[1], "prompt_id": key[2], "index": i,
                                        "kind": kind})
    return out


def _label(workload: str, sampling: str, all_sampling: Sequence[str]) -> str:
    """Workload label in results: the workload name, suffixed with the sampling variant
    when several variants run (``mtbench/greedy``, ``mtbench/sample``)."""
    return workload if len(all_sampling) == 1 and sampling == "greedy" else f"{workload}/{sampling}"


def _name(src) -> str:
    if isinstance(src, str):
        return src
    return getattr(src, "__qualname__", None) or getattr(getattr(src, "func", None),
                                                         "__qualname__", repr(src))


def _warmup(mode_classes, cloud, tok, drafter, signer, cfg, reqs) -> None:
    """One short, unmeasured request per mode straight to the server (warms kernels,
    allocators and HTTP connections on both sides)."""
    first = next(iter(reqs.values()))
    if not first:
        return
    req = dataclasses.replace(first[0], prompt_ids=first[0].prompt_ids[-32:])
    prof = Profile("warmup", None, None)
    for mcls in mode_classes:
        ctx = EdgeContext(cloud.url, tok, drafter if mcls.needs_drafter else None, signer,
                          prof, _sampling(cfg.sampling[0]), min(4, cfg.max_new_tokens),
                          cfg.depth, None, dict(cfg.mode_options.get(mcls.name, {})))
        asyncio.run(_run_cell(mcls, ctx, [req], None))


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
