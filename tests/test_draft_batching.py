"""Batched drafting on the edge: the ready requests' blocks drafted with one draft
forward per step (forks of one onnxruntime session), each block sampled as if drafted
alone, each fork's KV cache left exactly as a lone draft leaves it; the scheduler
batches only drafters that can draft together, and a failed batch fails every waiter
without wedging the worker."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cloud_api.inprocess import InProcessTransport
from cloud_api.service import CloudService
from edge_sdk import EdgeClient
from edge_sdk.drafters.base import Drafter, Proposal
from edge_sdk.drafters.onnx import BATCH_SYNC_MAX, OnnxDrafter, draft_batched
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.scheduler import DraftScheduler
from exporters.onnx.export import export_onnx
from tests.conftest import tiny_model

PROMPTS = [[2 + i, 9, 4 + 2 * i, 11, 3 + i] for i in range(5)]


@pytest.fixture(scope="module")
def onnx_draft(tmp_path_factory, target):
    draft = tiny_model(seed=1, like=target, noise=0.003)
    out = tmp_path_factory.mktemp("onnx-batch")
    export_onnx(draft, out, fp16=False, parity_steps=4, prompts=[[3, 5, 7]])
    return OnnxDrafter(str(out), "cpu", threads=1)


def _contexts():
    return [list(range(2, 2 + n)) for n in (5, 17, 30, 9, 12)]


@pytest.mark.parametrize("sampling", [SamplingConfig(),
                                      SamplingConfig(temperature=0.8, top_k=20)])
def test_batched_blocks_equal_lone_blocks(onnx_draft, sampling):
    """Caches that hold nothing, part of the context, or more than it (rolled back),
    a row catching up more than BATCH_SYNC_MAX tokens, depths 1..6: the same tokens,
    q and candidates as drafting each alone with the same draws, and the same cache."""
    ctxs, depths = _contexts(), [1, 3, 6, 2, 4]

    def forks():
        ds = [onnx_draft.fork() for _ in ctxs]
        ds[1].sync(ctxs[1][:-3])                       # 3 tokens behind
        ds[2].sync(ctxs[2][:4])                        # far behind: catches up alone
        ds[3].sync(ctxs[3] + [40, 41, 42])             # ahead of its context: rolled back
        return ds

    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(ctxs))]  # noqa: E731
    alone = forks()
    ref = [d.propose(c, k, sampling, g) for d, c, k, g in zip(alone, ctxs, depths, gens())]
    together = forks()
    assert len(ctxs[2]) - 4 > BATCH_SYNC_MAX
    got = draft_batched([d.runner for d in together],
                        [Proposal(c, k, sampling, g) for c, k, g in zip(ctxs, depths, gens())])
    for a, b, da, db in zip(ref, got, alone, together):
        assert a.tokens == b.tokens
        assert torch.allclose(a.q_tok, b.q_tok, atol=1e-5)
        if sampling.greedy:
            assert a.cands == b.cands
        else:
            assert torch.allclose(a.q, b.q, atol=1e-5)
        assert da.runner.ids == db.runner.ids == db.runner.ids[:db.cache_len()]
        assert db.cache_len() == len(db.runner.ids)
    # the compacted caches go on drafting like the lone ones
    for da, db, c, blk in zip(alone, together, ctxs, ref):
        assert torch.allclose(da.sync(c + blk.tokens), db.sync(c + blk.tokens), atol=1e-4)


def test_refuses_mixed_or_repeated_runners(onnx_draft):
    d = onnx_draft.fork()
    p = [Proposal([1, 2], 1, SamplingConfig()), Proposal([1, 3], 1, SamplingConfig())]
    with pytest.raises(ValueError, match="distinct runners"):
        draft_batched([d.runner, d.runner], p)


def test_pipelined_requests_draft_together_and_stay_exact(onnx_draft, target, tok):
    """Five concurrent requests on one client: the scheduler drafts ready requests'
    blocks together, and every output is the target's own."""
    svc = CloudService(target, tok)

    async def main():
        async with EdgeClient("inproc://", None, tok, chat=False,
                              transport=InProcessTransport(svc)) as c:
            ref = [(await c.generate(prompt_ids=p, max_new_tokens=16)).token_ids
                   for p in PROMPTS]
        sched = DraftScheduler()
        async with EdgeClient("inproc://", onnx_draft, tok, chat=False, depth=3,
                              scheduler=sched, transport=InProcessTransport(svc)) as c:
            outs = await asyncio.gather(*(c.generate(prompt_ids=p, max_new_tokens=16)
                                          for p in PROMPTS))
        return ref, [o.token_ids for o in outs], sched

    ref, outs, sched = asyncio.run(main())
    assert outs == ref
    # batches of at most half the open blocks: one half drafts, the other is verified
    assert sched.batches and 1 < max(sched.batches) <= 3


class _Failing(Drafter):
    """A drafter whose batched drafting fails (and lone drafting works)."""

    vocab_size = 64

    def __init__(self, inner):
        self.inner = inner

    def sync(self, context):
        return self.inner.sync(context)

    def step(self, token):
        return self.inner.step(token)

    def cache_len(self):
        return self.inner.cache_len()

    def batch_group(self):
        return "failing"

    @staticmethod
    def propose_many(drafters, proposals):
        raise RuntimeError("batch failed")


def test_failed_batch_fails_every_waiter_and_frees_the_worker(draft):
    sched = DraftScheduler()
    cfg = SamplingConfig()

    async def main():
        ds = [_Failing(TorchDrafter(draft)) for _ in range(3)]
        blocker = TorchDrafter(draft)
        first = asyncio.ensure_future(sched.draft("a", 0, blocker.propose, [1, 2], 2, cfg))
        await asyncio.sleep(0)                 # the worker is busy with "a"
        waiting = [asyncio.ensure_future(sched.draft(k, 0, d.propose, [1, 2], 2, cfg))
                   for k, d in zip("bcd", ds)]
        res = await asyncio.gather(first, *waiting, return_exceptions=True)
        for k in "abcd":
            sched.close(k)
        again = await sched.draft("e", 0, blocker.propose, [3, 4], 1, cfg)
        return res, again

    res, again = asyncio.run(main())
    # a alone (the worker was free); then b and c together (at most half of the four
    # open blocks), which fails for both; d alone, which drafts
    assert len(res[0].tokens) == 2 and len(res[3].tokens) == 2
    assert all(isinstance(r, RuntimeError) for r in res[1:3])
    assert sched.batches == {2: 1} and len(again.tokens) == 1


def test_lone_drafters_and_max_batch_one_never_batch(draft):
    cfg = SamplingConfig()

    async def run(sched, ds):
        blocker = TorchDrafter(draft)
        first = asyncio.ensure_future(sched.draft("a", 0, blocker.propose, [1, 2], 2, cfg))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(sched.draft(k, 0, d.propose, [1, 2], 2, cfg))
                for k, d in zip("bcd", ds)]
        await asyncio.gather(first, *rest)
        return sched

    s1 = asyncio.run(run(DraftScheduler(), [TorchDrafter(draft) for _ in range(3)]))
    s2 = asyncio.run(run(DraftScheduler(max_batch=1),
                         [_Failing(TorchDrafter(draft)) for _ in range(3)]))
    assert not s1.batches and s1.grants == 4
    assert not s2.batches and s2.grants == 4
    with pytest.raises(ValueError):
        DraftScheduler(max_batch=0)
