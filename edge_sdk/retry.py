"""Client-side retry pacing for 429/503 responses.

Usage in a transport loop::

    for attempt in range(max_attempts):
        resp = await session.post(...)
        if resp.status not in RETRYABLE_STATUSES:
            break
        await asyncio.sleep(backoff_delay(resp.headers, attempt))

A 403 ``quota_exceeded`` is final: do not retry it.
"""

from __future__ import annotations

import random
import time
from email.utils import parsedate_to_datetime
from typing import Callable, Mapping

__all__ = ["RETRYABLE_STATUSES", "backoff_delay", "parse_retry_after"]

RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


def _get(headers: Mapping[str, str], name: str) -> str | None:
    v = headers.get(name)  # CIMultiDict is case-insensitive already
    if v is None:
        for k, val in headers.items():
            if k.lower() == name:
                return val
    return v


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP-date).

    Returns None if absent or unparsable; never negative.
    """
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def backoff_delay(response_headers: Mapping[str, str], attempt: int, *,
                  base_s: float = 0.5, cap_s: float = 30.0, jitter: float = 0.1,
                  rng: Callable[[], float] = random.random) -> float:
    """Seconds to sleep before retry number ``attempt`` (0-based).

    * With ``retry-after`` (or ``x-ratelimit-reset`` when remaining is 0): wait at
      least that long, plus up to ``jitter`` (fraction) extra so clients spread out.
      The server's value is honoured even above ``cap_s``.
    * Otherwise: "full jitter" exponential backoff, uniform in
      ``[0, min(cap_s, base_s * 2**attempt)]``.
    """
    wait = parse_retry_after(_get(response_headers, "retry-after"))
    if wait is None and _get(response_headers, "x-ratelimit-remaining") == "0":
        wait = parse_retry_after(_get(response_headers, "x-ratelimit-reset"))
    if wait is not None:
        return wait * (1.0 + jitter * rng()) + (jitter * rng() if wait == 0 else 0.0)
    return rng() * min(cap_s, base_s * (2 ** max(0, attempt)))
