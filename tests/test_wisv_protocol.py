"""WISV's protocol and serving side (opt-in semantic, lossy acceptance; WISV §III):

* wire: the session's ``acceptance``, the verify request's ``channel`` element and the
  response's ``semantic`` offsets validate what they read and round-trip; an exact
  session's messages are the bytes they were before (no new elements);
* exact mode is unchanged: the same response bytes with and without a head loaded, the
  head and the hidden-state hook are never used for exact sessions, and an exact block
  batched with a semantic one is decided as alone;
* a head forced to accept accepts mismatches up to the per-block cap, counts them (the
  server, the response, the client's result, Prometheus) and every non-semantic token
  is still the target's argmax on the (lossy) prefix; a head forced to reject gives the
  exact output; a worse reported channel lowers tau and flips a borderline decision;
* bad input (acceptance, semantic with sampling, semantic without a head or on the
  scoring backend, malformed or misplaced channel) is a 4xx JSON naming the field,
  never a 500; over a real signed server, streamed (FSD) answers and the retry cache
  (a retried semantic block is answered from the cache, never decided again);
* the head loader, the SDK's channel estimator, the OpenAI endpoint and the CLI flags.
"""

from __future__ import annotations

import asyncio
import json
import math
import types

import numpy as np
import pytest
import torch

from cloud_api import verifier as verifier_mod
from cloud_api.context import SERVICE
from cloud_api.early_exit import untrained_head
from cloud_api.inprocess import InProcessTransport
from cloud_api.local import local_server
from cloud_api.service import CloudService
from cloud_api.sessions import ApiError
from cloud_api.wisv.head import DecisionHead, save_head
from cloud_api.wisv.serving import SemanticAcceptance, semantic_for
from cloud_api.wisv.threshold import ChannelState, ThresholdPolicy
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.channel import UNKNOWN_UPLINK_BPS, ChannelEstimator
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import frames, wire
from edge_sdk.protocol.wire import VerifyRequest, VerifyResponse, WireError
from tests.conftest import RawHTTP, tiny_model

PROMPT = [5, 9, 11]
H, V = 32, 64
# the strong and cellular-edge links
STRONG = types.SimpleNamespace(rtt_s=0.020, uplink_bps=250e6)
CELLULAR = types.SimpleNamespace(rtt_s=0.120, uplink_bps=5e6)


@pytest.fixture(scope="module")
def rough(target):
    """A draft that disagrees with the target often (many mismatches to decide)."""
    return tiny_model(seed=1, like=target, noise=0.3)


def head_with(p: float | None = None, bias: float | None = None) -> DecisionHead:
    """A head whose P(accept) is the constant ``p`` (zero weights), or whose final bias
    is ``bias`` (+50: always accept, -50: never)."""
    h = DecisionHead(H)
    with torch.no_grad():
        if p is not None:
            h.net.weight.zero_()
            h.net.bias.fill_(math.log(p / (1 - p)))
        else:
            h.net.bias.fill_(bias)
    return h


def semantic(p=None, bias=None, cap=2, guard="off", **policy) -> SemanticAcceptance:
    return SemanticAcceptance(head_with(p, bias), ThresholdPolicy(**policy), cap,
                              guard=guard)


class Recording(InProcessTransport):
    """In-process transport that keeps every verify (request bytes, response bytes)."""

    def __init__(self, svc):
        super().__init__(svc)
        self.verifies: list[tuple[bytes, bytes]] = []

    async def request(self, method, path, body=b"", content_type="", on_early=None):
        data, ct = await super().request(method, path, body, content_type, on_early)
        if path.endswith("/verify"):
            self.verifies.append((body, data))
        return data, ct


