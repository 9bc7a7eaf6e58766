"""Target steps while the draft model is still prefilling the prompt (``prefill_steps``):
on a busy device the draft's prefill can outlast the target's, and the request then
takes target steps instead of waiting, speculating from the round after the draft is
ready. Through the real server with the tiny pair; the device's slowness is a delay on
the draft's cold prefill (the bench emulates contention the same way)."""

from __future__ import annotations

import asyncio
import threading
import time

from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.torch import TorchDrafter

PROMPT = [5, 9, 11]
PREFILL_S = 0.6


class SlowPrefill(TorchDrafter):
    """A draft whose prefill of a whole prompt (a cold cache) is held until ``gate``
    is set, or takes ``delay`` seconds more: a device busy with other work."""

    def __init__(self, model, delay: float = 10.0, gate: threading.Event | None = None):
        super().__init__(model)
        self.delay, self.gate, self.cold_prefills = delay, gate, 0

    def sync(self, context):
        if self.cache_len() == 0 and len(context) > 1:
            self.cold_prefills += 1
            if self.gate is not None:
                self.gate.wait(self.delay)
            else:
                time.sleep(self.delay)
        return super().sync(context)


async def _refs(c, n, cfg, prompts):
    return [await c.generate(prompt_ids=p, target_only=True, max_new_tokens=n,
                             sampling=cfg, seed=0) for p in prompts]


async def _gated(url, model, tok, n=32, cfg=None, release_after=3, steps="greedy"):
    """A request whose draft prefill is released once ``release_after`` tokens have
    been committed, then a second request on the same (now warm) drafter."""
    gate = threading.Event()
    d = SlowPrefill(model, gate=gate)
    async with EdgeClient(url, d, tok, depth=4, chat=False, prefill_steps=steps) as c:
        ref, ref2 = await _refs(c, n, cfg, [PROMPT, PROMPT[:-1]])
        gen = c.stream(prompt_ids=PROMPT, max_new_tokens=n, sampling=cfg, seed=0)
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == release_after:
                gate.set()
        out = gen.result()
        again = await c.generate(prompt_ids=PROMPT[:-1], max_new_tokens=n, sampling=cfg,
                                 seed=0)
    return ref, out, again, ref2, d


def test_target_steps_cover_a_slow_draft_prefill(server, tok, draft):
    """The first tokens come from target steps while the draft prefills, then blocks
    are drafted and verified; the output is the target's."""
    ref, out, again, ref2, d = asyncio.run(_gated(server.url, draft, tok))
    assert out.token_ids == ref.token_ids and again.token_ids == ref2.token_ids
    m = out.metrics
    assert m["target_step_tokens"] >= 3 and m["drafted_tokens"] > 0
    assert len(out.token_ids) == 32 and d.cold_prefills == 1
    assert again.metrics["target_step_tokens"] <= 1 and again.metrics["drafted_tokens"] > 0


def test_off_waits_for_the_draft(server, tok, draft):
    async def go():
        d = SlowPrefill(draft, PREFILL_S)
        async with EdgeClient(server.url, d, tok, depth=4, chat=False,
                              prefill_steps="off") as c:
            ref, = await _refs(c, 32, None, [PROMPT])
            return ref, await c.generate(prompt_ids=PROMPT, max_new_tokens=32)
    ref, out = asyncio.run(go())
    assert out.token_ids == ref.token_ids
    assert out.metrics["target_step_tokens"] <= 1           # the last token's, if any
    assert out.metrics["ttft_s"] >= PREFILL_S


