"""Crash tests: the verification server is killed with SIGKILL between the two halves of
a round (after the target pass, before the response is written) and during a batched
pass, then restarted empty; every session resumes from its confirmed prefix and the
output equals the fault-free run's (greedy: the same tokens; seeded sampling: the same
draws), in stop-and-wait, proactive (IPDG), send-ahead and FSD modes (killed between
the early and the final verdict of a streamed answer). The server is a real
process (``tests/crash_server.py``) on the suite's tiny random target."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest

from cloud_api.app import create_app
from cloud_api.context import SERVICE
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol.sampling import SamplingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ([4, 5, 6], [9, 3, 7, 2])
N = 40
MODES = {"stop-and-wait": {}, "ipdg": {"proactive": "ipdg"},
         "send-ahead": {"proactive": "ipdg", "send_ahead": True},
         "fsd": {"proactive": "fsd+ipdg"}}
SAMPLING = {"greedy": (SamplingConfig(), 0), "sampled": (SamplingConfig(temperature=0.8), 7)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, *flags: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "crash_server.py"),
                          str(port), *flags], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = p.stdout.readline()
    assert line.strip() == "ready", f"server did not start ({p.poll()})"
    return p


async def _generate(url, draft, tok, prompt, sampling, mode):
    cfg, seed = SAMPLING[sampling]
    async with EdgeClient(url, TorchDrafter(draft), tok, depth=3, chat=False,
                          offline_timeout_s=90, probe_interval_s=0.2, **MODES[mode]) as c:
        return await c.generate(prompt_ids=prompt, max_new_tokens=N, sampling=cfg,
                                seed=seed)


def _reference(target, draft, tok, jobs):
    app = create_app(target, tok)
    app[SERVICE].eos = []
    with BackgroundServer(app) as srv:
        async def main():
            return await asyncio.gather(*[_generate(srv.url, draft, tok, *j) for j in jobs])
        return asyncio.run(main())


def _with_crash(draft, tok, jobs, *flags):
    """Run ``jobs`` against a server that kills itself (``flags``); a watcher restarts a
    clean server on the same port once it died. Returns (results, exit code)."""
    port = _free_port()
    box = {"p": _start(port, *flags)}
    died = {}

    def watch():
        died["rc"] = box["p"].wait()
        box["p"] = _start(port)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        async def main():
            return await asyncio.gather(*[_generate(f"http://127.0.0.1:{port}", draft, tok, *j)
                                          for j in jobs])
        results = asyncio.run(main())
        w.join(60)
        return results, died.get("rc")
    finally:
        box["p"].kill()
        box["p"].wait(30)


@pytest.mark.parametrize("sampling, mode", [("greedy", "stop-and-wait"), ("sampled", "ipdg"),
                                            ("greedy", "send-ahead"),
                                            ("sampled", "send-ahead")])
def test_kill_after_the_pass_before_the_response(target, draft, tok, sampling, mode):
    jobs = [(PROMPTS[0], sampling, mode)]
    ref = _reference(target, draft, tok, jobs)
    got, rc = _with_crash(draft, tok, jobs, "--kill-after-pass", "3")
    assert rc == -9                                      # it was killed, as planned
    assert got[0].token_ids == ref[0].token_ids and len(got[0].token_ids) == N
    assert got[0].all_verified


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_kill_between_the_early_and_the_final_verdict(target, draft, tok, sampling):
    """FSD: the server dies after streaming a block's early verdict, before its final
    one; the restarted server never saw the session: the client re-creates it from its
    confirmed prefix (nothing was committed from the early verdict) and the output is
    the fault-free run's."""
    jobs = [(PROMPTS[0], sampling, "fsd")]
    ref = _reference(target, draft, tok, jobs)
    got, rc = _with_crash(draft, tok, jobs, "--kill-after-early", "3")
    assert rc == -9
    assert got[0].token_ids == ref[0].token_ids and len(got[0].token_ids) == N
    assert got[0].all_verified


def test_kill_during_a_batched_pass(target, draft, tok):
    """Two sessions verified in one batched pass when the server dies: both resume."""
    jobs = [(PROMPTS[0], "greedy", "stop-and-wait"), (PROMPTS[1], "sampled", "send-ahead")]
    ref = _reference(target, draft, tok, jobs)
    got, rc = _with_crash(draft, tok, jobs, "--kill-in-batch", "--max-wait-ms", "300")
    assert rc == -9
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids and g.all_verified
