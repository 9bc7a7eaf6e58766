"""In-process transport: the edge calls a :class:`CloudService` directly, with the same
wire bytes as over HTTP but no sockets. For embedding cloud and edge in one process
(tests, simulations, evaluations: a ``CloudService(..., semantic=SemanticAcceptance)``
serves semantic sessions, WISV); production uses :class:`edge_sdk.transport.Transport`."""

from __future__ import annotations

import re

from cloud_api.service import CloudService
from cloud_api.sessions import ApiError
from edge_sdk.protocol import frames, wire
from edge_sdk.transport import MSGPACK, RemoteError

_SESSION = re.compile(r"^/v1/sessions/([^/]+)(/verify|/correction)?$")


class InProcessTransport:
    """Drop-in for ``Transport`` (``request`` / ``close`` and byte counters)."""

    def __init__(self, service: CloudService):
        self.svc = service
        self._started = False
        self.uplink_bytes = self.downlink_bytes = 0

    async def close(self) -> None:
        if self._started:
            await self.svc.queue.stop()
            self._started = False

    async def _dispatch(self, method: str, path: str, body: bytes, on_early=None) -> bytes:
        if path == "/v1/sessions" and method == "POST":
            return wire.pack(await self.svc.create(wire.unpack(body), None))
        m = _SESSION.match(path)
        if not m:
            raise ApiError(404, "not_found", "no such route")
        sid, tail = m.groups()
        if method == "POST" and tail == "/verify":
            sink = None if on_early is None else (
                lambda b: on_early(frames.EarlyVerdict.from_list(wire.unpack(b))))
            return await self.svc.verify(sid, body, None, on_early=sink)
        if method == "POST" and tail == "/correction":
            return await self.svc.correction(sid, body, None)
        if method == "DELETE" and tail is None:
            self.svc.delete(sid, None)
            return wire.pack({"deleted": True})
        raise ApiError(405, "method_not_allowed", "method not allowed")

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = MSGPACK, on_early=None) -> tuple[bytes, str]:
        if not self._started:
            self.svc.queue.start()
            self._started = True
        try:
            data = await self._dispatch(method, path, body, on_early)
        except ApiError as e:
            raise RemoteError(e.status, e.body()) from None
        except wire.WireError as e:
            raise RemoteError(400, ApiError(400, "bad_request", e.message, e.field).body()) \
                from None
        self.uplink_bytes += len(body)
        self.downlink_bytes += len(data)
        return data, MSGPACK
