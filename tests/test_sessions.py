"""Session limits: count, per-key, KV memory budget; eviction and SDK recovery."""

import asyncio

import aiohttp

from cloud_api.app import SERVICE, create_app
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import wire


async def _gen(url, drafter, tok, prompt, **kw):
    async with EdgeClient(url, drafter, tok, depth=3, chat=False) as c:
        return await c.generate(prompt_ids=prompt, max_new_tokens=30, **kw)


def test_evicted_sessions_are_recreated_and_lose_nothing(tok, target, draft):
    """max_sessions=1 with two interleaved requests: each keeps evicting the other; the
    SDK re-creates its session from the confirmed prefix and the greedy output still
    equals the target alone."""
    prompts = [[4, 5, 6], [7, 8, 9]]
    app = create_app(target, tok, max_sessions=1)
    with BackgroundServer(app) as srv:
        async def main():
            refs = [await _gen(srv.url, None, tok, p) for p in prompts]
            outs = await asyncio.gather(*(_gen(srv.url, TorchDrafter(draft), tok, p)
                                          for p in prompts))
            return refs, outs

        refs, outs = asyncio.run(main())
        evictions = app[SERVICE].sessions.evictions
    assert [r.token_ids for r in refs] == [o.token_ids for o in outs]
    assert evictions > 2


def test_kv_budget_evicts_with_a_clear_error(tok, target):
    app = create_app(target, tok, kv_budget_bytes=1)   # any second session overflows
    with BackgroundServer(app) as srv:
        async def main():
            async with aiohttp.ClientSession() as http:
                ids = []
                for p in ([4, 5, 6], [7, 8, 9]):
                    async with http.post(srv.url + "/v1/sessions",
                                         data=wire.pack({"prompt_ids": p}),
                                         headers={"content-type": wire_type}) as r:
                        assert r.status == 201
                        ids.append(wire.unpack(await r.read())["session_id"])
                async with http.get(f"{srv.url}/v1/sessions/{ids[0]}") as r:
                    return r.status, await r.json()

        wire_type = "application/x-msgpack"
        status, body = asyncio.run(main())
    assert status == 404 and body["error"]["code"] == "session_evicted"


def test_per_key_session_limit(tok, target):
    app = create_app(target, tok, max_sessions_per_key=2)
    with BackgroundServer(app) as srv:
        async def main():
            codes = []
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    async with http.post(srv.url + "/v1/sessions",
                                         json={"prompt_ids": [4, 5]}) as r:
                        codes.append((r.status, (await r.json()).get("error", {}).get("code")))
            return codes

        codes = asyncio.run(main())
    assert codes[:2] == [(201, None), (201, None)]
    assert codes[2] == (429, "too_many_sessions")


def test_unknown_route_and_wrong_content_type_over_http(target, tok):
    """The real app: an unsigned unknown route is a JSON 404 (not 401), a verify body
    declared as text is 415 naming content-type."""
    import requests

    from cloud_api.server import BackgroundServer

    with BackgroundServer(create_app(target, tok)) as srv:
        r = requests.get(srv.url + "/nope", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        sid = requests.post(srv.url + "/v1/sessions", json={"prompt_ids": [4, 5, 6]},
                            timeout=10).json()["session_id"]
        r = requests.post(f"{srv.url}/v1/sessions/{sid}/verify", data=b"\x90",
                          headers={"content-type": "text/plain"}, timeout=10)
        assert r.status_code == 415 and r.json()["error"]["field"] == "content-type"


def test_a_long_prompts_create_waits_for_its_prefill_instead_of_retrying(tok, target):
    """The cloud answers a create only after prefilling the prompt, so the create waits
    the transport's timeout plus CREATE_TIMEOUT_S_PER_TOKEN a prompt token. A create
    that takes 1.2 s against a 0.5 s transport timeout is answered on its first try
    (100 tokens: 0.5 + 2.0 s), where a fixed timeout sent it three times."""
    from aiohttp import web

    from edge_sdk.protocol.limits import CREATE_TIMEOUT_S_PER_TOKEN
    from edge_sdk.session import create_timeout_s
    from edge_sdk.transport import Transport

    creates = []

    @web.middleware
    async def slow_prefill(request, handler):          # the real create, 1.2 s late
        if request.method == "POST" and request.path == "/v1/sessions":
            creates.append(1)
            await asyncio.sleep(1.2)
        return await handler(request)

    prompt = [4 + i % 50 for i in range(100)]
    app = create_app(target, tok, middlewares=[slow_prefill])
    with BackgroundServer(app) as srv:
        async def main():
            t = Transport(srv.url, retries=2, timeout_s=0.5)
            assert create_timeout_s(t, 100) == 0.5 + 100 * CREATE_TIMEOUT_S_PER_TOKEN
            async with EdgeClient(srv.url, None, tok, chat=False, transport=t) as c:
                return await c.generate(prompt_ids=prompt, max_new_tokens=4)

        out = asyncio.run(main())
    assert len(out.token_ids) == 4 and creates == [1]
