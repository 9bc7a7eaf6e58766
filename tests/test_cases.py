"""CASES.md 2 and 6-10 against a real verification server (loopback HTTP, tiny models).

CASES 1 (greedy identity) and 3-5 (distributions) live in test_identity.py and
test_distribution.py. Everything here runs the real EdgeClient / aiohttp app / target
and draft models (tiny random Llamas from conftest); nothing is mocked. Observation
hooks wrap real methods (the drafter's ``sync``, the verifier's ``verify``) to assert
invariants while the real code runs.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest
import torch

from cloud_api.app import SERVICE, create_app
from cloud_api.server import BackgroundServer
from conftest import tiny_model
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.commit import Committer
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.kvmodel import KVModel
from edge_sdk.protocol import wire
from edge_sdk.transport import Transport
from conftest import RawHTTP as HTTP

MSGPACK = "application/x-msgpack"
PROMPT = [5, 6, 7]
V = 64
GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)


# ----------------------------------------------------------------------------- helpers

def generate(url, drafter, tok, *, events: list | None = None, **kw):
    """One generation through a fresh EdgeClient. Client options and request options
    may be mixed in ``kw``; ``events`` collects the streamed TokenEvents."""
    ckw = {k: kw.pop(k) for k in ("depth", "mode", "correction", "support_k",
                                  "n_proposals", "transport", "proactive",
                                  "send_ahead", "controller") if k in kw}
    # these cases check the stop-and-wait round (one block per verdict) at a fixed
    # depth; the proactive and pipelined paths and the paced depth, the SDK's default,
    # have their own tests (test_proactive.py, test_paced.py)
    ckw.setdefault("proactive", "off")
    ckw.setdefault("controller", "fixed")
    kw.setdefault("prompt_ids", PROMPT)

    async def go():
        async with EdgeClient(url, drafter, tok, chat=False, **ckw) as c:
            g = c.stream(**kw)
            async for ev in g:
                if events is not None:
                    events.append(ev)
            return g.result()

    return asyncio.run(go())


def round_roles(hist, depth, max_new):
    """Role of every committed token, reconstructed from the per-round accepted counts.

    A round drafts ``g = min(depth, remaining - 1)`` tokens and commits ``a`` drafts then
    one next token: a correction if ``a < g``, a bonus if ``a == g``. Returns
    ``[(role, g)]`` with role in first/middle/last (accepted drafts), correction, bonus.
    """
    out, committed = [], 0
    for a in hist:
        g = min(depth, max_new - committed - 1)
        for i in range(a):
            out.append(("first" if i == 0 else "last" if i == g - 1 else "middle", g))
        out.append(("bonus" if a == g else "correction", g))
        committed += a + 1
    return out[:max_new]




def vbody(sid, seq, base, tokens, q=None, pending=None, cfg=GREEDY, q_full=None) -> bytes:
    return wire.VerifyRequest(int(sid), seq, base, cfg.config_id, pending,
                              np.array(tokens, dtype=np.int64),
                              None if q is None else np.array(q, dtype=np.float64),
                              q_full).encode(V)


def strip_time(resp: wire.VerifyResponse) -> tuple:
    c = resp.correction
    corr = None if c is None else (c.complete, c.support_ids.tolist(), c.support_p.tolist(),
                                   c.proposal_ids.tolist(), c.proposal_p.tolist())
    return resp.block_seq, resp.accepted, resp.next_token, corr, resp.base_len


class Recorder:
    """Wraps ``Verifier.verify_batch`` of a live service: records every answered block
    ``(g, accepted, bonus?, awaiting)`` and checks the cloud KV invariant after it.
    Failures are collected (they happen on the server thread) and asserted by tests."""

    def __init__(self, app, check_content: bool = False):
        self.verifier = app[SERVICE].verifier
        self.orig = self.verifier.verify_batch
        self.rounds: list[tuple] = []
        self.failures: list[str] = []
        self.check_content = check_content
        self.verifier.verify_batch = self

    def __call__(self, items):
        results = self.orig(items)
        for (s, req), resp in zip(items, results):
            if not isinstance(resp, Exception):
                self.record(s, req, resp)
        return results

    def record(self, s, req, resp):
        try:
            expected = s.tokens if s.awaiting else s.tokens[:-1]
            assert s.kv.ids == expected, "cloud kv ids != confirmed prefix"
            assert s.kv.cache_len() == len(expected), "cloud cache length"
            if self.check_content and expected:
                fresh = KVModel(s.kv.model)
                fresh.forward(expected)
                for got, ref in zip(s.kv.cache.layers, fresh.cache.layers):
                    assert torch.allclose(got.keys, ref.keys, atol=1e-4), "stale keys"
                    assert torch.allclose(got.values, ref.values, atol=1e-4), "stale values"
        except AssertionError as e:
            self.failures.append(str(e))
        g = len(req.tokens)
        self.rounds.append((g, resp.accepted, resp.accepted == g, s.awaiting))

    def reset(self):
        self.rounds.clear()
        self.failures.clear()


@pytest.fixture(scope="module")
def app(target, tok):
    return create_app(target, tok)


@pytest.fixture(scope="module")
def srv(app):
    with BackgroundServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def rec(app, srv):
    r = Recorder(app, check_content=True)
    yield r
    app[SERVICE].verifier.verify_batch = r.orig


@pytest.fixture(scope="module")
def close_draft(target):
    """A draft that agrees often: full acceptances and rejections both occur."""
    return tiny_model(seed=1, like=target, noise=0.003)


@pytest.fixture(scope="module")
def ref48(srv, tok):
    """Target-only greedy reference: 48 tokens after PROMPT."""
    r = generate(srv.url, None, tok, max_new_tokens=48)
    assert r.finish_reason == "length" and 0 not in r.token_ids
    return r.token_ids


# ============================================================================ CASES 2: EOS

ROLES = ("first", "middle", "last", "correction", "bonus")


def _eos_candidates(runs):
    """runs: [(config, ref tokens, roles)] -> {role: [(config, j)]}, where ref[j] first
    occurs at j, is not the default EOS, and sits in a full-depth round."""
    cands: dict[str, list] = {}
    for cfg, ref, roles in runs:
        for j, (role, g) in enumerate(roles[: len(ref)]):
            if g == cfg["depth"] and ref[j] != 0 and ref[j] not in ref[:j]:
                cands.setdefault(role, []).append((cfg, j))
    return cands


def _pick(cands, role, n=2):
    """Up to n candidates for a role from distinct configs, preferring j > 0."""
    out, seen = [], set()
    for cfg, j in sorted(cands.get(role, []), key=lambda c: (c[1] == 0, c[1])):
        key = tuple(sorted((k, str(v)) for k, v in cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append((cfg, j))
    return out[:n]


def _eos_server_run(tok, eos_token, drafter_model, cfg, max_new):
    """A fresh target (same weights) that declares ``eos_token`` as EOS; one generation."""
    tgt = tiny_model(seed=0)
    tgt.generation_config.eos_token_id = int(eos_token)
    with BackgroundServer(create_app(tgt, tok)) as s:
        events: list = []
        r = generate(s.url, TorchDrafter(drafter_model), tok, events=events,
                     max_new_tokens=max_new, **cfg)
    return r, events


@pytest.fixture(scope="module")
def eos_greedy(srv, tok, close_draft):
    runs = []
    for prompt in ([5, 6, 7], [12, 13, 14, 15]):
        ref = generate(srv.url, None, tok, prompt_ids=prompt, max_new_tokens=48).token_ids
        for depth in (4, 5):
            r = generate(srv.url, TorchDrafter(close_draft), tok, prompt_ids=prompt,
                         max_new_tokens=48, depth=depth)
            assert r.token_ids == ref, "greedy speculative output differs from target"
            runs.append(({"prompt_ids": prompt, "depth": depth}, ref,
                         round_roles(r.metrics["accepted_hist"], depth, 48)))
    return _eos_candidates(runs), {tuple(c["prompt_ids"]): ref for c, ref, _ in runs}


@pytest.mark.parametrize("role", ROLES)
def test_eos_inside_block_greedy(role, eos_greedy, tok, close_draft):
    """EOS accepted as the first/middle/last draft of a block, or arriving as the
    correction or the bonus, ends generation right there."""
    cands, refs = eos_greedy
    picked = _pick(cands, role)
    assert picked, f"no EOS candidate with role {role}: tune the draft noise"
    for cfg, j in picked:
        ref = refs[tuple(cfg["prompt_ids"])]
        r, events = _eos_server_run(tok, ref[j], close_draft, cfg, 48)
        assert r.token_ids == ref[: j + 1], (role, cfg, j)
        assert r.finish_reason == "stop"
        m = r.metrics
        assert m["committed_tokens"] == j + 1
        assert [e.token_id for e in events] == ref[: j + 1]
        assert r.text == tok.decode(ref[:j])           # EOS itself adds no text
        assert "".join(e.text for e in events) == r.text
        # the round that carried EOS: its role is the one we asked for
        assert round_roles(m["accepted_hist"], cfg["depth"], 48)[j][0] == role


@pytest.fixture(scope="module")
def eos_sampled(srv, tok, close_draft):
    runs = []
    for mode in ("asym", "standard"):
        for seed in (1, 2):
            cfg = {"mode": mode, "depth": 4, "sampling": T1, "seed": seed}
            r = generate(srv.url, TorchDrafter(close_draft), tok, max_new_tokens=48, **cfg)
            runs.append((cfg, r.token_ids, round_roles(r.metrics["accepted_hist"], 4, 48)))
    return ({m: _eos_candidates([x for x in runs if x[0]["mode"] == m])
             for m in ("asym", "standard")},
            {(c["mode"], c["seed"]): ref for c, ref, _ in runs})


@pytest.mark.parametrize("mode,role", [("asym", r) for r in ROLES]
                         + [("standard", "correction"), ("standard", "bonus")])
def test_eos_inside_block_sampled(mode, role, eos_sampled, tok, close_draft):
    """Sampling: EOS as an accepted draft, as the edge-drawn (asym) or cloud-drawn
    (standard) correction, or as the cloud's bonus ends generation right there."""
    cands, refs = eos_sampled
    picked = _pick(cands[mode], role, n=1)
    if not picked and role in ("first", "middle", "last"):
        pytest.skip(f"no sampled run put a first-occurrence token as {role}")
    assert picked, f"no EOS candidate with role {role}"
    for cfg, j in picked:
        ref = refs[(cfg["mode"], cfg["seed"])]
        r, events = _eos_server_run(tok, ref[j], close_draft, cfg, 48)
        assert r.token_ids == ref[: j + 1]
        assert r.finish_reason == "stop"
        assert r.metrics["committed_tokens"] == j + 1 == len(events)
        assert r.text == tok.decode(ref[:j])


