"""HTTP-message-level fault proxy: drops, duplicates, reorders, delays, truncates and
black-holes single HTTP requests between the edge SDK and the verification API.

The byte-stream link emulator (:mod:`bench.linkem`) never loses or reorders a byte;
this proxy works one HTTP/1.1 message at a time so it can::

    EdgeClient ──HTTP──▶ FaultProxy (asyncio server, FaultPlan) ──aiohttp──▶ cloud API

It reads each request (request line, headers, a ``Content-Length`` body; keep-alive
connections carry several), asks the :class:`~bench.chaos.faults.FaultPlan` whether a
fault hits it, and forwards the exact method, path (raw, with its query), headers
(minus the hop-by-hop ones) and body upstream with one ``aiohttp.ClientSession``, then
writes the upstream status, headers and body back. Signed requests stay valid: the
signature covers method, path, timestamp, nonce and body digest, all forwarded as is.

A *reset* closes the client connection with ``SO_LINGER`` 0 (a TCP RST), which the
client sees as a reset or disconnected connection, the same as a real link failure.
The fault kinds and targets (verify, create, correction requests) are described in
:mod:`bench.chaos.faults`; :class:`ProxyStats` counts what happened. Chunked request
bodies are not supported (the SDK never sends them): the connection is reset.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from bench.chaos.faults import Fault, FaultPlan, request_target

__all__ = ["FaultProxy", "ProxyStats", "HttpRequest", "read_request", "encode_response"]

_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                  "te", "upgrade", "content-length", "host"})
_MAX_HEAD = 64 * 1024


@dataclass
class HttpRequest:
    """One request as read from the client: ``target`` is the raw path and query."""

    method: str
    target: str
    headers: list
    body: bytes
    head: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass
class Upstream:
    """The server's answer: status, reason, headers ``[(name, value)]``, body bytes."""

    status: int
    reason: str
    headers: list
    body: bytes


@dataclass
class ProxyStats:
    """Counters of one proxy: requests read, faults injected (``fired``), the statuses
    the server gave the extra copies of duplicated requests, reorders released by a
    following request (``reordered``) rather than by the hold window."""

    requests: int = 0
    forwarded: int = 0
    fired: int = 0
    duplicate_statuses: list = field(default_factory=list)
    reordered: int = 0
    blackholed: int = 0


class _Malformed(Exception):
    """A request the proxy cannot parse (or a chunked body): reset the connection."""


def _parse_head(head: bytes) -> tuple[str, str, list]:
    """(method, target, headers) of a request head. Raises _Malformed."""
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _ = lines[0].split(" ", 2)
    except ValueError:
        raise _Malformed(lines[0]) from None
    headers = []
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers.append((k.strip(), v.strip()))
    return method, target, headers


