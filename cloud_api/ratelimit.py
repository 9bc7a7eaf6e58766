"""Per-key rate limiting (``limits`` moving window, in-memory storage).

Two budgets per key, both over a moving window of ``window_s`` seconds (60 in
production, so ``ApiKey.rpm``/``tpm`` are per minute):

* requests — charged by :func:`ratelimit_middleware` on every authenticated request;
* verified tokens — charged by handlers via ``request["ratelimiter"].consume_tokens(
  request["api_key"], n)``, which also charges the key's total quota when the
  limiter was built with ``store=``.

Responses: every authenticated response carries ``x-ratelimit-limit``,
``x-ratelimit-remaining`` and ``x-ratelimit-reset`` (seconds until a slot frees,
integer).  Over a limit -> 429 ``rate_limited`` / ``token_rate_limited`` with
``retry-after`` (seconds); quota exhausted -> 403 ``quota_exceeded`` (do not retry).
State is per process; use a shared ``limits`` storage for several workers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from aiohttp import web
from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage, Storage
from limits.strategies import MovingWindowRateLimiter

from cloud_api.auth import error_response
from cloud_api.keys import ApiKey, KeyStore, QuotaExceeded

__all__ = ["LimitState", "RateLimitExceeded", "RateLimiter", "TokenCharge",
           "ratelimit_middleware", "unauthenticated_ip_middleware"]


@dataclass(frozen=True)
class LimitState:
    """Window snapshot: ``limit`` per window, ``remaining`` units, ``reset_s`` seconds."""

    limit: int
    remaining: int
    reset_s: float
    allowed: bool = True

    def headers(self) -> dict[str, str]:
        h = {"x-ratelimit-limit": str(self.limit),
             "x-ratelimit-remaining": str(max(0, self.remaining)),
             "x-ratelimit-reset": str(math.ceil(self.reset_s))}
        if not self.allowed:
            h["retry-after"] = str(max(1, math.ceil(self.reset_s)))
        return h


class RateLimitExceeded(Exception):
    """Raised by :meth:`RateLimiter.consume_tokens`; carries the window ``state``."""

    def __init__(self, state: LimitState, code: str = "token_rate_limited"):
        super().__init__(code)
        self.state, self.code = state, code


def _window_state(lim: MovingWindowRateLimiter, item, key: str, allowed: bool) -> LimitState:
    """The moving window of ``key`` under ``item`` as a :class:`LimitState`."""
    stats = lim.get_window_stats(item, key)
    return LimitState(item.amount, stats.remaining,
                      max(0.0, stats.reset_time - time.time()), allowed)


class RateLimiter:
    """Moving-window limiter keyed by ``ApiKey.account_id`` (a key and its rotations
    share their windows).

    Args:
        window_s: window length in seconds (limits are ``rpm``/``tpm`` per window).
        storage: a ``limits`` storage (default: in-memory).
        store: key store for total-quota accounting in :meth:`consume_tokens`.
    """

    def __init__(self, *, window_s: int = 60, storage: Storage | None = None,
                 store: KeyStore | None = None):
        self.window_s, self.store = int(window_s), store
        self._lim = MovingWindowRateLimiter(storage or MemoryStorage())

    def _item(self, amount: int, ns: str) -> RateLimitItemPerSecond:
        return RateLimitItemPerSecond(amount, self.window_s, namespace=ns)

    def _state(self, item, key_id: str, allowed: bool) -> LimitState:
        return _window_state(self._lim, item, key_id, allowed)

    def hit_request(self, key: ApiKey) -> LimitState:
        """Charge one request; returned state has ``allowed=False`` when over ``rpm``."""
        item = self._item(key.rpm, "sr-req")
        return self._state(item, key.account_id, self._lim.hit(item, key.account_id))

    def consume_tokens(self, key: ApiKey, n: int) -> LimitState:
        """Charge ``n`` verified tokens against ``tpm`` (and the quota, if a store is set).

        Raises:
            RateLimitExceeded: the window cannot absorb ``n`` now (nothing charged).
            QuotaExceeded: total quota would be exceeded (nothing charged).
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError("n must be >= 0")
        item, acct = self._item(key.tpm, "sr-tok"), key.account_id
        if n == 0:
            return self._state(item, acct, True)
        if not self._lim.test(item, acct, cost=n):
            raise RateLimitExceeded(self._state(item, acct, False))
        if self.store is not None:
            self.store.record_usage(key.key_id, n)
        self._lim.hit(item, acct, cost=n)
        return self._state(item, acct, True)

    def can_consume(self, key: ApiKey, n: int) -> bool:
        """Whether :meth:`consume_tokens` of ``n`` tokens would pass now (the window
        and the key's quota as last read); charges nothing."""
        if key.quota is not None and key.used_tokens + n > key.quota:
            return False
        return n <= 0 or self._lim.test(self._item(key.tpm, "sr-tok"), key.account_id,
                                        cost=n)

    def charge_for(self, key: ApiKey) -> "TokenCharge":
        """The verified-token charge of one request of ``key`` (handlers call it)."""
        return TokenCharge(self, key)


