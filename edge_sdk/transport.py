"""HTTP transport to the verification API: aiohttp client, signing hook, retries.

Byte counters measure message bodies (the protocol payload, both directions).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from edge_sdk.retry import RETRYABLE_STATUSES, backoff_delay

MSGPACK = "application/x-msgpack"
#: What "the cloud cannot be reached" looks like once :meth:`Transport.request` has
#: used its retries: refused or reset connections, timeouts, and an answer cut off
#: mid-body (``ClientPayloadError``: the connection broke while the body was read).
UNREACHABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
               asyncio.TimeoutError, ConnectionError)


class RemoteError(Exception):
    """A 4xx/5xx answer. ``status``, ``code``, ``field`` and ``body`` (parsed JSON)."""

    def __init__(self, status: int, body: dict | None, text: str = ""):
        err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
        self.status, self.body = status, body or {}
        self.code, self.field = err.get("code"), err.get("field")
        super().__init__(f"HTTP {status} {self.code or ''}: {err.get('message', text)}"
                         + (f" (field {self.field})" if self.field else ""))


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
                      content_type: str = MSGPACK) -> tuple[bytes, str]:
        """Send one request; returns (body bytes, content type).

        Raises:
            RemoteError: a 4xx/5xx answer (after retries for 429, 502-504).
            TLSVerifyError: the server's certificate is not trusted (not retried).
            aiohttp.ClientConnectionError, aiohttp.ClientPayloadError (an answer cut
                off mid-body), asyncio.TimeoutError: unreachable after ``retries``
                attempts (:data:`UNREACHABLE`).
        """
        http = await self._http()
        for attempt in range(self.retries + 1):
            headers = {"content-type": content_type} if body else {}
            if self.signer is not None:
                headers.update(self.signer.headers(method, path, body))
            try:
                async with http.request(method, self.base_url + path, data=body or None,
                                        headers=headers) as r:
                    data = await r.read()
                    self.uplink_bytes += len(body)
                    self.downlink_bytes += len(data)
                    if r.status < 400:
                        return data, r.content_type
                    if r.status in RETRYABLE_STATUSES and attempt < self.retries:
                        await asyncio.sleep(self._delay(attempt, r.headers))
                        continue
                    try:
                        parsed = json.loads(data)
                    except ValueError:
                        parsed = None
                    raise RemoteError(r.status, parsed, data[:200].decode("utf8", "replace"))
            except aiohttp.ClientSSLError as e:
                raise TLSVerifyError(
                    f"TLS handshake with {self.base_url} failed ({_reason(e)}): trust the "
                    "server's CA certificate (CLI --ca-cert, SDK ssl_context=)") from None
            except UNREACHABLE:
                if attempt >= self.retries:
                    raise
                await asyncio.sleep(self._delay(attempt, None))
        raise AssertionError("unreachable")


def _reason(e: BaseException) -> str:
    """The root cause of a connector error, in one line."""
    inner = getattr(e, "certificate_error", None) or getattr(e, "os_error", None) or e
    return str(getattr(inner, "reason", None) or inner).splitlines()[0]
