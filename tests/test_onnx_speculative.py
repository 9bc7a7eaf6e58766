"""Speculative decoding with the ONNX draft backend (issue #3): greedy identity and
distribution exactness through the real edge and cloud code, float32 and a
reduced-precision (float16) export — the q on the wire is the q that was sampled from."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cloud_api.app import create_app
from cloud_api.inprocess import InProcessTransport
from cloud_api.server import BackgroundServer
from cloud_api.service import CloudService
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.onnx import OnnxDrafter
from exporters.onnx.export import export_onnx
from tests.conftest import tiny_model, tiny_tokenizer
from tests.test_e2e_distribution import PROMPT, V, exact_pairs, pvalue


@pytest.fixture(scope="module")
def onnx_pair(tmp_path_factory):
    """Target and a close draft (vocab 16), the draft exported to ONNX fp32 + fp16."""
    target = tiny_model(vocab=V, seed=0)
    draft = tiny_model(vocab=V, seed=1, like=target, noise=0.01)
    out = tmp_path_factory.mktemp("onnx-draft")
    export_onnx(draft, out, fp16=True, parity_steps=16, prompts=[[3, 5, 7]])
    return target, out


@pytest.mark.parametrize("variant", ["fp32", "fp16"])
def test_onnx_draft_greedy_identity(onnx_pair, variant):
    target, out = onnx_pair
    tok = tiny_tokenizer(V)
    path = out if variant == "fp32" else out / "fp16"
    with BackgroundServer(create_app(target, tok)) as srv:
        async def main():
            async with EdgeClient(srv.url, None, tok, chat=False) as c:
                ref = await c.generate(prompt_ids=PROMPT, max_new_tokens=30)
            outs = []
            for depth in (1, 3, 5, 8):
                async with EdgeClient(srv.url, OnnxDrafter(str(path)), tok, depth=depth,
                                      chat=False) as c:
                    outs.append(await c.generate(prompt_ids=PROMPT, max_new_tokens=30))
            return ref, outs

        ref, outs = asyncio.run(main())
    for o in outs:
        assert o.token_ids == ref.token_ids
    assert sum(o.metrics["accepted_tokens"] for o in outs) > 0


def test_onnx_fp16_draft_keeps_the_distribution(onnx_pair):
    """3,000 two-token draws with the float16 ONNX draft (temperature 1): chi-square
    cannot tell them from the target's exact distribution."""
    target, out = onnx_pair
    tok = tiny_tokenizer(V)
    target.generation_config.eos_token_id = None
    svc = CloudService(target, tok)
    svc.eos = []
    cfg = SamplingConfig(temperature=1.0)

    async def main():
        counts = np.zeros(V * V)
        client = EdgeClient("inproc://", OnnxDrafter(str(out / "fp16")), tok, depth=2,
                            chat=False, transport=InProcessTransport(svc))
        try:
            for seed in range(3000):
                r = await client.generate(prompt_ids=PROMPT, sampling=cfg, seed=seed,
                                          max_new_tokens=2)
                counts[r.token_ids[0] * V + r.token_ids[1]] += 1
        finally:
            await client.close()
        return counts

    counts = asyncio.run(main())
    assert pvalue(counts, exact_pairs(target, cfg)) > 0.01
