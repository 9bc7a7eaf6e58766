"""oneDNN-prepacked linears (edge_sdk.packed): the same logits as the unpacked model,
greedy identity through the signed server with a packed bf16 target, and what is left
alone (other dtypes, the switch)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.kvmodel import KVModel
from edge_sdk.packed import PackedLinear, pack_linears, packed_default, packing_supported
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not packing_supported(), reason="torch without oneDNN")


def bf16(seed=0, **kw):
    return tiny_model(seed=seed, hidden=64, layers=2, vocab=64, **kw).to(torch.bfloat16)


def test_packed_logits_are_bit_identical_over_a_cached_decode():
    """Prefill, a 1-token pass and a 5-token pass through the KV cache: every logit of
    the packed copy equals the unpacked model's."""
    plain = bf16()
    packed = copy.deepcopy(plain)
    n = pack_linears(packed)
    assert n == 2 * 7 + 1                      # q k v o gate up down per layer + head
    assert isinstance(packed.get_output_embeddings(), PackedLinear)
    assert packed.get_output_embeddings().weight is not None     # kept for fingerprints
    assert packed.model.layers[0].mlp.up_proj.weight is None      # dense copy dropped
    a, b = KVModel(plain), KVModel(packed)
    for ids in ([3, 7, 9, 11, 2, 5], [8], [4, 6, 10, 12, 14]):
        assert torch.equal(a.forward(ids), b.forward(ids))


def test_other_dtypes_and_modules_are_left_alone():
    fp32 = tiny_model(seed=0)
    assert pack_linears(fp32) == 0
    assert type(fp32.lm_head) is torch.nn.Linear


def test_switch(monkeypatch):
    monkeypatch.delenv("SPECRELAY_PACKED", raising=False)
    assert packed_default() is True
    monkeypatch.setenv("SPECRELAY_PACKED", "0")
    assert packed_default() is False
    monkeypatch.setenv("SPECRELAY_PACKED", "yes")
    with pytest.raises(ValueError, match="SPECRELAY_PACKED"):
        packed_default()


def test_greedy_identity_with_a_packed_bf16_target_through_the_server():
    """The packed target behind the signed API: speculative greedy output (depth 4 and
    a batch of two concurrent requests) equals the packed target alone, which equals the
    unpacked model's own greedy decode."""
    from tests.conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    plain = bf16()
    target = copy.deepcopy(plain)
    pack_linears(target)
    drafter_model = bf16(seed=1, like=tiny_model(seed=0, hidden=64), noise=0.01)
    prompt = [5, 9, 11]
    with torch.inference_mode():
        ref_hf = plain.generate(torch.tensor([prompt]), max_new_tokens=24,
                                do_sample=False)[0, 3:].tolist()

    async def main(url):
        async with EdgeClient(url, TorchDrafter(drafter_model), tok, depth=4,
                              chat=False) as c:
            ref = await c.generate(prompt_ids=prompt, target_only=True, max_new_tokens=24)
            outs = await asyncio.gather(*(c.generate(prompt_ids=prompt, max_new_tokens=24)
                                          for _ in range(2)))
        return ref, outs

    with BackgroundServer(create_app(target, tok, max_batch=2, max_wait_s=0.01)) as srv:
        ref, outs = asyncio.run(main(srv.url))
    assert outs[0].metrics["drafted_tokens"] > 0
    assert [o.token_ids for o in outs] == [ref.token_ids] * 2
    n = len(ref.token_ids)
    assert ref.token_ids == ref_hf[:n]


def test_the_bench_cloud_process_serves_a_packed_target():
    """The bench's cloud process (same loader as ``specrelay serve``) packs a bf16 preset
    and says so in its handshake (the bench's ``packed_linears``)."""
    from bench.cloud_process import CloudServerProcess

    with CloudServerProcess("smollm2-135m", cpus=None, threads=1, auth=False,
                            dtype="bfloat16") as cloud:
        assert cloud.wait_ready()["packed_linears"] is True