def generate(transport, draft, tok, n=40, prompt=PROMPT, gen_kw=None, **kw):
    async def main():
        async with EdgeClient("inproc://", TorchDrafter(draft), tok, chat=False,
                              transport=transport,
                              **{"depth": 6, "controller": "fixed", **kw}) as c:
            return await c.generate(prompt_ids=prompt, max_new_tokens=n, **(gen_kw or {}))
    return asyncio.run(main())


def argmax_after(model, ids: list[int]) -> list[int]:
    """The target's argmax after each prefix ``ids[:i+1]`` (one full forward)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].argmax(-1).tolist()


@pytest.fixture()
def frozen_clock(monkeypatch):
    """The verifier's clock stands still (target_s is 0.0) and session ids are fixed:
    answers of two servers are comparable byte for byte."""
    from cloud_api.sessions import SessionStore

    monkeypatch.setattr(verifier_mod, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    monkeypatch.setattr(SessionStore, "new_id", lambda self: 4242 + len(self))


# ----------------------------------------------------------------------------- wire

def test_session_acceptance_field():
    m = wire.decode_session_request({"prompt_ids": [1, 2]}, V, 256)
    assert m["acceptance"] == "exact"
    m = wire.decode_session_request({"prompt_ids": [1, 2], "acceptance": "semantic"}, V, 256)
    assert m["acceptance"] == "semantic"
    for bad in ("lossy", "", None, 1, ["semantic"], "EXACT"):
        with pytest.raises(WireError) as e:
            wire.decode_session_request({"prompt_ids": [1, 2], "acceptance": bad}, V, 256)
        assert e.value.field == "acceptance"


def _request(channel=None, expect=7, pending=None):
    return VerifyRequest(3, 1, 5, 0, pending, np.array([4, 5, 6]), None, None, expect,
                         channel)


def test_channel_element_round_trip_and_exact_bytes_unchanged():
    for expect, pending in ((7, None), (None, 9)):
        r = _request((0.08, 5e7, 0.21), expect, pending)
        m = wire.unpack(r.encode(V))
        assert len(m) == 11 and m[10] == [0.08, 5e7, 0.21] and m[9] == expect
        got = VerifyRequest.decode(r.encode(V), V, 8)
        assert got.channel == (0.08, 5e7, 0.21) and got.expect_last == expect
        assert got.encode(V) == r.encode(V)
    # no channel: the element layout of before (9 or 10 elements)
    assert len(wire.unpack(_request(None, 7).encode(V))) == 10
    assert len(wire.unpack(_request(None, None, 9).encode(V))) == 9
    assert VerifyRequest.decode(_request().encode(V), V, 8).channel is None


@pytest.mark.parametrize("bad", [
    [0.08, 5e7], [0.08, 5e7, 0.2, 1.0], "0.08", {"rtt_s": 0.1}, [1, 5e7, 0.2],
    [float("nan"), 5e7, 0.2], [0.08, float("inf"), 0.2], [-0.01, 5e7, 0.2],
    [0.08, 0.0, 0.2], [0.08, 5e7, -1.0], [61.0, 5e7, 0.2], [0.08, 2e12, 0.2],
    [0.08, 5e7, 4000.0], [True, 5e7, 0.2], [0.08, None, 0.2]])
def test_malformed_channel_is_a_wire_error(bad):
    m = wire.unpack(_request().encode(V)) + [bad]
    with pytest.raises(WireError) as e:
        VerifyRequest.decode(wire.pack(m), V, 8)
    assert e.value.field == "channel"


def test_semantic_offsets_in_the_response():
    r = VerifyResponse(2, 4, 17, None, 12, 0.25, (1,), (0, 2))
    got = VerifyResponse.decode(r.encode())
    assert got.semantic == (0, 2) and got.semantic_accepted == 2 and got == r
    exact = VerifyResponse(2, 4, 17, None, 12, 0.25, (1,))
    assert len(wire.unpack(exact.encode())) == 8          # exact: no new element
    assert VerifyResponse.decode(exact.encode()).semantic is None
    assert exact.semantic_accepted == 0
    assert len(wire.unpack(VerifyResponse(2, 0, 17, None, 12, 0.2, (), ()).encode())) == 9
    base = wire.unpack(exact.encode())
    for bad in ([4], [2, 1], [1, 1], [-1], "x", [0.5]):   # nil: no semantic offsets
        with pytest.raises(WireError) as e:
            VerifyResponse.decode(wire.pack(base + [bad]))
        assert e.value.field == "semantic"
    stream = frames.StreamReader(V).feed(frames.EarlyVerdict(2, 1, 9, 1, 0.1).encode()
                                         + r.encode())
    assert stream[1].semantic == (0, 2)


# ----------------------------------------------------------------------------- policy

def test_threshold_relaxes_as_the_link_worsens():
    pol = ThresholdPolicy()
    taus = [pol(ChannelState(rtt, up, 0.1)) for rtt, up in
            ((0.02, 250e6), (0.04, 150e6), (0.08, 50e6), (0.12, 5e6))]
    assert taus == sorted(taus, reverse=True) and taus[0] > taus[-1]
    assert pol(None) == pol.strict and pol(ChannelState(5.0, 1.0, 1.0)) == pol.relaxed
    sa = semantic(p=0.8)
    assert sa.threshold(None) == sa.policy.strict
    assert sa.threshold((0.12, 5e6, 0.3)) < 0.8 < sa.threshold((0.02, 250e6, 0.1))


def test_channel_estimator():
    est = ChannelEstimator()
    assert est.state() == (0.0, UNKNOWN_UPLINK_BPS, 0.0)       # strict until measured
    est.observe(0.1, 0.3)
    est.observe(None, 0.5)                # a block sent ahead: no network figure
    est.observe(0.3, 0.4)
    rtt, up, rnd = est.state()
    assert rtt == pytest.approx(0.2) and up == UNKNOWN_UPLINK_BPS and rnd == pytest.approx(0.4)
    est = ChannelEstimator({"rtt_s": 0.12, "uplink_bps": 5e6})
    est.observe(99.0, 1e5)
    assert est.state() == (0.12, 5e6, 3600.0)                  # clamped to its range
    for link in ({"rtt_s": -1, "uplink_bps": 1e6}, {"rtt_s": 0.1, "uplink_bps": 0}):
        with pytest.raises(ValueError):
            ChannelEstimator(link)


def test_head_settings(tmp_path):
    assert semantic_for("off", H) is None and semantic_for(None, H) is None
    assert semantic_for("auto", H, "no-such-preset") is None
    path = tmp_path / "h.safetensors"
    save_head(head_with(bias=2.0), path, {"model": "tiny", "label": "test"})
    sa = semantic_for(str(path), H, strict=0.8, relaxed=0.6, max_per_block=3)
    assert sa.max_per_block == 3 and sa.policy.strict == 0.8 and sa.policy.relaxed == 0.6
    assert sa.guard == "off"
    assert semantic_for(str(path), H, guard="operators").guard == "operators"
    assert float(sa.head.net.bias.detach()) == 2.0
    for bad, kw in ((tmp_path / "missing.safetensors", {}), (path, {"hidden": 16}),
                    (path, {"strict": 0.3})):
        with pytest.raises(ValueError) as e:
            semantic_for(str(bad), kw.get("hidden", H), strict=kw.get("strict"))
        assert "\n" not in str(e.value)
    path.write_bytes(path.read_bytes()[:-1] + b"!")               # sha256 now differs
    with pytest.raises(ValueError, match="sha256"):
        semantic_for(str(path), H)
    with pytest.raises(ValueError):
        SemanticAcceptance(head_with(bias=0.0), max_per_block=0)


def test_in_process_servers_take_the_serve_options(target, tok, tmp_path):
    path = tmp_path / "h.safetensors"
    save_head(head_with(bias=50.0), path, {"model": "tiny", "label": "test"})
    with local_server(target, tok, wisv_head=str(path), wisv_strict=0.7,
                      wisv_max_per_block=4) as srv:
        sa = srv.app[SERVICE].verifier.semantic
        assert sa.max_per_block == 4 and sa.policy.strict == 0.7
        assert sa.guard == "off" and sa.guarded is None
    with local_server(target, tok, wisv_head=str(path), wisv_guard="operators") as srv:
        sa = srv.app[SERVICE].verifier.semantic
        assert sa.guard == "operators" and sa.guarded.shape == (target.config.vocab_size,)
    with local_server(target, tok, wisv_head="auto", preset="no-such-preset") as srv:
        assert srv.app[SERVICE].verifier.semantic is None
    with pytest.raises(ValueError, match="WISV head"):
        with local_server(target, tok, wisv_head=str(tmp_path / "x.safetensors")):
            pass


# ----------------------------------------------------------------------------- exact mode

def test_exact_mode_bit_for_bit_with_a_head_loaded(target, draft, tok, frozen_clock):
    """Same request and response bytes with and without a head; the head and the
    hidden-state hook are never used for exact sessions."""
    sa = semantic(bias=50.0)
    runs = []
    for sem in (None, sa):
        svc = CloudService(target, tok, semantic=sem)
        hooked = []
        svc.verifier._hidden_hook = lambda m, a: hooked.append(1)
        rec = Recording(svc)
        res = generate(rec, draft, tok)
        runs.append((res, rec.verifies))
        assert hooked == [] and svc.verifier.semantic_accepted == 0
    (r0, v0), (r1, v1) = runs
    assert sa.calls == 0
    assert r0.token_ids == r1.token_ids and v0 == v1 and len(v0) > 3
    for body, data in v1:
        assert len(wire.unpack(body)) in (9, 10) and len(wire.unpack(data)) == 8
    assert r1.exact_target_output and r1.semantic_accepted_tokens == 0
    assert r1.acceptance == "exact" and r1.metrics["semantic_accepted_tokens"] == 0


def test_exact_block_batched_with_a_semantic_block_is_decided_as_alone(target, tok,
                                                                       frozen_clock):
    """One padded pass over an exact and a semantic session (always-accept head): the
    exact row's answer is the bytes it gets from a server without a head."""
    ctx = [7, 8, 9, 10]
    best = argmax_after(target, ctx)[-1]
    block = [(best + 1) % V, 3, 4]                              # a mismatch at offset 0

    def body(info, chan=None):
        return VerifyRequest(int(info["session_id"]), 0, len(ctx), info["config_id"], None,
                             np.array(block), None, None, ctx[-1], chan).encode(V)

    async def answers(svc, with_semantic):
        ex = await svc.create({"prompt_ids": ctx}, None)
        items = [(svc.sessions.get(ex["session_id"]),
                  VerifyRequest.decode(body(ex), V, 16))]
        if with_semantic:
            se = await svc.create({"prompt_ids": [3, 4], "acceptance": "semantic"}, None)
            miss = (argmax_after(target, [3, 4])[-1] + 1) % V
            sreq = VerifyRequest(int(se["session_id"]), 0, 2, se["config_id"], None,
                                 np.array([miss, 2, 3]), None, None, 4, (0.1, 1e6, 0.2))
            items.append((svc.sessions.get(se["session_id"]), sreq))
        out = svc.verifier.verify_batch(items)
        return [r.encode() for r in out]

    alone = asyncio.run(answers(CloudService(target, tok), False))
    sa = semantic(bias=50.0)
    mixed = asyncio.run(answers(CloudService(target, tok, semantic=sa), True))
    assert mixed[0] == alone[0] and len(wire.unpack(mixed[0])) == 8
    assert wire.unpack(alone[0])[2] == 0                         # rejected at offset 0
    sem = VerifyResponse.decode(mixed[1])
    assert sa.calls == 1 and sem.semantic_accepted >= 1