# ============================================================== CASES 6: stop / length

class OverDrafter(TorchDrafter):
    """Drafts ``force`` tokens whatever depth the client asks for, so blocks carry (and
    the target accepts) more tokens than the length cap leaves room for."""

    def __init__(self, model, force=8):
        super().__init__(model)
        self.force = force

    def propose(self, context, depth, cfg, generator=None):
        return super().propose(context, self.force, cfg, generator)


@pytest.mark.parametrize("depth", range(1, 9))
def test_length_cap_every_depth(depth, srv, tok, close_draft, ref48):
    caps = (1, 2, 3, 5, 9, 14)
    for cap in caps:
        events: list = []
        r = generate(srv.url, TorchDrafter(close_draft), tok, events=events, depth=depth,
                     max_new_tokens=cap)
        assert r.token_ids == ref48[:cap], (depth, cap)
        assert r.finish_reason == "length"
        assert r.metrics["committed_tokens"] == cap == len(events)
        assert r.text == tok.decode(ref48[:cap])
        assert "".join(e.text for e in events) == r.text


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "t1"])
def test_length_cap_when_block_accepts_more(sampling, srv, tok, close_draft, ref48):
    """Blocks longer than the room left: the accepted surplus is never committed."""
    overshoot = 0
    for cap in (1, 2, 3, 4, 6, 10):
        r = generate(srv.url, OverDrafter(close_draft), tok, depth=8, max_new_tokens=cap,
                     sampling=sampling, seed=cap)
        m = r.metrics
        assert len(r.token_ids) <= cap and m["committed_tokens"] == len(r.token_ids)
        if sampling.greedy:
            assert r.token_ids == ref48[:cap]
        if r.finish_reason == "length":
            assert len(r.token_ids) == cap
        else:  # only a sampled default EOS may end it early
            assert r.finish_reason == "stop" and r.token_ids[-1] == 0
        offered = sum(a + 1 for a in m["accepted_hist"])
        overshoot += offered > len(r.token_ids)
    assert overshoot, "no block ever offered more tokens than the cap allowed"


