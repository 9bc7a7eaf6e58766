"""Concurrent modes: C requests in flight from one edge (``ctx.concurrency``), one
shared draft worker, reported under the profile label ``<profile>@c<C>``
(:mod:`bench.report.labels`).

* ``pipeline`` — AsymSpec's confirmed-prefix pipeline (§IV-C): one client/scheduler,
  cloud re-batching;
* ``no-pipeline``, ``runahead`` (NPDG), ``standard-sd-concurrent`` — the baselines:
  requests run independently, no cross-request re-batching;
* ``pipeline-standard`` — ablation: the pipeline with the full-q standard protocol.
* ``pipeline-ipdg`` — ablation: the pipeline whose requests also draft ahead (IPDG).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from bench.modes.base import BenchMode, BenchRequest, EdgeContext, RequestRecord
from bench.modes.measure import REQUEST_CALLS, HttpCall, TaggingTransport, breakdown
from bench.modes.registry import register_mode

__all__ = ["BusyExecutor", "ConcurrentMode", "PipelineMode", "NoPipelineMode",
           "RunaheadMode", "StandardSDConcurrentMode", "PipelineStandardMode",
           "PipelineAheadMode"]


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


@dataclass
class _Lane:
    """One request slot of a concurrent run: the client its requests go through."""

    client: object
    own: bool = True            # close the client with the mode


class ConcurrentMode(BenchMode):
    """C requests in flight at once (``ctx.concurrency``) from one edge.

    :meth:`run` keeps C *lanes* busy: each lane takes the next request as soon as its
    previous one finishes (a closed loop; the runner gives a cell whole waves of C
    requests). All draft compute of the run goes through ONE single-thread worker
    (:class:`BusyExecutor`: the edge core, its busy seconds give
    the edge utilisation). Each request's metrics carry ``start_s``/``end_s`` (one clock)
    so ``report.aggregate`` computes throughput over the makespan.

    Subclasses choose the client layout (:meth:`_make_lanes`) and the cloud's max batch
    during their runs (:meth:`server_max_batch`; the runner applies it).
    """

    concurrent: ClassVar[bool] = True
    client_kw: ClassVar[dict] = {}

    def __init__(self, ctx: EdgeContext):
        super().__init__(ctx)
        self.concurrency = max(1, int(ctx.concurrency or 1))
        self.worker = None
        self.lanes: list[_Lane] = []
        self.cell_metrics: dict = {}

    @classmethod
    def server_max_batch(cls, concurrency: int, default: int) -> int | None:
        """Blocks per target pass the cloud may batch during a run at ``concurrency``
        (``default``: the server's configured value). None leaves it unchanged."""
        return None

    def _client(self, drafter, scheduler=None, **extra):
        from edge_sdk.client import EdgeClient

        c = self.ctx
        kw = {"depth": c.depth, "proactive": "off", "controller": "fixed", "siblings": 0,
              **self.client_kw,
              **extra, **c.options.get("client", {})}
        return EdgeClient(c.base_url, drafter, c.tokenizer, signer=c.signer, chat=False,
                          transport=TaggingTransport(c.base_url, signer=c.signer),
                          scheduler=scheduler, **kw)

    async def _make_lanes(self) -> list[_Lane]:
        raise NotImplementedError

    async def open(self) -> None:
        self.worker = BusyExecutor()
        self.lanes = await self._make_lanes()

    async def close(self) -> None:
        for lane in self.lanes:
            if lane.own:
                await lane.client.close()
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        return await self._run_on(self.lanes[0], req)

    async def _run_on(self, lane: _Lane, req: BenchRequest) -> RequestRecord:
        c = self.ctx
        calls: list[HttpCall] = []
        token = REQUEST_CALLS.set(calls)
        try:
            t0 = time.perf_counter()
            trace: list[dict] = []
            res = await lane.client.generate(prompt_ids=list(req.prompt_ids),
                                             sampling=c.sampling, on_round=trace.append,
                                             max_new_tokens=c.max_new_tokens, seed=req.seed)
            t1 = time.perf_counter()
        finally:
            REQUEST_CALLS.reset(token)
        m = dict(res.metrics, round_trace=trace)
        m.update(start_s=t0, end_s=t1, http_exchanges=len(calls),
                 prompt_tokens=len(req.prompt_ids))
        return RequestRecord(req, m, list(res.token_ids), res.text, res.finish_reason)

    async def run(self, reqs: Sequence[BenchRequest],
                  on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Run ``reqs`` with at most C in flight; records in request order."""
        c = self.ctx
        out: list[RequestRecord | None] = [None] * len(reqs)
        todo = iter(enumerate(reqs))
        busy0, cpu0 = self.worker.busy_s, time.process_time()
        link0 = c.link_bytes() if c.link_bytes else None

        async def lane_loop(lane: _Lane) -> None:
            for i, r in todo:          # one event loop: lanes share the iterator safely
                out[i] = rec = await self._run_on(lane, r)
                if on_done:
                    on_done(rec)

        tasks = [asyncio.ensure_future(lane_loop(lane)) for lane in self.lanes]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        recs = [r for r in out if r is not None]
        self.cell_metrics = {"edge_busy_s": self.worker.busy_s - busy0,
                             "edge_cpu_s": time.process_time() - cpu0}
        # link bytes: the emulator counts the whole run; each request gets the share of
        # the run's link bytes its message bodies carried (for its latency breakdown)
        body_up = sum(r.metrics["uplink_bytes"] for r in recs) or 1
        body_down = sum(r.metrics["downlink_bytes"] for r in recs) or 1
        if link0 is not None:
            up1, down1 = c.link_bytes()
            link_up, link_down = up1 - link0[0], down1 - link0[1]
            self.cell_metrics["link_delta"] = (link_up, link_down)
        for r in recs:
            m = r.metrics
            if link0 is not None:
                up = round(link_up * m["uplink_bytes"] / body_up)
                down = round(link_down * m["downlink_bytes"] / body_down)
            else:
                up, down = m["uplink_bytes"], m["downlink_bytes"]
            m.update(link_uplink_bytes=up, link_downlink_bytes=down,
                     breakdown_s=breakdown(m["wall_s"], m["draft_seconds"],
                                           m["target_seconds"], m["http_exchanges"], up, down,
                                           c.profile))
        return recs


@register_mode
class PipelineMode(ConcurrentMode):
    """AsymSpec's confirmed-prefix pipeline (AsymSpec §IV-C): C concurrent requests through ONE
    :class:`edge_sdk.EdgeClient` — its :class:`~edge_sdk.scheduler.DraftScheduler`
    grants the single draft worker to *ready* requests (confirmed prefix, no open block;
    at most one open block per request, never a descendant of an unresolved block), so
    while one request's block waits for verification another drafts; ready requests on
    forks of one ONNX draft draft together (one draft forward per step, at most half of
    the requests with an open block per grant). Compact asym
    protocol, fixed depth. The cloud re-batches whatever blocks have arrived: max batch
    >= C. ``ctx.options["policy"]``: scheduler policy (``fifo`` / ``fewest-tokens``)."""

    name = "pipeline"
    description = ("confirmed-prefix pipeline: C requests on one client/scheduler, "
                   "cloud re-batching (max batch >= C)")
    baseline = False
    client_mode: ClassVar[str] = "asym"

    @classmethod
    def server_max_batch(cls, concurrency: int, default: int) -> int:
        return max(int(concurrency), 1)

    async def _make_lanes(self) -> list[_Lane]:
        from edge_sdk.scheduler import DraftScheduler

        sched = DraftScheduler(self.ctx.options.get("policy", "fifo"))
        sched.executor.shutdown(wait=False)
        sched.executor = self.worker            # the run's one (timed) draft worker
        client = self._client(self.ctx.drafter, sched, mode=self.client_mode)
        return [_Lane(client)] + [_Lane(client, own=False)
                                  for _ in range(self.concurrency - 1)]


class _IndependentMode(ConcurrentMode):
    """C independent stop-and-wait requests: each lane its own client, scheduler and
    drafter fork (shared weights, own KV cache), but every draft forward runs on the
    run's ONE draft worker (the edge has one core), first come first served. Nothing
    coordinates the requests: there is no ready-request scheduling across them, and the
    cloud's cross-request batching is set by :attr:`max_batch` (``"C"``: max batch = C;
    an int: that value)."""

    client_mode: ClassVar[str] = "asym"
    max_batch: ClassVar[object] = 1

    @classmethod
    def server_max_batch(cls, concurrency: int, default: int) -> int:
        return max(int(concurrency), 1) if cls.max_batch == "C" else int(cls.max_batch)

    async def _make_lanes(self) -> list[_Lane]:
        from edge_sdk.scheduler import DraftScheduler

        lanes = []
        for i in range(self.concurrency):
            sched = DraftScheduler()
            sched.executor.shutdown(wait=False)
            sched.executor = self.worker
            d = self.ctx.drafter if i == 0 else self.ctx.drafter.fork()
            lanes.append(_Lane(self._client(d, sched, mode=self.client_mode)))
        return lanes


@register_mode
class NoPipelineMode(_IndependentMode):
    """Baseline without the confirmed-prefix pipeline (AsymSpec's "No pipeline"
    ablation): C requests, each stop-and-wait on its own client, compact asym protocol,
    fixed depth; the edge's draft compute is serialised on one shared worker (a request
    drafts whenever the worker is free, so one request may still draft while another's
    block is in flight — what is removed is the coordinated pipeline); the cloud verifies
    each block on its own (server max batch 1: no cross-request re-batching)."""

    name = "no-pipeline"
    description = ("baseline: C independent stop-and-wait requests, one shared draft "
                   "worker, no cloud batching (max batch 1)")
    baseline = True
    max_batch = 1


@register_mode
class RunaheadMode(_IndependentMode):
    """Same-request runahead baseline (AsymSpec's "No pipeline + runahead"): as
    ``no-pipeline`` (independent clients, one shared draft worker, max batch 1), and
    while a request's block is in flight it drafts its next block from the *assumed*
    prefix (block fully accepted + the draft's guess of the bonus token) — the client's
    ``proactive="npdg"`` (run to the planned depth, kept on a hit, discarded on a miss).
    Discarded tokens: ``runahead_wasted_tokens`` (and ``proactive_hit_rate``)."""

    name = "runahead"
    description = ("baseline: no-pipeline + same-request runahead (NPDG from the assumed "
                   "prefix; misses counted as wasted)")
    baseline = True
    max_batch = 1
    client_kw = {"proactive": "npdg"}


@register_mode
class StandardSDConcurrentMode(_IndependentMode):
    """``standard-sd`` at concurrency C: canonical edge-cloud speculative decoding for C
    users — C independent stop-and-wait requests with the standard protocol (full draft
    distribution q uploaded per position, cloud draws the corrections), one shared draft
    worker, each block verified on its own (max batch 1: cross-request re-batching is
    the pipeline's mechanism, AsymSpec §IV-C2; see ``pipeline-standard`` for the
    pipeline with this protocol)."""

    name = "standard-sd-concurrent"
    description = ("baseline: standard-sd with C concurrent requests (full q uplink, "
                   "one shared draft worker, no cloud batching)")
    baseline = True
    client_mode = "standard"
    max_batch = 1


@register_mode
class PipelineStandardMode(PipelineMode):
    """Ablation: the confirmed-prefix pipeline (one client/scheduler, cloud re-batching,
    max batch >= C) with the *standard* protocol (full q per draft position on the
    uplink, cloud-drawn corrections) instead of the compact asymmetric one — what the
    pipeline gains without AsymSpec's protocol (AsymSpec Table II, "No asymmetric
    correction"). Not a baseline: it uses the pipeline's own mechanisms."""

    name = "pipeline-standard"
    description = ("ablation: the pipeline with the standard full-q protocol (cloud "
                   "re-batching, max batch >= C)")
    baseline = False
    client_mode = "standard"


@register_mode
class PipelineAheadMode(PipelineMode):
    """Ablation: the confirmed-prefix pipeline whose requests also draft ahead (RAPID's
    IPDG: the next block drafted on the assumed full acceptance while the current one is
    verified, sent before the verdict): the proactive steps share the one draft worker
    with the other requests' confirmed-prefix grants. Not a baseline."""

    name = "pipeline-ipdg"
    description = ("ablation: the pipeline + IPDG with blocks sent ahead (proactive steps "
                   "on the shared draft worker)")
    baseline = False
    client_kw = {"proactive": "ipdg", "send_ahead": True}
