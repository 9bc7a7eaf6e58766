"""FSD (SPEC §5): the cloud streams an early-exit verdict before the final one and the
edge pre-drafts from it.

* wire: the early-verdict item and the streamed-answer reader validate what they read;
* the provisional verdict on the *final* logits is the final verdict (same rule, same
  uniforms), greedy and sampling;
* the verifier sends each row of a batched pass its own early verdict, once;
* exactness with FSD on: greedy identity (chain, tree, over HTTP and in process),
  seed-by-seed sampling equality with stop-and-wait, the first-3-token distribution;
* clients and servers with and without early exits interoperate; a duplicate is
  answered from the replay cache (final only); a connection cut between the two items
  loses nothing.
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch

from cloud_api.app import create_app
from cloud_api.early_exit import untrained_head
from cloud_api.exit_select import early_head_for
from cloud_api.early_verdict import provisional_verdict
from cloud_api.inprocess import InProcessTransport
from cloud_api.server import BackgroundServer
from cloud_api.service import CloudService
from cloud_api.sessions import Session
from cloud_api.verifier import Verifier
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import rng, wire
from edge_sdk.protocol import sampling as S
from edge_sdk.transport import Transport
from tests.conftest import RawHTTP, tiny_model, tiny_tokenizer

PROMPT = [5, 9, 11]


@pytest.fixture(scope="module")
def deep():
    """A 4-layer tiny target (exits at layers 1-3) and a draft close to it."""
    t = tiny_model(seed=0, layers=4)
    return t, tiny_model(seed=1, layers=4, like=t, noise=0.01)


class LateFinal(InProcessTransport):
    """In-process transport whose verify answers arrive ``delay_s`` after the pass (the
    early verdict, sent mid-pass, arrives at once): the edge has time to pre-draft."""

    def __init__(self, svc, delay_s: float = 0.01):
        super().__init__(svc)
        self.delay_s = delay_s

    async def request(self, method, path, body=b"", content_type="", on_early=None):
        out = await super().request(method, path, body, content_type, on_early)
        if path.endswith("/verify"):
            await asyncio.sleep(self.delay_s)
        return out


def generate(svc, draft, tok, n=40, prompt=PROMPT, transport=None, url="inproc://", **kw):
    gen_kw = {k: kw.pop(k) for k in ("sampling", "seed") if k in kw}

    async def main():
        async with EdgeClient(url, TorchDrafter(draft), tok, chat=False,
                              transport=transport or (LateFinal(svc) if svc else None),
                              **kw) as c:
            return await c.generate(prompt_ids=prompt, max_new_tokens=n, **gen_kw)
    return asyncio.run(main())


# ----------------------------------------------------------------------------- wire

def test_early_verdict_and_stream_reader():
    ev = wire.EarlyVerdict(3, 2, 17, 20, 0.125)
    final = wire.VerifyResponse(3, 2, 17, None, 12, 0.25)
    body = ev.encode() + final.encode()
    r = wire.StreamReader(64)
    items = [it for i in range(len(body)) for it in r.feed(body[i:i + 1])]  # byte by byte
    assert items == [ev, final]
    err = wire.stream_error(409, {"code": "stale_block", "message": "m"})
    assert wire.StreamReader().feed(err) == [(409, {"code": "stale_block", "message": "m"})]
    for bad in ([wire.MSG_EARLY, 3, 2, 99, 20, 0.1],        # next token out of vocab
                [wire.MSG_EARLY, 3, 2, 5, 20, -1.0],        # negative time
                [wire.MSG_EARLY, 3, 2, 5],                  # short
                [1, 2, 3], "text"):
        with pytest.raises(wire.WireError):
            wire.StreamReader(64).feed(wire.pack(bad))
    with pytest.raises(wire.WireError):
        wire.StreamReader().feed(b"\xc1")                   # never-used msgpack byte


# ----------------------------------------------------------------------------- the rule

def _final_sampled(cfg, seed, context, block, q, logits):
    """The verifier's own sampled verdict of ``block`` on ``logits`` [g+1, V]."""
    v = Verifier.__new__(Verifier)
    s = Session(1, None, cfg, seed, "asym", 8, 0, 64, None, list(context), len(context))
    req = wire.VerifyRequest(1, 0, len(context), cfg.config_id, None,
                             np.array(block), np.array(q), None)
    p = torch.softmax(S.process_logits(logits, cfg, None), dim=-1)
    gen = rng.generator(seed, rng.VERIFY, len(context))
    a, nxt, *_ = v._sample_verdict(s, req, logits, p, context, block, gen)
    return a, nxt


@pytest.mark.parametrize("cfg", [SamplingConfig(), SamplingConfig(temperature=0.8),
                                 SamplingConfig(temperature=1.0, top_k=5)],
                         ids=["greedy", "t0.8", "topk5"])
