"""User-space link emulator: an asyncio loopback TCP proxy that shapes traffic.

``tc netem`` is not available everywhere (containers, CI), so the benchmark puts this
proxy between the edge SDK and the cloud API::

    edge client ──uplink──▶ LinkEmulator ──▶ upstream server (cloud API)
                ◀─downlink─              ◀──

Model, applied independently per direction (uplink = client→server,
downlink = server→client), per segment of at most ``segment_bytes`` (1500) bytes:

* **bandwidth**: a token bucket of rate ``*_bps`` (bits/s) with a small burst
  (``Profile.burst_bytes``). The bucket is shared by every connection through the
  emulator in that direction, like a real access link.
* **propagation delay**: ``rtt_s / 2`` seconds one way.
* **jitter**: an extra delay drawn per segment, uniform in ``[-jitter_s, +jitter_s]``
  or normal with standard deviation ``jitter_s`` (``Profile.jitter_dist``), from a
  seeded RNG; the total one-way delay is clamped at 0.
* **loss**: with probability ``loss`` a segment is "lost" and arrives one
  retransmission timeout later (``Profile.rto_s`` = ``max(rto_min_s, 2 * rtt_s)``).

The proxy forwards a TCP byte stream, so nothing is ever dropped or reordered: a segment
is never delivered before the one in front of it (a stall blocks the stream, as TCP
head-of-line blocking does). Delays pipeline: a transfer of ``n`` bytes takes about
``n * 8 / bps + rtt_s / 2`` seconds. Not modelled: TCP/IP header overhead, the
connection handshake (connecting through the proxy costs no RTT) and congestion control.
A Python proxy forwards a few hundred MB/s at most, so multi-Gbit/s profiles are only
approximate for bulk transfers (fine for the small messages of speculative decoding).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from dataclasses import dataclass

from bench.linkem.profiles import PROFILES, SEGMENT_BYTES, Profile

__all__ = ["LinkStats", "LinkEmulator", "LinkEmulatorThread"]

_COALESCE_S = 0.001  # segments whose delivery times are this close are written together


@dataclass
class LinkStats:
    """Counters of an emulator (all connections). Bytes are payload bytes delivered."""

    uplink_bytes: int = 0
    downlink_bytes: int = 0
    uplink_segments: int = 0
    downlink_segments: int = 0
    uplink_stalls: int = 0
    downlink_stalls: int = 0
    connections: int = 0

    def snapshot(self) -> dict:
        """Copy of the counters as a dict."""
        return dataclasses.asdict(self)

    def reset(self) -> None:
        """Zero every counter."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class _Link:
    """Timing model of one direction (shared by all connections)."""

    def __init__(self, bps: float | None, profile: Profile, rng: random.Random, stats: LinkStats,
                 direction: str, queue_bytes: int):
        self.bps = bps
        self.delay_s = profile.rtt_s / 2.0
        self.jitter_s = profile.jitter_s
        self.normal = profile.jitter_dist == "normal"
        self.loss = profile.loss
        self.rto_s = profile.rto_s
        self.burst_s = profile.burst_bytes * 8.0 / bps if bps else 0.0
        self.queue_s = queue_bytes * 8.0 / bps if bps else 0.0
        self.vfree = float("-inf")  # virtual time at which the bucket has sent everything queued
        self.rng = rng
        self.stats = stats
        self.dir = direction

    def backlog_wait(self, now: float) -> float:
        """Seconds to wait before accepting more data (router queue full)."""
        if not self.bps:
            return 0.0
        return max(0.0, self.vfree - now - self.queue_s)

    def schedule(self, data: bytes, now: float, conn: "_ConnState") -> list[tuple[float, bytes]]:
        """Delivery times for ``data`` read at ``now``: list of (deliver_at, chunk)."""
        out: list[tuple[float, bytes]] = []
        start = first_t = last_t = None
        n = len(data)
        stalls = 0
        segs = 0
        for off in range(0, n, SEGMENT_BYTES):
            size = min(SEGMENT_BYTES, n - off)
            segs += 1
            if self.bps:
                self.vfree = max(now - self.burst_s, self.vfree) + size * 8.0 / self.bps
                t = max(now, self.vfree)
            else:
                t = now
            d = self.delay_s
            if self.jitter_s:
                d += self.rng.gauss(0.0, self.jitter_s) if self.normal else self.rng.uniform(-self.jitter_s, self.jitter_s)
                d = max(0.0, d)
            if self.loss and self.rng.random() < self.loss:
                d += self.rto_s
                stalls += 1
            t = max(t + d, conn.last)  # in order: never before the segment in front
            conn.last = t
            if start is not None and t - first_t <= _COALESCE_S:
                last_t = t
                continue
            if start is not None:
                out.append((last_t, data[start:off]))
            start, first_t, last_t = off, t, t
        if start is not None:
            out.append((last_t, data[start:]))
        setattr(self.stats, f"{self.dir}_segments", getattr(self.stats, f"{self.dir}_segments") + segs)
        if stalls:
            setattr(self.stats, f"{self.dir}_stalls", getattr(self.stats, f"{self.dir}_stalls") + stalls)
        return out


class _ConnState:
    __slots__ = ("last", "queued", "room")

    def __init__(self) -> None:
        self.last = float("-inf")  # delivery time of the latest scheduled segment
        self.queued = 0  # bytes read but not yet written
        self.room = asyncio.Event()