# ----------------------------------------------------------------------------- semantic

@pytest.mark.parametrize("cap", [1, 2, 3])
def test_always_accepting_head_up_to_the_cap(target, rough, tok, cap):
    sa = semantic(bias=50.0, cap=cap)
    svc = CloudService(target, tok, semantic=sa)
    rec = Recording(svc)
    events = []

    async def main():
        async with EdgeClient("inproc://", TorchDrafter(rough), tok, chat=False, depth=6,
                              transport=rec, acceptance="semantic") as c:
            gen = c.stream(prompt_ids=PROMPT, max_new_tokens=48)
            async for ev in gen:
                events.append(ev)
            return gen.result()
    res = asyncio.run(main())
    resps = [VerifyResponse.decode(d) for _, d in rec.verifies]
    counts = [r.semantic_accepted for r in resps]
    assert max(counts) == cap and all(c <= cap for c in counts)
    for body, _ in rec.verifies:
        chan = VerifyRequest.decode(body, V, 16).channel
        assert chan is not None and all(math.isfinite(x) for x in chan)
    n = res.semantic_accepted_tokens
    assert n > 0 and n == sum(ev.semantic for ev in events) == res.metrics[
        "semantic_accepted_tokens"]
    assert n <= svc.verifier.semantic_accepted == sum(counts)
    assert not res.exact_target_output and res.acceptance == "semantic"
    d = res.to_dict()
    assert d["semantic_accepted_tokens"] == n and d["exact_target_output"] is False
    # semantic tokens are not the target's argmax; every other one is (on this prefix)
    ids = PROMPT + res.token_ids
    best = argmax_after(target, ids)
    for i, (t, sem) in enumerate(zip(res.token_ids, res.semantic)):
        assert (best[len(PROMPT) + i - 1] != t) == sem
    m = res.metrics
    assert m["mean_accepted_length"] == m["committed_tokens"] / m["rounds"] > 1.0


