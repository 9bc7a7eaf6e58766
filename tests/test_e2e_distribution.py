"""Distribution exactness through the real edge and cloud code paths, in process.

>= 10,000 two-token generations per correction stage: ``EdgeClient`` drafts with a tiny
random draft, the wire bytes go to the real ``CloudService`` (verifier, queue, sessions)
through ``InProcessTransport`` (no sockets), and corrections are drawn by the edge's
staged logic. The first-2-token distribution must match the target's exact one (chi-square
p > 0.01). The target's exact distribution is computed by brute force.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cloud_api.service import CloudService
from cloud_api.inprocess import InProcessTransport
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import sampling as S
from tests.conftest import tiny_model, tiny_tokenizer

V = 16
PROMPT = [3, 5, 7]
DRAWS = 10_000


def exact_pairs(model, cfg) -> np.ndarray:
    """P(a, b) of the target's first two tokens, [V*V]."""
    with torch.inference_mode():
        l1 = model(torch.tensor([PROMPT])).logits[0, -1]
        seqs = torch.tensor([PROMPT + [a] for a in range(V)])
        l2 = model(seqs).logits[:, -1]
    seen1 = S.presence_mask(torch.tensor(PROMPT), torch.zeros(0, dtype=torch.long), V)[0]
    seen2 = torch.stack([S.presence_mask(torch.tensor(PROMPT), torch.tensor([a]), V)[1]
                         for a in range(V)])
    p1 = S.probs_from_logits(l1, cfg, seen1)
    P2 = S.probs_from_logits(l2, cfg, seen2)
    return (p1.unsqueeze(1) * P2).reshape(-1).numpy()


async def draw(client: EdgeClient, cfg, n: int) -> tuple[np.ndarray, dict]:
    counts = np.zeros(V * V)
    modes = {"bounded": 0, "proposal": 0, "full": 0}
    for seed in range(n):
        r = await client.generate(prompt_ids=PROMPT, sampling=cfg, seed=seed,
                                  max_new_tokens=2)
        a, b = r.token_ids[:2] if len(r.token_ids) == 2 else (r.token_ids[0], -1)
        assert b >= 0, "EOS must not end these runs"
        counts[a * V + b] += 1
        for k, v in r.metrics["correction_mode_counts"].items():
            modes[k] += v
    return counts, modes


def pvalue(counts, exact) -> float:
    if counts[exact == 0].sum():
        return 0.0
    expected = exact * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:          # no small cells to pool
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


CASES = [
    ("bounded", SamplingConfig(temperature=1.0, top_k=6), 8),
    ("proposal", SamplingConfig(temperature=0.7, top_p=0.9), 4),
    ("full", SamplingConfig(temperature=1.0, repetition_penalty=1.2), 4),
]


@pytest.mark.parametrize("stage,cfg,k", CASES, ids=[c[0] for c in CASES])
def test_end_to_end_first_two_tokens(stage, cfg, k):
    tok = tiny_tokenizer(V)
    target = tiny_model(vocab=V, seed=0)
    target.generation_config.eos_token_id = None  # no EOS: every run yields 2 tokens
    draft = tiny_model(vocab=V, seed=1, like=target, noise=0.03)
    svc = CloudService(target, tok)
    svc.eos = []
    exact = exact_pairs(target, cfg)

    async def main():
        client = EdgeClient("inproc://", TorchDrafter(draft), tok, depth=2, chat=False,
                            correction=stage, support_k=k,
                            transport=InProcessTransport(svc))
        try:
            return await draw(client, cfg, DRAWS)
        finally:
            await client.close()

    counts, modes = asyncio.run(main())
    assert modes[stage] > 0.9 * sum(modes.values()) > 0   # the forced stage did the work
    assert pvalue(counts, exact) > 0.01


def test_bounded_budget_is_spent_at_most_and_reported():
    """eps_req > 0 through the real edge and cloud: bounded corrections are taken while
    their certificates fit, the spend never exceeds eps_req, and it is reported."""
    tok = tiny_tokenizer(V)
    target = tiny_model(vocab=V, seed=0)
    draft = tiny_model(vocab=V, seed=1, like=target, noise=0.03)
    svc = CloudService(target, tok)
    cfg = SamplingConfig(temperature=1.0)
    budget = 0.05

    async def main():
        client = EdgeClient("inproc://", TorchDrafter(draft), tok, depth=3, chat=False,
                            support_k=6, n_proposals=0, eps_req=budget,
                            transport=InProcessTransport(svc))
        try:
            return [await client.generate(prompt_ids=PROMPT, sampling=cfg, seed=s,
                                          max_new_tokens=24) for s in range(40)]
        finally:
            await client.close()

    runs = asyncio.run(main())
    spent = [r.metrics["tv_budget_spent"] for r in runs]
    bounded = sum(r.metrics["correction_mode_counts"]["bounded"] for r in runs)
    assert max(spent) <= budget + 1e-12
    assert bounded > 0 and max(spent) > 0