def test_a_request_served_wholly_by_target_steps_frees_its_draft(server, tok, draft):
    """A request shorter than the draft's prefill ends on target steps alone; it waits
    for the prefill before handing the drafter back, so the next request (same
    drafter) speculates normally."""
    async def go():
        d = SlowPrefill(draft, PREFILL_S)
        async with EdgeClient(server.url, d, tok, depth=4, chat=False) as c:
            ref, ref2 = await _refs(c, 32, None, [PROMPT, PROMPT[:-1]])
            out = await c.generate(prompt_ids=PROMPT, max_new_tokens=3)
            again = await c.generate(prompt_ids=PROMPT[:-1], max_new_tokens=32)
        return ref, out, again, ref2
    ref, out, again, ref2 = asyncio.run(go())
    assert out.token_ids == ref.token_ids[:3]
    assert out.metrics["drafted_tokens"] == 0 and out.metrics["target_step_tokens"] == 3
    assert out.metrics["ttft_s"] < PREFILL_S
    assert again.token_ids == ref2.token_ids and again.metrics["drafted_tokens"] > 0


class StoppablePrefill(SlowPrefill):
    """A slow first cold prefill that honours ``stop_prefill`` as a chunked one does:
    it stops (PrefillStopped, nothing cached) once asked, instead of running its
    ``delay`` out; later prefills are quick."""

    def __init__(self, model, delay: float = 30.0):
        super().__init__(model, delay, gate=threading.Event())
        self.stops = 0

    def stop_prefill(self, on: bool) -> None:
        if on:
            self.stops += 1
            self.gate.set()

    def sync(self, context):
        if self.cache_len() == 0 and len(context) > 1:
            self.cold_prefills += 1
            if self.cold_prefills == 1 and self.gate.wait(self.delay):   # the long one
                from edge_sdk.drafters.base import PrefillStopped

                raise PrefillStopped("stopped")
        return TorchDrafter.sync(self, context)


def test_a_request_that_ends_on_target_steps_stops_a_long_prefill(server, tok, draft):
    """A request that ends on target steps while the draft still prefills a long
    prompt asks the prefill to stop (a chunked prefill stops at its next chunk border)
    instead of making its answer wait for the rest of it; the drafter then serves the
    next request normally."""
    async def go():
        d = StoppablePrefill(draft)
        async with EdgeClient(server.url, d, tok, depth=4, chat=False) as c:
            ref, ref2 = await _refs(c, 32, None, [PROMPT, PROMPT[:-1]])
            t0 = time.perf_counter()
            out = await c.generate(prompt_ids=PROMPT, max_new_tokens=3)
            wall = time.perf_counter() - t0
            again = await c.generate(prompt_ids=PROMPT[:-1], max_new_tokens=32)
        return ref, out, wall, again, ref2, d
    ref, out, wall, again, ref2, d = asyncio.run(go())
    assert out.token_ids == ref.token_ids[:3] and out.metrics["target_step_tokens"] == 3
    assert d.stops == 1 and wall < 10.0 and d.cold_prefills == 2    # not the 30 s one
    assert again.token_ids == ref2.token_ids and again.metrics["drafted_tokens"] > 0


def test_sampling_requests_take_target_steps_when_asked(server, tok, draft):
    """A target step under sampling is the cloud's own draw from the target's
    distribution, from the position-keyed stream a target-only request of the same
    seed draws from: the steps' tokens are the target-only request's first tokens.
    By default (``greedy``) a sampled request waits for its draft instead, so a seed
    reproduces its output whatever the timing."""
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    ref, out, _, _, _ = asyncio.run(_gated(server.url, draft, tok, n=24, cfg=cfg,
                                           steps="always"))
    k = out.metrics["target_step_tokens"]
    assert len(out.token_ids) == 24 and k >= 3 and out.metrics["drafted_tokens"] > 0
    assert out.token_ids[:3] == ref.token_ids[:3]       # the first 3 (at least) were steps

    async def default():
        d = SlowPrefill(draft, PREFILL_S)
        async with EdgeClient(server.url, d, tok, depth=4, chat=False) as c:
            return await c.generate(prompt_ids=PROMPT, max_new_tokens=8, sampling=cfg)
    out = asyncio.run(default())
    assert out.metrics["target_step_tokens"] <= 1 and out.metrics["ttft_s"] >= PREFILL_S


def test_prefill_steps_values_are_checked(tok, draft):
    import pytest

    with pytest.raises(ValueError, match="prefill_steps"):
        EdgeClient("http://127.0.0.1:9", TorchDrafter(draft), tok, prefill_steps=True)