def test_always_rejecting_head_gives_the_exact_output(target, rough, tok):
    ref = generate(InProcessTransport(CloudService(target, tok)), rough, tok)
    sa = semantic(bias=-50.0)
    res = generate(InProcessTransport(CloudService(target, tok, semantic=sa)), rough, tok,
                   acceptance="semantic")
    assert res.token_ids == ref.token_ids and sa.calls > 0
    assert res.semantic_accepted_tokens == 0 and res.exact_target_output


def test_the_token_guard_keeps_guarded_mismatches_exact(target, rough, tok):
    """An always-accepting head: with every id guarded the output is exact (and the
    head is never asked); with only the ids the exact run emits guarded, no semantic
    token replaces one of them and none is accepted in place of one."""
    ref = generate(InProcessTransport(CloudService(target, tok)), rough, tok)
    sa = semantic(bias=50.0, guard="operators")
    sa.guarded = torch.ones(V, dtype=torch.bool)          # bind() keeps a set mask
    res = generate(InProcessTransport(CloudService(target, tok, semantic=sa)), rough, tok,
                   acceptance="semantic")
    assert res.token_ids == ref.token_ids and res.semantic_accepted_tokens == 0
    assert sa.calls == 0
    free = semantic(bias=50.0)
    loose = generate(InProcessTransport(CloudService(target, tok, semantic=free)), rough,
                     tok, acceptance="semantic")
    assert loose.semantic_accepted_tokens > 0
    sem_ids = {t for t, s in zip(loose.token_ids, loose.semantic) if s}
    sa = semantic(bias=50.0, guard="operators")
    sa.guarded = torch.zeros(V, dtype=torch.bool)
    sa.guarded[sorted(sem_ids)] = True
    res = generate(InProcessTransport(CloudService(target, tok, semantic=sa)), rough, tok,
                   acceptance="semantic")
    ids = PROMPT + res.token_ids
    best = argmax_after(target, ids)
    for i, (t, s) in enumerate(zip(res.token_ids, res.semantic)):
        if s:                       # neither the accepted draft nor the target's token
            assert not sa.guarded[t] and not sa.guarded[best[len(PROMPT) + i - 1]]
    assert res.token_ids != loose.token_ids


