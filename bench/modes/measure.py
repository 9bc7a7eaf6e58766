"""Per-request measurement on the edge: the HTTP exchanges a request made, the link
emulator's bytes around it, and its latency breakdown.

Latency breakdown (``metrics["breakdown_s"]``, seconds summed over the request, see
:func:`breakdown`): ``draft`` = edge draft compute (slowdown included), ``verify`` =
target compute reported by the cloud, ``upload``/``download`` = the link model's time
for the bytes that crossed the emulator (serialisation ``bytes*8/bandwidth`` plus the
one-way delay ``rtt/2`` per HTTP exchange), ``wait`` = the rest of the wall time
(queueing, jitter and loss stalls, prompt prefill, HTTP/msgpack/signing overhead,
edge-side bookkeeping). The five phases sum to ``wall_s`` (unless the modelled link
time alone exceeds it; ``wait`` is never negative).
"""
from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.linkem.profiles import Profile
from edge_sdk.transport import MSGPACK, Transport

if TYPE_CHECKING:
    from bench.modes.base import EdgeContext

__all__ = ["HttpCall", "RecordingTransport", "REQUEST_CALLS", "TaggingTransport",
           "LinkMeter", "breakdown"]


@dataclass
class HttpCall:
    """One HTTP exchange seen by :class:`RecordingTransport` (bytes = message bodies)."""

    method: str
    path: str
    up_bytes: int
    down_bytes: int
    t0: float
    t1: float


class RecordingTransport(Transport):
    """:class:`edge_sdk.transport.Transport` that logs every exchange in :attr:`calls`
    (body sizes in bytes, ``time.perf_counter`` seconds)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls: list[HttpCall] = []

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = MSGPACK, **kw) -> tuple[bytes, str]:
        t0 = time.perf_counter()
        data, ct = await super().request(method, path, body, content_type, **kw)
        self.calls.append(HttpCall(method, path, len(body), len(data), t0,
                                   time.perf_counter()))
        return data, ct


REQUEST_CALLS: contextvars.ContextVar = contextvars.ContextVar("specrelay_bench_calls",
                                                                default=None)


class TaggingTransport(Transport):
    """:class:`Transport` that files every exchange (:class:`HttpCall`) under the request
    that made it: the list in the asyncio context variable :data:`REQUEST_CALLS` set by
    :meth:`bench.modes.concurrent.ConcurrentMode.run` for that request (tasks a request
    spawns inherit it), so concurrent requests sharing one client and connection pool
    are told apart."""

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = MSGPACK, **kw) -> tuple[bytes, str]:
        t0 = time.perf_counter()
        data, ct = await super().request(method, path, body, content_type, **kw)
        calls = REQUEST_CALLS.get()
        if calls is not None:
            calls.append(HttpCall(method, path, len(body), len(data), t0, time.perf_counter()))
        return data, ct


def breakdown(wall_s: float, draft_s: float, verify_s: float, exchanges: int,
              link_up_bytes: int, link_down_bytes: int, profile: Profile) -> dict:
    """Split a request's wall time (s) into the five phases of ``report.BREAKDOWN_PHASES``.

    ``upload = exchanges * rtt/2 + link_up_bytes*8/uplink_bps`` and likewise
    ``download`` (the link emulator's model for the bytes it carried); ``wait`` is what
    remains of ``wall_s`` after draft, verify, upload and download (>= 0). Seconds.
    """
    one_way = profile.rtt_s / 2.0
    up = exchanges * one_way + (link_up_bytes * 8.0 / profile.uplink_bps
                                if profile.uplink_bps else 0.0)
    down = exchanges * one_way + (link_down_bytes * 8.0 / profile.downlink_bps
                                  if profile.downlink_bps else 0.0)
    wait = max(0.0, wall_s - draft_s - verify_s - up - down)
    return {"draft": draft_s, "upload": up, "wait": wait, "verify": verify_s,
            "download": down}


class LinkMeter:
    """Link-emulator byte counters around one request (``ctx.link_bytes``); without
    them :meth:`delta` returns the fallback (message-body) byte counts."""

    def __init__(self, ctx: EdgeContext):
        self.f = ctx.link_bytes
        self.start = self.f() if self.f else (0, 0)

    def delta(self, fallback_up: int, fallback_down: int) -> tuple[int, int]:
        if not self.f:
            return fallback_up, fallback_down
        up, down = self.f()
        return up - self.start[0], down - self.start[1]
