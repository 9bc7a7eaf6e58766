"""A verification server process that kills itself (SIGKILL) at a chosen point, for the
crash tests: ``python tests/crash_server.py PORT [--kill-after-pass N] [--kill-in-batch]``.

It serves the real app (``cloud_api.app.create_app``) on the tiny random target of the
test suite (``tests.conftest.tiny_model(seed=0)``, the same weights in every process).
The faults are injected from outside the code under test:

* ``--kill-after-pass N``: a middleware lets the N-th verify request run (the target
  pass, the session's commit) and kills the process before its response is written;
* ``--kill-in-batch``: the target model's forward kills the process when it is called
  with more than one sequence (a batched verification pass).

It prints ``ready`` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_between_items(target, svc, n: int) -> None:
    """Slow the pass after its exit layer (0.4 s) and die 0.1 s after the ``n``-th early
    verdict left: the client has the early item, never the final one."""
    import asyncio
    import time

    target.model.layers[-1].register_forward_hook(lambda *a: time.sleep(0.4))
    seen = {"n": 0}
    verify = svc.verify

    async def verify_and_die(*args, on_early=None, **kw):
        def early(b):
            on_early(b)
            seen["n"] += 1
            if seen["n"] == n:
                asyncio.get_running_loop().call_later(0.1, _kill)
        return await verify(*args, on_early=None if on_early is None else early, **kw)
    svc.verify = verify_and_die


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--kill-after-pass", type=int, default=0)
    p.add_argument("--kill-in-batch", action="store_true")
    p.add_argument("--max-wait-ms", type=float, default=30.0)
    p.add_argument("--kill-after-early", type=int, default=0,
                   help="FSD: die between the two items of the N-th streamed verify "
                        "(its early verdict sent, its final verdict not)")
    a = p.parse_args()

    import torch
    from aiohttp import web

    from cloud_api.app import create_app
    from cloud_api.context import SERVICE
    from tests.conftest import tiny_model, tiny_tokenizer

    torch.set_num_threads(1)
    target, tok = tiny_model(seed=0), tiny_tokenizer()
    if a.kill_in_batch:
        forward = target.forward

        from edge_sdk.row_attention import RowBatch

        def killing_forward(*args, **kw):
            rows = kw.get("cache")       # a batched pass packs its sessions' rows
            if isinstance(rows, RowBatch) and len(rows.kvs) > 1:
                _kill()
            return forward(*args, **kw)

        target.forward = killing_forward
    verifies = {"n": 0}

    @web.middleware
    async def kill_after_pass(request, handler):
        resp = await handler(request)
        if request.path.endswith("/verify"):
            verifies["n"] += 1
            if verifies["n"] == a.kill_after_pass:
                _kill()                    # the pass ran; the response never leaves
        return resp

    from cloud_api.early_exit import untrained_head

    app = create_app(target, tok, middlewares=[kill_after_pass], max_batch=8,
                     max_wait_s=a.max_wait_ms / 1000, early_head=untrained_head(target, 1))
    svc = app[SERVICE]
    svc.eos = []                     # every request runs to its length cap
    if a.kill_after_early:
        _kill_between_items(target, svc, a.kill_after_early)

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
