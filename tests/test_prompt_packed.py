"""The create request's compact prompt (``prompt_packed``: raw DEFLATE of LEB128 varint
token ids) and its defaults-elided fields: round trips, every malformed form refused
with the field named, a bounded inflate, and the SDK against a real server, including
one whose decoder predates the field (it asks again with ``prompt_ids``)."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import wire
from edge_sdk.session import SessionParams

V, BIG_V, MAX_CTX = 512, 151_936, 4096


def _deflate(raw: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(raw) + c.flush()


@settings(max_examples=200, deadline=None, database=None)
@given(ids=st.lists(st.integers(0, (1 << 35) - 1), min_size=1, max_size=300))
def test_pack_prompt_round_trips_every_id_width(ids):
    assert wire.unpack_prompt(wire.pack_prompt(ids), 1 << 35, MAX_CTX) == ids


def test_varint_widths_at_their_boundaries():
    for v, n in ((0, 1), (127, 1), (128, 2), (16383, 2), (16384, 3), (151_935, 3),
                 ((1 << 21) - 1, 3), (1 << 21, 4), ((1 << 35) - 1, 5)):
        raw = zlib.decompress(wire.pack_prompt([v]), -15)
        assert len(raw) == n and raw[-1] < 0x80 and all(b >= 0x80 for b in raw[:-1])
        assert wire.unpack_prompt(wire.pack_prompt([v]), 1 << 35, MAX_CTX) == [v]
    with pytest.raises(ValueError):
        wire.pack_prompt([1 << 35])
    with pytest.raises(ValueError):
        wire.pack_prompt([-1])


@pytest.mark.parametrize("body,why", [
    (b"", "non-empty"),
    ("ids", "non-empty"),
    (b"\xff\xff\xff", "DEFLATE"),
    (_deflate(b"\x05\x06")[:-2], "truncated"),
    (_deflate(b"\x05\x06") + b"junk", "trailing"),
    (_deflate(b""), "unterminated"),
    (_deflate(b"\x05\x86"), "unterminated"),
    (_deflate(b"\x80\x80\x80\x80\x80\x01"), "longer than 5"),
    (_deflate(bytes([0x80, 0x04])), "out of vocabulary"),          # 512 >= V
    (_deflate(b"\x05" * (MAX_CTX + 1)), "more than"),
    (_deflate(b"\x00" * (50 * MAX_CTX)), "more than"),             # a compression bomb
])
def test_malformed_packed_prompts_name_the_field(body, why):
    with pytest.raises(wire.WireError) as e:
        wire.decode_session_request({"prompt_packed": body}, V, MAX_CTX)
    assert e.value.field == "prompt_packed" and why in e.value.message


def test_exactly_one_prompt_form():
    packed = wire.pack_prompt([5, 6])
    for m in ({}, {"prompt_ids": [5], "prompt_packed": packed},
              {"prompt": "w5", "prompt_packed": packed}):
        with pytest.raises(wire.WireError) as e:
            wire.decode_session_request(m, V, MAX_CTX)
        assert e.value.field == "prompt"
    m = wire.decode_session_request(wire.unpack(wire.pack({"prompt_packed": packed})),
                                    V, MAX_CTX)
    assert m["prompt_ids"] == [5, 6]


def _params(cfg=SamplingConfig(), **kw) -> SessionParams:
    base = dict(cfg=cfg, seed=0, mode="asym", support_k=32, n_proposals=4,
                tokenizer_hash="f67fbde3e0a0e214", draft_vocab=BIG_V, vocab=BIG_V)
    return SessionParams(**{**base, **kw})


@pytest.mark.parametrize("kw", [
    {},
    {"cfg": SamplingConfig(temperature=0.7, top_p=0.9), "seed": 3, "mode": "standard",
     "support_k": 8, "n_proposals": 0, "acceptance": "exact"},
    {"cfg": SamplingConfig(top_k=5), "support_k": 1 << 20},          # K clamped to V
])
def test_compact_body_decodes_to_the_same_session(kw):
    """Leaving defaults out and packing the prompt change the bytes, not the session."""
    p = _params(**kw)
    ids = np.random.default_rng(0).integers(0, BIG_V, 200).tolist()
    full = {"prompt_ids": ids, "sampling": p.cfg.to_dict(), "seed": p.seed,
            "max_new_tokens": 32, "tokenizer_hash": p.tokenizer_hash, "mode": p.mode,
            "support_k": min(p.support_k, BIG_V), "n_proposals": p.n_proposals,
            "vocab_size": BIG_V, "acceptance": p.acceptance}
    for packed in (True, False):
        body = p.body(ids, 32, packed)
        assert ("prompt_packed" in body) == packed and ("prompt_ids" in body) != packed
        got = wire.decode_session_request(wire.unpack(wire.pack(body)), BIG_V, MAX_CTX)
        want = wire.decode_session_request(full, BIG_V, MAX_CTX)
        assert got == want


def test_greedy_defaults_body_is_small():
    """A chat-templated prompt's create body: ~0.6x the id array, and the greedy
    defaults (sampling, seed, mode, support_k, n_proposals) cost no bytes."""
    p = _params()
    ids = [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13]
    ids = (ids * 20)[:240]
    small, plain = wire.pack(p.body(ids, 32)), wire.pack(p.body(ids, 32, packed=False))
    assert set(wire.unpack(small)) == {"prompt_packed", "max_new_tokens",
                                       "tokenizer_hash", "vocab_size"}
    assert len(small) < 0.6 * len(plain)


def _ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


async def _generate(url, drafter, tok, ids):
    async with EdgeClient(url, drafter, tok, depth=4, chat=False) as c:
        ref = await c.generate(prompt_ids=ids, target_only=True, max_new_tokens=24)
        out = await c.generate(prompt_ids=ids, max_new_tokens=24)
    return ref, out


def _spy_creates(monkeypatch) -> list:
    """The create bodies the (in-process) server decodes, by their prompt field."""
    seen, real = [], wire.decode_session_request

    def spy(m, *a):
        seen.append(next(k for k in wire.PROMPT_IDS_FIELDS if k in m) if isinstance(m, dict)
                    and any(k in m for k in wire.PROMPT_IDS_FIELDS) else None)
        return real(m, *a)
    monkeypatch.setattr(wire, "decode_session_request", spy)
    return seen


def test_sdk_sends_the_packed_prompt_to_a_real_server(server, tok, draft, monkeypatch):
    """Through the real server: the prompt travels packed where that is shorter (ids
    >= 128 cost 3 bytes each in the msgpack array), as the array where it is not, and
    the output is the target's."""
    seen = _spy_creates(monkeypatch)
    long_ids = _ids_of(tok, " ".join(f"w{200 + i % 7}" for i in range(60)))
    ref, out = asyncio.run(_generate(server.url, TorchDrafter(draft), tok, long_ids))
    assert out.token_ids == ref.token_ids and out.metrics["drafted_tokens"] > 0
    assert seen == ["prompt_packed", "prompt_packed"]
    assert len(wire.pack_prompt(long_ids)) < 0.5 * len(wire.pack(long_ids))
    seen.clear()
    short_ids = _ids_of(tok, "w5 w9 w11")                  # 1 byte each as the array
    ref, out = asyncio.run(_generate(server.url, TorchDrafter(draft), tok, short_ids))
    assert out.token_ids == ref.token_ids and seen == ["prompt_ids", "prompt_ids"]


