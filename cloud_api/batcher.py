"""Global verification queue: blocks of all sessions are batched as they arrive
(AsymSpec §IV-C)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor


class VerifyQueue:
    """Collects (session, request) pairs; a worker hands the verifier batches of up to
    ``max_batch`` items, waiting at most ``max_wait_s`` seconds for more after the first.
    ``on_batch(size)`` is called for every batch (metrics).
    Batches are formed from whatever is available, independently of arrival grouping.
    """

    def __init__(self, verifier, executor: Executor, max_batch: int = 8,
                 max_wait_s: float = 0.0, on_batch=None):
        self.verifier, self.executor, self.on_batch = verifier, executor, on_batch
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self._q: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.batch_sizes: list[int] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, session, req, sink=None):
        """Queue one block; returns its VerifyResponse or raises its ApiError.
        ``sink(EarlyVerdict)``: called on the target thread with the block's early
        verdict, when the verifier has an early exit (FSD)."""
        fut = asyncio.get_running_loop().create_future()
        await self._q.put((session, req, fut, sink))
        res = await fut
        if isinstance(res, BaseException):
            raise res
        return res

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._q.get()]
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                try:
                    batch.append(self._q.get_nowait() if timeout <= 0 else
                                 await asyncio.wait_for(self._q.get(), timeout))
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
            self.batch_sizes.append(len(batch))
            if self.on_batch is not None:
                self.on_batch(len(batch))
            items = [(s, r) for s, r, *_ in batch]
            sinks = [k for *_, k in batch]
            extra = (sinks,) if any(k is not None for k in sinks) else ()
            try:
                results = await loop.run_in_executor(
                    self.executor, self.verifier.verify_batch, items, *extra)
            except Exception as e:  # noqa: BLE001 - hand the failure to every waiter
                results = [e] * len(batch)
            for (_, _, fut, _), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)