def test_guarded_tokens_of_a_tokenizer():
    """The guard reads whole tokens: operators, comparisons, keywords, numbers."""
    from cloud_api.wisv.serving import guarded_tokens

    class Tok:
        words = [" ==", "<=", " +", "-", " and", "not", " in", " True", " 42", "0",
                 " 3.5", " x", " count", "()", "\n", " ", "==x", " index", "  ", " //"]

        def __len__(self):
            return len(self.words)

        def batch_decode(self, ids, clean_up_tokenization_spaces=False):
            return [self.words[i[0]] for i in ids]

    g = guarded_tokens(Tok(), 24)
    assert g.shape == (24,) and g.dtype == torch.bool
    assert g.tolist() == [True] * 11 + [False] * 8 + [True] + [False] * 4
    assert SemanticAcceptance(head_with(bias=0.0)).guard == "off"
    sa = SemanticAcceptance(head_with(bias=0.0), guard="operators")
    with pytest.raises(RuntimeError, match="bind"):
        sa.allowed(torch.tensor([1]), torch.tensor([2]))
    sa.bind(Tok(), 24)
    assert sa.allowed(torch.tensor([11, 11, 0, 12, 30]),
                      torch.tensor([12, 1, 13, 19, 12])).tolist() == [
        True, False, False, False, True]
    with pytest.raises(ValueError, match="guard"):
        SemanticAcceptance(head_with(bias=0.0), guard="strict")


