"""Wire format: round trips of every message, and fuzzing of every decoder.

Decoders must raise only :class:`WireError` (naming a field) on any input: random bytes,
random msgpack structures, and near-valid messages with one field broken. The last test
posts random bodies to a real server's verify endpoint: never a 5xx, and a rejected body
never changes the session.
"""

from __future__ import annotations

import json
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.protocol.wire import (Correction, CorrectionRequest, CorrectionResponse,
                                    VerifyRequest, VerifyResponse, WireError)
from tests.conftest import RawHTTP as HTTP

V, MAX_BLOCK, MAX_CTX = 64, 8, 256
BIG_V = 70_000                      # > 65536: token ids travel as uint32
FUZZ = settings(max_examples=2000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MSGPACK = "application/x-msgpack"


# ============================================================================ round trips

EXACT_Q = [5e-324, 2.2250738585072014e-308, 0.1 + 0.2, 1 / 3, math.nextafter(1.0, 0.0), 1.0]


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("vocab", [V, BIG_V])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "standard", "pending", "empty"])
def test_verify_request_round_trip(kind, vocab):
    g = 0 if kind == "empty" else len(EXACT_Q)
    toks = np.array([0, 1, vocab - 1, 7, vocab // 2, 3][:g], dtype=np.int64)
    q = np.array(EXACT_Q[:g]) if kind in ("sampled", "pending") else None
    qf = None
    if kind == "standard":
        qf = np.full((g, vocab), 1.0 / vocab)
    pend = vocab - 1 if kind == "pending" else None
    req = VerifyRequest(2**32 - 1, 2**40, 17, 65535, pend, toks, q, qf)
    body = req.encode(vocab)
    got = VerifyRequest.decode(body, vocab, MAX_BLOCK)
    assert (got.session_id, got.block_seq, got.base_len, got.config_id, got.pending_commit) \
        == (2**32 - 1, 2**40, 17, 65535, pend)
    assert got.tokens.dtype == np.int64 and got.tokens.tolist() == toks.tolist()
    assert _same(got.q_tok, q), "q must travel bit for bit"
    assert _same(got.q_full, qf)
    # the uplink is O(g): token ids at 2 (or 4) bytes plus 8 bytes per q
    if kind in ("sampled", "pending"):
        assert len(body) <= 40 + g * (wire.token_dtype(vocab).itemsize + 8)


def test_verify_response_round_trip():
    bonus = VerifyResponse(3, 4, 17, None, 42, 0.00123)
    assert VerifyResponse.decode(bonus.encode()) == bonus
    corr = Correction(False, np.array([5, 1, 9]), np.array([0.5, 0.25, 0.125]),
                      np.array([9, 9]), np.array([0.125, 0.125]))
    r = VerifyResponse.decode(VerifyResponse(0, 1, None, corr, 9, 0.5).encode())
    assert (r.block_seq, r.accepted, r.next_token, r.base_len, r.target_s) == (0, 1, None, 9, 0.5)
    c = r.correction
    assert c.complete is False
    for a, b in ((c.support_ids, corr.support_ids), (c.support_p, corr.support_p),
                 (c.proposal_ids, corr.proposal_ids), (c.proposal_p, corr.proposal_p)):
        assert np.array_equal(a, b)
    empty = Correction(True, np.zeros(0, int), np.zeros(0), np.zeros(0, int), np.zeros(0))
    c2 = Correction.from_wire(wire.unpack(wire.pack(empty.to_wire())))
    assert c2.complete and c2.support_ids.size == 0 and c2.proposal_p.size == 0


def test_correction_messages_round_trip():
    for k in (1, 32, V, None):
        assert CorrectionRequest.decode(CorrectionRequest(7, k).encode(), V) == \
            CorrectionRequest(7, k)
    p = np.array(EXACT_Q)
    r = CorrectionResponse.decode(CorrectionResponse(7, False, np.arange(6), p).encode())
    assert (r.block_seq, r.complete) == (7, False)
    assert r.ids.tolist() == list(range(6)) and r.p.tobytes() == p.tobytes()
    full = np.full(V, 1.0 / V)
    r = CorrectionResponse.decode(CorrectionResponse(8, True, None, full).encode())
    assert r.ids is None and r.complete and r.p.tobytes() == full.tobytes()


def test_session_request_round_trip_and_defaults():
    cfg = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1)
    body = {"prompt_ids": [5, 6, 7], "chat": False, "sampling": cfg.to_dict(), "seed": 9,
            "max_new_tokens": 12, "vocab_size": V, "tokenizer_hash": "abcd",
            "mode": "standard", "support_k": 16, "n_proposals": 2}
    for decoded in (wire.unpack(wire.pack(body)), json.loads(json.dumps(body))):
        m = wire.decode_session_request(decoded, V, MAX_CTX)
        assert m["prompt_ids"] == [5, 6, 7] and m["sampling"] == cfg
        assert m["sampling"].config_id == cfg.config_id
        assert (m["seed"], m["max_new_tokens"], m["vocab_size"], m["tokenizer_hash"],
                m["mode"], m["support_k"], m["n_proposals"]) == (9, 12, V, "abcd",
                                                                 "standard", 16, 2)
    m = wire.decode_session_request({"prompt": "w5 w6"}, V, MAX_CTX)
    assert m["prompt"] == "w5 w6" and m["sampling"] == SamplingConfig()
    assert (m["seed"], m["mode"], m["chat"], m["vocab_size"]) == (0, "asym", False, None)
    assert SamplingConfig.from_dict(cfg.to_dict()) == cfg


@settings(max_examples=100, deadline=None, database=None)
@given(g=st.integers(0, MAX_BLOCK), data=st.data(), vocab=st.sampled_from([V, 300, BIG_V]))
def test_verify_request_round_trip_property(g, data, vocab):
    toks = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=g, max_size=g)),
                    dtype=np.int64)
    q = data.draw(st.none() | st.lists(
        st.floats(min_value=5e-324, max_value=1.0, allow_subnormal=True), min_size=g,
        max_size=g).map(np.array))
    pend = data.draw(st.none() | st.integers(0, vocab - 1))
    head = [data.draw(st.integers(0, 2**63 - 1)), data.draw(st.integers(0, 2**63 - 1)),
            data.draw(st.integers(1, 2**63 - 1)), data.draw(st.integers(0, 65535))]
    got = VerifyRequest.decode(VerifyRequest(*head, pend, toks, q, None).encode(vocab),
                               vocab, MAX_BLOCK)
    assert [got.session_id, got.block_seq, got.base_len, got.config_id] == head
    assert got.pending_commit == pend and got.tokens.tolist() == toks.tolist()
    assert _same(got.q_tok, q)


