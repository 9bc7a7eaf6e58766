"""Check a verification API before loading a draft model: it answers, and it accepts
the key. An app calls it at start-up so that a wrong URL or key fails in a second, not
after a model load and a wait for an unreachable cloud (``EdgeClient``'s requests ride a
lost cloud out for ``offline_timeout_s``, 300 s by default)."""

from __future__ import annotations

import json

from edge_sdk.results import CloudUnreachable
from edge_sdk.transport import UNREACHABLE, RemoteError, Transport


async def check_api(base_url: str, api_key: str | None = None, *, signer=None,
                    ssl_context=None, timeout_s: float = 5.0) -> dict:
    """``GET /healthz``, then (with a key) a signed ``GET /v1/key``, each once.

    Args:
        base_url: the API, ``http://host:port`` or ``https://...``.
        api_key: ``sr_live_...`` as ``specrelay keys create`` prints it (or ``signer``:
            a ready :class:`edge_sdk.protocol.signing.Signer`); None checks the API only.
        ssl_context: TLS context for a private CA (as :class:`EdgeClient` takes it).
        timeout_s: per request, seconds.
    Returns:
        ``{"health": /healthz's JSON (max_context, sessions, ...), "key": the key's
        record (key_id, name, scopes, rpm, tpm, quota, used_tokens) or None}``.
    Raises:
        ValueError: ``base_url`` is not an http(s) URL; the key is malformed.
        CloudUnreachable: nothing answers at ``base_url``.
        edge_sdk.transport.TLSVerifyError: the server's certificate is not trusted.
        RemoteError: the key is refused (401 ``unknown_key``, 403 ...), or the URL is
            not a specrelay API (``/healthz`` answered 4xx/5xx).
    """
    from edge_sdk.protocol.signing import Signer

    check_url(base_url)
    if signer is None and api_key is not None:
        signer = Signer.from_api_key(api_key)
    t = Transport(base_url, signer=signer, retries=0, timeout_s=timeout_s,
                  ssl_context=ssl_context)
    try:
        try:
            body, _ = await t.request("GET", "/healthz")
        except UNREACHABLE as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CloudUnreachable(f"cannot reach {base_url}: is `specrelay serve` running "
                                   f"there? ({why})") from None
        health = json_object(body)
        if signer is None:
            return {"health": health, "key": None}
        try:
            body, _ = await t.request("GET", "/v1/key")
        except RemoteError as e:
            if e.status != 404:
                raise
            return {"health": health, "key": {}}   # a server before /v1/key: accepted
        return {"health": health, "key": json_object(body)}
    finally:
        await t.close()


def check_url(base_url: str) -> None:
    """Raises ValueError unless ``base_url`` is an http:// or https:// URL with a host."""
    from urllib.parse import urlsplit

    u = urlsplit(base_url) if isinstance(base_url, str) else None
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"base_url: {base_url!r} is not an http:// or https:// URL "
                         "(e.g. http://127.0.0.1:8000)")


def json_object(body: bytes) -> dict:
    """``body`` parsed as a JSON object; {} when it is not one."""
    try:
        out = json.loads(body)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}
