"""Confirmed-prefix draft scheduler (AsymSpec §IV-C; AsymSpec §IV-C).

The edge's draft compute (one worker thread) is granted to *ready* requests: a request
is ready when its prefix is confirmed and it has no open block. A block is open from the
start of drafting until its verdict is committed. While one request's block waits for
verification, another ready request drafts. No descendant of an unresolved block is
ever drafted by this scheduler: ``draft`` refuses a request that has an open block.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

POLICIES = ("fifo", "fewest-tokens")


class OpenBlockError(RuntimeError):
    """A request tried to draft while it already had an open block."""


class DraftScheduler:
    """Grants the single draft worker to ready requests.

    Args:
        policy: ``fifo`` (in order of becoming ready) or ``fewest-tokens`` (the ready
            request with the fewest committed tokens first: short requests finish
            sooner, long ones cannot starve since their count stops growing).
    """

    def __init__(self, policy: str = "fifo"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.policy = policy
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="draft")
        self._open: set = set()
        self._waiting: list = []          # heap of (priority, seq, future)
        self._busy = False
        self._seq = itertools.count()
        self.grants = 0

    def open_blocks(self) -> int:
        return len(self._open)

    def _priority(self, committed: int) -> int:
        return committed if self.policy == "fewest-tokens" else 0

    async def draft(self, request_key, committed: int, fn: Callable, *args):
        """Open a block for ``request_key`` and run ``fn(*args)`` on the draft worker
        when granted. Raises OpenBlockError if the request already has an open block."""
        if request_key in self._open:
            raise OpenBlockError(f"request {request_key!r} already has an open block")
        self._open.add(request_key)
        try:
            await self._acquire(self._priority(committed))
            try:
                self.grants += 1
                return await asyncio.get_running_loop().run_in_executor(self.executor, fn,
                                                                         *args)
            finally:
                self._release()
        except BaseException:
            self._open.discard(request_key)
            raise

    def close(self, request_key) -> None:
        """The request's open block was committed or aborted: it is ready again."""
        self._open.discard(request_key)

    async def _acquire(self, priority: int) -> None:
        if not self._busy and not self._waiting:
            self._busy = True
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()          # granted while being cancelled: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)     # hand over; stays busy
                return
        self._busy = False

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)
