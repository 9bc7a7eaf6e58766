"""oneDNN-prepacked linears (edge_sdk.packed): the same logits as the unpacked model,
greedy identity through the signed server with a packed bf16 or float32 target, serving
loads packing float32, and what is left alone (float16, the switch)."""

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
from edge_sdk.packed import (SERVING_DTYPES, PackedLinear, pack_linears, packed_default,
                             packing_supported)
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not packing_supported(), reason="torch without oneDNN")


def bf16(seed=0, **kw):
    return tiny_model(seed=seed, hidden=64, layers=2, vocab=64, **kw).to(torch.bfloat16)


needs_bf16 = pytest.mark.skipif(
    not packing_supported(torch.bfloat16),
    reason="oneDNN packs bf16 only with AVX-512 or AVX-NE-CONVERT")


def _packable(dtype):
    """A dtype as a test parameter, skipped where oneDNN cannot pack it on this CPU."""
    return pytest.param(dtype, id=str(dtype).split(".")[-1],
                        marks=[] if packing_supported(dtype) else [pytest.mark.skip(
                            reason=f"oneDNN cannot pack {dtype} on this CPU")])


@needs_bf16
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
    assert pack_linears(fp32) == 0                  # bf16 only unless asked
    assert type(fp32.lm_head) is torch.nn.Linear
    fp16 = tiny_model(seed=0).half()
    assert pack_linears(fp16, require_equal=False, dtypes=SERVING_DTYPES) == 0


def test_serving_loads_pack_float32_too(tmp_path):
    """``load_model(packed=True)`` packs a float32 model's linears (oneDNN's float32
    kernel: rounding of its own, so only where the serving load asks for every layer),
    dropping the dense copies but the output embedding's."""
    from edge_sdk.models import load_model
    from tests.conftest import tiny_tokenizer

    tiny_model(seed=0, hidden=64, layers=2, vocab=64).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    m, _ = load_model(str(tmp_path), dtype="float32", packed=True)
    assert isinstance(m.model.layers[0].mlp.up_proj, PackedLinear)
    assert m.model.layers[0].mlp.up_proj.weight is None
    assert m.model.layers[0].mlp.up_proj.weight_dtype == torch.float32
    assert isinstance(m.get_output_embeddings(), PackedLinear)
    assert m.get_output_embeddings().weight is not None
    plain, _ = load_model(str(tmp_path), dtype="float32")
    assert type(plain.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_switch(monkeypatch):
    monkeypatch.delenv("SPECRELAY_PACKED", raising=False)
    assert packed_default() is True
    monkeypatch.setenv("SPECRELAY_PACKED", "0")
    assert packed_default() is False
    monkeypatch.setenv("SPECRELAY_PACKED", "yes")
    with pytest.raises(ValueError, match="SPECRELAY_PACKED"):
        packed_default()


@pytest.mark.parametrize("dtype", [_packable(torch.bfloat16), _packable(torch.float32)])
def test_greedy_identity_with_a_packed_target_through_the_server(dtype):
    """The packed target behind the signed API: speculative greedy output (depth 4 and
    a batch of two concurrent requests) equals the packed target alone, which equals the
    greedy decode of transformers' ``generate`` on the unpacked model (bf16: the packed
    kernels round alike) or on the packed one (float32: oneDNN rounds otherwise than
    MKL, so the packed model is its own reference)."""
    from tests.conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    plain = tiny_model(seed=0, hidden=64, layers=2, vocab=64).to(dtype)
    target = copy.deepcopy(plain)
    assert pack_linears(target, require_equal=dtype == torch.bfloat16, dtypes=(dtype,)) > 0
    drafter_model = bf16(seed=1, like=tiny_model(seed=0, hidden=64), noise=0.01)
    prompt = [5, 9, 11]
    with torch.inference_mode():
        ref_model = plain if dtype == torch.bfloat16 else target
        ref_hf = ref_model.generate(torch.tensor([prompt]), max_new_tokens=24,
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


@pytest.mark.parametrize("dtype", [_packable(torch.bfloat16), _packable(torch.float32)])
def test_the_bench_cloud_process_serves_a_packed_target(dtype):
    """The bench's cloud process (same loader as ``specrelay serve``) packs a bf16 or
    float32 preset and says so in its handshake (the bench's ``packed_linears``)."""
    from bench.cloud_process import CloudServerProcess

    with CloudServerProcess("smollm2-135m", cpus=None, threads=1, auth=False,
                            dtype=str(dtype).split(".")[-1]) as cloud:
        assert cloud.wait_ready()["packed_linears"] is True
