"""The scoring backend (:mod:`cloud_api.scoring`): the same target logits through the
torch verifier and through top-N engine rows give the same decisions where the rows
suffice (greedy, top-k <= N); other configs are refused with 422; a server verifying
through a scorer produces the target-only greedy output and the torch server's seeded
top-k output; the SGLang client speaks the ``/generate`` input-logprob format (a fake
engine on the tiny model) and an unreachable engine is a retryable 503."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from cloud_api.inprocess import InProcessTransport
from cloud_api.scoring.interface import VerifierBackend
from cloud_api.scoring.local import ModelScorer
from cloud_api.scoring.sglang import SGLangScorer
from cloud_api.scoring.verifier import ScoringVerifier
from cloud_api.server import BackgroundServer
from cloud_api.service import CloudService
from cloud_api.sessions import Session
from cloud_api.verifier import Verifier
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.transport import RemoteError
from fake_engines import fake_sglang, fake_vllm

N_TOP, V = 20, 64
PROMPTS = [[4, 5, 6], [9, 3, 7, 2], [11, 12]]
TOPK = SamplingConfig(temperature=0.8, top_k=8)


def _scoring(model, scorer=None) -> ScoringVerifier:
    return ScoringVerifier(scorer or ModelScorer(model, N_TOP), V, 256)


def _top_n_rows(logits: torch.Tensor, n: int) -> torch.Tensor:
    """What an engine's top-n raw logprobs carry of ``logits`` [g+1, V]."""
    lp = torch.log_softmax(logits.double(), -1)
    top = torch.topk(lp, n, -1)
    return torch.full_like(lp, float("-inf")).scatter(-1, top.indices, top.values)


def _greedy(model, ctx: list[int], n: int) -> list[int]:
    out = list(ctx)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ctx):]


@pytest.mark.parametrize("cfg", [SamplingConfig(), TOPK], ids=["greedy", "top-k 8"])
def test_same_logits_same_decisions(target, cfg):
    """Conformance: identical target logits, full rows (torch verifier) vs top-N rows
    (scoring backend): the same accepted length, next token and correction."""
    torch_v, score_v = Verifier(target), _scoring(target)
    assert isinstance(torch_v, VerifierBackend) and isinstance(score_v, VerifierBackend)
    g = torch.Generator().manual_seed(3)
    seen = set()
    for trial in range(40):
        ctx = torch.randint(2, V, (4,), generator=g).tolist()
        blk = (torch.randint(2, V, (3,), generator=g).tolist() if trial % 2
               else _greedy(target, ctx, 3))               # mostly accepted
        with torch.no_grad():
            logits = target(torch.tensor([ctx + blk])).logits[0, len(ctx) - 1:]
        s = Session(1, None, cfg, trial, "asym", 8, 2, 16, None, list(ctx), len(ctx))
        q = None if cfg.greedy else np.full(len(blk), 0.3)
        req = wire.VerifyRequest(1, 0, len(ctx), cfg.config_id, None, np.array(blk),
                                 q, None, ctx[-1])
        a = torch_v._verdict(s, req, ctx, blk, logits)
        b = score_v._verdict(s, req, ctx, blk, _top_n_rows(logits, N_TOP))
        assert a[:2] == b[:2]
        seen.add((a[0], a[2] is None))
        if a[2] is not None:
            assert a[2].support_ids.tolist() == b[2].support_ids.tolist()
            np.testing.assert_allclose(a[2].support_p, b[2].support_p, rtol=1e-9)
            assert a[2].proposal_ids.tolist() == b[2].proposal_ids.tolist()
    assert (3, True) in seen and any(n < 3 for n, _ in seen)   # both outcomes exercised


async def _generate(svc, draft, tok, prompts, cfg=None, seed=0, target_only=False):
    async with EdgeClient("inproc://", None if target_only else TorchDrafter(draft), tok,
                          depth=3, chat=False, transport=InProcessTransport(svc)) as c:
        return [(await c.generate(prompt_ids=p, max_new_tokens=24, seed=seed,
                                  sampling=cfg or SamplingConfig(),
                                  target_only=target_only)).token_ids for p in prompts]


