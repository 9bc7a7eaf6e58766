"""Tamper suite for the signing middleware (real crypto, real aiohttp server)."""

from __future__ import annotations

import base64
import json
import time

import msgpack
import pytest
import pytest_asyncio
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_api.auth import NonceCache, auth_middleware, require_owner
from cloud_api.keys import SQLiteKeyStore
from edge_sdk.protocol import signing as sg
from edge_sdk.protocol.signing import Signer

BODY = msgpack.packb({"session": "s1", "draft": [1, 2, 3]})


def make_app(store: SQLiteKeyStore) -> web.Application:
    sessions: dict[str, str] = {}

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"key_id": request["api_key"].key_id,
                                  "body": (await request.read()).hex(),
                                  "query": dict(request.query)})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def new_session(request: web.Request) -> web.Response:
        sid = f"s{len(sessions)}"
        sessions[sid] = request["api_key"].key_id
        return web.json_response({"session_id": sid})

    async def get_session(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        require_owner(request, sessions.get(sid))
        return web.json_response({"session_id": sid})

    app = web.Application(middlewares=[auth_middleware(store)])
    app.router.add_route("*", "/v1/echo", echo)
    app.router.add_route("*", "/v1/other", echo)
    app.router.add_post("/admin/echo", echo)
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/sessions", new_session)
    app.router.add_get("/v1/sessions/{sid}", get_session)
    return app


@pytest.fixture
def env(tmp_path):
    store = SQLiteKeyStore(tmp_path / "keys.sqlite3")
    _, raw_verify = store.create("edge", ["verify"])
    _, raw_other = store.create("edge-2", ["verify"])
    _, raw_admin = store.create("ops", ["admin"])
    _, raw_revoked = store.create("old", ["verify"])
    store.revoke(sg.parse_api_key(raw_revoked).key_id)
    priv = Ed25519PrivateKey.generate()
    pem = priv.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    _, raw_ed = store.create("device", ["verify"], ed25519_public_key=pem)
    ed_id = sg.parse_api_key(raw_ed).key_id
    return {
        "store": store,
        "hmac": Signer.from_api_key(raw_verify),
        "other": Signer.from_api_key(raw_other),
        "admin": Signer.from_api_key(raw_admin),
        "revoked": Signer.from_api_key(raw_revoked),
        "ed": Signer(ed_id, ed25519_private_key=priv),
        "ed_hmac": Signer.from_api_key(raw_ed),  # HMAC for an Ed25519-bound key
        "ed_forged": Signer(ed_id, ed25519_private_key=Ed25519PrivateKey.generate()),
        "unknown": Signer.from_api_key(sg.format_api_key("ZZZZZZZZZZZZ", "a" * 32)),
        "old_clock": Signer.from_api_key(raw_verify, clock=lambda: time.time() - 301),
        "future_clock": Signer.from_api_key(raw_verify, clock=lambda: time.time() + 301),
    }


@pytest_asyncio.fixture
async def client(aiohttp_client, env):
    return await aiohttp_client(make_app(env["store"]))


async def send(client, method, path, body=b"", headers=None):
    resp = await client.request(method, path, data=body, headers=headers or {})
    return resp.status, await resp.json()


@pytest.mark.asyncio
async def test_valid_hmac_and_ed25519_accepted(client, env):
    for name in ("hmac", "ed"):
        h = env[name].headers("POST", "/v1/echo", BODY)
        status, data = await send(client, "POST", "/v1/echo", BODY, h)
        assert status == 200, data
        assert data["key_id"] == env[name].key_id and bytes.fromhex(data["body"]) == BODY
    h = env["admin"].headers("POST", "/admin/echo", b"{}")
    assert (await send(client, "POST", "/admin/echo", b"{}", h))[0] == 200


@pytest.mark.asyncio
async def test_query_and_get_and_public(client, env):
    path = "/v1/echo?b=2&a=x y&u=\u00fc"
    status, data = await send(client, "GET", path, b"", env["hmac"].headers("GET", path))
    assert status == 200 and data["query"] == {"b": "2", "a": "x y", "u": "\u00fc"}
    assert (await send(client, "GET", "/healthz"))[0] == 200


@pytest.mark.asyncio
async def test_tamper_suite_zero_accepted_distinct_codes(client, env):
    s = env["hmac"]
    results: dict[str, tuple[int, dict]] = {}

    async def case(name, method, path, body, headers):
        results[name] = await send(client, method, path, body, headers)

    await case("no_headers", "POST", "/v1/echo", BODY, {})
    h = s.headers("POST", "/v1/echo", BODY)
    await case("missing_one", "POST", "/v1/echo", BODY,
               {k: v for k, v in h.items() if k != sg.H_NONCE})
    await case("malformed_ts", "POST", "/v1/echo", BODY, {**h, sg.H_TIMESTAMP: "soon"})
    await case("malformed_sig", "POST", "/v1/echo", BODY, {**h, sg.H_SIGNATURE: "rsa=AAAA"})
    forged = "hmac-sha256=" + base64.b64encode(b"\x00" * 32).decode()
    await case("forged_sig", "POST", "/v1/echo", BODY, {**h, sg.H_SIGNATURE: forged})
    await case("body_modified", "POST", "/v1/echo", BODY + b"x", s.headers("POST", "/v1/echo", BODY))
    other = b'{"evil": 1}'
    h = s.headers("POST", "/v1/echo", BODY)
    await case("body_swapped", "POST", "/v1/echo", other,
               {**h, sg.H_DIGEST: sg.body_digest(other)})
    await case("other_path", "POST", "/v1/other", BODY, s.headers("POST", "/v1/echo", BODY))
    await case("query_added", "POST", "/v1/echo?x=1", BODY, s.headers("POST", "/v1/echo", BODY))
    await case("wrong_method", "PUT", "/v1/echo", BODY, s.headers("POST", "/v1/echo", BODY))
    h = env["other"].headers("POST", "/v1/echo", BODY)
    await case("key_id_swapped", "POST", "/v1/echo", BODY, {**h, sg.H_KEY: s.key_id})
    await case("expired", "POST", "/v1/echo", BODY, env["old_clock"].headers("POST", "/v1/echo", BODY))
    await case("future", "POST", "/v1/echo", BODY,
               env["future_clock"].headers("POST", "/v1/echo", BODY))
    h = s.headers("POST", "/v1/echo", BODY)
    assert (await send(client, "POST", "/v1/echo", BODY, h))[0] == 200  # first use is fine
    await case("replayed", "POST", "/v1/echo", BODY, h)
    await case("revoked", "POST", "/v1/echo", BODY, env["revoked"].headers("POST", "/v1/echo", BODY))
    await case("unknown", "POST", "/v1/echo", BODY, env["unknown"].headers("POST", "/v1/echo", BODY))
    await case("ed_forged", "POST", "/v1/echo", BODY, env["ed_forged"].headers("POST", "/v1/echo", BODY))
    await case("hmac_on_ed_key", "POST", "/v1/echo", BODY,
               env["ed_hmac"].headers("POST", "/v1/echo", BODY))
    await case("verify_on_admin", "POST", "/admin/echo", BODY,
               s.headers("POST", "/admin/echo", BODY))
    await case("admin_on_verify", "POST", "/v1/echo", BODY,
               env["admin"].headers("POST", "/v1/echo", BODY))

    expected = {
        "no_headers": (401, "missing_credentials"), "missing_one": (401, "missing_credentials"),
        "malformed_ts": (401, "malformed_credentials"),
        "malformed_sig": (401, "malformed_credentials"),
        "forged_sig": (401, "invalid_signature"), "body_modified": (401, "digest_mismatch"),
        "body_swapped": (401, "invalid_signature"), "other_path": (401, "invalid_signature"),
        "query_added": (401, "invalid_signature"), "wrong_method": (401, "invalid_signature"),
        "key_id_swapped": (401, "invalid_signature"), "expired": (401, "timestamp_expired"),
        "future": (401, "timestamp_in_future"), "replayed": (401, "replayed_nonce"),
        "revoked": (401, "key_revoked"), "unknown": (401, "unknown_key"),
        "ed_forged": (401, "invalid_signature"),
        "hmac_on_ed_key": (401, "algorithm_not_allowed"),
        "verify_on_admin": (403, "insufficient_scope"),
        "admin_on_verify": (403, "insufficient_scope"),
    }
    got = {k: (st, d["error"]["code"]) for k, (st, d) in results.items()}
    assert got == expected
    assert not [k for k, (st, _) in results.items() if st < 400]  # 0 accepted
    assert len(set(expected.values())) == 11  # distinct codes per failure class
    for _, data in results.values():  # no extra detail leaked
        assert set(data) == {"error"} and set(data["error"]) == {"code", "message"}


@pytest.mark.asyncio
async def test_session_owner_binding(client, env):
    h = env["hmac"].headers("POST", "/v1/sessions", b"")
    status, data = await send(client, "POST", "/v1/sessions", b"", h)
    path = f"/v1/sessions/{data['session_id']}"
    assert (await send(client, "GET", path, b"", env["hmac"].headers("GET", path)))[0] == 200
    status, data = await send(client, "GET", path, b"", env["other"].headers("GET", path))
    assert status == 404 and data["error"]["code"] == "not_found"
    missing = "/v1/sessions/nope"
    assert (await send(client, "GET", missing, b"", env["hmac"].headers("GET", missing)))[0] == 404


def test_nonce_cache_bounded_and_expires():
    c = NonceCache(ttl_s=10, max_entries=2)
    assert c.check_and_add("k", "n1", 0) and c.check_and_add("k", "n2", 1)
    assert c.check_and_add("k", "n1", 5) is False
    assert c.check_and_add("k", "n3", 5) is None  # full: fail closed
    assert c.check_and_add("k", "n3", 10.5) is True  # n1 expired and evicted


def test_config_and_canonical_guards():
    with pytest.raises(ValueError):
        auth_middleware(SQLiteKeyStore(), skew_s=300, nonce_ttl_s=100)
    with pytest.raises(ValueError):
        sg.canonical_string(alg="hmac-sha256", key_id="A" * 12, method="POST",
                            raw_path="/a\nb", raw_query="", timestamp=1,
                            nonce="n" * 22, content_sha256=sg.body_digest(b""))
    with pytest.raises(ValueError):
        sg.canonical_target("https://evil.example/v1/echo")
    assert json.loads(json.dumps(Signer("A" * 12, hmac_key=b"k" * 32).headers("GET", "/")))


@pytest.mark.asyncio
async def test_unsigned_unknown_route_is_404_not_401(client, env):
    assert (await client.get("/nope")).status == 404
    assert (await client.delete("/admin/echo")).status == 405    # the route, another method
    assert (await client.post("/v1/echo", data=BODY)).status == 401    # a route: unsigned
    h = env["hmac"].headers("POST", "/v1/echo", BODY)          # signed: checked as before
    assert (await send(client, "POST", "/v1/nope", BODY, h))[0] == 401


def test_nonce_cache_refuses_replays_under_eviction_pressure():
    """Filling the cache never evicts an unexpired nonce: a replay inside the window is
    still refused, a flood from one key fails closed for that key only, and memory stays
    within the bounds."""
    c = NonceCache(ttl_s=600, max_entries=1000, max_per_key=100)
    assert c.check_and_add("victim", "n-first", 0.0) is True
    for i in range(5000):                                  # flood from another key
        c.check_and_add("attacker", f"n{i}", 1.0 + i * 1e-3)
    assert c.size == 101                                   # 1 + the attacker's share
    assert c.check_and_add("victim", "n-first", 10.0) is False     # replay refused
    assert c.check_and_add("attacker", "n-new", 10.0) is None      # its share is full
    assert c.check_and_add("victim", "n-second", 10.0) is True     # others unaffected
    for k in range(20):                                    # many keys: the total bound
        for i in range(100):
            c.check_and_add(f"k{k}", f"n{i}", 11.0)
    assert c.size == 1000
    assert c.check_and_add("victim", "n-first", 12.0) is False
    assert c.check_and_add("victim", "n-third", 12.0) is None      # full: fail closed
    assert c.check_and_add("victim", "n-third", 601.5) is True     # the window passed
    assert c.size < 1000


@pytest.mark.asyncio
async def test_replay_refused_over_http_after_cache_pressure(aiohttp_client, env):
    """Through the middleware: a request replayed after a flood of fresh requests from
    the same key is refused as a replay (401), never served."""
    from aiohttp import web

    cache = NonceCache(ttl_s=600, max_entries=50, max_per_key=10)
    app = web.Application(middlewares=[auth_middleware(env["store"], nonce_cache=cache)])

    async def echo(request):
        return web.json_response({"ok": True})

    app.router.add_post("/v1/echo", echo)
    client = await aiohttp_client(app)
    first = env["hmac"].headers("POST", "/v1/echo", BODY)
    assert (await send(client, "POST", "/v1/echo", BODY, first))[0] == 200
    statuses = [(await send(client, "POST", "/v1/echo", BODY,
                            env["hmac"].headers("POST", "/v1/echo", BODY)))[0]
                for _ in range(15)]
    assert statuses[:9] == [200] * 9 and set(statuses[9:]) == {503}
    status, body = await send(client, "POST", "/v1/echo", BODY, first)
    assert status == 401 and body["error"]["code"] == "replayed_nonce"