# ============================================================================ fuzzing
#
# Hypothesis draws cheap things natively (raw bytes, field choices); deep random
# structures come from a seeded builder (one drawn integer -> one structure), which keeps
# 2000 examples per decoder within a couple of seconds. Value pools hold the boundary
# values of every field (0/1, 63/64/65 for the vocabulary, 8/9 for the block limit,
# 2^16, 2^32, 2^63, 2^64-1, NaN, +-inf, subnormals, bools, bytes vs str ...).

INTS = [0, 1, 2, 3, 7, 8, 9, 16, 63, 64, 65, 255, 256, 257, 1234, 65535, 65536, 70_000,
        2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -2**31, -2**63]
BIG_INTS = [10**30, -(10**30), 2**64, 10**400]          # only JSON can carry these
FLOATS = [0.0, -0.0, 0.5, 0.25, 1.0, 1.5, 2.0, -1.0, -0.5, math.nan, math.inf, -math.inf,
          5e-324, 2.2250738585072014e-308, 1.0000000000000002, 0.9999999999999999, 1e308,
          100.0, 100.1, 3.0]
STRS = ["", "a", "1", "0", "asym", "standard", "fast", "w5 w6", "\x00", "é", "NaN",
        "prompt_ids", "temperature", "sampling", "x" * 40]
