"""An app developer's first hour with the SDK: a wrong URL or key fails in a second
before any model loads (``check_api``), bad request values fail before any network
call with the field and its range named, sampled requests without a seed differ from
call to call (and replay from the seed they report), a stop string is one stop string,
and a closed client says so."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from cloud_api.app import create_app
from cloud_api.keys import SQLiteKeyStore
from cloud_api.server import BackgroundServer
from edge_sdk import CloudUnreachable, EdgeClient, RemoteError, SamplingConfig, check_api
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import signing as sg


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_check_api_names_a_dead_url_a_bad_url_and_a_refused_key(tmp_path, target, tok):
    store = SQLiteKeyStore(tmp_path / "k.sqlite3")
    rec, raw = store.create("app", ["verify"])
    stranger = sg.format_api_key("Q" * sg.LOOKUP_LEN, "s" * 32)
    url = _dead_url()
    t0 = time.monotonic()
    with pytest.raises(CloudUnreachable, match=f"cannot reach {url}: is `specrelay serve`"):
        asyncio.run(check_api(url))
    assert time.monotonic() - t0 < 3
    with pytest.raises(ValueError, match="base_url: '127.0.0.1:8000' is not an http"):
        asyncio.run(check_api("127.0.0.1:8000"))
    with pytest.raises(sg.InvalidApiKey):
        asyncio.run(check_api(url, "sr_live_nope"))            # before any request
    with BackgroundServer(create_app(target, tok, key_store=store)) as srv:
        got = asyncio.run(check_api(srv.url, raw))
        assert got["key"]["key_id"] == rec.key_id and got["health"]["max_context"] > 0
        assert asyncio.run(check_api(srv.url))["key"] is None
        with pytest.raises(RemoteError) as e:
            asyncio.run(check_api(srv.url, stranger))
        assert e.value.status == 401 and e.value.code == "unknown_key"


def test_bad_request_values_fail_before_any_network_call(tok, draft):
    """Against a dead URL: every mistake is a ValueError naming the field (and its
    range), raised at once, not a CloudUnreachable after the offline wait."""
    with pytest.raises(ValueError, match="base_url"):
        EdgeClient("127.0.0.1:8000", None, tok)

    async def main():
        async with EdgeClient(_dead_url(), TorchDrafter(draft), tok, chat=False,
                              offline_timeout_s=60) as c:
            cases = [({"max_new_tokens": 0}, "max_new_tokens must be an integer in 1..32768"),
                     ({"max_new_tokens": 10 ** 6}, "max_new_tokens"),
                     ({"max_new_tokens": True}, "max_new_tokens"),
                     ({"seed": "abc"}, "seed must be an integer"),
                     ({"seed": -1}, "seed"),
                     ({"stop": [1, 2]}, "stop must be a string or a list of strings"),
                     ({"sampling": "hot"}, "sampling must be a SamplingConfig or a dict"),
                     ({"sampling": {"temperature": -1}}, "sampling.temperature"),
                     ({"sampling": {"warmth": 1}}, "sampling.warmth: unknown field")]
            for kw, needle in cases:
                t0 = time.monotonic()
                with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
                    await c.generate(prompt_ids=[4, 5], **kw)
                assert time.monotonic() - t0 < 1, kw
            for prompt, needle in (("", "non-empty string"), ("   ", "non-empty"),
                                   (42, "must be a string")):
                with pytest.raises(ValueError, match=needle):
                    await c.generate(prompt)
            with pytest.raises(ValueError, match="at least one token"):
                await c.generate(prompt_ids=[])
            with pytest.raises(RuntimeError, match="after the stream has been iterated"):
                c.stream(prompt_ids=[4, 5]).result()
        with pytest.raises(RuntimeError, match="EdgeClient is closed"):
            await c.generate(prompt_ids=[4, 5])

    asyncio.run(main())


def test_sampling_values_name_their_range():
    with pytest.raises(ValueError, match=r"temperature: invalid value -1 \(allowed: 0 "):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p: invalid value 1.5 \(allowed: in \(0, 1\]"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="sampling.temperature: 'hot' is not a number"):
        SamplingConfig(temperature="hot")
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=True)


def test_unseeded_sampling_differs_per_call_and_replays_from_its_seed(server, tok, draft):
    hot = SamplingConfig(temperature=1.0)

    async def main():
        async with EdgeClient(server.url, TorchDrafter(draft), tok, chat=False) as c:
            runs = [await c.generate(prompt_ids=[4, 5, 6], sampling=hot, max_new_tokens=24)
                    for _ in range(3)]
            again = await c.generate(prompt_ids=[4, 5, 6], sampling=hot, max_new_tokens=24,
                                     seed=runs[0].seed)
            greedy = await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=8,
                                      stop="zz", sampling={"temperature": 0})
            return runs, again, greedy

    runs, again, greedy = asyncio.run(main())
    assert len({r.seed for r in runs}) == 3 and all(isinstance(r.seed, int) for r in runs)
    assert len({tuple(r.token_ids) for r in runs}) > 1     # not one fixed answer
    assert again.token_ids == runs[0].token_ids and again.to_dict()["seed"] == runs[0].seed
    assert greedy.finish_reason in ("length", "stop") and greedy.seed is not None


def test_a_stop_string_is_one_stop_string():
    from edge_sdk.generation import request_stop

    assert request_stop("10") == ["10"]
    assert request_stop(("a", "", "b")) == ["a", "b"]
    assert request_stop(None) == []
    for bad in (b"10", 0, {"a": "b"}, ["a", 1]):
        with pytest.raises(ValueError, match="stop must be a string or a list"):
            request_stop(bad)


def test_waiting_for_a_lost_cloud_says_so_at_once(tok, draft):
    """``on_cloud_loss="wait"`` rides a lost cloud out for ``offline_timeout_s``; the
    first failed try logs one warning naming the URL and the wait, so the wait does
    not look like a hang. (A handler on the ``edge_sdk`` logger itself: the CLI stops
    that logger's propagation when it runs in the same process.)"""
    url = _dead_url()

    async def main():
        async with EdgeClient(url, TorchDrafter(draft), tok, chat=False,
                              offline_timeout_s=1.0) as c:
            await c.generate(prompt_ids=[4, 5], max_new_tokens=4)

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    lg, keep = logging.getLogger("edge_sdk"), Keep()
    lg.addHandler(keep)
    try:
        with pytest.raises(CloudUnreachable, match="gave up after 1 s"):
            asyncio.run(main())
    finally:
        lg.removeHandler(keep)
    warned = keep.messages
    assert len(warned) == 1 and url in warned[0] and "up to 1 s (offline_timeout_s)" \
        in warned[0], warned


def test_a_bad_depth_or_key_is_named_when_the_client_is_made(tok):
    with pytest.raises(ValueError, match="depth must be an integer >= 1, not 0"):
        EdgeClient("http://127.0.0.1:9", None, tok, depth=0)
    with pytest.raises(sg.InvalidApiKey, match="a key looks like sr_live_"):
        sg.Signer.from_api_key("sr_live_nope")