def _stop_expectation(ref, tok, s):
    """Smallest m such that decode(ref[:m]) contains s; (m, text cut before s)."""
    for m in range(1, len(ref) + 1):
        text = tok.decode(ref[:m])
        if s in text:
            return m, text[: text.find(s)]
    raise AssertionError(f"stop string {s!r} never appears")


def _stop_strings(ref, tok):
    words = [tok.decode([t]) for t in ref]
    k = 9
    return [
        f"{words[k]} {words[k + 1]}",                 # two whole tokens
        f"{words[k + 5][1:]} {words[k + 6][:2]}",     # tail of one token + head of next
        words[4][1:],                                 # inside a single token
    ]


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_stop_string_inside_block(depth, srv, tok, close_draft, ref48):
    inside = 0
    for s in _stop_strings(ref48, tok):
        m, exp_text = _stop_expectation(ref48, tok, s)
        # (a) stop completes with room to spare: nothing after it is emitted or counted
        events: list = []
        r = generate(srv.url, TorchDrafter(close_draft), tok, events=events, depth=depth,
                     max_new_tokens=48, stop=[s, "never-there"])
        assert r.token_ids == ref48[:m], (s, depth)
        assert r.finish_reason == "stop"
        assert r.text == exp_text and s not in r.text
        assert r.metrics["committed_tokens"] == m == len(events)
        streamed = "".join(e.text for e in events)
        assert streamed == r.text, "streamed text differs from the final text"
        offered = sum(a + 1 for a in r.metrics["accepted_hist"])
        inside += offered > m
        # (b) the stop completes on exactly the last allowed token: stop wins
        r = generate(srv.url, TorchDrafter(close_draft), tok, depth=depth,
                     max_new_tokens=m, stop=[s])
        assert (r.token_ids, r.finish_reason, r.text) == (ref48[:m], "stop", exp_text)
        assert r.metrics["committed_tokens"] == m
        # (c) the cap comes one token before the stop completes: length
        if m > 1:
            r = generate(srv.url, TorchDrafter(close_draft), tok, depth=depth,
                         max_new_tokens=m - 1, stop=[s])
            assert r.token_ids == ref48[: m - 1] and r.finish_reason == "length"
            assert r.text == tok.decode(ref48[: m - 1])
    if depth > 1:
        assert inside, "no stop string completed inside a block"