def test_provisional_on_final_logits_is_the_final_verdict(cfg):
    """Same rule, same uniforms: fed the final logits, the provisional verdict is the
    final one (a sampled rejection: same count, correction left to the edge)."""
    g, V = 5, 16
    for seed in range(40):
        t = torch.Generator().manual_seed(seed)
        logits = 3 * torch.randn(g + 1, V, generator=t)
        block = [int(x) for x in torch.randint(0, V, (g,), generator=t)]
        if seed % 3 == 0:              # often accepted: the block is the argmax path
            block = [int(x) for x in logits[:g].argmax(-1)]
        q = [float(x) for x in torch.rand(g, generator=t) * 0.9 + 0.1]
        ctx = [1, 2, 3 + seed % 4]
        got = provisional_verdict(cfg, seed, ctx, block, q, logits)
        if cfg.greedy:
            assert got == S.greedy_verify(torch.tensor(block), logits)
        else:
            assert got == _final_sampled(cfg, seed, ctx, block, q, logits)


def test_topk_rule_trusts_the_draft():
    """accept_topk=2 accepts a draft token that is the early runner-up."""
    x = torch.tensor([[0.0, 5.0, 4.0], [0.0, 1.0, 9.0], [3.0, 0.0, 0.0]])
    assert provisional_verdict(SamplingConfig(), 0, [0], [2, 2], None, x, 1) == (0, 1)
    assert provisional_verdict(SamplingConfig(), 0, [0], [2, 2], None, x, 2) == (2, 0)


# ----------------------------------------------------------------------------- verifier

def test_batched_pass_sends_each_row_its_early_verdict(deep, tok):
    target, _ = deep
    svc = CloudService(target, tok, early_head=untrained_head(target, 2))

    async def main():
        ids = []
        for p in ([5, 9, 11], [7, 3, 2, 8, 4]):
            info = await svc.create({"prompt_ids": p, "seed": 1}, None)
            ids.append(info["session_id"])
        sess = [svc.sessions.get(str(i), None) for i in ids]
        reqs = [wire.VerifyRequest(s.id, 0, len(s.tokens), s.cfg.config_id, None,
                                   np.array(blk), None, None, s.tokens[-1])
                for s, blk in zip(sess, ([4, 4, 4], [6]))]
        got: list = []
        out = await asyncio.get_running_loop().run_in_executor(
            svc.executor, svc.verifier.verify_batch, list(zip(sess, reqs)),
            [got.append, got.append])
        return got, out
    got, out = asyncio.run(main())
    assert sorted(v.block_seq for v in got) == [0, 0] and len(got) == 2
    assert all(v.layer == 2 and v.t_early >= 0 for v in got)
    assert all(isinstance(r, wire.VerifyResponse) for r in out)
    assert svc.verifier.early_frames == 2 and 0 <= svc.verifier.early_hits <= 2


def test_early_head_settings(deep, tok):
    target, _ = deep
    assert early_head_for(target, tok, "off") is None
    assert early_head_for(target, tok, None) is None
    assert early_head_for(target, tok, "auto", "no-such-preset") is None
    assert early_head_for(target, tok, "untrained:3").layer == 3
    for bad in ("soon", "untrained:x"):
        with pytest.raises(ValueError):
            early_head_for(target, tok, bad)
    with pytest.raises(ValueError):
        untrained_head(target, 4)           # the last layer is the final verdict


# ----------------------------------------------------------------------------- exactness

@pytest.fixture(scope="module")
def reference(deep, tok):
    target, draft = deep
    return generate(lambda: None, draft, tok, transport=InProcessTransport(
        CloudService(target, tok))).token_ids


@pytest.mark.parametrize("layer", [1, 3])
@pytest.mark.parametrize("mode,roots", [("fsd", 1), ("fsd+ipdg", 1), ("fsd+ipdg", 2)])
def test_greedy_identity_with_fsd(deep, tok, reference, mode, roots, layer):
    target, draft = deep
    svc = CloudService(target, tok, early_head=untrained_head(target, layer))
    out = generate(svc, draft, tok, proactive=mode, proactive_roots=roots)
    assert out.token_ids == reference
    m = out.metrics
    assert m["early_verdicts"] > 0 and 0 <= m["early_verdict_hit_rate"] <= 1
    assert m["early_redirect_hits"] <= m["early_redirects"] <= m["early_verdicts"]
    assert m["wasted_draft_tokens"] == (m["drafted_tokens"] - m["accepted_tokens"]
                                        + m["proactive_wasted_tokens"])
    if layer == 3:                           # the upper exit predicts often enough
        assert m["early_hits"] > 0 and m["proactive_hits"] > 0


def test_fsd_send_ahead_identity(deep, tok, reference):
    target, draft = deep
    svc = CloudService(target, tok, early_head=untrained_head(target, 3))
    out = generate(svc, draft, tok, proactive="fsd", send_ahead=True)
    assert out.token_ids == reference


