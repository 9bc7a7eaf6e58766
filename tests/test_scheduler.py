"""Confirmed-prefix scheduler (SPEC §3): at most one open block per request, no token lost
or duplicated, whatever the arrival and verification order."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_api.service import CloudService
from cloud_api.inprocess import InProcessTransport
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.scheduler import DraftScheduler, OpenBlockError

PROMPTS = [[2 + i, 9, 4 + 2 * i] for i in range(6)]


class DelayedTransport(InProcessTransport):
    """In-process transport whose answers arrive after scripted delays (seconds)."""

    def __init__(self, svc, delays):
        super().__init__(svc)
        self.delays, self.i = delays, 0

    async def request(self, method, path, body=b"", content_type=""):
        d = self.delays[self.i % len(self.delays)]
        self.i += 1
        await asyncio.sleep(d)
        return await super().request(method, path, body)


class CheckedScheduler(DraftScheduler):
    """Records the open-block sets it sees; asserts the invariant on every grant."""

    def __init__(self, policy):
        super().__init__(policy)
        self.max_open = 0

    async def draft(self, key, committed, fn, *args):
        out = await super().draft(key, committed, fn, *args)
        assert key in self._open
        self.max_open = max(self.max_open, self.open_blocks())
        return out


@pytest.fixture(scope="module")
def references(target, tok):
    svc = CloudService(target, tok)

    async def main():
        async with EdgeClient("inproc://", None, tok, chat=False,
                              transport=InProcessTransport(svc)) as c:
            return [(await c.generate(prompt_ids=p, max_new_tokens=16)).token_ids
                    for p in PROMPTS]

    return asyncio.run(main())


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(delays=st.lists(st.floats(0, 0.004), min_size=1, max_size=9),
       starts=st.lists(st.floats(0, 0.01), min_size=len(PROMPTS), max_size=len(PROMPTS)),
       depths=st.lists(st.integers(1, 8), min_size=len(PROMPTS), max_size=len(PROMPTS)),
       policy=st.sampled_from(["fifo", "fewest-tokens"]))
def test_random_orders_keep_invariants(target, draft, tok, references, delays, starts,
                                       depths, policy):
    svc = CloudService(target, tok)
    sched = CheckedScheduler(policy)

    async def one(client, p, start, depth):
        await asyncio.sleep(start)
        return await client.generate(prompt_ids=p, max_new_tokens=16, depth=depth)

    async def main():
        async with EdgeClient("inproc://", TorchDrafter(draft), tok, chat=False,
                              scheduler=sched, transport=DelayedTransport(svc, delays)) as c:
            return await asyncio.gather(*(one(c, p, s, d)
                                          for p, s, d in zip(PROMPTS, starts, depths)))

    outs = asyncio.run(main())
    sched.shutdown()
    assert [o.token_ids for o in outs] == references      # nothing lost or duplicated
    assert sched.open_blocks() == 0
    assert sched.max_open <= len(PROMPTS)


def test_second_open_block_is_refused():
    sched = DraftScheduler()

    async def main():
        key = object()
        await sched.draft(key, 0, lambda: None)
        with pytest.raises(OpenBlockError):
            await sched.draft(key, 0, lambda: None)
        sched.close(key)
        await sched.draft(key, 0, lambda: None)       # ready again after commit

    asyncio.run(main())
    sched.shutdown()


def test_pipeline_overlaps_drafting_with_verification(target, draft, tok):
    """While one request waits for its verdict another drafts: with slow verification
    several blocks are open at once."""
    svc = CloudService(target, tok)
    sched = CheckedScheduler("fifo")

    async def main():
        async with EdgeClient("inproc://", TorchDrafter(draft), tok, chat=False, depth=3,
                              scheduler=sched, transport=DelayedTransport(svc, [0.01])) as c:
            await asyncio.gather(*(c.generate(prompt_ids=p, max_new_tokens=8)
                                   for p in PROMPTS[:4]))

    asyncio.run(main())
    sched.shutdown()
    assert sched.max_open >= 3
