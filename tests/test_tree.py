"""Sibling trees (SpecInfer §4 token-tree verification, greedy): the layout and verdict,
the wire field, the verifier's tree pass and cache cut, and greedy identity end to end."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from cloud_api.sessions import ApiError, Session
from cloud_api.verifier import Verifier
from edge_sdk.control.siblings import SiblingPolicy
from edge_sdk.drafters.base import DraftBlock
from edge_sdk.kvmodel import KVModel, batched_forward
from edge_sdk.protocol import tree as TR
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.protocol.wire import VerifyRequest, VerifyResponse, WireError


def test_layout_rows_offsets_and_mask():
    t = TR.layout(3, [[], [7, 8], []])
    assert t.rows == 1 + 3 + 2
    assert t.offsets.tolist() == [0, 1, 2, 3, 2, 2]
    # sibling of d_2 (draft index 1) sees last and d_1 and itself only
    assert t.attn[4].tolist() == [True, True, False, False, True, False]
    assert t.attn[5].tolist() == [True, True, False, False, False, True]
    assert t.attn[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert t.sib_rows == ((1, 7, 4), (1, 8, 5))
    chain = TR.layout(2, None)
    assert chain.rows == 3 and not chain.sib_rows
    with pytest.raises(ValueError):
        TR.layout(2, [[1]])


def test_tree_verdict_cases():
    t = TR.layout(3, [[9], [7, 8], []])
    # rows: last, d1, d2, d3, s(0,9), s(1,7), s(1,8)
    drafts = [4, 5, 6]
    best = torch.tensor([4, 5, 6, 2, 0, 0, 0])            # all accepted, bonus 2
    assert TR.tree_verdict(best, drafts, t) == (3, None, 2)
    best = torch.tensor([4, 8, 6, 2, 0, 0, 11])           # d2 wrong, sibling 8 right
    assert TR.tree_verdict(best, drafts, t) == (1, 8, 11)
    best = torch.tensor([4, 3, 6, 2, 0, 0, 11])           # d2 wrong, no sibling matches
    assert TR.tree_verdict(best, drafts, t) == (1, None, 3)
    best = torch.tensor([9, 5, 6, 2, 12, 0, 0])           # d1 wrong, its sibling right
    assert TR.tree_verdict(best, drafts, t) == (0, 9, 12)


def test_wire_alts_roundtrip_and_validation():
    V = 64
    req = VerifyRequest(1, 0, 3, 0, None, np.array([4, 5, 6]), None, None, 2,
                        alts=[[], [7, 8], [9, 10]])
    back = VerifyRequest.decode(req.encode(V), V, 8)
    assert back.alts == [[], [7, 8], [9, 10]] and back.expect_last == 2
    plain = VerifyRequest(1, 0, 3, 0, None, np.array([4, 5, 6]), None, None, 2)
    assert VerifyRequest.decode(plain.encode(V), V, 8).alts is None
    assert len(wire.unpack(plain.encode(V))) == 10         # chain bytes unchanged
    bad = [
        [2, b"\x01", bytes(np.array([5, 8], "<u2"))],      # sibling equals the draft
        [2, b"\x01", bytes(np.array([7, 7], "<u2"))],      # duplicate sibling
        [2, b"\x03", bytes(np.array([7, 8], "<u2"))],      # position past the block
        [2, b"\x01\x01", bytes(np.array([7, 8, 9, 10], "<u2"))],   # not increasing
        [9, b"\x01", bytes(np.array([7] * 9, "<u2"))],     # too wide
        [2, b"\x01", bytes(np.array([7, 99], "<u2"))],     # out of vocabulary
        [2, b"\x01", bytes(np.array([7], "<u2"))],         # wrong count
        "x",
    ]
    for alts in bad:
        m = wire.unpack(plain.encode(V)) + [None, alts]
        with pytest.raises(WireError) as e:
            VerifyRequest.decode(wire.pack(m), V, 8)
        assert e.value.field == "alts"
    resp = VerifyResponse(0, 1, 11, None, 6, 0.1, (), sibling=8)
    assert VerifyResponse.decode(resp.encode()).sibling == 8
    assert len(wire.unpack(VerifyResponse(0, 1, 11, None, 6, 0.1).encode())) == 8


def _greedy(model, ids, n):
    kv, out = KVModel(model), list(ids)
    for _ in range(n):
        out.append(int(kv.sync(out)[-1].argmax()))
    return out[len(ids):]


def _session(model, prompt, sid=1, cfg=None, mode="asym"):
    return Session(sid, None, cfg or SamplingConfig(), 0, mode, 8, 4, 64, KVModel(model),
                   list(prompt), len(prompt))


@pytest.mark.parametrize("wrong_at", [0, 2])
def test_verifier_sibling_hit_commits_target_tokens_and_cuts_the_cache(target, wrong_at):
    prompt = [2, 3, 4, 5]
    truth = _greedy(target, prompt, 6)
    block = list(truth[:4])
    block[wrong_at] = (truth[wrong_at] + 1) % 64 or 3    # a wrong draft there
    alts = [[] for _ in block]
    alts[wrong_at] = [(truth[wrong_at] + 2) % 64 or 5, truth[wrong_at]]
    v = Verifier(target)
    s = _session(target, prompt)
    v.prefill(s)
    r = v.verify(s, VerifyRequest(1, 0, len(prompt), s.cfg.config_id, None,
                                  np.array(block), None, None, None, alts=alts))
    assert (r.accepted, r.sibling) == (wrong_at, truth[wrong_at])
    assert r.next_token == truth[wrong_at + 1]
    assert s.tokens == prompt + truth[:wrong_at + 2]
    assert s.kv.ids == s.tokens[:-1] and v.sibling_hits == 1
    # the cut cache continues exactly like a fresh one on the same prefix
    fresh = KVModel(target)
    want = fresh.sync(s.tokens, [7, 8])
    got = s.kv.sync(s.tokens, [7, 8])
    assert torch.allclose(got, want, atol=1e-4)


def test_verifier_tree_without_hit_equals_chain(target):
    prompt = [6, 7, 8]
    truth = _greedy(target, prompt, 5)
    block = [truth[0], (truth[1] + 1) % 64 or 3, truth[2]]
    alts = [[], [(truth[1] + 5) % 64 or 9], []]
    out = []
    for a in (None, alts):
        v, s = Verifier(target), _session(target, prompt)
        v.prefill(s)
        r = v.verify(s, VerifyRequest(1, 0, 3, s.cfg.config_id, None, np.array(block),
                                      None, None, None, alts=a))
        out.append((r.accepted, r.next_token, r.sibling, s.tokens, s.kv.ids))
    assert out[0] == out[1] and out[0][2] is None


def test_batched_tree_rows_equal_single_rows(target):
    kvs, news, trees, single = [], [], [], []
    for i, p in enumerate(([2, 3], [4, 5, 6, 7, 8], [9])):
        tr = TR.layout(3, [[10 + i], [], [20, 21]]) if i != 1 else None
        toks = [p[-1], 30, 31, 32] + ([t for _, t, _ in tr.sib_rows] if tr else [])
        a, b = KVModel(target), KVModel(target)
        if len(p) > 1:
            a.forward(p[:-1]), b.forward(p[:-1])
        single.append(a.forward(toks, tr))
        kvs.append(b), news.append(toks), trees.append(tr)
    got = batched_forward(kvs, news, trees)
    for g, w in zip(got, single):
        assert torch.allclose(g, w, atol=1e-4)


def test_verifier_refuses_trees_where_inexact(target):
    v = Verifier(target)
    for cfg, mode in ((SamplingConfig(temperature=0.8), "asym"), (SamplingConfig(), "standard")):
        s = _session(target, [2, 3], cfg=cfg, mode=mode)
        req = VerifyRequest(1, 0, 2, s.cfg.config_id, None, np.array([4]),
                            np.array([0.5]) if not cfg.greedy else None,
                            np.full((1, 64), 1 / 64) if mode == "standard" else None,
                            None, alts=[[5]])
        with pytest.raises(ApiError) as e:
            v.check(s, req)
        assert e.value.status == 422 and e.value.field == "alts"
    s = _session(target, [2, 3])
    v.max_tree_rows = 4
    with pytest.raises(ApiError) as e:
        v.check(s, VerifyRequest(1, 0, 2, s.cfg.config_id, None, np.array([4, 5]), None,
                                 None, None, alts=[[6, 7], []]))
    assert e.value.field == "alts"


def test_sibling_policy_picks_least_sure_positions():
    blk = DraftBlock([4, 5, 6, 7], torch.ones(4, dtype=torch.float64), None, 0.0,
                     [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20, 21]],
                     [0.99, 0.3, 0.6, 0.5])
    pol = SiblingPolicy(width=2, below=0.8, max_rows=9)
    assert pol.choose(blk, 40) == [[], [13, 14], [16, 17], []]     # 5 + 4 rows
    # the last position never gets siblings (a hit there would look like a full
    # acceptance to a block sent ahead)
    assert SiblingPolicy(width=1, below=1.0).choose(blk, 40)[-1] == []
    assert pol.choose(blk, 0) is None                              # server: no trees
    assert SiblingPolicy(width=1, below=0.2).choose(blk, 40) is None
    with pytest.raises(ValueError):
        SiblingPolicy(width=9)


def test_free_rows_rule_override_and_policy_rows(target, tok, monkeypatch):
    from cloud_api.service import CloudService
    from edge_sdk import models

    # the engine rule: 16 rows (one AMX tile) for a bf16 model on an AMX CPU, else 0
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset({"amx_bf16", "avx512f"}))
    assert models.free_pass_rows(bf16) == models.AMX_TILE_ROWS == 16
    assert models.free_pass_rows(target) == 0                      # float32: rows cost
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert models.free_pass_rows(bf16) == 0                        # no AMX tiles
    assert Verifier(target).free_rows == 0
    assert Verifier(target, free_rows=12).free_rows == 12          # the operator's figure
    assert Verifier(target, max_tree_rows=8, free_rows=12).free_rows == 8
    with pytest.raises(ValueError):
        Verifier(target, free_rows=-1)
    svc = CloudService(target, tok, free_rows=12)
    try:
        assert svc.tree_limits() == {"max_tree_rows": 40, "free_rows": 12}
        svc.verifier.supports_trees = False
        assert svc.tree_limits() == {"max_tree_rows": 0, "free_rows": 0}
    finally:
        svc.executor.shutdown(wait=False)
    # the SDK's default tree stays within the free rows; a width asked for does not
    auto, wide = SiblingPolicy.auto(), SiblingPolicy(width=2)
    assert auto.free_only and auto.width == 2 and not wide.free_only
    assert [auto.server_rows(40, 0), auto.server_rows(40, 12), auto.server_rows(8, 16)] \
        == [0, 12, 8]
    assert [wide.server_rows(40, 0), wide.server_rows(8, 0)] == [40, 8]
    blk = DraftBlock([4, 5, 6, 7], torch.ones(4, dtype=torch.float64), None, 0.0,
                     [[10, 11], [13, 14], [16, 17], [19, 20]], [0.5, 0.3, 0.6, 0.5])
    assert auto.choose(blk, auto.server_rows(40, 0)) is None       # nothing free: chains
    assert auto.choose(blk, auto.server_rows(40, 7)) == [[], [13, 14], [], []]   # 5 + 2
    assert wide.choose(blk, wide.server_rows(40, 0)) == [[10, 11], [13, 14], [16, 17], []]


def test_auto_siblings_follow_the_servers_free_rows(target, draft, tok):
    # EdgeClient's default (siblings="auto") draws trees only from a server that says
    # rows are free, and the output is the target's greedy output either way
    from cloud_api.app import create_app
    from cloud_api.server import BackgroundServer
    from edge_sdk.client import EdgeClient
    from edge_sdk.drafters.torch import TorchDrafter

    async def go(url, **kw):
        async with EdgeClient(url, TorchDrafter(draft), tok, depth=5, **kw) as c:
            assert kw or c.siblings == SiblingPolicy.auto()
            return [await c.generate(p, max_new_tokens=24)
                    for p in ("w2 w3 w4", "w9 w8", "w20 w21 w22 w23")]
    outs = {}
    for free in (0, 16):
        with BackgroundServer(create_app(target, tok, free_rows=free)) as srv:
            outs[free] = asyncio.run(go(srv.url))
            if free:
                outs["chain"] = asyncio.run(go(srv.url, siblings=0))
    ids = {k: [r.token_ids for r in v] for k, v in outs.items()}
    assert ids[0] == ids[16] == ids["chain"]
    assert sum(r.metrics["sibling_rows"] for r in outs[0]) == 0
    assert sum(r.metrics["sibling_rows"] for r in outs["chain"]) == 0
    assert sum(r.metrics["sibling_rows"] for r in outs[16]) > 0
    with pytest.raises(ValueError):
        EdgeClient("http://127.0.0.1:9", TorchDrafter(draft), tok, siblings="wide")


def test_greedy_identity_with_siblings_over_http(target, draft, tok, server):
    from edge_sdk.client import EdgeClient
    from edge_sdk.drafters.torch import TorchDrafter

    async def go(siblings, proactive):
        async with EdgeClient(server.url, TorchDrafter(draft), tok, depth=5,
                              siblings=siblings, proactive=proactive,
                              send_ahead=proactive != "off") as c:
            outs = []
            for p in ("w2 w3 w4", "w9 w8", "w20 w21 w22 w23"):
                r = await c.generate(p, max_new_tokens=24)
                outs.append((r.token_ids, r.metrics))
            return outs
    base = asyncio.run(go(None, "off"))
    for sib, pro in ((SiblingPolicy(width=3, below=1.0), "off"), (2, "ipdg")):
        got = asyncio.run(go(sib, pro))
        assert [g[0] for g in got] == [b[0] for b in base]
        assert sum(g[1]["sibling_rows"] for g in got) > 0
        assert sum(g[1]["sibling_hits"] for g in got) > 0
        if pro == "off":     # a hit commits 2 tokens where a chain commits 1
            assert sum(g[1]["rounds"] for g in got) < sum(b[1]["rounds"] for b in base)


def test_bench_mode_at_depth():
    from bench import modes as M

    c = M.get_mode("sr-tree@12")
    assert c.fixed_depth == 12 and c.client_kw["siblings"] == 2 and c.name == "sr-tree@12"
    assert M.get_mode("sr-tree@12") is c
    for bad in ("cloud-ar@3", "sr-ahead@0", "sr-ahead@99", "nope@4"):
        with pytest.raises(ValueError):
            M.get_mode(bad)


def test_fixed_depth_reaches_the_wire_limit():
    """A fixed depth above the adaptive controllers' L_max is drafted as asked."""
    from edge_sdk.control import L_MAX, FixedDepth
    from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

    assert FixedDepth(12).next_depth() == 12 > L_MAX
    assert FixedDepth(99).next_depth() == MAX_DRAFT_TOKENS
