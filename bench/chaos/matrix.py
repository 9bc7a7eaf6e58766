"""Running the link-fault matrix: every fault x sampling variant x client mode, each run
compared with the same request without faults.

Layout (one process)::

    EdgeClient ──▶ FaultProxy (this event loop) ──▶ verification API (signed,
    (drafter)                                       BackgroundServer thread, target)

Client modes (:data:`CLIENT_MODES`): ``stop-and-wait``; ``ipdg+ahead`` (IPDG proactive
drafting with blocks sent ahead, the CLI default: two verify requests of one session in
flight); ``pipeline-8`` (8 concurrent requests on ONE :class:`edge_sdk.EdgeClient`,
its draft scheduler shared, the cloud batching their blocks). A sequential run gets a
fresh proxy (so every run is hit by the row's fault); the 8 requests of a pipeline
share one proxy (the fault hits the pipeline's k-th request).

The reference of each (sampling, mode, request) is the same request, same seed, sent
straight to the server (no proxy) before the faulted runs. Rows on ``correction``
requests run the sampling variants only (greedy never asks for a correction) with
:data:`~bench.chaos.faults.CORRECTION_CLIENT` on top of ``client_kw``; their references
(keyed ``(sampling, mode, "correction")``) are made with the same options, before the
first such row. The client retries per
:class:`ChaosSettings`: a per-request timeout (``timeout_s``), ``retries`` transport
retries, then the ``wait`` cloud-loss policy for up to ``offline_timeout_s``.
Scoring: :mod:`bench.chaos.score`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence

from bench.chaos.faults import CORRECTION_CLIENT, Fault
from bench.chaos.proxy import FaultProxy
from bench.chaos.score import Row, RunOutcome

__all__ = ["CLIENT_MODES", "ChaosSettings", "Server", "run_matrix", "references",
           "run_fault"]

CLIENT_MODES = {"stop-and-wait": {"proactive": "off"},
                "ipdg+ahead": {"proactive": "ipdg", "send_ahead": True},
                "pipeline-8": {"proactive": "off"}}
PIPELINE = 8


@dataclass
class ChaosSettings:
    """How the matrix runs. Lengths in tokens, times in seconds.

    prompts: prompt token ids of the sequential runs (one run each, per sampling
    variant and mode); pipeline_prompts: the pipeline's 8 requests (None: ``prompts``
    repeated). samplings: name -> ``SamplingConfig``. Request ``i`` is seeded
    ``seed + i``.
    """

    prompts: list
    samplings: dict
    max_new_tokens: int = 24
    depth: int = 4
    seed: int = 0
    timeout_s: float = 3.0
    retries: int = 2
    offline_timeout_s: float = 60.0
    modes: Sequence[str] = tuple(CLIENT_MODES)
    pipeline_prompts: list | None = None
    client_kw: dict = field(default_factory=dict)


@dataclass
class Server:
    """The API under test: its ``url``, request ``signer`` (or None) and a callable
    returning the target passes run so far (``passes``)."""

    url: str
    signer: object
    passes: Callable[[], int]


@dataclass
class _Job:
    prompt: list
    seed: int


class _Run(NamedTuple):
    """One request of a cell: token ids streamed, the exception it ended with (None:
    finished), target passes (None: not attributed), faults injected and requests of
    the fault's target seen by its proxy (a pipeline's are on its first request)."""

    tokens: list
    error: BaseException | None
    passes: int | None
    fired: int = 0
    seen: int = 0


def profile(fault: Fault | None) -> str:
    """The client profile of a row: ``correction`` (:data:`CORRECTION_CLIENT`, sampling
    only) for a fault on correction requests, else ``""`` (the matrix's client)."""
    return "correction" if fault is not None and fault.target == "correction" else ""


def _profiled(s: ChaosSettings, prof: str) -> ChaosSettings:
    """``s`` for the client profile ``prof``: ``correction`` drops the greedy variants
    and adds :data:`CORRECTION_CLIENT` to the client's options."""
    if not prof:
        return s
    return replace(s, samplings={k: c for k, c in s.samplings.items() if not c.greedy},
                   client_kw={**s.client_kw, **CORRECTION_CLIENT})


def _jobs(s: ChaosSettings, mode: str) -> list[_Job]:
    if mode == "pipeline-8":
        ps = s.pipeline_prompts or [s.prompts[i % len(s.prompts)] for i in range(PIPELINE)]
        return [_Job(list(p), s.seed + i) for i, p in enumerate(ps[:PIPELINE])]
    return [_Job(list(p), s.seed + i) for i, p in enumerate(s.prompts)]


def _client(url: str, srv: Server, drafter, tok, s: ChaosSettings, mode: str,
            offline_timeout_s: float | None = None):
    from edge_sdk.client import EdgeClient
    from edge_sdk.transport import Transport

    t = Transport(url, signer=srv.signer, retries=s.retries, timeout_s=s.timeout_s,
                  backoff_s=0.05)
    kw = {"controller": "fixed", **CLIENT_MODES[mode], **s.client_kw}
    return EdgeClient(url, drafter, tok, depth=s.depth, chat=False, transport=t,
                      offline_timeout_s=offline_timeout_s or s.offline_timeout_s,
                      probe_interval_s=0.2, **kw)


async def _one(client, job: _Job, sampling, n: int) -> tuple[list, BaseException | None]:
    """Stream one request; (token ids streamed, the exception it ended with or None)."""
    gen = client.stream(prompt_ids=job.prompt, max_new_tokens=n, sampling=sampling,
                        seed=job.seed)
    toks: list = []
    try:
        async for ev in gen:
            toks.append(ev.token_id)
    except Exception as e:  # noqa: BLE001 - scored: documented or not
        return toks, e
    return toks, None


async def _sequential(srv: Server, drafter, tok, s: ChaosSettings, mode: str, sampling,
                      fault: Fault | None) -> list[_Run]:
    """The sequential runs of ``mode``: each through a fresh proxy with ``fault``
    (None: straight to the server)."""
    out = []
    for job in _jobs(s, mode):
        proxy = FaultProxy(srv.url, fault) if fault is not None else None
        url = (await proxy.start()).url if proxy else srv.url
        p0 = srv.passes()
        try:
            async with _client(url, srv, drafter, tok, s, mode,
                               fault.offline_timeout_s if fault else None) as c:
                toks, err = await _one(c, job, sampling, s.max_new_tokens)
        finally:
            if proxy:
                await proxy.stop()
        out.append(_Run(toks, err, srv.passes() - p0, *_counts(proxy)))
    return out


def _counts(proxy: FaultProxy | None) -> tuple[int, int]:
    """(faults injected, requests of the fault's target seen) of ``proxy``."""
    if proxy is None:
        return 0, 0
    return proxy.stats.fired, proxy.plan.seen[proxy.plan.fault.target]


async def _pipeline(srv: Server, drafter, tok, s: ChaosSettings, sampling,
                    fault: Fault | None) -> list[_Run]:
    """The pipeline's 8 concurrent requests on one client (one proxy with ``fault``);
    passes are not attributed per request (blocks share batched passes)."""
    proxy = FaultProxy(srv.url, fault) if fault is not None else None
    url = (await proxy.start()).url if proxy else srv.url
    try:
        async with _client(url, srv, drafter, tok, s, "pipeline-8",
                           fault.offline_timeout_s if fault else None) as c:
            got = await asyncio.gather(*[_one(c, j, sampling, s.max_new_tokens)
                                         for j in _jobs(s, "pipeline-8")])
    finally:
        if proxy:
            await proxy.stop()
    counts = _counts(proxy)
    return [_Run(t, e, None, *(counts if i == 0 else (0, 0))) for i, (t, e) in enumerate(got)]


def _cell(srv, drafter, tok, s, mode, sampling, fault) -> list[_Run]:
    if mode == "pipeline-8":
        return asyncio.run(_pipeline(srv, drafter, tok, s, sampling, fault))
    return asyncio.run(_sequential(srv, drafter, tok, s, mode, sampling, fault))


def references(srv: Server, drafter, tok, s: ChaosSettings, prof: str = "",
               into: dict | None = None) -> dict:
    """The fault-free runs of the client profile ``prof`` (:func:`profile`) for every
    sampling variant and mode of ``s``, added to ``into`` (or a new dict; the keys it
    holds already are not run again) and returned: keyed by :func:`ref_key`. Raises
    RuntimeError when a reference run fails (nothing to compare with)."""
    refs = {} if into is None else into
    ps = _profiled(s, prof)
    for sname, cfg in ps.samplings.items():
        for mode in ps.modes:
            if ref_key(sname, mode, prof) in refs:
                continue
            runs = _cell(srv, drafter, tok, ps, mode, cfg, None)
            bad = [r.error for r in runs if r.error is not None]
            if bad:
                raise RuntimeError(f"reference run ({sname}, {mode}) failed: {bad[0]!r}")
            refs[ref_key(sname, mode, prof)] = runs
    return refs


def ref_key(sname: str, mode: str, prof: str = "") -> tuple:
    """The key of a reference: (sampling name, mode), plus the client profile when it
    is not the matrix's own (``(sampling, mode, "correction")``)."""
    return (sname, mode, prof) if prof else (sname, mode)


def run_fault(srv: Server, drafter, tok, s: ChaosSettings, fault: Fault, refs: dict,
              log: Callable[[str], None] = lambda m: None) -> Row:
    """One row: ``fault`` over every sampling variant and mode of its client profile
    (:func:`profile`), scored against ``refs`` (:func:`references`; missing ones are
    made first, without faults, and added to ``refs``)."""
    prof = profile(fault)
    ps = _profiled(s, prof)
    row = Row(fault.name, note=fault.note, target=fault.target,
              expect_hits=fault.kind != "none")
    if not ps.samplings:
        row.note = "not run: greedy only (greedy never asks for a correction)"
        return row
    references(srv, drafter, tok, s, prof, refs)          # the missing ones, first
    for sname, cfg in ps.samplings.items():
        for mode in ps.modes:
            t0 = time.perf_counter()
            runs = _cell(srv, drafter, tok, ps, mode, cfg, fault)
            log(f"chaos: {fault.name} / {sname} / {mode}: {time.perf_counter() - t0:.1f} s")
            for run, ref in zip(runs, refs[ref_key(sname, mode, prof)]):
                row.add(RunOutcome(run.tokens, run.error, ref.tokens, run.passes,
                                   ref.passes if run.passes is not None else None))
                row.injected += run.fired
                row.seen += run.seen
    return row


def run_matrix(srv: Server, drafter, tok, s: ChaosSettings, faults: Sequence[Fault],
               log: Callable[[str], None] = lambda m: None) -> list[Row]:
    """Every row of ``faults`` (the references of a client profile before its first
    row). Returns the rows in order."""
    refs: dict = {}
    return [run_fault(srv, drafter, tok, s, f, refs, log) for f in faults]