KEYS = sorted(wire.SESSION_FIELDS) + ["bogus", "", "Prompt", "min_p"]
SKEYS = ["temperature", "top_k", "top_p", "repetition_penalty", "min_p", ""]


class Gen:
    """Random message parts from a seed (msgpack-representable unless ``big``)."""

    def __init__(self, seed: int, big: bool = False):
        import random

        self.r, self.big = random.Random(seed), big

    def int(self):
        r = self.r.random()
        if r < 0.6:
            return self.r.choice(INTS)
        if r < 0.7 and self.big:
            return self.r.choice(BIG_INTS)
        return self.r.randint(-300, 300)

    def bytes(self):
        k = self.r.randrange(5)
        n = self.r.choice([0, 1, 2, 3, 7, 8, 9, 16, 24, 64, 128, 512])
        if k == 0:
            return self.r.randbytes(n)
        if k == 1:
            return np.array([self.r.choice([0, 9, 63, 64, 65535]) for _ in range(n // 2)],
                            "<u2").tobytes()
        if k == 2:
            return np.array([self.r.choice([0, 9, 63, 64, 2**32 - 1]) for _ in range(n // 4)],
                            "<u4").tobytes()
        return np.array([self.r.choice(FLOATS) for _ in range(n // 8)], "<f8").tobytes()

    def leaf(self):
        k = self.r.randrange(7)
        if k < 2:
            return None if k == 0 else self.r.random() < 0.5
        if k < 4:
            return self.int()
        if k == 4:
            return self.r.choice(FLOATS)
        return self.r.choice(STRS) if k == 5 else self.bytes()

    def any(self, depth=0):
        k = self.r.randrange(10)
        if depth >= 3 or k < 6:
            return self.leaf()
        n = self.r.choice([0, 1, 2, 3, 5, 9, 10])
        if k < 8:
            return [self.any(depth + 1) for _ in range(n)]
        keys = KEYS + STRS + [b"prompt_ids", b"x"]
        return {self.r.choice(keys): self.any(depth + 1) for _ in range(n)}

    def field(self, valid):
        k = self.r.randrange(6)
        if k in (0, 5):
            return valid
        return self.leaf() if k == 1 else self.int() if k == 2 else (
            self.bytes() if k == 3 else self.any(1))


seeds = st.integers(0, 2**64 - 1)


def _packable(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def random_structure(seed):
    return Gen(seed).any()


def near_valid_verify(seed):
    """A verify message with 1-4 fields replaced and sometimes the wrong length."""
    g = Gen(seed)
    m = [1, 77, 0, 3, 1234, None, np.array([9, 10, 11], "<u2").tobytes(),
         np.array([0.5, 0.25, 1.0]).tobytes(), None]
    for i in g.r.sample(range(9), g.r.randint(1, 4)):
        m[i] = g.field(m[i])
    cut = g.r.choice([9, 9, 9, 9, 8, 10, 0, 1])
    return m[:cut] + [None] * max(0, cut - 9)


def session_request(seed):
    """A create-session body: known fields with boundary values, sometimes extra keys."""
    g = Gen(seed, big=True)
    pools = {
        "prompt": lambda: g.r.choice([g.r.choice(STRS), g.leaf()]),
        "prompt_ids": lambda: g.r.choice([
            [g.r.choice([0, 5, 63, 64, -1]) for _ in range(g.r.randint(0, 4))],
            [5] * g.r.choice([255, 256, 257, 300]), [g.leaf() for _ in range(2)], g.leaf()]),
        "prompt_packed": lambda: g.r.choice([
            wire.pack_prompt([g.r.choice([0, 5, 63, 64, 127, 128]) for _ in range(
                g.r.randint(1, 300))]), wire.pack_prompt([5, 6])[:-1],
            g.r.randbytes(g.r.randint(0, 8)), g.leaf()]),
        "sampling": lambda: g.r.choice([
            {g.r.choice(SKEYS): g.r.choice([g.int(), g.r.choice(FLOATS), g.leaf()])
             for _ in range(g.r.randint(0, 4))}, g.any(1)]),
        "mode": lambda: g.r.choice(["asym", "standard", "fast", g.leaf()]),
        "tokenizer_hash": lambda: g.r.choice(STRS + [None, 5]),
    }
    m = {}
    for key in g.r.sample(sorted(wire.SESSION_FIELDS), g.r.randint(0, 6)):
        m[key] = pools.get(key, lambda: g.r.choice([g.int(), g.leaf()]))()
    if g.r.random() < 0.5:
        m[g.r.choice(["prompt_ids", "prompt"])] = [5, 6] if g.r.random() < 0.5 else "w5"
    if g.r.random() < 0.1:
        m[g.r.choice(KEYS + [b"prompt", b"x"])] = g.leaf()
    return m


def assert_valid_verify(r: VerifyRequest, vocab):
    g = r.tokens.size
    assert g <= MAX_BLOCK and (g == 0 or int(r.tokens.max()) < vocab)
    assert r.base_len >= 1 and 0 <= r.config_id <= 65535 and r.session_id >= 0
    assert r.pending_commit is None or 0 <= r.pending_commit < vocab
    if r.q_tok is not None:
        assert r.q_tok.size == g and np.all((r.q_tok > 0) & (r.q_tok <= 1))
    if r.q_full is not None:
        assert r.q_full.shape == (g, vocab) and np.isfinite(r.q_full).all()


def only_wire_error(fn, *a):
    """Call a decoder; any exception other than WireError fails the test."""
    try:
        return fn(*a)
    except WireError as e:
        assert isinstance(e.field, str) and isinstance(e.message, str) and e.message
        return None


@FUZZ
@given(body=st.binary(max_size=300) | seeds.map(random_structure).map(_packable))
def test_fuzz_decoders_random_bytes(body):
    for vocab in (V, BIG_V):
        r = only_wire_error(VerifyRequest.decode, body, vocab, MAX_BLOCK)
        if r is not None:
            assert_valid_verify(r, vocab)
        only_wire_error(CorrectionRequest.decode, body, vocab)
    only_wire_error(VerifyResponse.decode, body)
    only_wire_error(CorrectionResponse.decode, body)
    m = only_wire_error(wire.unpack, body)
    if m is not None:
        only_wire_error(wire.decode_session_request, m, V, MAX_CTX)


@FUZZ
@given(m=seeds.map(near_valid_verify))
def test_fuzz_verify_near_valid(m):
    body = _packable(m)
    for vocab in (V, BIG_V):
        r = only_wire_error(VerifyRequest.decode, body, vocab, MAX_BLOCK)
        if r is not None:
            assert_valid_verify(r, vocab)


@FUZZ
@given(seed=seeds, n=st.sampled_from([3, 3, 3, 2, 4, 0]), head=st.sampled_from([3, 3, 1, "3"]))
def test_fuzz_correction_request(seed, n, head):
    g = Gen(seed)
    m = ([head] + [g.field(7), g.field(16)] + [g.leaf()])[:n]
    r = only_wire_error(CorrectionRequest.decode, _packable(m), V)
    if r is not None:
        assert r.block_seq >= 0 and (r.k is None or 1 <= r.k <= V)


@FUZZ
@given(m=seeds.map(session_request) | seeds.map(lambda s: Gen(s, big=True).any()))
def test_fuzz_session_request(m):
    out = only_wire_error(wire.decode_session_request, m, V, MAX_CTX)
    if out is None:
        return
    assert isinstance(out["sampling"], SamplingConfig)
    if "prompt_ids" in out:
        assert 1 <= len(out["prompt_ids"]) <= MAX_CTX
        assert all(type(t) is int and 0 <= t < V for t in out["prompt_ids"])
    else:
        assert isinstance(out["prompt"], str) and out["prompt"]
    assert out["seed"] >= 0 and 1 <= out["max_new_tokens"] <= MAX_CTX
    assert out["mode"] in ("asym", "standard")
    assert 1 <= out["support_k"] <= V and 0 <= out["n_proposals"] <= 256
    assert out["vocab_size"] is None or type(out["vocab_size"]) is int


def test_fuzzers_reach_valid_messages():
    """The generators are not all noise: some messages pass every check."""
    ok_verify = sum(only_wire_error(VerifyRequest.decode, _packable(near_valid_verify(s)),
                                    V, MAX_BLOCK) is not None for s in range(400))
    ok_session = sum(only_wire_error(wire.decode_session_request, session_request(s), V,
                                     MAX_CTX) is not None for s in range(400))
    assert ok_verify > 10 and ok_session > 10


# ============================================================================ HTTP fuzz



TK8 = SamplingConfig(temperature=1.0, top_k=8)


class Sessions:
    """Two live sessions to fuzz: a greedy one mid-generation and a sampled one that
    awaits its correction token. Re-created when they get long."""

    def __init__(self, http: HTTP):
        self.http, self.info = http, {}

    def new(self, kind):
        old = self.info.get(kind)
        if old:
            self.http("DELETE", f"/v1/sessions/{old['sid']}")
        cfg = SamplingConfig() if kind == "greedy" else TK8
        st_, data = self.http("POST", "/v1/sessions", wire.pack(
            {"prompt_ids": [5, 6, 7], "sampling": cfg.to_dict(), "seed": 1}))
        assert st_ == 201
        sid = int(wire.unpack(data)["session_id"])
        q = None if kind == "greedy" else np.array([1.0, 1.0])
        body = VerifyRequest(sid, 0, 3, cfg.config_id, None, np.array([2, 2]), q,
                             None).encode(V)
        st_, data = self.http("POST", f"/v1/sessions/{sid}/verify", body)
        assert st_ == 200
        corr = VerifyResponse.decode(data).correction
        assert (corr is None) == (kind == "greedy"), "the sampled session must await"
        pend = None if corr is None else int(corr.support_ids[0])
        self.info[kind] = {"sid": sid, "cfg": cfg, "pending": pend}
        return self.info[kind]

    def state(self, sid):
        st_, data = self.http("GET", f"/v1/sessions/{sid}")
        assert st_ == 200
        return json.loads(data)


@pytest.fixture(scope="module")
def live(target, tok):
    with BackgroundServer(create_app(target, tok)) as srv:
        http = HTTP(srv.url)
        sess = Sessions(http)
        sess.new("greedy")
        sess.new("sampled")
        yield sess
        http.close()


def _valid_list(info, state):
    pend = info["pending"] if state["awaiting_correction"] else None
    q = None if info["cfg"].greedy else np.array([0.5, 0.5]).tobytes()
    return [wire.MSG_VERIFY, info["sid"], state["next_block_seq"], state["base_len"],
            info["cfg"].config_id, pend, np.array([9, 10], "<u2").tobytes(), q, None]


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_verify_endpoint(live, data):
    kind = data.draw(st.sampled_from(["greedy", "sampled"]))
    info = live.info[kind]
    before = live.state(info["sid"])
    if before["base_len"] > 200 or (kind == "sampled" and not before["awaiting_correction"]):
        info = live.new(kind)
        before = live.state(info["sid"])
    how = data.draw(st.sampled_from(["bytes", "structure", "near-valid", "near-valid"]))
    g = Gen(data.draw(seeds))
    if how == "bytes":
        body = data.draw(st.binary(max_size=200))
    elif how == "structure":
        body = _packable(g.any())
    else:
        m = _valid_list(info, before)
        for i in data.draw(st.sets(st.integers(0, 8), min_size=1, max_size=3)):
            m[i] = g.field(m[i])
        body = _packable(m)
    status, out = live.http("POST", f"/v1/sessions/{info['sid']}/verify", body)
    assert status < 500, out[:300]
    if status == 200:                         # a mutation that happened to be valid
        assert VerifyResponse.decode(out).block_seq == before["next_block_seq"]
        if kind == "sampled":
            corr = VerifyResponse.decode(out).correction
            info["pending"] = None if corr is None else int(corr.support_ids[0])
        return
    err = json.loads(out)["error"]
    assert err["code"] and err["message"] and isinstance(err.get("field", ""), str)
    assert live.state(info["sid"]) == before, "a rejected body changed the session"
