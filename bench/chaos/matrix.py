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
straight to the server (no proxy) before the faulted runs. The client retries per
:class:`ChaosSettings`: a per-request timeout (``timeout_s``), ``retries`` transport
retries, then the ``wait`` cloud-loss policy for up to ``offline_timeout_s``.
Scoring: :mod:`bench.chaos.score`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from bench.chaos.faults import Fault
from bench.chaos.proxy import FaultProxy
from bench.chaos.score import Row, RunOutcome

__all__ = ["CLIENT_MODES", "ChaosSettings", "Server", "run_matrix"]

CLIENT_MODES = {"stop-and-wait": {},
                "ipdg+ahead": {"proactive": "ipdg", "send_ahead": True},
                "pipeline-8": {}}
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
    return EdgeClient(url, drafter, tok, depth=s.depth, chat=False, transport=t,
                      offline_timeout_s=offline_timeout_s or s.offline_timeout_s,
                      probe_interval_s=0.2, **CLIENT_MODES[mode], **s.client_kw)


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
                      fault: Fault | None) -> list[tuple[list, BaseException | None, int, int]]:
    """The sequential runs of ``mode``: each through a fresh proxy with ``fault``
    (None: straight to the server). Returns (tokens, error, passes, faults injected)
    per run."""
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
        out.append((toks, err, srv.passes() - p0, proxy.stats.fired if proxy else 0))
    return out


async def _pipeline(srv: Server, drafter, tok, s: ChaosSettings, sampling,
                    fault: Fault | None) -> list[tuple[list, BaseException | None, None, int]]:
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
    fired = proxy.stats.fired if proxy else 0
    return [(t, e, None, fired if i == 0 else 0) for i, (t, e) in enumerate(got)]


def _cell(srv, drafter, tok, s, mode, sampling, fault):
    if mode == "pipeline-8":
        return asyncio.run(_pipeline(srv, drafter, tok, s, sampling, fault))
    return asyncio.run(_sequential(srv, drafter, tok, s, mode, sampling, fault))


def references(srv: Server, drafter, tok, s: ChaosSettings) -> dict:
    """(sampling name, mode) -> the fault-free runs. Raises RuntimeError when a
    reference run fails (nothing to compare with)."""
    refs = {}
    for sname, cfg in s.samplings.items():
        for mode in s.modes:
            runs = _cell(srv, drafter, tok, s, mode, cfg, None)
            bad = [e for _, e, _, _ in runs if e is not None]
            if bad:
                raise RuntimeError(f"reference run ({sname}, {mode}) failed: {bad[0]!r}")
            refs[sname, mode] = runs
    return refs


def run_fault(srv: Server, drafter, tok, s: ChaosSettings, fault: Fault, refs: dict,
              log: Callable[[str], None] = lambda m: None) -> Row:
    """One row: ``fault`` over every sampling variant and mode, scored against
    ``refs`` (:func:`references`)."""
    row = Row(fault.name, note=fault.note)
    for sname, cfg in s.samplings.items():
        for mode in s.modes:
            t0 = time.perf_counter()
            runs = _cell(srv, drafter, tok, s, mode, cfg, fault)
            log(f"chaos: {fault.name} / {sname} / {mode}: {time.perf_counter() - t0:.1f} s")
            for (toks, err, passes, fired), (rtoks, _, rpasses, _) in zip(
                    runs, refs[sname, mode]):
                row.add(RunOutcome(toks, err, rtoks, passes,
                                   rpasses if passes is not None else None))
                row.injected += fired
    return row


def run_matrix(srv: Server, drafter, tok, s: ChaosSettings, faults: Sequence[Fault],
               log: Callable[[str], None] = lambda m: None) -> list[Row]:
    """Every row of ``faults`` (references first). Returns the rows in order."""
    refs = references(srv, drafter, tok, s)
    return [run_fault(srv, drafter, tok, s, f, refs, log) for f in faults]