def test_stop_string_over_surplus_block(srv, tok, close_draft, ref48):
    """A stop string completing in a block that also runs past the length cap."""
    s = _stop_strings(ref48, tok)[0]
    m, exp_text = _stop_expectation(ref48, tok, s)
    r = generate(srv.url, OverDrafter(close_draft), tok, max_new_tokens=m, stop=[s])
    assert (r.token_ids, r.finish_reason, r.text) == (ref48[:m], "stop", exp_text)


# --- the Committer on its own

def _push_all(c: Committer, toks):
    out = []
    for t in toks:
        if c.done:
            break
        out.append(c.push(t))
    return out


def test_committer_stop_spanning_two_tokens(tok):
    c = Committer(tok, 10, [0], ["w5 w6"])
    deltas = _push_all(c, [3, 5, 6, 7])
    assert c.finish_reason == "stop" and c.token_ids == [3, 5, 6]
    assert c.text == "w3 " and "".join(deltas) == c.text
    assert all("w5" not in d for d in deltas), "a stop-string prefix was streamed"
    with pytest.raises(RuntimeError):
        c.push(8)


def test_committer_stop_across_token_boundary_partial(tok):
    c = Committer(tok, 10, [0], ["3 w"])
    deltas = _push_all(c, [13, 5, 6])
    assert c.token_ids == [13, 5] and c.finish_reason == "stop"
    assert c.text == "w1" and "".join(deltas) == "w1"


def test_committer_holds_back_then_releases(tok):
    c = Committer(tok, 10, [0], ["w5 w9"])
    deltas = _push_all(c, [3, 5, 6, 7])
    assert c.finish_reason == "length" or not c.done
    assert "".join(deltas) == c.text == "w3 w5 w6 w7"


def test_committer_flushes_held_text_at_length_and_eos(tok):
    c = Committer(tok, 2, [0], ["w5 w9"])
    assert "".join(_push_all(c, [3, 5])) == c.text == "w3 w5"
    assert c.finish_reason == "length"
    c = Committer(tok, 9, [0], ["w5 w9"])
    assert "".join(_push_all(c, [3, 5, 0, 9])) == c.text == "w3 w5"
    assert c.finish_reason == "stop" and c.token_ids == [3, 5, 0]


def test_committer_earliest_stop_wins(tok):
    c = Committer(tok, 10, [0], ["w7", "w6 w7"])
    deltas = _push_all(c, [5, 6, 7, 8])
    assert c.text == "w5 " and "".join(deltas) == c.text and c.token_ids == [5, 6, 7]


def test_committer_eos(tok):
    c = Committer(tok, 10, [0, 38])
    deltas = _push_all(c, [3, 4, 38, 5])
    assert c.token_ids == [3, 4, 38] and c.finish_reason == "stop"
    assert c.text == "w3 w4" == "".join(deltas)      # a non-special EOS adds no text


def test_committer_length_and_stop_on_same_token(tok):
    c = Committer(tok, 3, [0], ["w5"])
    _push_all(c, [3, 4, 5])
    assert c.finish_reason == "stop" and c.text == "w3 w4 "
    c = Committer(tok, 3, [0], ["w9"])
    _push_all(c, [3, 4, 5, 6])
    assert c.finish_reason == "length" and c.token_ids == [3, 4, 5]
    assert c.remaining == 0


