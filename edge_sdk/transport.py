"""HTTP transport to the verification API: aiohttp client, signing hook, retries.

Byte counters measure message bodies (the protocol payload, both directions).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from edge_sdk.protocol import frames, wire
from edge_sdk.retry import RETRYABLE_STATUSES, backoff_delay

MSGPACK = "application/x-msgpack"
#: What "the cloud cannot be reached" looks like once :meth:`Transport.request` has
#: used its retries: refused or reset connections, timeouts, and an answer cut off
#: mid-body (``ClientPayloadError``: the connection broke while the body was read).
UNREACHABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
               asyncio.TimeoutError, ConnectionError)


class RemoteError(Exception):
    """A 4xx/5xx answer. ``status``, ``code``, ``message``, ``field`` and ``body``
    (parsed JSON); ``str()`` is :meth:`describe` with the wire's field name."""

    def __init__(self, status: int, body: dict | None, text: str = ""):
        err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
        self.status, self.body = status, body or {}
        self.code, self.field = err.get("code"), err.get("field")
        self.message = err.get("message", text)
        super().__init__(self.describe())

    def describe(self, field: str | None = None) -> str:
        """``HTTP 400 code: message (field F)``, the field named ``field`` when given
        (a front end naming it as its own request does), else as the wire names it."""
        name = field or self.field
        return (f"HTTP {self.status} {self.code or ''}: {self.message}"
                + (f" (field {name})" if name else ""))


class TLSVerifyError(Exception):
    """The TLS handshake failed (an untrusted or mismatched certificate). Never
    retried: waiting does not make a certificate trusted."""