def test_a_worse_channel_flips_a_borderline_decision(target, rough, tok):
    """P(accept) = 0.8: refused under a strong link's tau (0.9), accepted under a
    cellular one (about 0.66)."""
    ref = generate(InProcessTransport(CloudService(target, tok)), rough, tok)
    out = {}
    for name, link in (("strong", STRONG), ("cellular", CELLULAR)):
        sa = semantic(p=0.8)
        rec = Recording(CloudService(target, tok, semantic=sa))
        out[name] = generate(rec, rough, tok, acceptance="semantic", link=link)
        chan = VerifyRequest.decode(rec.verifies[-1][0], V, 16).channel
        assert chan[:2] == (link.rtt_s, link.uplink_bps) and chan[2] > 0
    assert out["strong"].token_ids == ref.token_ids
    assert out["strong"].semantic_accepted_tokens == 0
    assert out["cellular"].semantic_accepted_tokens > 0


def test_semantic_with_proactive_send_ahead_and_fsd(target, rough, tok):
    """Pipelined rounds and streamed (FSD) answers carry the counts; the edge and the
    cloud agree on the confirmed prefix throughout (the SDK checks every round)."""
    for kw, early in (({"proactive": "ipdg", "send_ahead": True}, None),
                      ({"proactive": "fsd"}, untrained_head(target, 1))):
        sa = semantic(bias=50.0)
        svc = CloudService(target, tok, semantic=sa, early_head=early)
        res = generate(InProcessTransport(svc), rough, tok, acceptance="semantic", **kw)
        assert 0 < res.semantic_accepted_tokens <= svc.verifier.semantic_accepted
        if early is not None:
            assert svc.verifier.early_frames > 0


def test_bad_requests_in_process(target, tok):
    svc = CloudService(target, tok)
    with pytest.raises(ApiError) as e:
        asyncio.run(svc.create({"prompt_ids": [1, 2], "acceptance": "semantic"}, None))
    assert (e.value.status, e.value.code, e.value.field) == (422, "semantic_unavailable",
                                                             "acceptance")
    with pytest.raises(ValueError):
        EdgeClient("http://127.0.0.1:9", None, tok, acceptance="lossy")
    with pytest.raises(ValueError, match="greedy"):
        generate(InProcessTransport(CloudService(target, tok, semantic=semantic(bias=0.0))),
                 target, tok, acceptance="semantic",
                 gen_kw={"sampling": SamplingConfig(temperature=0.7)})


