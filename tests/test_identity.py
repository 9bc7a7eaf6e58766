"""Greedy identity (CASES 1): speculative output == plain target greedy decoding.

Reference = the target alone through the same server (blocks of depth 0: one 1-token
decode pass per token). The verifier's passes are row-invariant (:mod:`edge_sdk.invariant`:
a verify row's logits are the 1-token decode's bit for bit), so every test here requires
exact identity, float32 and bfloat16 alike.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.metrics import first_divergence
from edge_sdk.protocol import sampling as S
from tests.conftest import tiny_model

def top2_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        return float(S.top2_gap(model(torch.tensor([ids])).logits[0, -1:])[0])


def assert_identical(model, prompt_ids, ref: list[int], out: list[int]):
    """Equal token for token; a failure names the reference's top-2 gap there."""
    i = first_divergence(ref, out)
    if i is None:
        return
    gap = top2_gap(model, list(prompt_ids) + ref[:i]) if i < min(len(ref), len(out)) else None
    raise AssertionError(f"diverged at {i}: ref {ref[i:i + 5]} vs {out[i:i + 5]}, "
                         f"top-2 gap {gap}")


async def _pair(url, drafter, tok, prompt_ids, depth, cfg=None, mode="asym", n=40):
    async with EdgeClient(url, drafter, tok, depth=depth, mode=mode, chat=False) as c:
        ref = await c.generate(prompt_ids=prompt_ids, target_only=True, max_new_tokens=n,
                               sampling=cfg)
        out = await c.generate(prompt_ids=prompt_ids, max_new_tokens=n, sampling=cfg)
    return ref, out


@pytest.fixture(scope="module")
def close_draft(target):
    return tiny_model(seed=1, like=target, noise=0.01)


@pytest.mark.parametrize("mode", ["asym", "standard"])
@pytest.mark.parametrize("depth", range(1, 9))
def test_tiny_greedy_identity(server, tok, target, close_draft, depth, mode):
    ref, out = asyncio.run(_pair(server.url, TorchDrafter(close_draft), tok, [5, 9, 11],
                                 depth, mode=mode))
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text and out.finish_reason == ref.finish_reason
    assert out.metrics["drafted_tokens"] > 0


def test_standard_mode_caps_its_block_at_the_body_limit():
    """The standard baseline uploads g x V float64 per block: with a Qwen-sized
    vocabulary a depth-8 block (9.7 MB) would exceed the 8 MiB body limit and get 413.
    The session caps its blocks at the rows that fit (6 for V = 151,936), so the
    default depth works, and the output stays the target's."""
    from edge_sdk.protocol import wire
    from tests.conftest import tiny_tokenizer

    v = 151_936
    rows = wire.max_full_rows(v)
    assert rows == 6
    q = np.full((rows, v), 1.0 / v)
    fits = wire.VerifyRequest(1, 0, 3, 0, None, np.arange(rows), q[:, 0], q)
    assert len(fits.encode(v)) <= wire.MAX_BODY_BYTES
    over = wire.VerifyRequest(1, 0, 3, 0, None, np.arange(rows + 1),
                              np.full(rows + 1, 1.0 / v), np.full((rows + 1, v), 1.0 / v))
    assert len(over.encode(v)) > wire.MAX_BODY_BYTES
    big_tok = tiny_tokenizer(v)
    tgt = tiny_model(vocab=v, hidden=16, seed=0)
    drf = tiny_model(vocab=v, hidden=16, seed=1, like=tgt, noise=0.005)
    with BackgroundServer(create_app(tgt, big_tok)) as srv:
        ref, out = asyncio.run(_pair(srv.url, TorchDrafter(drf), big_tok, [5, 9, 11], 8,
                                     mode="standard", n=16))
    assert out.token_ids == ref.token_ids
    assert out.metrics["drafted_tokens"] > 0
    assert max(out.metrics["depth_hist"]) <= rows


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_tiny_greedy_identity_with_repetition_penalty(server, tok, target, close_draft, depth):
    cfg = SamplingConfig(repetition_penalty=1.3)
    ref, out = asyncio.run(_pair(server.url, TorchDrafter(close_draft), tok, [5, 9, 11],
                                 depth, cfg))
    assert out.token_ids == ref.token_ids