def test_committer_holds_incomplete_utf8():
    """A byte-level tokenizer splits "é" over two tokens: nothing half-decoded is
    streamed, and a stop string made of the completed character still matches."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1, "\u00c3": 2, "\u00a9": 3,
                                     "a": 4}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.ByteLevel()
    bt = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    c = Committer(bt, 10, [0])
    assert _push_all(c, [4, 2, 3, 4]) == ["a", "", "\u00e9", "a"] and c.text == "a\u00e9a"
    c = Committer(bt, 10, [0], ["\u00e9"])
    assert "".join(_push_all(c, [4, 2, 3, 4])) == c.text == "a"
    assert c.finish_reason == "stop" and c.token_ids == [4, 2, 3]


def test_committer_push_many_and_validation(tok):
    c = Committer(tok, 10, [0], ["", "w6"])
    taken, delta = c.push_many([4, 5, 6, 7])
    assert taken == [4, 5, 6] and delta == c.text == "w4 w5 "
    with pytest.raises(ValueError):
        Committer(tok, 0)


# ========================================================================= CASES 7: KV

class CheckingDrafter(TorchDrafter):
    """Asserts after every ``sync`` that the draft cache holds exactly the confirmed
    prefix and that its content is not stale (logits equal a fresh full forward)."""

    def __init__(self, model):
        super().__init__(model)
        self.model, self.syncs, self.rollbacks, self.failures = model, 0, 0, []

    def sync(self, context):
        ctx = list(context)
        before = list(self.kv.ids)
        logits = super().sync(ctx)
        self.syncs += 1
        if before[: len(ctx)] != ctx[: len(before)]:
            self.rollbacks += 1                     # stale drafts had to be dropped
        try:
            assert self.kv.ids == ctx and self.kv.cache_len() == len(ctx)
            with torch.inference_mode():
                fresh = self.model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
            assert torch.allclose(logits, fresh, atol=1e-4), "stale draft KV content"
        except AssertionError as e:
            self.failures.append(f"{e} at len {len(ctx)}")
        return logits


@pytest.mark.parametrize("mode,sampling,depth", [
    ("asym", GREEDY, 3), ("asym", GREEDY, 6), ("asym", T1, 4), ("standard", T1, 5)],
    ids=["greedy-d3", "greedy-d6", "asym-t1-d4", "standard-t1-d5"])
def test_kv_holds_confirmed_prefix_every_round(mode, sampling, depth, srv, rec, tok,
                                               close_draft):
    rec.reset()
    d = CheckingDrafter(close_draft)
    r = generate(srv.url, d, tok, depth=depth, mode=mode, sampling=sampling, seed=3,
                 max_new_tokens=40)
    assert not d.failures and not rec.failures, (d.failures, rec.failures)
    # one sync per drafted round, plus the draft prefill run while the cloud prefills
    assert d.syncs == r.metrics["rounds"] - sum(g == 0 for g, *_ in rec.rounds) + 1
    hist = r.metrics["accepted_hist"]
    assert any(0 < a < depth for a in hist), "no partial acceptance exercised"
    assert d.rollbacks > 0, "the draft cache never had to roll back"
    assert [a for _, a, *_ in rec.rounds] == hist
    if mode == "asym" and not sampling.greedy:
        assert any(aw for *_, aw in rec.rounds), "no pending correction exercised"


class Faulty:
    """Forward hook that raises inside layer 1 (after layer 0 updated the cache)."""

    def __init__(self, model):
        self.armed = False
        model.model.layers[1].register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected fault mid-forward")


def test_kvmodel_rebuilt_after_failed_forward():
    m = tiny_model(seed=0)
    fault = Faulty(m)
    kv = KVModel(m)
    kv.forward([5, 6, 7, 8])
    fault.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        kv.sync([5, 6, 7, 8, 9], [10, 11])
    assert kv.ids == [] and kv.cache_len() == 0     # rebuilt, never left long
    got = kv.sync([5, 6, 7, 8, 9], [10, 11])
    ref = KVModel(tiny_model(seed=0)).sync([5, 6, 7, 8, 9], [10, 11])
    assert torch.allclose(got, ref, atol=1e-5)
    assert kv.ids == [5, 6, 7, 8, 9, 10, 11] and kv.cache_len() == 7


def test_kvmodel_last_rows_skip_the_head_not_the_cache():
    """``forward(..., last=n)``: only the last n rows' logits (the prefill skips the LM
    head for rows nobody reads); the KV cache is the same as a full pass's."""
    m = tiny_model(seed=0)
    full, part = KVModel(m), KVModel(m)
    ref = full.forward([5, 6, 7, 8, 9, 10])
    got = part.forward([5, 6, 7, 8, 9, 10], last=2)
    assert got.shape == (2, ref.shape[1])
    assert torch.allclose(got, ref[-2:], atol=1e-5)
    for a, b in zip(full.cache.layers, part.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert part.ids == full.ids and part.cache_len() == 6
    assert torch.allclose(part.forward([11]), full.forward([11]), atol=1e-5)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="last="):
            KVModel(m).forward([5, 6], last=bad)


