"""Shared fixtures: tiny random Llama models with a tiny word-level tokenizer, and a
real verification server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def worker_pythonpath():
    """PYTHONPATH with the repository and ``tests/`` first while the block runs, so Ray
    workers and child processes import this checkout (and the test modules whose
    factories they call); the caller's value is restored afterwards."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]
                                               + ([saved] if saved else []))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def tiny_tokenizer(vocab: int = 64):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, vocab)}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


def tiny_model(vocab: int = 64, layers: int = 2, hidden: int = 32, seed: int = 0,
               like=None, noise: float = 0.0):
    """A random Llama. ``like``+``noise``: a draft made by perturbing another model's
    weights (so it agrees often but not always)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=0, bos_token_id=1,
                      pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0)  # sharper distributions than the default init
        if like is not None:
            m.load_state_dict(like.state_dict())
            g = torch.Generator().manual_seed(seed + 1)
            for p in m.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g))
    m.generation_config.eos_token_id = 0
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def draft(target):
    return tiny_model(seed=1, like=target, noise=0.05)


@pytest.fixture()
def server(target, tok):
    from cloud_api.app import create_app
    from cloud_api.server import BackgroundServer

    with BackgroundServer(create_app(target, tok)) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


class RawHTTP:
    """Synchronous raw-request client over one aiohttp ClientSession (for tests that
    send hand-made bodies and read status + bytes). ``signer``: default request signer;
    ``created`` sessions are deleted by :meth:`cleanup`/:meth:`close`."""

    def __init__(self, base: str, signer=None):
        self.base, self.signer = base, signer
        self.loop, self.s = asyncio.new_event_loop(), None
        self.created: list = []

    def __call__(self, method, path, body: bytes = b"", ctype=None, signer=None,
                 headers=None):
        import aiohttp

        from edge_sdk.transport import MSGPACK

        signer = signer or self.signer

        async def go():
            if self.s is None:
                self.s = aiohttp.ClientSession()
            h = {"content-type": ctype or MSGPACK} if body else {}
            if signer is not None:
                h.update(signer.headers(method, path, body))
            h.update(headers or {})
            async with self.s.request(method, self.base + path, data=body or None,
                                      headers=h) as r:
                return r.status, await r.read()
        return self.loop.run_until_complete(go())

    def create(self, **body) -> dict:
        from edge_sdk.protocol import wire

        st, data = self("POST", "/v1/sessions", wire.pack(body))
        assert st == 201, data
        info = wire.unpack(data)
        self.created.append(info["session_id"])
        return info

    def cleanup(self):
        """Delete the sessions this client created (sessions are limited per key)."""
        while self.created:
            self("DELETE", f"/v1/sessions/{self.created.pop()}")

    def state(self, sid) -> dict:
        st, data = self("GET", f"/v1/sessions/{sid}")
        assert st == 200, data
        return json.loads(data)

    def sessions(self) -> int:
        return json.loads(self("GET", "/healthz")[1])["sessions"]

    def verify(self, sid, body: bytes):
        return self("POST", f"/v1/sessions/{sid}/verify", body)

    def close(self):
        self.cleanup()
        if self.s is not None:
            self.loop.run_until_complete(self.s.close())
        self.loop.close()


# --------------------------------------------------------------------------- process exit

_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process without the interpreter's final teardown.

    After every test passed, one CI run died with SIGSEGV (exit 139) while the
    interpreter was finalising: native libraries this suite loads side by side (torch's
    OpenMP pool, onnxruntime, tokenizers, Ray's core worker, llama.cpp) destroy their
    threads and static objects in an order nothing here controls. The outcome is decided
    by then, so the Python-level exit handlers run (Ray and multiprocessing shut their
    processes down), faulthandler is re-armed for them (a crash there prints every
    thread's stack), the streams are flushed, and the process exits with pytest's own
    status; the native teardown that follows a normal exit is skipped."""
    if not _EXIT_STATUS or os.environ.get("SPECRELAY_TEST_NATIVE_EXIT"):
        return
    import atexit
    import faulthandler
    import sys

    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_EXIT_STATUS[-1])
