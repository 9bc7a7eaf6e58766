"""Signature-verifying aiohttp middleware and session ownership helper.

Plug in (auth must be the outermost of the two)::

    app = web.Application(middlewares=[auth_middleware(store),
                                       ratelimit_middleware(RateLimiter())])

Every non-public request must carry the ``x-sr-*`` headers produced by
``edge_sdk.protocol.signing.Signer``.  On success ``request["api_key"]`` holds
the :class:`cloud_api.keys.ApiKey`.  Rejections are JSON
``{"error": {"code": ..., "message": ...}}``:

=====  =========================  ============================================
401    ``missing_credentials``    one of the x-sr-* headers is absent
401    ``malformed_credentials``  unparsable header values
401    ``timestamp_expired``      timestamp older than ``skew_s``
401    ``timestamp_in_future``    timestamp more than ``skew_s`` ahead
401    ``digest_mismatch``        body does not match ``x-sr-content-sha256``
401    ``unknown_key``            no such key id
401    ``algorithm_not_allowed``  HMAC for a key with an Ed25519 key / Ed25519 without one
401    ``invalid_signature``      signature does not verify
401    ``key_revoked``            key revoked (checked after the signature)
401    ``replayed_nonce``         nonce already seen for this key
403    ``insufficient_scope``     key lacks the scope the route needs
503    ``nonce_cache_full``       replay cache saturated (fail closed)
=====  =========================  ============================================

The nonce cache is per process: run several workers only behind sticky routing
or pass a shared implementation as ``nonce_cache`` (same method; it may answer with
an awaitable: :class:`cloud_api.replicas.shared_state.SharedNonceCache`).
"""

from __future__ import annotations

import hmac
import inspect
import time
from collections import OrderedDict
from typing import Callable, Iterable

from aiohttp import web

from cloud_api.keys import KeyStore
from edge_sdk.protocol import signing as sg

__all__ = ["NonceCache", "auth_middleware", "error_response", "require_owner",
           "scope_for_path"]

DEFAULT_SCOPE_RULES = (("/v1/", "verify"), ("/admin/", "admin"))


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> web.Response:
    """JSON error ``{"error": {"code", "message"}}`` with the given HTTP status."""
    return web.json_response({"error": {"code": code, "message": message}},
                             status=status, headers=headers)


def scope_for_path(path: str, rules=DEFAULT_SCOPE_RULES, default: str = "admin") -> str:
    """Scope required for ``path``: first matching prefix rule, else ``default``."""
    for prefix, scope in rules:
        if path.startswith(prefix) or path == prefix.rstrip("/"):
            return scope
    return default


class NonceCache:
    """Bounded replay cache: remembers ``(key_id, nonce)`` for ``ttl_s`` seconds.

    ``ttl_s`` must be >= 2 * skew so a nonce outlives its timestamp's validity. Memory is
    bounded by ``max_entries`` in all and ``max_per_key`` per key; an unexpired entry is
    never evicted to make room (that would let its replay through): a full cache, or a
    key over its share, fails closed (``None``: the middleware answers 503 with
    ``Retry-After``), and one key's burst cannot lock the other keys out.
    """

    def __init__(self, ttl_s: float = 600, max_entries: int = 200_000,
                 max_per_key: int = 20_000):
        self.ttl_s, self.max_entries, self.max_per_key = ttl_s, max_entries, max_per_key
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._per_key: dict[str, int] = {}

    @property
    def size(self) -> int:
        """Entries held (expired ones included until the next check)."""
        return len(self._seen)

    def _expire(self, now: float) -> None:
        while self._seen and next(iter(self._seen.values())) <= now:
            (key_id, _), _ = self._seen.popitem(last=False)
            left = self._per_key[key_id] - 1
            if left:
                self._per_key[key_id] = left
            else:
                del self._per_key[key_id]

    def check_and_add(self, key_id: str, nonce: str, now: float) -> bool | None:
        """True if fresh (now recorded), False if replayed, None if the cache (or this
        key's share of it) is full."""
        self._expire(now)
        k = (key_id, nonce)
        if k in self._seen:
            return False
        n = self._per_key.get(key_id, 0)
        if len(self._seen) >= self.max_entries or n >= self.max_per_key:
            return None
        self._seen[k] = now + self.ttl_s  # insertion order == expiry order
        self._per_key[key_id] = n + 1
        return True


_SIGNED_HEADERS = (sg.H_KEY, sg.H_TIMESTAMP, sg.H_NONCE, sg.H_DIGEST, sg.H_SIGNATURE)
_UNAUTH = {"WWW-Authenticate": 'SR-Signature realm="specrelay"'}