class LinkEmulator:
    """Asyncio TCP proxy on ``listen_host:listen_port`` shaping traffic to the upstream.

    Args:
        upstream_host, upstream_port: the real server.
        profile: a :class:`Profile` (or a name in :data:`PROFILES`).
        listen_host: address to listen on.
        listen_port: port to listen on, 0 = pick a free one (see :attr:`port`).
        seed: seed of the jitter/loss RNGs (one per direction), for replayable runs.
        queue_bytes: bottleneck queue size in bytes per direction; a sender is paused
            (TCP backpressure) while more than this is waiting for the token bucket.
        max_inflight_bytes: per connection and direction, bytes read but not yet
            delivered before the proxy stops reading (bounds memory).

    Use ``async with LinkEmulator(...) as em:`` or ``await em.start()`` /
    ``await em.stop()``. :attr:`stats` counts delivered bytes per direction.
    """

    def __init__(self, upstream_host: str, upstream_port: int, profile: Profile | str,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, *, seed: int = 0,
                 queue_bytes: int = 128 * 1024, max_inflight_bytes: int = 8 * 1024 * 1024):
        self.upstream = (upstream_host, upstream_port)
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.listen = (listen_host, listen_port)
        self.seed = seed
        self.queue_bytes = queue_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = LinkStats()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._port: int | None = None
        p = self.profile
        self._up = _Link(p.uplink_bps, p, random.Random(f"{seed}:uplink"), self.stats, "uplink", queue_bytes)
        self._down = _Link(p.downlink_bps, p, random.Random(f"{seed}:downlink"), self.stats, "downlink", queue_bytes)

    @property
    def port(self) -> int:
        """The port the proxy listens on (valid after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("LinkEmulator not started")
        return self._port

    @property
    def host(self) -> str:
        """The address the proxy listens on."""
        return self.listen[0]

    async def start(self) -> "LinkEmulator":
        """Start listening; returns self."""
        self._server = await asyncio.start_server(self._handle, *self.listen)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening and abort every open connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    async def __aenter__(self) -> "LinkEmulator":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- per connection

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        uwriter = None
        try:
            try:
                ureader, uwriter = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            self.stats.connections += 1
            pumps = [asyncio.create_task(self._pump(creader, uwriter, self._up)),
                     asyncio.create_task(self._pump(ureader, cwriter, self._down))]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)  # retrieves resets etc.
        except asyncio.CancelledError:
            # stop() cancels us. Do not re-raise: Python 3.11's start_server callback calls
            # task.exception() on the finished handler, which raises for a cancelled task.
            pass
        finally:
            for w in (cwriter, uwriter):
                if w is not None:
                    w.close()
            self._conns.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        conn = _ConnState()
        q: asyncio.Queue = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(q, writer, link, conn))
        me = asyncio.current_task()

        def _writer_failed(t: asyncio.Task) -> None:  # stop reading if the other end broke
            if not t.cancelled() and t.exception() is not None:
                me.cancel()

        deliver.add_done_callback(_writer_failed)
        try:
            while True:
                wait = link.backlog_wait(loop.time())
                if wait > 0:
                    await asyncio.sleep(wait)
                while conn.queued > self.max_inflight_bytes:
                    conn.room.clear()
                    await conn.room.wait()
                try:
                    data = await reader.read(65536)
                except (ConnectionError, OSError):
                    data = b""
                if not data:
                    break
                conn.queued += len(data)
                for item in link.schedule(data, loop.time(), conn):
                    q.put_nowait(item)
            q.put_nowait(None)
            await deliver
        except asyncio.CancelledError:
            if deliver.done() and not deliver.cancelled() and deliver.exception() is not None:
                raise deliver.exception() from None
            raise
        finally:
            deliver.cancel()

    async def _deliver(self, q: asyncio.Queue, writer: asyncio.StreamWriter, link: _Link, conn: _ConnState) -> None:
        loop = asyncio.get_running_loop()
        attr = f"{link.dir}_bytes"
        while True:
            item = await q.get()
            if item is None:
                if writer.can_write_eof():
                    try:
                        writer.write_eof()
                    except (ConnectionError, OSError):
                        pass
                return
            t, chunk = item
            delay = t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            writer.write(chunk)
            setattr(self.stats, attr, getattr(self.stats, attr) + len(chunk))
            conn.queued -= len(chunk)
            conn.room.set()
            await writer.drain()


class LinkEmulatorThread:
    """:class:`LinkEmulator` running on its own event loop in a daemon thread, for
    synchronous code::

        with LinkEmulatorThread("127.0.0.1", 8000, PROFILES["weak"]) as em:
            requests.get(f"http://127.0.0.1:{em.port}/")

    Takes the same arguments as :class:`LinkEmulator`.
    """

    def __init__(self, *args, **kwargs):
        self.emulator = LinkEmulator(*args, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        return self.emulator.port

    @property
    def host(self) -> str:
        """The address the proxy listens on."""
        return self.emulator.host

    @property
    def stats(self) -> LinkStats:
        """Live counters (see :class:`LinkStats`)."""
        return self.emulator.stats

    @property
    def profile(self) -> Profile:
        return self.emulator.profile

    def start(self, timeout: float = 10.0) -> "LinkEmulatorThread":
        """Start the loop thread and the proxy; returns self."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="linkem", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.emulator.start(), self._loop).result(timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the proxy and join the thread."""
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.emulator.stop(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._loop.close()
            self._loop = None

    def __enter__(self) -> "LinkEmulatorThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