def test_tiny_greedy_identity_batched(tok, target, close_draft):
    """8 concurrent requests share verification batches (max_batch 4): each equals its
    unbatched reference."""
    prompts = [[2 + i, 7, 11 + i] for i in range(8)]
    app = create_app(target, tok, max_batch=4, max_wait_s=0.01)

    async def main(url):
        async def one(p, depth):
            async with EdgeClient(url, TorchDrafter(close_draft), tok, depth=depth,
                                  chat=False) as c:
                return await c.generate(prompt_ids=p, max_new_tokens=30)

        async with EdgeClient(url, None, tok, chat=False) as ref_client:
            refs = [await ref_client.generate(prompt_ids=p, max_new_tokens=30) for p in prompts]
        outs = await asyncio.gather(*(one(p, 1 + i % 8) for i, p in enumerate(prompts)))
        return refs, outs

    with BackgroundServer(app) as srv:
        from cloud_api.app import SERVICE

        refs, outs = asyncio.run(main(srv.url))
        sizes = app[SERVICE].queue.batch_sizes
    assert [r.token_ids for r in refs] == [o.token_ids for o in outs]
    assert max(sizes) > 1, "the concurrent requests never shared a batch"


# ----------------------------------------------------------------------------- real model

@pytest.fixture(scope="module")
def smollm2():
    from edge_sdk.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def real_prompts(smollm2):
    from specrelay_data.workloads import load_workload
    from edge_sdk.models import encode_prompt

    _, tok = smollm2
    chats = load_workload("mtbench", n=3, seed=1)
    code = load_workload("humaneval", n=2, seed=1)
    return ([encode_prompt(tok, p.text, True) for p in chats]
            + [encode_prompt(tok, p.text, False) for p in code])


@pytest.mark.real_model
def test_smollm2_greedy_identity(smollm2, real_prompts):
    """SmolLM2-135M target, 5 real prompts (MT-Bench + HumanEval), depths 1..8 spread
    over them (two depths per prompt), float32."""
    from edge_sdk.models import load_model

    target, tok = smollm2
    from specrelay_cli.options import default_draft

    draft, _ = load_model(default_draft("smollm2-135m"))
    depths = [(1, 5), (2, 6), (3, 7), (4, 8), (2, 8)]

    async def run(url, ids, pair):
        async with EdgeClient(url, None, tok, chat=False) as c:
            ref = await c.generate(prompt_ids=ids, max_new_tokens=24)
        outs = []
        for d in pair:
            async with EdgeClient(url, TorchDrafter(draft), tok, depth=d, chat=False) as c:
                outs.append(await c.generate(prompt_ids=ids, max_new_tokens=24))
        return ref, outs

    with BackgroundServer(create_app(target, tok)) as srv:
        for ids, pair in zip(real_prompts, depths):
            ref, outs = asyncio.run(run(srv.url, ids, pair))
            for out in outs:
                assert_identical(target, ids, ref.token_ids, out.token_ids)


@pytest.mark.real_model
def test_smollm2_bfloat16_identity_bit_for_bit(real_prompts):
    """bfloat16 target: logits are coarse (8-bit mantissa), and before the verifier's
    passes were row-invariant the 1-token decode pass and the multi-token verification
    pass rounded differently, so exact ties and near-ties flipped (every divergence on
    MT-Bench prompts sat at a top-2 gap of exactly 0). With row-invariant passes
    (:mod:`edge_sdk.invariant`) the output is the target's token for token."""
    from edge_sdk.models import load_model
    from specrelay_cli.options import default_draft

    target, tok = load_model("smollm2-135m", dtype="bfloat16")
    draft, _ = load_model(default_draft("smollm2-135m"))
    with BackgroundServer(create_app(target, tok)) as srv:
        for ids in real_prompts[:3]:
            ref, out = asyncio.run(_pair(srv.url, TorchDrafter(draft), tok, ids, 4, n=24))
            assert_identical(target, ids, ref.token_ids, out.token_ids)