def test_scoring_backend_refuses_semantic(target, tok):
    from cloud_api.scoring.local import ModelScorer
    from cloud_api.scoring.verifier import ScoringVerifier

    svc = CloudService(None, tok, verifier=ScoringVerifier(ModelScorer(target, 20), V, 256))
    with pytest.raises(ApiError) as e:
        asyncio.run(svc.create({"prompt_ids": [1, 2], "acceptance": "semantic"}, None))
    assert (e.value.status, e.value.code, e.value.field) == (422, "semantic_unavailable",
                                                             "acceptance")
    with pytest.raises(ValueError):
        CloudService(None, tok, verifier=svc.verifier, semantic=semantic(bias=0.0))


# ----------------------------------------------------------------------------- over HTTP

def _error(st, data):
    err = json.loads(data)["error"]
    return st, err["code"], err.get("field")


def test_http_validation_and_retry_cache(target, tok):
    """Signed loopback server: 4xx JSON naming the field, never a 500; a retried
    semantic block is answered from the cache (same bytes, same count, no new head
    call)."""
    sa = semantic(bias=50.0)
    with local_server(target, tok, semantic=sa) as srv, \
            local_server(target, tok, name="no-head") as plain:
        http, bare = RawHTTP(srv.url, srv.signer), RawHTTP(plain.url, plain.signer)
        try:
            st, data = http("POST", "/v1/sessions", wire.pack(
                {"prompt_ids": PROMPT, "acceptance": "lossy"}))
            assert _error(st, data) == (400, "bad_request", "acceptance")
            st, data = http("POST", "/v1/sessions", wire.pack(
                {"prompt_ids": PROMPT, "acceptance": "semantic",
                 "sampling": {"temperature": 0.7}}))
            assert _error(st, data) == (422, "bad_field", "acceptance")
            st, data = bare("POST", "/v1/sessions", wire.pack(
                {"prompt_ids": PROMPT, "acceptance": "semantic"}))
            assert _error(st, data) == (422, "semantic_unavailable", "acceptance")
            st, data = http("POST", "/v1/sessions", json.dumps(
                {"prompt_ids": PROMPT, "acceptance": 3}).encode(), "application/json")
            assert _error(st, data) == (400, "bad_request", "acceptance")

            info = http.create(prompt_ids=PROMPT, acceptance="semantic")
            assert info["acceptance"] == "semantic"
            exact = http.create(prompt_ids=PROMPT)
            assert "acceptance" not in exact
            sid = info["session_id"]
            best = argmax_after(target, PROMPT)[-1]
            block = np.array([(best + 1) % V, 7, 8])
            req = VerifyRequest(int(sid), 0, len(PROMPT), info["config_id"], None, block,
                                None, None, PROMPT[-1], (0.05, 1e7, 0.1))
            m = wire.unpack(req.encode(V))
            for chan in ([0.05, 1e7], [float("nan"), 1e7, 0.1], "x", [0.05, -1.0, 0.1]):
                st, data = http.verify(sid, wire.pack(m[:10] + [chan]))
                assert _error(st, data) == (400, "bad_request", "channel")
            ex = VerifyRequest(int(exact["session_id"]), 0, len(PROMPT),
                               exact["config_id"], None, block, None, None, PROMPT[-1],
                               (0.05, 1e7, 0.1))
            st, data = http.verify(exact["session_id"], ex.encode(V))
            assert _error(st, data) == (422, "bad_field", "channel")

            st, first = http.verify(sid, req.encode(V))
            assert st == 200
            resp = VerifyResponse.decode(first)
            assert resp.semantic_accepted >= 1 and 0 in resp.semantic
            calls = sa.calls
            st, again = http.verify(sid, req.encode(V))
            assert st == 200 and again == first and sa.calls == calls
            st, data = http("GET", "/metrics")
            line = next(ln for ln in data.decode().splitlines()
                        if ln.startswith("specrelay_semantic_accepted_tokens_total"))
            assert float(line.split()[-1]) == resp.semantic_accepted
        finally:
            http.close()
            bare.close()


