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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--kill-after-pass", type=int, default=0)
    p.add_argument("--kill-in-batch", action="store_true")
    p.add_argument("--max-wait-ms", type=float, default=30.0)
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

        def killing_forward(*args, **kw):
            ids = kw.get("input_ids", args[0] if args else None)
            if ids is not None and ids.shape[0] > 1:
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

    app = create_app(target, tok, middlewares=[kill_after_pass], max_batch=8,
                     max_wait_s=a.max_wait_ms / 1000)
    app[SERVICE].eos = []            # every request runs to its length cap

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