class Transport:
    """Signed, retrying HTTP client.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        signer: object with ``headers(method, path, body) -> dict`` (request signing) or None.
        retries: attempts after the first for connection errors (a response cut off
            mid-body included), 429 and 502-504 (verify is idempotent: the cloud answers
            a repeated block from its cache).
        timeout_s: per-request timeout in seconds.
        ssl_context: TLS context for ``https://`` (e.g. trusting a private CA); None
            uses the system trust store.
    """

    def __init__(self, base_url: str, signer=None, retries: int = 4, timeout_s: float = 120.0,
                 backoff_s: float = 0.05, ssl_context=None):
        self.base_url = base_url.rstrip("/")
        self.signer, self.retries, self.backoff_s = signer, retries, backoff_s
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ssl_context = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self.uplink_bytes = 0
        self.downlink_bytes = 0

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(ssl=self.ssl_context) if self.ssl_context else None
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=conn)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _delay(self, attempt: int, headers=None) -> float:
        return backoff_delay(headers or {}, attempt, base_s=self.backoff_s)

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = MSGPACK, on_early=None,
                      timeout_s: float | None = None) -> tuple[bytes, str]:
        """Send one request; returns (body bytes, content type). ``timeout_s`` replaces
        the transport's per-attempt timeout for this request (a long prompt's create).

        With ``on_early`` (FSD; verify requests only) the request asks for a streamed
        answer (``wire.STREAM_SEQ``): ``on_early(EarlyVerdict)`` is called as soon as
        the early verdict arrives (again on a retry: make it idempotent) and the
        final verdict's bytes are returned (a stream-error item raises RemoteError).

        Raises:
            RemoteError: a 4xx/5xx answer (after retries for 429, 502-504).
            TLSVerifyError: the server's certificate is not trusted (not retried).
            aiohttp.ClientConnectionError, aiohttp.ClientPayloadError (an answer cut
                off mid-body), asyncio.TimeoutError: unreachable after ``retries``
                attempts (:data:`UNREACHABLE`).
        """
        http = await self._http()
        kw = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
        for attempt in range(self.retries + 1):
            headers = self._headers(method, path, body, content_type, on_early)
            try:
                async with http.request(method, self.base_url + path, data=body or None,
                                        headers=headers, **kw) as r:
                    self.uplink_bytes += len(body)
                    status, data = r.status, None
                    if r.status < 400 and r.content_type == wire.STREAM_SEQ:
                        status, data = await self._read_stream(r, on_early)
                    if data is None:
                        data = await r.read()
                        self.downlink_bytes += len(data)
                    if status < 400:
                        return data, MSGPACK if r.content_type == wire.STREAM_SEQ else \
                            r.content_type
                    if status in RETRYABLE_STATUSES and attempt < self.retries:
                        await asyncio.sleep(self._delay(attempt, r.headers))
                        continue
                    try:
                        parsed = json.loads(data)
                    except ValueError:
                        parsed = None
                    raise RemoteError(status, parsed, data[:200].decode("utf8", "replace"))
            except aiohttp.ClientSSLError as e:
                why = _reason(e)
                fix = ("the server speaks plain HTTP? use an http:// URL"
                       if "WRONG_VERSION_NUMBER" in why else
                       "trust the server's CA certificate (CLI --ca-cert, SDK ssl_context=)")
                raise TLSVerifyError(
                    f"TLS handshake with {self.base_url} failed ({why}): {fix}") from None
            except UNREACHABLE:
                if attempt >= self.retries:
                    raise
                await asyncio.sleep(self._delay(attempt, None))
        raise AssertionError("unreachable")


    def _headers(self, method: str, path: str, body: bytes, content_type: str,
                 on_early) -> dict:
        """Content type, the streamed-answer ``Accept`` (FSD) and the signature."""
        headers = {"content-type": content_type} if body else {}
        if on_early is not None:
            headers["accept"] = f"{wire.STREAM_SEQ}, {MSGPACK}"
        if self.signer is not None:
            headers.update(self.signer.headers(method, path, body))
        return headers

    async def _read_stream(self, r: aiohttp.ClientResponse, on_early) -> tuple[int, bytes]:
        """Read a streamed verify answer: early verdicts go to ``on_early``; returns
        ``(200, final verdict bytes)`` or ``(status, JSON error bytes)`` for a
        stream-error item. Raises ClientPayloadError for a stream that ends without
        its final item (a connection cut after the early verdict: retried)."""
        reader = frames.StreamReader()
        try:
            async for chunk in r.content.iter_any():
                self.downlink_bytes += len(chunk)
                for item in reader.feed(chunk):
                    if isinstance(item, frames.EarlyVerdict):
                        if on_early is not None:
                            on_early(item)
                    elif isinstance(item, wire.VerifyResponse):
                        return 200, item.encode()
                    else:
                        return item[0], json.dumps({"error": item[1]}).encode()
        except wire.WireError as e:
            raise aiohttp.ClientPayloadError(f"bad streamed answer: {e}") from None
        raise aiohttp.ClientPayloadError("streamed answer ended before its final verdict")


async def key_refusal(transport: Transport, timeout_s: float = 5.0) -> RemoteError | None:
    """Ask the API whether it accepts ``transport``'s key, with a signed ``GET /v1/key``
    (200 and the key's record for an accepted key). Unsigned (no signer), a server that
    requires keys answers 401 ``missing_credentials``.

    Returns:
        None when the key is accepted (a server without ``/v1/key`` answers a signed
        request 404, after its key check passed), else the refusal (401/403).

    Raises:
        RemoteError: any other 4xx/5xx answer.
        asyncio.TimeoutError, and what :meth:`Transport.request` raises when the API
        cannot be reached.
    """
    try:
        await asyncio.wait_for(transport.request("GET", "/v1/key"), timeout_s)
    except RemoteError as e:
        if e.status in (401, 403):
            return e
        if e.status != 404:
            raise
    return None


def _reason(e: BaseException) -> str:
    """The root cause of a connector error, in one line."""
    inner = getattr(e, "certificate_error", None) or getattr(e, "os_error", None) or e
    return str(getattr(inner, "reason", None) or inner).splitlines()[0]