def test_scoring_server_output_equals_the_torch_server(target, draft, tok):
    ref = asyncio.run(_generate(CloudService(target, tok), draft, tok, PROMPTS,
                                target_only=True))
    scorer = ModelScorer(target, N_TOP)
    svc = CloudService(None, tok, verifier=_scoring(target, scorer))
    assert asyncio.run(_generate(svc, draft, tok, PROMPTS)) == ref
    torch_topk = asyncio.run(_generate(CloudService(target, tok), draft, tok, PROMPTS,
                                       TOPK, seed=5))
    svc = CloudService(None, tok, verifier=_scoring(target))
    assert asyncio.run(_generate(svc, draft, tok, PROMPTS, TOPK, seed=5)) == torch_topk
    assert scorer.calls > 0


@pytest.mark.parametrize("sampling,why", [
    ({"temperature": 0.8}, "whole vocabulary"), ({"temperature": 0.8, "top_k": 32}, "32"),
    ({"temperature": 0.0, "repetition_penalty": 1.2}, "penalty")])
def test_configs_the_rows_cannot_verify_are_refused(target, tok, sampling, why):
    svc = CloudService(None, tok, verifier=_scoring(target))

    async def create():
        await svc.start()
        try:
            return await InProcessTransport(svc).request("POST", "/v1/sessions", wire.pack(
                {"prompt_ids": [4, 5], "sampling": sampling, "max_new_tokens": 4}))
        finally:
            await svc.stop()

    with pytest.raises(RemoteError) as e:
        asyncio.run(create())
    assert e.value.status == 422
    err = e.value.body["error"] if isinstance(e.value.body, dict) else {}
    assert err.get("code") == "not_exact_on_backend" and err.get("field") == "sampling"
    assert why in err.get("message", "")


def test_sglang_scorer_against_a_fake_engine(target, draft, tok):
    rows = [([4, 5, 6], [7, 8]), ([9, 3], [])]
    with BackgroundServer(fake_sglang(target)) as srv:
        got = SGLangScorer(srv.url, N_TOP).score(rows)
        want = ModelScorer(target, N_TOP).score(rows)
        assert [[sorted(r) for r in x] for x in got] == [[sorted(r) for r in x] for x in want]
        for x, y in zip(got, want):
            for r, w in zip(x, y):
                np.testing.assert_allclose([r[k] for k in sorted(r)],
                                           [w[k] for k in sorted(w)], atol=1e-5)
        svc = CloudService(None, tok, verifier=_scoring(target, SGLangScorer(srv.url, N_TOP)))
        out = asyncio.run(_generate(svc, draft, tok, PROMPTS[:2]))
    ref = asyncio.run(_generate(CloudService(target, tok), draft, tok, PROMPTS[:2],
                                target_only=True))
    assert out == ref


def test_vllm_scorer_against_a_fake_engine(target, draft, tok):
    from cloud_api.scoring.vllm import VLLMScorer

    with BackgroundServer(fake_vllm(target)) as srv:
        scorer = VLLMScorer(srv.url, "tiny", N_TOP)
        svc = CloudService(None, tok, verifier=_scoring(target, scorer))
        out = asyncio.run(_generate(svc, draft, tok, PROMPTS[:2]))
    ref = asyncio.run(_generate(CloudService(target, tok), draft, tok, PROMPTS[:2],
                                target_only=True))
    assert out == ref


def test_an_unreachable_engine_is_a_retryable_503(target, tok):
    v = _scoring(target, SGLangScorer("http://127.0.0.1:9", N_TOP, timeout_s=2))
    s = Session(1, None, SamplingConfig(), 0, "asym", 8, 2, 16, None, [4, 5, 6], 3)
    req = wire.VerifyRequest(1, 0, 3, s.cfg.config_id, None, np.array([7]), None, None, 6)
    (res,) = v.verify_batch([(s, req)])
    assert res.status == 503 and res.code == "engine_unavailable"
    assert s.tokens == [4, 5, 6] and s.next_seq == 0          # nothing committed
    json.dumps(res.body())
