"""The SDK honours 429 + retry-after from the real signed app and loses nothing."""

import asyncio

from cloud_api.app import create_app
from cloud_api.keys import SQLiteKeyStore
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.protocol.signing import Signer
from edge_sdk.transport import Transport


def test_rate_limited_generation_completes_identically(target, tok):
    store = SQLiteKeyStore(":memory:")
    _, raw = store.create("tight", scopes=("verify",), rpm=6, tpm=100_000)
    signer = Signer.from_api_key(raw)
    app = create_app(target, tok, key_store=store, rate_window_s=1)
    with BackgroundServer(app) as srv:
        async def main():
            async with EdgeClient(srv.url, None, tok, chat=False,
                                  transport=Transport(srv.url, signer=signer,
                                                      retries=20)) as c:
                return await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=12)

        limited = asyncio.run(main())
    app2 = create_app(target, tok)
    with BackgroundServer(app2) as srv2:
        async def ref():
            async with EdgeClient(srv2.url, None, tok, chat=False) as c:
                return await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=12)

        reference = asyncio.run(ref())
    assert limited.token_ids == reference.token_ids
    assert limited.metrics["wall_s"] > 1.0     # it had to wait out at least one window
