"""Bad-input suite for the verification API (real aiohttp server on loopback).

Every malformed or inconsistent request must get a 4xx (never a 5xx) with a JSON body
``{"error": {"code", "message", "field"}}`` naming the field where there is one, and
must leave the session exactly as it was: ``GET /v1/sessions/{id}`` is unchanged and
the next valid block gets the same answer as on a fresh identical session that never
saw the bad input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from tests.conftest import RawHTTP as HTTP

MSGPACK = "application/x-msgpack"
JSON = "application/json"
V = 64
PROMPT = [5, 6, 7]
LONG = [(7 * i) % 60 + 2 for i in range(250)]      # max_position_embeddings is 256
GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)
TK8 = SamplingConfig(temperature=1.0, top_k=8)




def tb(ids) -> bytes:
    return np.asarray(ids, dtype="<u2").tobytes()


def fb(vals) -> bytes:
    return np.asarray(vals, dtype="<f8").tobytes()


def strip_time(data: bytes) -> tuple:
    r = wire.VerifyResponse.decode(data)
    c = r.correction
    corr = None if c is None else (c.complete, c.support_ids.tolist(), c.support_p.tolist(),
                                   c.proposal_ids.tolist(), c.proposal_p.tolist())
    return r.block_seq, r.accepted, r.next_token, corr, r.base_len


def check_error(status: int, data: bytes, field: str | None) -> dict:
    assert 400 <= status < 500, (status, data[:300])
    body = json.loads(data)
    err = body["error"]
    assert isinstance(err["code"], str) and err["code"]
    assert isinstance(err["message"], str) and err["message"]
    if field is not None:
        assert err.get("field") == field, err
    return err


# ----------------------------------------------------------------------------- sessions

@dataclass
class Ctx:
    kind: str
    sid: int
    cfg: SamplingConfig
    seq: int
    base: int
    pending: int | None = None
    zero_p: int | None = None     # a token with zero target probability (top-k session)
    last: int | None = None       # the last confirmed token (greedy session)


KINDS = {
    "greedy": dict(prompt_ids=PROMPT),
    "sampled": dict(prompt_ids=PROMPT, sampling=TK8.to_dict(), seed=3, n_proposals=4),
    "standard": dict(prompt_ids=PROMPT, sampling=T1.to_dict(), seed=3, mode="standard"),
    "long": dict(prompt_ids=LONG),
}
CFG = {"greedy": GREEDY, "sampled": TK8, "standard": T1, "long": GREEDY}
REJECTED = 2   # draft token of the sampled history block; checked to be rejected below


def setup(http: HTTP, kind: str) -> Ctx:
    """A fresh session driven to its test state by valid requests only."""
    info = http.create(**KINDS[kind])
    sid, cfg = int(info["session_id"]), CFG[kind]
    ctx = Ctx(kind, sid, cfg, 0, info["base_len"])
    if kind == "greedy":          # one block answered: mid-generation
        st, data = http("POST", f"/v1/sessions/{sid}/verify",
                        wire.pack([1, sid, 0, 3, cfg.config_id, None, tb([59, 9]), None,
                                   None]))
        assert st == 200
        ctx.last = wire.VerifyResponse.decode(data).next_token
    elif kind == "sampled":       # a rejected block: the session awaits its correction
        st, data = http("POST", f"/v1/sessions/{sid}/verify",
                        wire.pack([1, sid, 0, 3, cfg.config_id, None,
                                   tb([REJECTED, REJECTED]), fb([1.0, 1.0]), None]))
        assert st == 200
        corr = wire.VerifyResponse.decode(data).correction
        assert corr is not None and corr.complete, "history block must be rejected"
        ctx.pending = int(corr.support_ids[0])
        ctx.zero_p = next(t for t in range(V) if t not in set(corr.support_ids.tolist()))
    s = http.state(sid)
    ctx.seq, ctx.base = s["next_block_seq"], s["base_len"]
    assert s["awaiting_correction"] == (kind == "sampled")
    return ctx


def valid(ctx: Ctx) -> list:
    """The next valid verify request of the session, as a msgpack array."""
    head = [wire.MSG_VERIFY, ctx.sid, ctx.seq, ctx.base, ctx.cfg.config_id, ctx.pending]
    if ctx.kind == "greedy":
        return head + [tb([9, 10, 11]), None, None]
    if ctx.kind == "sampled":
        return head + [tb([9, 10]), fb([0.5, 0.5]), None]
    if ctx.kind == "standard":
        return head + [tb([9, 10]), None, fb(np.full(2 * V, 1.0 / V))]
    return head + [tb([9, 10, 11, 12]), None, None]


@pytest.fixture(scope="module")
def srv(target, tok):
    with BackgroundServer(create_app(target, tok)) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    h = HTTP(srv.url)
    yield h
    h.close()


@pytest.fixture(scope="module")
def refs(http):
    """The answer to the next valid block on a session that never saw bad input."""
    out = {}
    for kind in KINDS:
        ctx = setup(http, kind)
        st, data = http("POST", f"/v1/sessions/{ctx.sid}/verify", wire.pack(valid(ctx)))
        assert st == 200, data
        out[kind] = strip_time(data)
    http.cleanup()
    return out


@pytest.fixture(autouse=True)
def _cleanup(request):
    yield
    if "http" in request.fixturenames:
        request.getfixturevalue("http").cleanup()


def assert_untouched(http: HTTP, ctx: Ctx, before: dict, ref: tuple, path=None):
    assert http.state(ctx.sid) == before, "a rejected request changed the session"
    st, data = http("POST", path or f"/v1/sessions/{ctx.sid}/verify", wire.pack(valid(ctx)))
    assert st == 200, data
    assert strip_time(data) == ref, "the session answers differently after bad input"


# ----------------------------------------------------------------------------- cases

@dataclass
class Case:
    kind: str
    name: str
    make: Callable[[Ctx], tuple]   # ctx -> (method, path, body)
    status: int
    field: str | None


def M(i, v):
    """Replace element i of the next valid verify request."""
    def make(ctx):
        m = valid(ctx)
        m[i] = v(ctx) if callable(v) else v
        return "POST", f"/v1/sessions/{ctx.sid}/verify", wire.pack(m)
    return make


def ARR(f):
    def make(ctx):
        return "POST", f"/v1/sessions/{ctx.sid}/verify", wire.pack(f(valid(ctx)))
    return make


def RAW(body: bytes | Callable):
    def make(ctx):
        return ("POST", f"/v1/sessions/{ctx.sid}/verify",
                body(ctx) if callable(body) else body)
    return make


def URL(sid_text: str, endpoint="verify", method="POST"):
    def make(ctx):
        path = f"/v1/sessions/{sid_text}" + (f"/{endpoint}" if endpoint else "")
        return method, path, wire.pack(valid(ctx)) if method == "POST" else b""
    return make


def CORR(m):
    def make(ctx):
        body = m if isinstance(m, bytes) else wire.pack(m(ctx) if callable(m) else m)
        return "POST", f"/v1/sessions/{ctx.sid}/correction", body
    return make


S, SEQ, BASE, CID, PEND, TOK, Q, QF = range(1, 9)
NAN, INF = float("nan"), float("inf")

CASES = [
    # --- not a verify message at all
    Case("greedy", "garbage-msgpack", RAW(b"\xc1\xc1\xc1"), 400, "body"),
    Case("greedy", "truncated", RAW(lambda c: wire.pack(valid(c))[:-3]), 400, "body"),
    Case("greedy", "empty-body", RAW(b""), 400, "body"),
    Case("greedy", "trailing-bytes", RAW(lambda c: wire.pack(valid(c)) + b"\x00"), 400, "body"),
    Case("greedy", "map-not-array", RAW(wire.pack({"session_id": 1})), 400, "body"),
    Case("greedy", "json-body", RAW(b'[1, 2, 3]'), 400, "body"),
    Case("greedy", "8-elements", ARR(lambda m: m[:8]), 400, "body"),
    Case("greedy", "13-elements", ARR(lambda m: m + [None, None, None, None]), 400, "body"),
    # the alts element (sibling trees): malformed, or in a sampling session
    Case("greedy", "alts-not-a-list", ARR(lambda m: m + [None, None, 7]), 400, "alts"),
    Case("greedy", "alts-position-past-block",
         ARR(lambda m: m + [None, None, [1, b"\x09", b"\x01\x00"]]), 400, "alts"),
    Case("sampled", "alts-sampling-session",
         ARR(lambda m: m + [None, None, [1, b"\x00", b"\x07\x00"]]), 422, "alts"),
    # the channel element (WISV): malformed, or sent by an exact session
    Case("greedy", "channel-short", ARR(lambda m: m + [None, [0.1, 1e6]]), 400, "channel"),
    Case("greedy", "channel-nan", ARR(lambda m: m + [None, [float("nan"), 1e6, 0.1]]),
         400, "channel"),
    Case("greedy", "channel-exact-session", ARR(lambda m: m + [None, [0.1, 1e6, 0.1]]),
         422, "channel"),
    Case("greedy", "expect-last-str", ARR(lambda m: m + ["7"]), 400, "expect_last"),
    Case("greedy", "expect-last-oov", ARR(lambda m: m + [1 << 40]), 400, "expect_last"),
    Case("greedy", "expect-last-wrong",
         lambda ctx: ARR(lambda m: m + [(ctx.last + 1) % V])(ctx), 409, "expect_last"),
    Case("greedy", "msg-type", M(0, wire.MSG_CORRECTION), 400, "type"),
    Case("greedy", "msg-type-str", M(0, "verify"), 400, "type"),
    # --- wrong types / ranges in each field
    *[Case("greedy", f"session_id={v!r}", M(S, v), 400, "session_id")
      for v in ("1", 1.5, -1, True, None, [1])],
    *[Case("greedy", f"block_seq={v!r}", M(SEQ, v), 400, "block_seq")
      for v in ("1", -1, 1.0, None, False, b"\x01")],
    *[Case("greedy", f"base_len={v!r}", M(BASE, v), 400, "base_len")
      for v in (0, -3, "6", 6.0, None)],
    *[Case("greedy", f"config_id={v!r}", M(CID, v), 400, "config_id")
      for v in (65536, -1, "a", None)],
    *[Case("greedy", f"pending={v!r}", M(PEND, v), 400, "pending_commit")
      for v in (V, -1, "3", 3.0, 2**40)],
    *[Case("greedy", f"tokens={n}", M(TOK, v), 400, "tokens")
      for n, v in (("list", [9, 10]), ("str", "ab"), ("int", 9), ("odd-bytes", b"\x01"),
                   ("id-64", tb([9, V])), ("id-65535", tb([65535])),
                   ("17-drafts", tb([9] * 17)), ("100-drafts", tb([9] * 100)))],
    Case("greedy", "q_full-garbage", M(QF, b"\x00"), 400, "q_full"),
    Case("greedy", "q-odd-bytes", M(Q, b"\x00" * 7), 400, "q"),
    # --- well-formed but inconsistent with the session
    Case("greedy", "session_id-mismatch", M(S, lambda c: c.sid ^ 1), 422, "session_id"),
    Case("greedy", "config_id-mismatch", M(CID, T1.config_id), 409, "config_id"),
    Case("greedy", "stale-base_len", M(BASE, lambda c: c.base - 1), 409, "base_len"),
    Case("greedy", "future-base_len", M(BASE, lambda c: c.base + 1), 409, "base_len"),
    Case("greedy", "future-block_seq", M(SEQ, lambda c: c.seq + 1), 409, "block_seq"),
    Case("greedy", "old-block_seq", M(SEQ, lambda c: c.seq - 1), 409, "block_seq"),
    Case("greedy", "pending-not-owed", M(PEND, 9), 422, "pending_commit"),
    # --- the session id in the URL
    *[Case("greedy", f"url-sid={t}", URL(t), 404, "session_id")
      for t in ("1", "0", "abc", "-1", "0x10", "1e3", "%20", "9" * 30, "%EF%BC%91", "9" * 5000)],
    Case("greedy", "url-unknown-get", URL("12345", None, "GET"), 404, "session_id"),
    Case("greedy", "url-unknown-delete", URL("abc", None, "DELETE"), 404, "session_id"),
    Case("greedy", "url-unknown-correction", URL("77", "correction"), 404, "session_id"),
    Case("greedy", "wrong-method", lambda c: ("GET", f"/v1/sessions/{c.sid}/verify", b""),
         405, None),
    # --- correction requests
    Case("greedy", "correction-none-pending", CORR(lambda c: [3, c.seq - 1, 8]), 409,
         "block_seq"),
    Case("greedy", "correction-garbage", CORR(b"\xc1"), 400, "body"),
    Case("sampled", "correction-wrong-seq", CORR(lambda c: [3, c.seq, 8]), 409, "block_seq"),
    Case("sampled", "correction-old-seq", CORR(lambda c: [3, c.seq + 5, None]), 409,
         "block_seq"),
    *[Case("sampled", f"correction-k={k!r}", CORR(lambda c, k=k: [3, c.seq - 1, k]), 400, "k")
      for k in (0, -1, V + 1, "8", 2.0)],
    Case("sampled", "correction-seq-str", CORR(lambda c: [3, "0", 8]), 400, "block_seq"),
    Case("sampled", "correction-short", CORR(lambda c: [3, c.seq - 1]), 400, "body"),
    Case("sampled", "correction-type", CORR(lambda c: [1, c.seq - 1, 8]), 400, "body"),
    # read-only valid requests must not change the session either
    Case("sampled", "correction-valid-k", CORR(lambda c: [3, c.seq - 1, 16]), 200, None),
    Case("sampled", "correction-valid-full", CORR(lambda c: [3, c.seq - 1, None]), 200, None),
    # --- sampling sessions: q
    Case("sampled", "q-missing", M(Q, None), 422, "q"),
    *[Case("sampled", f"q={v!r}", M(Q, fb([0.5, v])), 400, "q")
      for v in (0.0, -0.5, 1.5, NAN, INF, -INF, 1.0000000000000002)],
    Case("sampled", "q-short", M(Q, fb([0.5])), 400, "q"),
    Case("sampled", "q-long", M(Q, fb([0.5] * 3)), 400, "q"),
    Case("sampled", "q-list", M(Q, [0.5, 0.5]), 400, "q"),
    Case("sampled", "pending-missing", M(PEND, None), 422, "pending_commit"),
    Case("sampled", "pending-zero-p", M(PEND, lambda c: c.zero_p), 422, "pending_commit"),
    Case("sampled", "pending-out-of-vocab", M(PEND, V + 3), 400, "pending_commit"),
    Case("sampled", "17-drafts", ARR(lambda m: m[:TOK] + [tb([9] * 17), fb([0.5] * 17), None]),
         400, "tokens"),
    Case("sampled", "stale-base", M(BASE, lambda c: c.base - 1), 409, "base_len"),
    Case("sampled", "greedy-config", M(CID, GREEDY.config_id), 409, "config_id"),
    # --- the standard baseline: q_full
    Case("standard", "q_full-missing", M(QF, None), 422, "q_full"),
    Case("standard", "q_full-rows", M(QF, fb(np.full(2 * V, 0.5 / V))), 400, "q_full"),
    Case("standard", "q_full-nan", M(QF, fb([NAN] + [1.0 / V] * (2 * V - 1))), 400, "q_full"),
    Case("standard", "q_full-negative",
         M(QF, fb([-1.0 / V, 3.0 / V] + [1.0 / V] * (2 * V - 2))), 400, "q_full"),
    Case("standard", "q_full-short", M(QF, fb(np.full(V, 1.0 / V))), 400, "q_full"),
    Case("standard", "q_full-str", M(QF, "uniform"), 400, "q_full"),
    # --- context limit
    Case("long", "block-past-context", M(TOK, tb([9] * 8)), 422, "tokens"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}-{c.name}" for c in CASES])
def test_bad_verify_input(case: Case, http, refs):
    ctx = setup(http, case.kind)
    before = http.state(ctx.sid)
    n_sessions = http.sessions()
    method, path, body = case.make(ctx)
    status, data = http(method, path, body)
    if case.status < 400:
        assert status == case.status, data[:300]
    else:
        check_error(status, data, case.field)
        assert status == case.status, (status, data[:300])
    assert http.sessions() == n_sessions
    assert_untouched(http, ctx, before, refs[case.kind])


def test_many_bad_inputs_in_a_row(http, refs):
    """All rejected inputs sent to one session: still nothing changes."""
    ctx = setup(http, "greedy")
    before = http.state(ctx.sid)
    for case in CASES:
        if case.kind == "greedy" and case.status >= 400:
            status, data = http(*case.make(ctx))
            check_error(status, data, case.field)
    assert_untouched(http, ctx, before, refs["greedy"])


# ----------------------------------------------------------------------------- create

GOOD = {"prompt_ids": PROMPT}

CREATE_CASES = [
    ({**GOOD, "bogus": 1}, 400, "bogus"),
    ({**GOOD, "eps_req": 0.1}, 400, "eps_req"),
    ({}, 400, "prompt"),
    ({**GOOD, "prompt": "w5"}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["w5"]}, 400, "prompt"),
    ({"prompt_ids": []}, 400, "prompt_ids"),
    ({"prompt_ids": "5 6"}, 400, "prompt_ids"),
    ({"prompt_ids": [5, V]}, 400, "prompt_ids"),
    ({"prompt_ids": [5, 1000]}, 400, "prompt_ids"),
    ({"prompt_ids": [-1]}, 400, "prompt_ids"),
    ({"prompt_ids": ["w5"]}, 400, "prompt_ids"),
    ({"prompt_ids": [5.0]}, 400, "prompt_ids"),
    ({"prompt_ids": [True]}, 400, "prompt_ids"),
    ({"prompt_ids": [None]}, 400, "prompt_ids"),
    ({"prompt_ids": [5] * 300}, 400, "prompt_ids"),
    ({"prompt_ids": [5] * 256}, 422, "prompt"),
    *[({**GOOD, "sampling": {"temperature": v}}, 400, "sampling.temperature")
      for v in (-1.0, 101.0, "hot", True, None, [1.0])],
    *[({**GOOD, "sampling": {"top_k": v}}, 400, "sampling.top_k") for v in (-1, 2.5, "8")],
    *[({**GOOD, "sampling": {"top_p": v}}, 400, "sampling.top_p") for v in (0.0, 1.5, -0.1)],
    *[({**GOOD, "sampling": {"repetition_penalty": v}}, 400, "sampling.repetition_penalty")
      for v in (0.0, -1.0, 1000.0)],
    ({**GOOD, "sampling": {"min_p": 0.1}}, 400, "sampling.min_p"),
    ({**GOOD, "sampling": "hot"}, 400, "sampling"),
    ({**GOOD, "sampling": 1.0}, 400, "sampling"),
    ({**GOOD, "seed": -1}, 400, "seed"),
    ({**GOOD, "seed": "x"}, 400, "seed"),
    ({**GOOD, "seed": 1.5}, 400, "seed"),
    ({**GOOD, "max_new_tokens": 0}, 400, "max_new_tokens"),
    ({**GOOD, "max_new_tokens": 10**6}, 400, "max_new_tokens"),
    ({**GOOD, "mode": "fast"}, 400, "mode"),
    ({**GOOD, "mode": None}, 400, "mode"),
    ({**GOOD, "support_k": 0}, 400, "support_k"),
    ({**GOOD, "support_k": V + 1}, 400, "support_k"),
    ({**GOOD, "n_proposals": -1}, 400, "n_proposals"),
    ({**GOOD, "n_proposals": 257}, 400, "n_proposals"),
    ({**GOOD, "vocab_size": V + 1}, 422, "vocab_size"),
    ({**GOOD, "vocab_size": 32000}, 422, "vocab_size"),
    ({**GOOD, "vocab_size": "64"}, 400, "vocab_size"),
    ({**GOOD, "tokenizer_hash": "deadbeefdeadbeef"}, 422, "tokenizer_hash"),
    ({**GOOD, "tokenizer_hash": 123}, 400, "tokenizer_hash"),
]


@pytest.mark.parametrize("body,status,field", CREATE_CASES,
                         ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(CREATE_CASES)])
@pytest.mark.parametrize("ctype", [MSGPACK, JSON])
def test_bad_create_session(body, status, field, ctype, http):
    n = http.sessions()
    raw = wire.pack(body) if ctype == MSGPACK else json.dumps(body).encode()
    got, data = http("POST", "/v1/sessions", raw, ctype=ctype)
    check_error(got, data, field)
    assert got == status, (got, data)
    assert http.sessions() == n


BODY_CASES = [
    ("garbage-msgpack", b"\xc1", MSGPACK),
    ("msgpack-array", wire.pack([1, 2]), MSGPACK),
    ("msgpack-int-key", b"\x81\x01\x02", MSGPACK),                 # {1: 2}
    ("msgpack-bytes-key", wire.pack({b"prompt_ids": [5]}), MSGPACK),
    ("msgpack-mixed-keys", wire.pack({b"a": 1, "b": 2, "prompt_ids": [5]}), MSGPACK),
    ("msgpack-bytes-sampling-key",
     wire.pack({"prompt_ids": [5], "sampling": {b"x": 1, "y": 2}}), MSGPACK),
    ("msgpack-nil", wire.pack(None), MSGPACK),
    ("empty", b"", MSGPACK),
    ("json-invalid", b"{prompt_ids: [5]}", JSON),
    ("json-array", b"[5, 6]", JSON),
    ("json-string", b'"w5"', JSON),
    ("json-nan-temperature", b'{"prompt_ids": [5], "sampling": {"temperature": NaN}}', JSON),
    ("json-inf-seed", b'{"prompt_ids": [5], "seed": Infinity}', JSON),
    ("json-huge-int", b'{"prompt_ids": [5], "seed": 1' + b"0" * 40 + b"}", JSON),
    ("json-latin1", b'{"prompt": "\xff\xfe"}', JSON),
    ("json-deep-nesting", b"[" * 100_000, JSON),
    ("json-huge-temperature",
     b'{"prompt_ids": [5], "sampling": {"temperature": 1' + b"0" * 400 + b"}}", JSON),
    ("json-huge-top-p", b'{"prompt_ids": [5], "sampling": {"top_p": -1' + b"0" * 400 + b"}}",
     JSON),
    ("msgpack-deep-nesting", b"\x91" * 100_000, MSGPACK),
]


@pytest.mark.parametrize("name,raw,ctype", BODY_CASES, ids=[c[0] for c in BODY_CASES])
def test_bad_create_body(name, raw, ctype, http):
    n = http.sessions()
    status, data = http("POST", "/v1/sessions", raw, ctype=ctype)
    err = check_error(status, data, None)
    assert isinstance(err.get("field", ""), str)
    assert http.sessions() == n


# ----------------------------------------------------------------------------- size limit

def test_body_over_size_limit(target, tok):
    """Bodies over ``client_max_size`` get 413 JSON; the session is untouched."""
    with BackgroundServer(create_app(target, tok, client_max_size=2048)) as s:
        h = HTTP(s.url)
        try:
            ref_ctx = setup(h, "standard")
            st, data = h("POST", f"/v1/sessions/{ref_ctx.sid}/verify",
                         wire.pack(valid(ref_ctx)))       # 2 rows of q_full: ~1 KiB
            assert st == 200
            ref = strip_time(data)
            ctx = setup(h, "standard")
            before = h.state(ctx.sid)
            n = h.sessions()
            big = valid(ctx)
            big[TOK], big[QF] = tb([9] * 8), fb(np.full(8 * V, 1.0 / V))   # 4 KiB of q_full
            for body in (wire.pack(big), b"\x00" * 5000):
                status, data = h("POST", f"/v1/sessions/{ctx.sid}/verify", body)
                err = check_error(status, data, "body")
                assert status == 413 and err["code"] == "body_too_large"
            status, data = h("POST", "/v1/sessions", wire.pack({"prompt": "w5 " * 1000}))
            assert status == 413 and check_error(status, data, "body")
            assert h.sessions() == n
            assert_untouched(h, ctx, before, ref)
        finally:
            h.close()


# ----------------------------------------------------------------------------- ownership

def test_foreign_session_is_not_found(target, tok, tmp_path):
    """With API keys, another key's session id behaves like an unknown one."""
    from cloud_api.keys import SQLiteKeyStore
    from edge_sdk.protocol.signing import Signer

    store = SQLiteKeyStore(tmp_path / "keys.sqlite3")
    alice = Signer.from_api_key(store.create("alice", ["verify"])[1])
    mallory = Signer.from_api_key(store.create("mallory", ["verify"])[1])
    with BackgroundServer(create_app(target, tok, key_store=store)) as s:
        a, m = HTTP(s.url, alice), HTTP(s.url, mallory)
        try:
            ref_ctx = setup(a, "greedy")
            st, data = a("POST", f"/v1/sessions/{ref_ctx.sid}/verify", wire.pack(valid(ref_ctx)))
            assert st == 200
            ref = strip_time(data)
            ctx = setup(a, "greedy")
            before = a.state(ctx.sid)
            path = f"/v1/sessions/{ctx.sid}"
            for method, p, body in [("GET", path, b""), ("DELETE", path, b""),
                                    ("POST", path + "/verify", wire.pack(valid(ctx))),
                                    ("POST", path + "/correction", wire.pack([3, 0, 8]))]:
                status, data = m(method, p, body)
                assert status == 404 and check_error(status, data, "session_id")
            # unsigned requests are refused before they reach the session
            anon = HTTP(s.url)
            status, data = anon("POST", path + "/verify", wire.pack(valid(ctx)))
            anon.close()
            assert status == 401 and check_error(status, data, None)
            assert_untouched(a, ctx, before, ref)
        finally:
            a.close()
            m.close()