class TokenCharge:
    """``charge(n)``: charge ``n`` verified tokens to a key (raises as
    :meth:`RateLimiter.consume_tokens`); ``charge.can(n)``: would it pass now. A
    handler that runs the work elsewhere (a verifier replica) asks ``can`` first and
    charges after the work ran."""

    def __init__(self, limiter: RateLimiter, key: ApiKey):
        self.limiter, self.key = limiter, key

    def __call__(self, n: int) -> LimitState:
        return self.limiter.consume_tokens(self.key, n)

    def can(self, n: int) -> bool:
        return self.limiter.can_consume(self.key, n)


def ratelimit_middleware(limiter: RateLimiter):
    """aiohttp middleware; place it after ``auth_middleware``.

    Requests without ``request["api_key"]`` (public paths) pass unmetered.
    Exposes ``request["ratelimiter"]`` and maps :class:`RateLimitExceeded` /
    :class:`QuotaExceeded` raised by handlers to 429 / 403.
    """

    @web.middleware
    async def middleware(request: web.Request, handler):
        key: ApiKey | None = request.get("api_key")
        if key is None:
            return await handler(request)
        if key.quota is not None and key.used_tokens >= key.quota:
            return error_response(403, "quota_exceeded", "token quota exhausted")
        state = limiter.hit_request(key)
        if not state.allowed:
            return error_response(429, "rate_limited", "too many requests", state.headers())
        request["ratelimiter"] = limiter
        try:
            resp = await handler(request)
        except RateLimitExceeded as exc:
            return error_response(429, exc.code, "verified-token rate limit exceeded",
                                  exc.state.headers())
        except QuotaExceeded:
            return error_response(403, "quota_exceeded", "token quota exhausted")
        if not resp.prepared:
            resp.headers.update(state.headers())
        return resp

    return middleware


def unauthenticated_ip_middleware(per_window: int, *, window_s: int = 60,
                                  storage: Storage | None = None):
    """Per-IP budget for requests that are not authenticated: refused signatures (401)
    and the public paths (``/healthz``, ``/metrics``). Place it before ``auth_middleware``.

    An IP over ``per_window`` such requests in the moving window gets 429
    ``too_many_unauthenticated`` with ``retry-after`` before any key lookup or signature
    check is spent on it. Authenticated requests are never charged (their key's rpm/tpm
    apply), so signed traffic alone never exhausts the budget; while an address is over
    it, though, all its requests are refused (the check precedes authentication). The
    address is the TCP peer (``request.remote``); behind a reverse proxy that is the
    proxy: rate-limit there, or give the proxy's address a larger budget.
    """
    lim = MovingWindowRateLimiter(storage or MemoryStorage())
    item = RateLimitItemPerSecond(int(per_window), int(window_s), namespace="sr-ip")

    @web.middleware
    async def middleware(request: web.Request, handler):
        ip = request.remote or "unknown"
        if not lim.test(item, ip):
            return error_response(429, "too_many_unauthenticated",
                                  "too many unauthenticated requests from this address",
                                  _window_state(lim, item, ip, False).headers())
        try:
            return await handler(request)
        finally:
            if request.get("api_key") is None:       # refused, unknown, or public
                lim.hit(item, ip)

    return middleware
