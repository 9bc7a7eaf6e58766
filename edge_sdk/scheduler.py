"""Confirmed-prefix draft scheduler (AsymSpec §IV-C; AsymSpec §IV-C).

The edge's draft compute (one worker thread) is granted to *ready* requests: a request
is ready when its prefix is confirmed and it has no open block. A block is open from the
start of drafting until its verdict is committed. While one request's block waits for
verification, another ready request drafts. No descendant of an unresolved block is
ever drafted by this scheduler: ``draft`` refuses a request that has an open block.

Batched drafting: when the worker frees up and several ready requests wait to draft a
block on drafters that can draft together (:meth:`edge_sdk.drafters.base.Drafter.
batch_group`, e.g. forks of one onnxruntime session), up to ``max_batch`` of them are
drafted at once, one forward per draft step for all (the draft's weights read once per
step instead of once per request). Each block is sampled exactly as if drafted alone.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from edge_sdk.drafters.base import Drafter, Proposal

POLICIES = ("fifo", "fewest-tokens")


class OpenBlockError(RuntimeError):
    """A request tried to draft while it already had an open block."""


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    fn: Callable = field(compare=False)
    args: tuple = field(compare=False)
    fut: asyncio.Future = field(compare=False)
    queued: float = field(default=0.0, compare=False)

    def group(self):
        """The batch group of a ``Drafter.propose`` call, else None (runs alone)."""
        d = getattr(self.fn, "__self__", None)
        if (isinstance(d, Drafter) and getattr(self.fn, "__func__", None) is
                type(d).propose and type(d).propose is Drafter.propose):
            return d.batch_group()
        return None


class DraftScheduler:
    """Grants the single draft worker to ready requests.

    Args:
        policy: ``fifo`` (in order of becoming ready) or ``fewest-tokens`` (the ready
            request with the fewest committed tokens first: short requests finish
            sooner, long ones cannot starve since their count stops growing).
        max_batch: most blocks drafted together (1: one request at a time).
    """

    #: a batchable grant waits until no request has become ready for this long ...
    GATHER_GAP_S = 0.004
    #: ... and at most this long: the verdicts of one target pass reach the edge a
    #: few milliseconds apart, a lone draft step costs tens of milliseconds
    GATHER_MAX_S = 0.02

    def __init__(self, policy: str = "fifo", max_batch: int = 8):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if int(max_batch) < 1:
            raise ValueError("max_batch must be >= 1")
        self.policy = policy
        self.max_batch = int(max_batch)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="draft")
        self._open: set = set()
        self._jobs: list[_Job] = []       # heap
        self._busy = False
        self._seq = itertools.count()
        self.grants = 0
        self.batches: Counter = Counter()   # batched grants (> 1 block) by size: bounded
        self._last_ready = 0.0            # loop time the latest job was queued
        self._timer: asyncio.TimerHandle | None = None

    def open_blocks(self) -> int:
        return len(self._open)

    def _priority(self, committed: int) -> int:
        return committed if self.policy == "fewest-tokens" else 0

    async def draft(self, request_key, committed: int, fn: Callable, *args):
        """Open a block for ``request_key`` and run ``fn(*args)`` on the draft worker
        when granted (``fn`` a ``Drafter.propose``: possibly together with other ready
        requests' blocks). Raises OpenBlockError if the request already has an open
        block."""
        if request_key in self._open:
            raise OpenBlockError(f"request {request_key!r} already has an open block")
        self._open.add(request_key)
        try:
            job = _Job(self._priority(committed), next(self._seq), fn, args,
                       asyncio.get_running_loop().create_future())
            heapq.heappush(self._jobs, job)
            self._last_ready = job.queued = asyncio.get_running_loop().time()
            self._dispatch()
            return await job.fut
        except BaseException:
            self._open.discard(request_key)
            raise

    def close(self, request_key) -> None:
        """The request's open block was committed or aborted: it is ready again."""
        self._open.discard(request_key)

    def _limit(self) -> int:
        """Most blocks in the next grant: ``max_batch``, and at most half of the
        requests with an open block (rounded up), so that while one half drafts the
        other half's blocks are being verified (the pipeline's overlap, AsymSpec
        §IV-C; one batch of everything would leave the cloud idle while it drafts)."""
        return max(1, min(self.max_batch, -(-len(self._open) // 2)))

    def _take(self) -> list[_Job]:
        """The next grant: the first waiting job, with the other waiting jobs of its
        batch group (in priority order, up to ``max_batch``)."""
        while self._jobs:
            first = heapq.heappop(self._jobs)
            if not first.fut.cancelled():
                break
        else:
            return []
        g, limit = first.group(), self._limit()
        if g is None or limit == 1:
            return [first]
        batch, rest = [first], []
        while self._jobs and len(batch) < limit:
            j = heapq.heappop(self._jobs)
            if j.fut.cancelled():
                continue
            (batch if j.group() == g else rest).append(j)
        for j in rest:
            heapq.heappush(self._jobs, j)
        return batch

    def _gather_until(self) -> float | None:
        """Loop time to hold the free worker until, so that requests whose verdicts
        are arriving join the next batch; None: grant now. Held only when the first
        waiting job can be batched and a request with an open block is not queued yet
        (one request alone is never held)."""
        live = [j for j in self._jobs if not j.fut.cancelled()]
        if (not live or len(live) >= self._limit() or len(self._open) <= len(live)
                or min(live).group() is None):
            return None
        first = min(j.queued for j in live)
        until = min(self._last_ready + self.GATHER_GAP_S, first + self.GATHER_MAX_S)
        return until if until > asyncio.get_running_loop().time() else None

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy:
            return
        until = self._gather_until()
        if until is not None:
            self._timer = asyncio.get_running_loop().call_at(until, self._dispatch)
            return
        batch = self._take()
        if batch:
            self._busy = True
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.grants += len(batch)
            try:
                if len(batch) == 1:
                    call = (batch[0].fn, *batch[0].args)
                else:
                    self.batches[len(batch)] += 1
                    drafters = [j.fn.__self__ for j in batch]
                    proposals = [Proposal(*j.args) for j in batch]
                    call = (type(drafters[0]).propose_many, drafters, proposals)
                res = await loop.run_in_executor(self.executor, *call)
                results = [res] if len(batch) == 1 else res
            except Exception as e:  # noqa: BLE001 - handed to every waiter
                results = [e] * len(batch)
            for j, r in zip(batch, results):
                if j.fut.done():
                    continue
                if isinstance(r, BaseException):
                    j.fut.set_exception(r)
                else:
                    j.fut.set_result(r)
        finally:
            self._busy = False
            self._dispatch()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)