def test_sdk_falls_back_for_a_server_that_predates_the_field(server, tok, draft,
                                                            monkeypatch):
    """A server whose create decoder does not know ``prompt_packed`` answers 422 naming
    it (its unknown-field rule); the SDK asks again with ``prompt_ids`` and the output
    is unchanged."""
    ids = _ids_of(tok, " ".join(f"w{200 + i % 7}" for i in range(40)))
    fields = wire.SESSION_FIELDS - {"prompt_packed"}
    monkeypatch.setattr(wire, "SESSION_FIELDS", fields)     # the server's decoder, too
    with pytest.raises(wire.WireError) as e:
        wire.decode_session_request({"prompt_packed": wire.pack_prompt(ids)}, V, MAX_CTX)
    assert e.value.field == "prompt_packed"
    seen = _spy_creates(monkeypatch)
    ref, out = asyncio.run(_generate(server.url, TorchDrafter(draft), tok, ids))
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 24
    assert seen == ["prompt_packed", "prompt_ids"] * 2      # refused, then asked again


def test_create_echoes_the_prompt_ids_only_to_a_text_prompt(target, tok):
    """A client that sent token ids (array or packed) has them: the create's answer
    leaves them out (they were most of a short request's downlink); one that sent text
    gets the tokenisation it needs."""
    from cloud_api.service import CloudService

    ids = _ids_of(tok, "w5 w9 w11 w200")

    async def go():
        svc = CloudService(target, tok)
        await svc.start()
        try:
            return [await svc.create(body, None) for body in (
                {"prompt_ids": ids}, {"prompt_packed": wire.pack_prompt(ids)},
                {"prompt": "w5 w9 w11 w200", "chat": False})]
        finally:
            await svc.stop()
    arr, packed, text = asyncio.run(go())
    assert "prompt_ids" not in arr and "prompt_ids" not in packed
    assert arr["prompt_len"] == packed["prompt_len"] == len(ids)
    assert text["prompt_ids"] == ids and text["prompt_len"] == len(ids)