def test_end_to_end_over_signed_http(target, rough, tok):
    """The SDK over a real signed server, stop-and-wait and streamed (FSD)."""
    from edge_sdk.transport import Transport

    for kw in ({}, {"proactive": "fsd"}):
        sa = semantic(bias=50.0)
        early = untrained_head(target, 1) if kw else None
        with local_server(target, tok, semantic=sa, early_head=early) as srv:
            res = generate(Transport(srv.url, signer=srv.signer), rough, tok,
                           acceptance="semantic", link=CELLULAR, **kw)
            exact = generate(Transport(srv.url, signer=srv.signer), rough, tok, **kw)
            n_server = srv.app[SERVICE].verifier.semantic_accepted
        assert res.semantic_accepted_tokens > 0 and not res.exact_target_output
        assert exact.exact_target_output and exact.semantic_accepted_tokens == 0
        assert n_server >= res.semantic_accepted_tokens


# ----------------------------------------------------------------------------- surfaces

def test_openai_endpoint_flags_lossy_output(target, rough, tok):
    import urllib.error
    import urllib.request

    from cloud_api.server import BackgroundServer
    from edge_sdk.openai_server import create_edge_app

    def post(url, body):
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    with local_server(target, tok, semantic=semantic(bias=50.0)) as cloud:
        app = create_edge_app(cloud.url, TorchDrafter(rough), tok, signer=cloud.signer,
                              depth=4)
        with BackgroundServer(app) as edge:
            url = edge.url + "/v1/completions"
            base = {"prompt": "w5 w9 w11", "max_tokens": 16, "temperature": 0}
            st, r = post(url, base | {"acceptance": "semantic"})
            assert st == 200, r
            ext = r["specrelay"]
            assert ext["acceptance"] == "semantic" and ext["exact"] is False
            assert ext["semantic_accepted_tokens"] > 0
            st, r = post(url, base)
            assert st == 200 and r["specrelay"]["exact"] is True
            assert r["specrelay"]["acceptance"] == "exact"
            assert r["specrelay"]["semantic_accepted_tokens"] == 0
            for bad in ({"acceptance": "lossy"},
                        {"acceptance": "semantic", "temperature": 0.7}):
                st, r = post(url, base | bad)
                assert st == 400 and r["error"]["param"] == "acceptance"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_flags(tmp_path):
    from click.testing import CliRunner

    from specrelay_cli import main

    port = str(_free_port())

    r = CliRunner().invoke(main, ["generate", "hi", "--acceptance", "semantic",
                                  "--temperature", "0.7"])
    assert r.exit_code == 2 and "--acceptance" in r.output
    r = CliRunner().invoke(main, ["serve", "--help"])
    for opt in ("--wisv-head", "--wisv-strict", "--wisv-relaxed", "--wisv-max-per-block",
                "--wisv-guard"):
        assert opt in r.output
    r = CliRunner().invoke(main, ["serve", "--port", port, "--wisv-head",
                                  str(tmp_path / "none.safetensors")])
    assert r.exit_code == 2 and "--wisv-head" in r.output
    r = CliRunner().invoke(main, ["serve", "--port", port, "--wisv-strict", "0.3"])
    assert r.exit_code == 2 and "--wisv-strict" in r.output
    r = CliRunner().invoke(main, ["edge-serve", "--help"])
    assert "--acceptance" in r.output