def test_cloud_session_recovers_after_failed_target_pass(tok):
    """A target pass that dies mid-forward leaves the session's confirmed state alone
    and its cache rebuilt; resending the block gives the normal answer."""
    m = tiny_model(seed=0)
    fault = Faulty(m)
    app = create_app(m, tok)
    with BackgroundServer(app) as s:
        http = HTTP(s.url)
        try:
            a = http.create(prompt_ids=PROMPT, sampling=T1.to_dict(), seed=4)
            b = http.create(prompt_ids=PROMPT, sampling=T1.to_dict(), seed=4)
            st0 = http.state(a["session_id"])
            body = vbody(a["session_id"], 0, 3, [9, 10, 11], [0.5, 0.5, 0.5], cfg=T1)
            fault.armed = True
            status, _ = http.verify(a["session_id"], body)
            assert status >= 500
            assert http.state(a["session_id"]) == st0
            sess = app[SERVICE].sessions.get(a["session_id"])
            assert sess.kv.ids == [] and sess.kv.cache_len() == 0
            status, out = http.verify(a["session_id"], body)
            assert status == 200
            sess.check_kv()
            status, ref = http.verify(b["session_id"], vbody(b["session_id"], 0, 3,
                                                             [9, 10, 11], [0.5] * 3, cfg=T1))
            # same verdict and draws; p may differ in the last bits (one pass over the
            # whole prefix instead of prefill + incremental)
            got, want = (strip_time(wire.VerifyResponse.decode(x)) for x in (out, ref))
            assert got[:3] == want[:3] and got[4] == want[4]
            assert got[3][1] == want[3][1] and got[3][3] == want[3][3]
            assert np.allclose(got[3][2], want[3][2], rtol=1e-5)
            assert np.allclose(got[3][4], want[3][4], rtol=1e-5)
        finally:
            http.close()


# ======================================================================= CASES 8: seeds

