"""Structured logs never contain secrets, keys or prompts."""

import asyncio
import json
import logging

from cloud_api.app import create_app
from cloud_api.keys import SQLiteKeyStore
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol.signing import Signer, parse_api_key


def test_access_log_has_no_secrets_or_prompts(target, draft, tok, caplog):
    store = SQLiteKeyStore(":memory:")
    rec, raw = store.create("logtest", scopes=("verify",))
    prompt = "w17 w23 w42 w11 w5"
    with caplog.at_level(logging.DEBUG):
        with BackgroundServer(create_app(target, tok, key_store=store)) as srv:
            async def main():
                async with EdgeClient(srv.url, TorchDrafter(draft), tok, chat=False,
                                      signer=Signer.from_api_key(raw)) as c:
                    return await c.generate(prompt, max_new_tokens=6)

            r = asyncio.run(main())
    lines = [x.getMessage() for x in caplog.records]
    access = [json.loads(x.getMessage()) for x in caplog.records
              if x.name == "specrelay.access"]
    assert access and all(a["key_id"] == rec.key_id for a in access
                          if a["endpoint"].startswith("POST /v1/"))
    secret = parse_api_key(raw).secret
    text = "\n".join(lines)
    for needle in (raw, secret, prompt, r.text):
        assert needle and needle not in text
