"""Per-key rate limits (1 s moving window), quota, and the client backoff helper."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time

import pytest
import pytest_asyncio
from aiohttp import web
from multidict import CIMultiDict

from cloud_api.auth import auth_middleware
from cloud_api.keys import SQLiteKeyStore
from cloud_api.ratelimit import RateLimiter, ratelimit_middleware
from edge_sdk.protocol.signing import Signer
from edge_sdk.retry import backoff_delay, parse_retry_after


@pytest.fixture
def store():
    return SQLiteKeyStore(":memory:")


async def make_client(aiohttp_client, store, window_s):
    async def verify(request):
        n = json.loads(await request.read())["tokens"]
        state = request["ratelimiter"].consume_tokens(request["api_key"], n)
        return web.json_response({"remaining_tokens": state.remaining})

    async def healthz(request):
        return web.json_response({"ok": True})

    limiter = RateLimiter(window_s=window_s, store=store)
    app = web.Application(middlewares=[auth_middleware(store),
                                       ratelimit_middleware(limiter)])
    app.router.add_post("/v1/verify", verify)
    app.router.add_get("/healthz", healthz)
    return await aiohttp_client(app)


@pytest_asyncio.fixture
async def client(aiohttp_client, store):
    """Tiny 1 s window so recovery is observable quickly."""
    return await make_client(aiohttp_client, store, 1)


@pytest_asyncio.fixture
async def client_60s(aiohttp_client, store):
    """Production-sized window: no flakiness from the window sliding mid-test."""
    return await make_client(aiohttp_client, store, 60)


async def post(client, signer, tokens=0):
    body = json.dumps({"tokens": tokens}).encode()
    resp = await client.post("/v1/verify", data=body,
                             headers=signer.headers("POST", "/v1/verify", body))
    return resp, await resp.json()


@pytest.mark.asyncio
async def test_requests_429_with_headers_then_recover(client, store):
    _, raw = store.create("edge", rpm=3, tpm=10_000)
    signer = Signer.from_api_key(raw)
    for remaining in (2, 1, 0):
        resp, _ = await post(client, signer)
        assert resp.status == 200
        assert resp.headers["x-ratelimit-limit"] == "3"
        assert resp.headers["x-ratelimit-remaining"] == str(remaining)
        assert 0 <= int(resp.headers["x-ratelimit-reset"]) <= 1
    resp, data = await post(client, signer)
    assert resp.status == 429 and data["error"]["code"] == "rate_limited"
    assert resp.headers["retry-after"] == "1"
    assert resp.headers["x-ratelimit-remaining"] == "0"
    assert resp.headers["x-ratelimit-limit"] == "3"
    # other keys and public paths are unaffected
    _, raw_b = store.create("other", rpm=3)
    assert (await post(client, Signer.from_api_key(raw_b)))[0].status == 200
    assert (await client.get("/healthz")).status == 200
    # client honours retry-after, then the moving window lets it through again
    delay = backoff_delay(resp.headers, attempt=0, jitter=0.05)
    assert 1.0 <= delay <= 1.05
    await asyncio.sleep(delay)
    assert (await post(client, signer))[0].status == 200


@pytest.mark.asyncio
async def test_token_rate_and_quota(client_60s, store):
    client = client_60s
    _, raw = store.create("edge", rpm=100, tpm=10)
    signer = Signer.from_api_key(raw)
    resp, data = await post(client, signer, 6)
    assert resp.status == 200 and data["remaining_tokens"] == 4
    resp, data = await post(client, signer, 6)
    assert resp.status == 429 and data["error"]["code"] == "token_rate_limited"
    assert 59 <= int(resp.headers["retry-after"]) <= 60
    assert resp.headers["x-ratelimit-limit"] == "10"
    assert (await post(client, signer, 4))[0].status == 200  # rejected call charged nothing

    rec, raw_q = store.create("quota", rpm=100, tpm=1000, quota=10)
    sq = Signer.from_api_key(raw_q)
    assert (await post(client, sq, 6))[0].status == 200
    resp, data = await post(client, sq, 6)
    assert resp.status == 403 and data["error"]["code"] == "quota_exceeded"
    assert (await post(client, sq, 4))[0].status == 200
    resp, data = await post(client, sq, 0)  # exhausted: refused before the handler
    assert resp.status == 403 and data["error"]["code"] == "quota_exceeded"
    assert store.get_by_lookup(rec.key_id).used_tokens == 10


def test_backoff_delay():
    # retry-after (delta seconds), case-insensitive plain dict, jitter only adds
    for rnd in (0.0, 0.5, 0.999):
        d = backoff_delay({"Retry-After": "3"}, 5, jitter=0.1, rng=lambda: rnd)
        assert 3.0 <= d <= 3.3
    assert backoff_delay(CIMultiDict({"retry-after": "120"}), 0, cap_s=30) >= 120
    # HTTP-date form
    when = email.utils.formatdate(time.time() + 10, usegmt=True)
    assert 8 <= backoff_delay({"retry-after": when}, 0, jitter=0) <= 10.5
    assert parse_retry_after("garbage") is None and parse_retry_after("-5") == 0.0
    # x-ratelimit-reset used when remaining is 0 and no retry-after
    assert backoff_delay({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "2"}, 0,
                         jitter=0) == 2.0
    # no hint: full-jitter exponential, capped
    assert backoff_delay({}, 3, base_s=0.5, rng=lambda: 0.999) == pytest.approx(3.996)
    assert backoff_delay({}, 20, base_s=0.5, cap_s=30, rng=lambda: 1.0) == 30
    assert backoff_delay({}, 0, rng=lambda: 0.0) == 0.0


def test_limiter_unit(store):
    rec, _ = store.create("u", rpm=2, tpm=5)
    lim = RateLimiter(window_s=60)
    assert lim.hit_request(rec).allowed and lim.hit_request(rec).allowed
    st = lim.hit_request(rec)
    assert not st.allowed and st.headers()["retry-after"] == "60"
    with pytest.raises(ValueError):
        lim.consume_tokens(rec, -1)
    assert lim.consume_tokens(rec, 0).remaining == 5


def test_unauthenticated_requests_are_limited_per_ip(target, tok, tmp_path):
    """Refused signatures and public paths share a per-IP budget; past it, 429 with
    retry-after comes before any signature work; signed requests are not charged and
    still pass."""
    import requests

    from cloud_api.app import create_app
    from cloud_api.keys import SQLiteKeyStore
    from cloud_api.server import BackgroundServer
    from edge_sdk.protocol.signing import Signer

    store = SQLiteKeyStore(tmp_path / "k.sqlite3")
    signer = Signer.from_api_key(store.create("ok", ["verify"])[1])
    with BackgroundServer(create_app(target, tok, key_store=store,
                                     unauth_per_window=5)) as s:
        def signed_get():
            return requests.get(s.url + "/v1/sessions/1",
                                headers=signer.headers("GET", "/v1/sessions/1"), timeout=10)

        for _ in range(5):
            assert signed_get().status_code == 404                  # not charged
        codes = [requests.get(s.url + "/healthz", timeout=10).status_code
                 for _ in range(3)]
        codes += [requests.post(s.url + "/v1/sessions", data=b"\x80", timeout=10).status_code
                  for _ in range(3)]
        assert codes == [200, 200, 200, 401, 401, 429]
        r = requests.get(s.url + "/healthz", timeout=10)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "too_many_unauthenticated"
        # the check precedes authentication: while over budget the address is refused
        assert signed_get().status_code == 429