@pytest.mark.parametrize("mode", ["asym", "standard"])
def test_same_seed_same_output(mode, srv, tok, close_draft):
    kw = dict(mode=mode, depth=4, sampling=T1, max_new_tokens=30)
    a = generate(srv.url, TorchDrafter(close_draft), tok, seed=11, **kw)
    b = generate(srv.url, TorchDrafter(close_draft), tok, seed=11, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.metrics["accepted_hist"] == b.metrics["accepted_hist"]
    assert a.metrics["correction_mode_counts"] == b.metrics["correction_mode_counts"]
    outs = {tuple(generate(srv.url, TorchDrafter(close_draft), tok, seed=s, **kw).token_ids)
            for s in (12, 13, 14)}
    outs.add(tuple(a.token_ids))
    assert len(outs) == 4, "different seeds gave identical samples"


def test_seed_replays_on_a_fresh_server(srv, tok, close_draft):
    kw = dict(depth=3, sampling=SamplingConfig(temperature=1.0, top_k=20), seed=21,
              max_new_tokens=25)
    a = generate(srv.url, TorchDrafter(close_draft), tok, **kw)
    with BackgroundServer(create_app(tiny_model(seed=0), tok)) as s2:
        b = generate(s2.url, TorchDrafter(close_draft), tok, **kw)
    assert a.token_ids == b.token_ids


def test_target_only_sampling_seeds(srv, tok):
    kw = dict(sampling=T1, max_new_tokens=25)
    a = generate(srv.url, None, tok, seed=5, **kw).token_ids
    assert a == generate(srv.url, None, tok, seed=5, **kw).token_ids
    assert a != generate(srv.url, None, tok, seed=6, **kw).token_ids


# ============================================================ CASES 9: retries, duplicates

@pytest.fixture()
def http(srv):
    h = HTTP(srv.url)
    yield h
    h.close()


def test_duplicate_block_answered_from_cache(http):
    info = http.create(prompt_ids=PROMPT)
    sid = info["session_id"]
    body = vbody(sid, 0, 3, [59, 55, 9, 9])
    s1, r1 = http.verify(sid, body)
    st1 = http.state(sid)
    s2, r2 = http.verify(sid, body)
    assert s1 == s2 == 200 and r1 == r2                   # byte-identical
    assert http.state(sid) == st1                         # advanced once
    resp = wire.VerifyResponse.decode(r1)
    assert st1["next_block_seq"] == 1 and st1["base_len"] == 3 + resp.accepted + 1
    assert resp.base_len == st1["base_len"]
    # the session continues from the single advance
    s3, _ = http.verify(sid, vbody(sid, 1, resp.base_len, [9]))
    assert s3 == 200 and http.state(sid)["next_block_seq"] == 2


def test_concurrent_duplicates_advance_once(srv, http):
    info = http.create(prompt_ids=PROMPT, sampling=T1.to_dict(), seed=8)
    sid = info["session_id"]
    body = vbody(sid, 0, 3, [9, 10, 11, 12], [0.9, 0.9, 0.9, 0.9], cfg=T1)

    async def both():
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(f"{srv.url}/v1/sessions/{sid}/verify", data=body,
                                  headers={"content-type": MSGPACK}) as r:
                    return r.status, await r.read()
            return await asyncio.gather(*(one() for _ in range(4)))

    res = asyncio.run(both())
    assert all(st == 200 for st, _ in res) and len({b for _, b in res}) == 1
    st = http.state(sid)
    assert st["next_block_seq"] == 1
    assert st["base_len"] == wire.VerifyResponse.decode(res[0][1]).base_len


def test_same_seq_different_content_is_409(http):
    sid = http.create(prompt_ids=PROMPT)["session_id"]
    assert http.verify(sid, vbody(sid, 0, 3, [59, 9]))[0] == 200
    st = http.state(sid)
    status, data = http.verify(sid, vbody(sid, 0, 3, [59, 10]))
    err = json.loads(data)["error"]
    assert status == 409 and err["code"] == "block_seq_reused" and err["field"] == "block_seq"
    assert err["state"] == st and http.state(sid) == st


def test_stale_blocks_refused_with_confirmed_state(http):
    sid = http.create(prompt_ids=PROMPT)["session_id"]
    r0 = wire.VerifyResponse.decode(http.verify(sid, vbody(sid, 0, 3, [59, 9]))[1])
    r1 = wire.VerifyResponse.decode(http.verify(sid, vbody(sid, 1, r0.base_len, [9]))[1])
    # the block before the last is still answered from the replay cache (its answer may
    # have been lost while a block sent ahead was verified), unchanged
    st = http.state(sid)
    assert http.verify(sid, vbody(sid, 0, 3, [59, 9]))[1] == http.verify(
        sid, vbody(sid, 0, 3, [59, 9]))[1] and http.state(sid) == st
    r2 = wire.VerifyResponse.decode(http.verify(sid, vbody(sid, 2, r1.base_len, [9]))[1])
    st = http.state(sid)
    assert st["base_len"] == r2.base_len and st["next_block_seq"] == 3
    cases = [
        (vbody(sid, 3, r1.base_len, [9]), "base_len"),    # old base, current seq
        (vbody(sid, 0, 3, [59, 9]), "block_seq"),          # an old block, resent late
        (vbody(sid, 2, r1.base_len, [7]), "block_seq"),    # old seq, new content
        (vbody(sid, 6, r2.base_len, [9]), "block_seq"),    # a block from the future
    ]
    for body, field in cases:
        status, data = http.verify(sid, body)
        err = json.loads(data)["error"]
        assert status == 409, data
        assert err["field"] == field
        assert err["state"] == st, "the refusal must carry the confirmed state"
        assert http.state(sid) == st


def test_sampling_retry_never_resamples(http):
    """A resent sampling block returns the same verdict, correction support and
    proposals; a fresh session with the same seed and block draws the same too."""
    def new_session():
        return http.create(prompt_ids=PROMPT, sampling=T1.to_dict(), seed=9,
                           n_proposals=6)["session_id"]

    for t in range(2, V):       # q = 1 makes a rejection likely; find one deterministically
        sid = new_session()
        body = vbody(sid, 0, 3, [t, t], [1.0, 1.0], cfg=T1)
        status, out = http.verify(sid, body)
        assert status == 200
        resp = wire.VerifyResponse.decode(out)
        if resp.correction is not None:
            break
    else:
        raise AssertionError("no block was rejected")
    st = http.state(sid)
    assert st["awaiting_correction"] and len(resp.correction.proposal_ids) == 6
    status, again = http.verify(sid, body)
    assert status == 200 and again == out
    assert http.state(sid) == st
    other = new_session()
    status, o = http.verify(other, vbody(other, 0, 3, [t, t], [1.0, 1.0], cfg=T1))
    assert strip_time(wire.VerifyResponse.decode(o)) == strip_time(resp)
    # the edge's correction rides on the next block; then the old block is stale
    pend = int(resp.correction.support_ids[0])
    status, _ = http.verify(sid, vbody(sid, 1, st["base_len"], [9], [0.5], pending=pend,
                                       cfg=T1))
    assert status == 200
    status, data = http.verify(sid, body)
    assert status == 409 and json.loads(data)["error"]["state"] == http.state(sid)


class Delayed(Transport):
    """Verify requests leave ``delay_s`` late (a slower link)."""

    delay_s = 0.0

    async def request(self, method, path, body=b"", content_type=MSGPACK, **kw):
        if path.endswith("/verify"):
            await asyncio.sleep(self.delay_s)
        return await super().request(method, path, body, content_type, **kw)


class DoubleSend(Delayed):
    """Delivers every verify request twice (as a retry after a lost response would)
    and keeps the second answer."""

    async def request(self, method, path, body=b"", content_type=MSGPACK, **kw):
        if path.endswith("/verify"):
            first = await super().request(method, path, body, content_type, **kw)
            second = await super().request(method, path, body, content_type, **kw)
            assert first[0] == second[0], "a retried block got a different answer"
            return second
        return await super().request(method, path, body, content_type, **kw)


@pytest.mark.parametrize("mode,ahead", [("asym", False), ("standard", False),
                                        ("asym", True)],
                         ids=["asym", "standard", "asym-send-ahead"])
def test_transport_retries_do_not_double_sample(mode, ahead, app, srv, rec, tok,
                                                close_draft):
    kw = dict(mode=mode, depth=4, sampling=T1, seed=17, max_new_tokens=30)
    slow, double = Delayed(srv.url), DoubleSend(srv.url)
    if ahead:   # blocks sent before their predecessor's verdict, each delivered twice
        kw.update(proactive="ipdg", send_ahead=True)
        slow.delay_s = double.delay_s = 0.02
    rec.reset()
    plain = generate(srv.url, TorchDrafter(close_draft), tok, transport=slow, **kw)
    passes = len(rec.rounds)
    rec.reset()
    retried = generate(srv.url, TorchDrafter(close_draft), tok, transport=double, **kw)
    assert retried.token_ids == plain.token_ids
    assert retried.metrics["accepted_hist"] == plain.metrics["accepted_hist"]
    assert len(rec.rounds) == passes, "a duplicate block ran a second target pass"
    if ahead:
        assert plain.metrics["ahead_blocks"] > 0 and retried.metrics["ahead_hits"] > 0


# ================================================================== CASES 10: statistics

@pytest.mark.parametrize("mode,sampling,depth,max_new", [
    ("asym", GREEDY, 4, 40), ("asym", T1, 5, 40), ("standard", T1, 3, 33),
    ("asym", GREEDY, 8, 7)], ids=["greedy-d4", "asym-t1-d5", "standard-t1-d3", "cut-d8"])
def test_statistics_are_honest(mode, sampling, depth, max_new, srv, rec, tok, close_draft):
    rec.reset()
    # seed 0: a run of several rounds (seed 2 now samples EOS after one round)
    r = generate(srv.url, TorchDrafter(close_draft), tok, mode=mode, depth=depth,
                 sampling=sampling, seed=0, max_new_tokens=max_new)
    m = r.metrics
    assert m["rounds"] >= 2 and len(r.token_ids) >= min(max_new, 8)
    cloud_g = [g for g, *_ in rec.rounds]
    cloud_a = [a for _, a, *_ in rec.rounds]
    # recount from the cloud's own per-round verdicts
    assert m["rounds"] == len(rec.rounds) == len(m["accepted_hist"])
    assert m["accepted_hist"] == cloud_a
    assert m["drafted_tokens"] == sum(cloud_g)
    assert m["accepted_tokens"] == sum(cloud_a)
    assert m["acceptance_rate"] == pytest.approx(sum(cloud_a) / sum(cloud_g), abs=1e-15)
    assert 0 < m["acceptance_rate"] < 1
    # bonus and corrections are reported apart from accepted drafts
    full = sum(a == g > 0 for g, a, *_ in rec.rounds)
    plain = sum(g == 0 for g, *_ in rec.rounds)        # depth-0: target step, no draft
    assert m["bonus_tokens"] == full
    assert m["target_step_tokens"] == plain
    assert m["correction_tokens"] == m["rounds"] - full - plain
    assert m["committed_tokens"] == len(r.token_ids)
    assert m["committed_tokens"] <= m["accepted_tokens"] + m["rounds"]
    assert m["mean_accepted_length"] == pytest.approx(m["committed_tokens"] / m["rounds"])
    assert m["wasted_draft_tokens"] == m["drafted_tokens"] - m["accepted_tokens"]
    assert m["target_passes"] == m["rounds"]
    if mode == "asym" and not sampling.greedy:
        assert sum(m["correction_mode_counts"].values()) == m["correction_tokens"]


def test_target_only_reports_zero_drafted(srv, rec, tok):
    rec.reset()
    r = generate(srv.url, None, tok, max_new_tokens=12)
    m = r.metrics
    assert m["drafted_tokens"] == 0 and m["accepted_tokens"] == 0
    assert m["acceptance_rate"] == 0.0 and m["wasted_draft_tokens"] == 0
    assert m["rounds"] == m["committed_tokens"] == 12 == len(rec.rounds)
    assert m["mean_accepted_length"] == 1.0
    assert all(g == 0 for g, *_ in rec.rounds) and set(m["accepted_hist"]) == {0}


def test_acceptance_counts_only_target_verdicts_with_eos_cut(tok, close_draft, eos_greedy):
    """Tokens the target accepted after an EOS are still accepted drafts (honest rate),
    but they are never committed."""
    cands, refs = eos_greedy
    cfg, j = _pick(cands, "first")[0]
    ref = refs[tuple(cfg["prompt_ids"])]
    r, _ = _eos_server_run(tok, ref[j], close_draft, cfg, 48)
    m = r.metrics
    assert m["committed_tokens"] == j + 1
    assert m["accepted_tokens"] == sum(m["accepted_hist"])
    assert m["acceptance_rate"] == m["accepted_tokens"] / m["drafted_tokens"]
    assert sum(a + 1 for a in m["accepted_hist"]) > m["committed_tokens"]