async def read_request(reader: asyncio.StreamReader) -> HttpRequest | None:
    """The next request on a connection; None at a clean end of the connection.
    Raises _Malformed (unparsable, too long a head, a chunked body) and the reader's
    IncompleteReadError / ConnectionError on a connection cut mid-request."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    except asyncio.LimitOverrunError:
        raise _Malformed("head too long") from None
    method, target, headers = _parse_head(head)
    low = {k.lower(): v for k, v in headers}
    if "chunked" in low.get("transfer-encoding", "").lower():
        raise _Malformed("chunked request body")
    n = int(low.get("content-length", "0") or 0)
    body = await reader.readexactly(n) if n else b""
    return HttpRequest(method, target, headers, body, head)


def encode_response(up: Upstream, body_len: int | None = None) -> bytes:
    """The HTTP/1.1 head of ``up`` (keep-alive, ``Content-Length`` = ``body_len`` or
    the body's length), without the body."""
    lines = [f"HTTP/1.1 {up.status} {up.reason}"]
    lines += [f"{k}: {v}" for k, v in up.headers if k.lower() not in _HOP]
    lines.append(f"Content-Length: {len(up.body) if body_len is None else body_len}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP RST (``SO_LINGER`` 0), dropping unsent data."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """The proxy on ``127.0.0.1:port`` (0: a free port, see :attr:`url`) in front of
    ``upstream_url``, injecting ``fault`` (a :class:`Fault`) per its plan.

    Args:
        upstream_url: the verification API, ``http://host:port``.
        fault: the row's fault (kind ``none``: transparent).
        hold_s: ``reorder``: seconds to wait for a following request before forwarding
            the held one anyway.

    Use ``async with FaultProxy(...) as p:`` (or :meth:`start` / :meth:`stop`) on the
    event loop that serves it.
    """

    def __init__(self, upstream_url: str, fault: Fault, *, port: int = 0,
                 hold_s: float = 0.3):
        self.upstream = upstream_url.rstrip("/")
        self.plan = FaultPlan(fault)
        self.stats = ProxyStats()
        self.port, self.hold_s = port, hold_s
        self._server = None
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set = set()
        self._partition_end = 0.0
        self._next_forwarded: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FaultProxy":
        self._http = aiohttp.ClientSession(auto_decompress=False,
                                           timeout=aiohttp.ClientTimeout(total=300))
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port,
                                                  limit=_MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening; cancel every connection still held (nothing more is
        forwarded)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> "FaultProxy":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------ per connection

    async def _handle(self, reader, writer) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        keep = False
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    keep = True
                    return
                self.stats.requests += 1
                if not await self._serve(req, writer):
                    return
        except (_Malformed, asyncio.IncompleteReadError, ConnectionError, OSError,
                aiohttp.ClientError, asyncio.TimeoutError):
            pass                      # a cut request or an unreachable server: reset
        except asyncio.CancelledError:
            pass                      # stop(); not re-raised (start_server's callback)
        finally:
            self._tasks.discard(task)
            if keep:
                writer.close()
            else:
                reset(writer)

    def _partitioned(self) -> bool:
        return time.monotonic() < self._partition_end

    async def _blackhole(self) -> bool:
        """Hold the connection until the partition ends (not with ``refuse``); then
        reset it (False)."""
        self.stats.blackholed += 1
        if not self.plan.fault.refuse:
            await asyncio.sleep(max(0.0, self._partition_end - time.monotonic()))
        return False

    async def _serve(self, req: HttpRequest, writer) -> bool:
        """Answer one request under the plan. False: reset the client connection."""
        fault = self.plan.pick(req.method, req.path)
        if fault is not None:
            self.stats.fired += 1
            if fault.kind == "partition":
                self._partition_end = time.monotonic() + fault.seconds
        if self._partitioned():
            return await self._blackhole()
        kind = fault.kind if fault is not None else "none"
        if kind == "drop-request":
            return False
        if kind == "reset-request":
            await self._partial_upstream(req)
            return False
        up = await self._before_forward(kind, fault, req)
        return await self._answer(kind, fault, req, up, writer)

    async def _before_forward(self, kind: str, fault: Fault | None,
                              req: HttpRequest) -> Upstream:
        """Delay or hold the request as its fault says, forward it (twice for a
        duplicate, the copy's status kept) and return the first answer."""
        if kind == "delay-request":
            await asyncio.sleep(fault.seconds)
        elif kind == "reorder":
            await self._hold()
        up = await self._forward(req)
        if kind == "duplicate":
            copy = await self._forward(req)
            self.stats.duplicate_statuses.append(copy.status)
        return up

    async def _answer(self, kind: str, fault: Fault | None, req: HttpRequest,
                      up: Upstream, writer) -> bool:
        """Write ``up`` to the client as the fault says. False: reset the connection."""
        if kind == "drop-response":
            return False
        if kind == "delay-response":
            await asyncio.sleep(fault.seconds)
        if self._partitioned():
            return await self._blackhole()
        if kind == "reset-response":
            writer.write(encode_response(up) + up.body[: len(up.body) // 2])
            await writer.drain()
            return False
        writer.write(encode_response(up) + up.body)
        await writer.drain()
        return True

    # ------------------------------------------------------------------ upstream

    async def _forward(self, req: HttpRequest) -> Upstream:
        """Send ``req`` upstream as is; the answer. A request of the fault's target
        (verify, correction) answered wakes a held (reordered) one."""
        headers = [(k, v) for k, v in req.headers if k.lower() not in _HOP]
        async with self._http.request(req.method, URL(self.upstream + req.target,
                                                      encoded=True),
                                      data=req.body or None, headers=headers,
                                      skip_auto_headers=("Content-Type", "User-Agent",
                                                         "Accept", "Accept-Encoding")) as r:
            body = await r.read()
            out = Upstream(r.status, r.reason or "", [(k.decode("latin-1"),
                                                       v.decode("latin-1"))
                                                      for k, v in r.raw_headers], body)
        self.stats.forwarded += 1
        if (self._next_forwarded is not None
                and request_target(req.method, req.path) == self.plan.fault.target):
            self._next_forwarded.set()
        return out

    async def _hold(self) -> None:
        """``reorder``: wait until another request of the fault's target has been
        answered (a block sent ahead, another request of a pipeline), or ``hold_s``
        seconds."""
        ev = self._next_forwarded = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), self.hold_s)
            self.stats.reordered += 1
        except asyncio.TimeoutError:
            pass
        finally:
            if self._next_forwarded is ev:
                self._next_forwarded = None

    async def _partial_upstream(self, req: HttpRequest) -> None:
        """``reset-request``: the head and half the body to the server on a connection
        of its own, then a reset (the server sees a request cut mid-body)."""
        host, port = URL(self.upstream).host, URL(self.upstream).port
        try:
            _, w = await asyncio.open_connection(host, port)
        except OSError:
            return
        try:
            w.write(req.head + req.body[: len(req.body) // 2])
            await w.drain()
            await asyncio.sleep(0.05)
        except (ConnectionError, OSError):
            pass
        finally:
            reset(w)
