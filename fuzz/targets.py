"""Fuzz targets: every wire decoder and the signed-request parser.

Each target takes the fuzzer's bytes and either returns (input handled: decoded, or
refused with the documented error) or raises (a finding). The documented errors are
:class:`edge_sdk.protocol.wire.WireError` for the wire decoders (the server turns it into
a 4xx naming the field) and ``ValueError`` subclasses for the key and signature parsers.
A decoder that accepts an input must also round-trip it: re-encoding the decoded message
and decoding that again gives the same message, and a second encoding is byte-identical
to the first (our encoders are canonical).

The ``auth_request`` target drives the real aiohttp middleware: a request correctly
signed by a real key, with fuzzer-chosen header values substituted, must be refused
with a 4xx (or the documented 503 of a full nonce cache) unless every signed header is
the signer's own; the route handler runs only for such requests.
"""

from __future__ import annotations

import asyncio
import math
from typing import Callable

import numpy as np

from edge_sdk.protocol import frames, wire
from edge_sdk.protocol import signing as sg

#: vocabulary sizes the decoders are driven with (the first input byte picks one): a
#: tiny one reaches the out-of-vocabulary checks, the real pair's reaches uint32 ids
VOCABS = (50, 300, 151_936)
MAX_BLOCK = 8


class Finding(AssertionError):
    """A property violation (not a crash of the target itself)."""


def _vocab(data: bytes) -> tuple[int, bytes]:
    return (VOCABS[data[0] % len(VOCABS)], data[1:]) if data else (VOCABS[0], data)