def test_fsd_sampling_equals_stop_and_wait_seed_by_seed(deep, tok):
    target, draft = deep
    cfg = SamplingConfig(temperature=0.9)
    redirected = 0
    for seed in range(4):
        base = generate(CloudService(target, tok), draft, tok, n=16, depth=2, sampling=cfg,
                        seed=seed)
        for mode in ("fsd", "fsd+ipdg"):
            svc = CloudService(target, tok, early_head=untrained_head(target, 3))
            out = generate(svc, draft, tok, n=16, depth=2, sampling=cfg, seed=seed,
                           proactive=mode)
            assert out.token_ids == base.token_ids
            redirected += out.metrics["early_redirect_hits"]
    assert redirected > 0


V3, PROMPT3 = 8, [3, 5, 7]


def test_fsd_distribution_in_process():
    """2,000 FSD generations (depth 1, 4 tokens; an exit at layer 1 of 2): the
    first-3-token distribution equals the target's (chi-square p > 0.01)."""
    from tests.test_e2e_distribution import pvalue
    from tests.test_proactive import exact_triples

    cfg = SamplingConfig(temperature=1.0)
    tk = tiny_tokenizer(V3)
    tgt = tiny_model(vocab=V3, seed=0)
    tgt.generation_config.eos_token_id = None
    dft = tiny_model(vocab=V3, seed=1, like=tgt, noise=0.005)

    async def main():
        svc = CloudService(tgt, tk, early_head=untrained_head(tgt, 1))
        svc.eos = []
        counts, kept = np.zeros(V3 ** 3), 0
        async with EdgeClient("inproc://", TorchDrafter(dft), tk, chat=False, depth=1,
                              support_k=V3, proactive="fsd+ipdg",
                              transport=LateFinal(svc, 0.0)) as c:
            for seed in range(2000):
                r = await c.generate(prompt_ids=PROMPT3, sampling=cfg, seed=seed,
                                     max_new_tokens=4)
                a, b, d = r.token_ids[:3]
                counts[(a * V3 + b) * V3 + d] += 1
                kept += r.metrics["early_verdicts"]
        return counts, kept
    counts, early = asyncio.run(main())
    assert early > 500
    assert pvalue(counts, exact_triples(tgt, cfg).numpy()) > 0.01


# ----------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def servers(deep, tok):
    target, _ = deep
    with BackgroundServer(create_app(target, tok, early_head=untrained_head(target, 3))) \
            as fsd, BackgroundServer(create_app(target, tok)) as plain:
        yield fsd, plain


@pytest.mark.parametrize("server,mode", [("fsd", "fsd"), ("fsd", "fsd+ipdg"),
                                         ("fsd", "off"), ("plain", "fsd")])
def test_http_interop_identity(deep, tok, reference, servers, server, mode):
    """FSD clients and servers with and without early exits mix freely."""
    _, draft = deep
    url = servers[0 if server == "fsd" else 1].url
    out = generate(None, draft, tok, url=url, proactive=mode)
    assert out.token_ids == reference
    if server == "plain" or mode == "off":
        assert out.metrics["early_verdicts"] == 0


def test_http_stream_then_duplicate(deep, tok, servers):
    """A streamed verify answers [early verdict, final verdict]; the same bytes again
    (a retry) get the final verdict alone, from the replay cache, byte-identical."""
    http = RawHTTP(servers[0].url)
    try:
        info = http.create(prompt_ids=PROMPT, seed=0)
        body = wire.VerifyRequest(int(info["session_id"]), 0, len(PROMPT), info["config_id"],
                                  None, np.array([4, 4]), None, None, PROMPT[-1]).encode(64)
        accept = {"accept": wire.STREAM_SEQ}
        st, first = http("POST", f"/v1/sessions/{info['session_id']}/verify", body,
                         headers=accept)
        st2, again = http("POST", f"/v1/sessions/{info['session_id']}/verify", body,
                          headers=accept)
    finally:
        http.close()
    assert st == st2 == 200
    items, items2 = wire.StreamReader(64).feed(first), wire.StreamReader(64).feed(again)
    assert isinstance(items[0], wire.EarlyVerdict) and items[0].block_seq == 0
    assert isinstance(items[1], wire.VerifyResponse) and len(items) == 2
    assert items2 == [items[1]]


class CutAfterEarly(Transport):
    """Cuts every other streamed answer right after its early verdict (the connection
    drops between the two items): the client must retry."""

    cuts = 0

    async def _read_stream(self, r, on_early):
        if CutAfterEarly.cuts % 2 == 0:
            reader = wire.StreamReader()
            async for chunk in r.content.iter_any():
                for item in reader.feed(chunk):
                    if isinstance(item, wire.EarlyVerdict):
                        on_early(item)
                        CutAfterEarly.cuts += 1
                        raise aiohttp.ClientPayloadError("cut after the early verdict")
        CutAfterEarly.cuts += 1
        return await super()._read_stream(r, on_early)


def test_connection_cut_between_the_items_loses_nothing(deep, tok, reference, servers):
    _, draft = deep
    url = servers[0].url
    out = generate(None, draft, tok, url=url, proactive="fsd",
                   transport=CutAfterEarly(url, backoff_s=0.001))
    assert out.token_ids == reference
    assert CutAfterEarly.cuts > 4
