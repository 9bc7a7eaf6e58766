"""Cloud loss (issue #8): the server is killed and restarted mid-generation.

Default (``wait``): the SDK rides it out and the greedy output equals the fault-free run.
``draft_only``: generation continues with the draft alone and every token produced while
the cloud was down is flagged unverified; after the restart the request resumes under
verification with nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.transport import Transport

PROMPT = [4, 5, 6]
N = 40


class KillingTransport(Transport):
    """Before the ``kill_at``-th verify request, stops the server and restarts a fresh
    one on the same port ``down_s`` seconds later (in a thread)."""

    def __init__(self, url, server_box, make_app, kill_at=4, down_s=1.5):
        super().__init__(url, retries=1, backoff_s=0.02)
        self.box, self.make_app, self.kill_at, self.down_s = server_box, make_app, kill_at, down_s
        self.verifies, self.t_kill, self.t_back = 0, None, None

    def _restart(self, port):
        time.sleep(self.down_s)
        self.box[0] = BackgroundServer(self.make_app(), port=port).start()
        self.t_back = time.perf_counter()

    async def request(self, method, path, body=b"", content_type="application/x-msgpack"):
        if path.endswith("/verify"):
            self.verifies += 1
            if self.verifies == self.kill_at:
                srv = self.box[0]
                await asyncio.get_running_loop().run_in_executor(None, srv.stop)
                self.t_kill = time.perf_counter()
                threading.Thread(target=self._restart, args=(srv.port,), daemon=True).start()
        return await super().request(method, path, body, content_type)


def _run(url, drafter, tok, transport=None, **kw):
    events = []

    async def main():
        async with EdgeClient(url, drafter, tok, depth=3, chat=False, transport=transport,
                              **kw) as c:
            gen = c.stream(prompt_ids=PROMPT, max_new_tokens=N)
            async for ev in gen:
                events.append((time.perf_counter(), ev))
            return gen.result()

    return asyncio.run(main()), events


@pytest.fixture()
def reference(target, draft, tok):
    with BackgroundServer(create_app(target, tok)) as srv:
        return _run(srv.url, TorchDrafter(draft), tok)[0]


def test_wait_mode_equals_fault_free_run(target, draft, tok, reference):
    make = lambda: create_app(target, tok)  # noqa: E731
    box = [BackgroundServer(make()).start()]
    t = KillingTransport(box[0].url, box, make)
    try:
        r, events = _run(box[0].url, TorchDrafter(draft), tok, t)
    finally:
        box[0].stop()
    assert t.t_kill is not None and t.t_back is not None
    assert r.token_ids == reference.token_ids and r.all_verified
    assert r.metrics["unverified_tokens"] == 0


class SlowDrafter(TorchDrafter):
    """A draft on a slow device (30 ms per proposal), so the outage spans many tokens."""

    def propose(self, *a, **kw):
        time.sleep(0.03)
        return super().propose(*a, **kw)


def _no_eos_app(target, tok):
    from cloud_api.app import SERVICE

    app = create_app(target, tok)
    app[SERVICE].eos = []      # run to the length cap whatever the draft says
    return app


def test_draft_only_flags_every_token_made_while_down(target, draft, tok):
    make = lambda: _no_eos_app(target, tok)  # noqa: E731
    with BackgroundServer(make()) as srv:
        reference = _run(srv.url, TorchDrafter(draft), tok)[0]
    box = [BackgroundServer(make()).start()]
    t = KillingTransport(box[0].url, box, make, down_s=0.6)
    try:
        r, events = _run(box[0].url, SlowDrafter(draft), tok, t,
                         on_cloud_loss="draft_only", probe_interval_s=0.1)
    finally:
        box[0].stop()
    assert len(r.token_ids) == N == len(events) == len(r.verified)
    assert [e.token_id for _, e in events] == r.token_ids          # nothing lost/repeated
    flags = [e.verified for _, e in events]
    assert not all(flags) and any(flags[-5:])                      # resumed verified
    for ts, ev in events:
        if t.t_kill < ts < t.t_back:                               # produced while down
            assert not ev.verified
    assert r.metrics["unverified_tokens"] == flags.count(False)
    first_bad = flags.index(False)
    assert r.token_ids[:first_bad] == reference.token_ids[:first_bad]


def test_wait_mode_gives_up_with_a_clear_error(target, draft, tok):
    srv = BackgroundServer(create_app(target, tok)).start()
    url = srv.url
    srv.stop()

    async def main():
        async with EdgeClient(url, TorchDrafter(draft), tok, chat=False,
                              transport=Transport(url, retries=0),
                              offline_timeout_s=0.5) as c:
            return await c.generate(prompt_ids=PROMPT, max_new_tokens=4)

    from edge_sdk.client import CloudUnreachable

    t0 = time.monotonic()
    with pytest.raises(CloudUnreachable):
        asyncio.run(main())
    assert 0.2 < time.monotonic() - t0 < 5