def _same(a, b) -> bool:
    """Deep equality of decoded messages (dataclasses with numpy arrays inside)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.shape == b.shape and a.dtype == b.dtype
                and bool(np.array_equal(a, b, equal_nan=True)))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            _same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _round_trip(msg, encode: Callable, decode: Callable) -> None:
    first = encode(msg)
    try:
        again = decode(first)
    except wire.WireError as e:
        raise Finding(f"the encoding of an accepted {type(msg).__name__} is refused: "
                      f"{e}") from None
    if not _same(msg, again):
        raise Finding(f"decode(encode(m)) != m for {type(msg).__name__}")
    if encode(again) != first:
        raise Finding(f"encoding of {type(msg).__name__} is not canonical")


def verify_request(data: bytes) -> None:
    vocab, body = _vocab(data)
    try:
        m = wire.VerifyRequest.decode(body, vocab, MAX_BLOCK)
    except wire.WireError:
        return
    if m.channel is not None and not all(
            isinstance(x, float) and math.isfinite(x) and lo <= x <= hi
            for x, (_, lo, hi) in zip(m.channel, wire.CHANNEL_RANGES)):
        raise Finding(f"an accepted channel element is out of range: {m.channel}")
    _round_trip(m, lambda x: x.encode(vocab),
                lambda b: wire.VerifyRequest.decode(b, vocab, MAX_BLOCK))


def verify_response(data: bytes) -> None:
    try:
        m = wire.VerifyResponse.decode(data)
    except wire.WireError:
        return
    if m.semantic is not None and any(i >= m.accepted for i in m.semantic):
        raise Finding("an accepted semantic offset is not an accepted draft")
    _round_trip(m, lambda x: x.encode(), wire.VerifyResponse.decode)


def correction_request(data: bytes) -> None:
    vocab, body = _vocab(data)
    try:
        m = wire.CorrectionRequest.decode(body, vocab)
    except wire.WireError:
        return
    _round_trip(m, lambda x: x.encode(), lambda b: wire.CorrectionRequest.decode(b, vocab))


def correction_response(data: bytes) -> None:
    try:
        m = wire.CorrectionResponse.decode(data)
    except wire.WireError:
        return
    _round_trip(m, lambda x: x.encode(), wire.CorrectionResponse.decode)


def streamed_verify(data: bytes) -> None:
    """A streamed verify answer (FSD), fed in two chunks split where the first byte
    says: every item it yields must round-trip like a single message."""
    vocab, body = _vocab(data)
    cut = (data[0] if data else 0) % (len(body) + 1)
    try:
        reader = frames.StreamReader(vocab)
        items = reader.feed(body[:cut]) + reader.feed(body[cut:])
    except wire.WireError:
        return
    for it in items:
        if isinstance(it, frames.EarlyVerdict):
            _round_trip(it, lambda x: x.encode(),
                        lambda b: frames.EarlyVerdict.from_list(wire.unpack(b), vocab))
        elif isinstance(it, wire.VerifyResponse):
            _round_trip(it, lambda x: x.encode(), wire.VerifyResponse.decode)
        elif not (isinstance(it, tuple) and 400 <= it[0] <= 599 and isinstance(it[1], dict)):
            raise Finding(f"unexpected item {it!r}")


def session_request(data: bytes) -> None:
    vocab, body = _vocab(data)
    try:
        m = wire.decode_session_request(wire.unpack(body), vocab, max_context=4096)
    except wire.WireError:
        return
    if not isinstance(m, dict) or not ({"prompt", "prompt_ids"} & set(m)):
        raise Finding("an accepted session request lost its prompt")
    if m.get("acceptance") not in wire.ACCEPTANCE:
        raise Finding(f"an accepted session request has acceptance {m.get('acceptance')!r}")


def api_key(data: bytes) -> None:
    raw = data.decode("utf-8", "replace")
    try:
        parsed = sg.parse_api_key(raw)
    except sg.InvalidApiKey:
        return
    if sg.format_api_key(parsed.key_id, parsed.secret) != raw.strip():
        raise Finding("an accepted key does not re-format to itself")


def signature_header(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        alg, sig = sg.parse_signature_header(text)
    except ValueError:
        return
    if alg not in (sg.ALG_HMAC, sg.ALG_ED25519) or len(sig) not in (32, 64):
        raise Finding("parse_signature_header accepted a bad signature")


# ----------------------------------------------------------------------- auth_request

class _Protocol:
    """What ``aiohttp.web.Request`` and its ``StreamReader`` read from a connection."""

    _reading_paused = False
    transport = None
    ssl_context = None
    peername = ("203.0.113.7", 40000)
    sockname = ("127.0.0.1", 8000)
    max_field_size = max_line_length = 8190
    max_headers = 128

    def pause_reading(self, *args, **kw) -> None:
        pass

    def resume_reading(self, *args, **kw) -> None:
        pass


class _AuthHarness:
    """The real ``auth_middleware`` over an in-memory key store with one real key."""

    HEADERS = (sg.H_KEY, sg.H_TIMESTAMP, sg.H_NONCE, sg.H_DIGEST, sg.H_SIGNATURE)

    def __init__(self) -> None:
        from cloud_api.auth import auth_middleware
        from cloud_api.local import ephemeral_key_store

        store, raw = ephemeral_key_store("fuzz")
        self.signer = sg.Signer.from_api_key(raw)
        self._fresh = lambda: auth_middleware(store)
        self.middleware, self.runs = self._fresh(), 0
        self.loop = asyncio.new_event_loop()
        self.reached = False

    async def _handler(self, request):
        from aiohttp import web

        self.reached = True
        return web.Response(status=200)

    def request(self, method: str, path: str, headers: dict, body: bytes):
        """A real ``aiohttp.web.Request`` as the HTTP parser would hand it over (what
        ``aiohttp.test_utils.make_mocked_request`` builds, with its mocks made once)."""
        from aiohttp import web
        from aiohttp.http import HttpVersion11, RawRequestMessage
        from aiohttp.streams import StreamReader
        from aiohttp.test_utils import make_mocked_request
        from aiohttp.web_urldispatcher import UrlMappingMatchInfo
        from multidict import CIMultiDict, CIMultiDictProxy
        from yarl import URL

        if not hasattr(self, "_parts"):
            t = make_mocked_request("POST", "/", loop=self.loop)
            # a plain protocol object: a Mock would record every call (memory grows)
            self._parts = (_Protocol(), t._payload_writer, t.task, t.match_info.route,
                           t.match_info.apps[0])
        protocol, writer, task, route, app = self._parts
        h = CIMultiDictProxy(CIMultiDict(headers))
        raw = tuple((k.encode(), v.encode("utf-8", "surrogateescape")) for k, v in h.items())
        msg = RawRequestMessage(method, path, HttpVersion11, h, raw, False, None, False,
                                False, URL(path))
        payload = StreamReader(protocol, 2**16, loop=self.loop)
        payload.feed_data(body)
        payload.feed_eof()
        req = web.Request(msg, payload, protocol, writer, task, self.loop)
        info = UrlMappingMatchInfo({}, route)
        info.add_app(app)
        req._match_info = info
        return req

    def run(self, data: bytes) -> None:
        import atheris

        fdp = atheris.FuzzedDataProvider(data)
        method = ("POST", "GET", "DELETE")[fdp.ConsumeIntInRange(0, 2)]
        path = "/v1/sessions/" + fdp.ConsumeUnicodeNoSurrogates(12)
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        try:
            signed = self.signer.headers(method, path, body)
            req = self.request(method, path, dict(signed), body)
        except ValueError:
            return                                   # not a path a client can send
        headers, forged = dict(signed), False
        for name in self.HEADERS:
            if fdp.ConsumeBool():
                value = fdp.ConsumeUnicodeNoSurrogates(48)
                if fdp.ConsumeBool():
                    headers.pop(name, None)
                    forged = True
                elif value != headers.get(name):
                    headers[name] = value
                    forged = True
        if forged:
            try:
                req = self.request(method, path, headers, body)
            except ValueError:
                return                               # aiohttp refuses such a header
        self.runs += 1
        if self.runs % 10_000 == 0:     # a new nonce cache before one key's share fills
            self.middleware = self._fresh()
        self.reached = False
        resp = self.loop.run_until_complete(self.middleware(req, self._handler))
        if forged and self.reached:
            raise Finding(f"a forged request reached the handler: {headers}")
        if not forged and not self.reached:
            raise Finding(f"a correctly signed request was refused ({resp.status})")
        if forged and not (400 <= resp.status < 500 or resp.status == 503):
            raise Finding(f"a forged request got status {resp.status}")


_AUTH: list[_AuthHarness] = []


def auth_request(data: bytes) -> None:
    if not _AUTH:
        _AUTH.append(_AuthHarness())
    _AUTH[0].run(data)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "verify_request": verify_request,
    "verify_response": verify_response,
    "correction_request": correction_request,
    "correction_response": correction_response,
    "streamed_verify": streamed_verify,
    "session_request": session_request,
    "api_key": api_key,
    "signature_header": signature_header,
    "auth_request": auth_request,
}


def seeds(name: str) -> list[bytes]:
    """Valid inputs of target ``name`` (built with the real encoders): the fuzzer's
    starting corpus, so mutations start from messages the decoders accept."""
    v = bytes([2])                                   # the real vocabulary (151,936)
    toks = np.array([17, 151_000, 3], dtype=np.int64)
    q = np.array([0.5, 0.25, 1.0])
    corr = wire.Correction(True, np.array([5, 9]), np.array([0.75, 0.25]),
                           np.array([5]), np.array([0.75]))
    out = {
        "verify_request": [
            v + wire.VerifyRequest(1, 2, 10, 0, None, toks, q, None).encode(151_936),
            v + wire.VerifyRequest(1, 3, 13, 1, 4, toks[:1], None, None).encode(151_936),
            bytes([0]) + wire.VerifyRequest(7, 0, 5, 2, None, np.array([1, 2]), None,
                                            np.full((2, 50), 1 / 50)).encode(50),
            v + wire.VerifyRequest(1, 4, 16, 0, None, toks, q, None, 99).encode(151_936),
            # semantic sessions (WISV): the channel element, with and without expect_last
            v + wire.VerifyRequest(1, 5, 20, 0, None, toks, None, None, 99,
                                   (0.08, 5e7, 0.21)).encode(151_936),
            v + wire.VerifyRequest(1, 6, 24, 0, 7, toks[:2], None, None, None,
                                   (0.0, 1e12, 0.0)).encode(151_936)],
        "verify_response": [
            wire.VerifyResponse(2, 3, 42, None, 13, 0.08, (0, 2)).encode(),
            wire.VerifyResponse(3, 0, None, corr, 13, 0.1).encode(),
            wire.VerifyResponse(4, 5, 42, None, 19, 0.08, (0,), (1, 3)).encode(),
            wire.VerifyResponse(5, 0, 42, None, 20, 0.08, (), ()).encode()],
        "correction_request": [v + wire.CorrectionRequest(2, 32).encode(),
                               v + wire.CorrectionRequest(2, None).encode()],
        "correction_response": [
            wire.CorrectionResponse(2, True, np.array([1, 2]), np.array([0.5, 0.5])).encode(),
            wire.CorrectionResponse(2, False, None, np.full(4, 0.25)).encode()],
        "streamed_verify": [
            v + frames.EarlyVerdict(2, 3, 42, 24, 0.05).encode()
            + wire.VerifyResponse(2, 3, 42, None, 13, 0.08).encode(),
            v + frames.EarlyVerdict(3, 1, None, 24, 0.04).encode()
            + frames.stream_error(500, {"code": "internal", "message": "m"}),
            v + frames.EarlyVerdict(4, 1, 42, 24, 0.05).encode()
            + wire.VerifyResponse(4, 3, 42, None, 17, 0.08, (), (1,)).encode()],
        "session_request": [v + wire.pack({
            "prompt_ids": [1, 2, 3], "chat": False, "seed": 3, "max_new_tokens": 64,
            "sampling": {"temperature": 0.7, "top_p": 0.9}, "vocab_size": 151_936,
            "mode": "asym", "support_k": 32, "n_proposals": 4}),
            v + wire.pack({"prompt": "Hi", "chat": True}),
            v + wire.pack({"prompt_ids": [1, 2], "acceptance": "semantic"})],
        "api_key": [sg.format_api_key("A" * sg.LOOKUP_LEN, "b" * 32).encode()],
        "signature_header": [b"hmac-sha256=" + b"A" * 43 + b"=",
                             b"ed25519=" + b"B" * 86 + b"=="],
        "auth_request": [b"\x00" * 8, bytes(range(64))],
    }
    return out[name]
