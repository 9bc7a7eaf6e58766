"""Run the verification app: foreground (``serve``) or on a background thread (demo,
benchmarks, tests)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class BackgroundServer:
    """Serves an aiohttp app on its own event loop in a daemon thread.

    ``with BackgroundServer(app) as srv: srv.url`` -> ``http://127.0.0.1:<port>``.
    ``port=0`` picks a free port. Shutdown is graceful (in-flight requests finish).
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0,
                 ssl_context=None):
        self.app, self.host, self.port, self.ssl = app, host, port, ssl_context
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="specrelay-server")
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl else 'http'}://{self.host}:{self.port}"

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def start(self) -> "BackgroundServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=120)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(60)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