class _Denied(Exception):
    """A refused request: its JSON error response (401s carry WWW-Authenticate)."""

    def __init__(self, code: str, message: str, status: int = 401,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status
        self.headers = headers if headers is not None else (
            _UNAUTH if status == 401 else None)

    def response(self) -> web.Response:
        return error_response(self.status, self.code, self.message, self.headers)


def _signed_parts(request: web.Request):
    """``(key_id, nonce, digest, timestamp, alg, signature, canonical message)`` of a
    request carrying every x-sr-* header. Raises _Denied: unparsable values."""
    h = request.headers
    key_id, nonce, digest = h[sg.H_KEY], h[sg.H_NONCE], h[sg.H_DIGEST]
    try:
        ts = int(h[sg.H_TIMESTAMP])
        alg, sig = sg.parse_signature_header(h[sg.H_SIGNATURE])
        msg = sg.canonical_string(
            alg=alg, key_id=key_id, method=request.method,
            raw_path=request.rel_url.raw_path or "/",
            raw_query=request.rel_url.raw_query_string, timestamp=ts,
            nonce=nonce, content_sha256=digest)
    except ValueError:
        raise _Denied("malformed_credentials", "malformed signature headers") from None
    return key_id, nonce, digest, ts, alg, sig, msg


def _check_timestamp(ts: int, now: float, skew_s: float) -> None:
    """Raises _Denied unless ``ts`` (Unix seconds) is within ``skew_s`` of ``now``."""
    if ts < now - skew_s:
        raise _Denied("timestamp_expired", "request timestamp too old")
    if ts > now + skew_s:
        raise _Denied("timestamp_in_future", "request timestamp too far in the future")


def _check_key(store: KeyStore, key_id: str, alg: str, sig, msg):
    """The key that signed ``msg``. Raises _Denied: unknown key, an algorithm the key
    does not allow, a signature that does not verify, or a revoked key (checked after
    the signature)."""
    key = store.get_by_lookup(key_id)
    if key is None:
        raise _Denied("unknown_key", "unknown API key")
    if (alg == sg.ALG_HMAC) != (key.ed25519_public_key is None):
        raise _Denied("algorithm_not_allowed", "signature algorithm not allowed for key")
    if not sg.verify_signature(alg, sig, msg, hmac_key=key.secret_hash,
                               ed25519_public_key=key.ed25519_public_key):
        raise _Denied("invalid_signature", "signature verification failed")
    if key.revoked:
        raise _Denied("key_revoked", "API key revoked")
    return key


async def _check_nonce(nonces: NonceCache, key_id: str, nonce: str, now: float) -> None:
    """Raises _Denied: a replayed nonce (401), or a full replay cache (503, fail
    closed). A shared cache may answer with an awaitable (one held by another
    process: :class:`cloud_api.replicas.shared_state.SharedNonceCache`)."""
    fresh = nonces.check_and_add(key_id, nonce, now)
    if inspect.isawaitable(fresh):
        fresh = await fresh
    if fresh is None:
        raise _Denied("nonce_cache_full", "try again later", 503, {"Retry-After": "1"})
    if not fresh:
        raise _Denied("replayed_nonce", "nonce already used")


async def _authenticate(request: web.Request, store: KeyStore, nonces: NonceCache,
                        clock: Callable[[], float], skew_s: float):
    """The :class:`cloud_api.keys.ApiKey` that signed ``request``, checked in the order
    of the table above. Raises _Denied."""
    if any(n not in request.headers for n in _SIGNED_HEADERS):
        raise _Denied("missing_credentials", "request is not signed")
    key_id, nonce, digest, ts, alg, sig, msg = _signed_parts(request)
    now = clock()
    _check_timestamp(ts, now, skew_s)
    body = await request.read()  # cached: handlers can read it again
    if not hmac.compare_digest(sg.body_digest(body), digest):
        raise _Denied("digest_mismatch", "body does not match content digest")
    key = _check_key(store, key_id, alg, sig, msg)
    await _check_nonce(nonces, key.key_id, nonce, now)
    return key


def auth_middleware(store: KeyStore, *, skew_s: float = 300, nonce_ttl_s: float = 600,
                    public_paths: Iterable[str] = ("/healthz", "/metrics"),
                    scope_rules=DEFAULT_SCOPE_RULES, default_scope: str = "admin",
                    nonce_cache: NonceCache | None = None,
                    clock: Callable[[], float] = time.time):
    """Create the verifying middleware.

    Args:
        store: key store used to resolve ``x-sr-key``.
        skew_s: accepted |server time - x-sr-timestamp|, seconds.
        nonce_ttl_s: how long nonces are remembered, seconds (>= 2*skew_s).
        public_paths: exact paths served without authentication.
        scope_rules: ``(prefix, scope)`` pairs; unmatched paths need ``default_scope``.
        clock: Unix-seconds clock (tests).

    Raises:
        ValueError: ``nonce_ttl_s < 2 * skew_s`` (would allow replays).
    """
    if nonce_ttl_s < 2 * skew_s:
        raise ValueError("nonce_ttl_s must be >= 2 * skew_s")
    public = frozenset(public_paths)
    nonces = nonce_cache or NonceCache(nonce_ttl_s)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in public:
            return await handler(request)
        if request.match_info.http_exception is not None and any(
                n not in request.headers for n in _SIGNED_HEADERS):
            return await handler(request)   # no such route / method: 404 / 405
        try:
            key = await _authenticate(request, store, nonces, clock, skew_s)
            if scope_for_path(request.path, scope_rules, default_scope) not in key.scopes:
                raise _Denied("insufficient_scope", "API key lacks the required scope", 403)
        except _Denied as d:
            return d.response()
        request["api_key"] = key
        return await handler(request)

    return middleware


def require_owner(request: web.Request, owner_key_id: str) -> None:
    """Ensure the authenticated key owns a resource (e.g. a session).

    Raises:
        web.HTTPNotFound: (JSON error ``not_found``) if another key owns it, so
            foreign sessions are indistinguishable from missing ones.
    """
    key = request.get("api_key")
    if key is None or not isinstance(owner_key_id, str) or not hmac.compare_digest(
            key.key_id.encode(), owner_key_id.encode()):
        raise web.HTTPNotFound(
            text='{"error": {"code": "not_found", "message": "not found"}}',
            content_type="application/json")
