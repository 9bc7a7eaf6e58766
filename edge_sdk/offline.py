"""What a request does when the cloud cannot be reached (after the transport's own
retries): the cloud-loss policies.

``wait`` (default)
    keep retrying with backoff (0.1 s, doubling, at most 2 s between tries) for up to
    ``offline_timeout_s`` seconds, then raise :class:`CloudUnreachable`; no unverified
    token is ever produced.
``draft_only``
    continue with the draft model alone, every such token flagged ``verified=False``,
    probing the cloud at most every ``probe_interval_s`` seconds; once it answers, the
    session is re-created from the full prefix and verification resumes (nothing lost
    or repeated).
``local``
    continue *exactly* with the device's own copy of the target under a memory budget
    (``EdgeClient(local_target=...)``, a :class:`edge_sdk.local_target.LocalSession`:
    CATS self-speculative decoding, every token the full target's, so it stays
    ``verified=True``), probing the cloud the same way; once it answers the session is
    re-created from the full prefix and the cloud verifies again (nothing lost or
    repeated).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Awaitable, Callable, TypeVar

from edge_sdk.results import CloudUnreachable
from edge_sdk.retry import backoff_delay
from edge_sdk.transport import UNREACHABLE

log = logging.getLogger("edge_sdk")

POLICIES = ("wait", "draft_only", "local")
T = TypeVar("T")


def reconnect_delay(attempt: int) -> float:
    """Seconds before reconnect try ``attempt`` (0-based): 0.1 s doubling to at most
    2 s, without jitter (one request retrying its own cloud)."""
    return backoff_delay({}, attempt, base_s=0.1, cap_s=2.0, jitter=0.0, rng=lambda: 1.0)


class CloudLoss:
    """One request's cloud-loss policy and state (``offline``: drafting alone).

    Args: policy (one of :data:`POLICIES`), timeout_s (``wait``: seconds before giving
    up), probe_interval_s (``draft_only``: seconds between probes), transport (its
    ``base_url`` names the API in the error message).
    """

    def __init__(self, policy: str, timeout_s: float, probe_interval_s: float,
                 transport):
        self.policy, self.timeout_s = policy, timeout_s
        self.probe_interval_s, self.transport = probe_interval_s, transport
        self.offline = False
        self._last_probe = time.monotonic()

    def lost(self) -> CloudUnreachable:
        t = self.timeout_s
        return CloudUnreachable(
            f"cannot reach the verification API at {self.transport.base_url} (gave up "
            f"after {t:.0f} s: is it running? offline_timeout_s / --offline-timeout "
            "waits longer)")

    async def until_reachable(self, fn: Callable[[], Awaitable[T]],
                              on_fail: Callable[[], None] = lambda: None) -> T:
        """``await fn()``, retrying with :func:`reconnect_delay` while the cloud is
        unreachable (``on_fail()`` after each failed try), for up to ``timeout_s``.
        Raises CloudUnreachable."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in itertools.count():
            try:
                return await fn()
            except UNREACHABLE as e:
                on_fail()
                delay = reconnect_delay(attempt)
                if time.monotonic() + delay > deadline:
                    raise self.lost() from None
                if attempt == 0:        # say so at once: a long wait looks like a hang
                    log.warning("cannot reach the verification API at %s (%s): retrying "
                                "for up to %.0f s (offline_timeout_s)",
                                getattr(self.transport, "base_url", "?"),
                                str(e).splitlines()[0] if str(e) else type(e).__name__,
                                self.timeout_s)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def verified(self, fn: Callable[[], Awaitable[T]],
                       on_fail: Callable[[], None]) -> T | None:
        """``await fn()`` (one verified round) under the policy: ``wait`` rides the loss
        out (:meth:`until_reachable`); ``draft_only`` and ``local`` return None on the
        first loss."""
        if self.policy == "wait":
            return await self.until_reachable(fn, on_fail)
        try:
            return await fn()
        except UNREACHABLE:
            on_fail()
            return None

    def go_offline(self) -> None:
        """Start drafting alone (``local``: decoding locally); the first probe comes
        ``probe_interval_s`` later."""
        self.offline = True
        self._last_probe = time.monotonic()

    async def offline_step(self, reconnect: Callable[[], Awaitable],
                           draft_one: Callable[[], Awaitable[list[int]]]) -> list[int]:
        """One draft-only step: probe the cloud (``reconnect()``, re-creating the session)
        when a probe is due, and return [] once it answers; else ``draft_one()``."""
        now = time.monotonic()
        if now - self._last_probe >= self.probe_interval_s:
            self._last_probe = now
            try:
                await reconnect()
                self.offline = False
                return []
            except UNREACHABLE:
                pass
        return await draft_one()
