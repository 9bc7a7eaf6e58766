"""``specrelay serve --backend sglang|vllm``: a real serve subprocess verifying through
a (fake, format-faithful) engine gives the torch server's greedy output and refuses
configs the top-N rows cannot verify; misuse is refused in one line before anything
loads; a live engine is exercised only where one is configured."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from click.testing import CliRunner

import conftest
import specrelay_cli
from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol import wire
from fake_engines import fake_sglang, fake_vllm
from serve_process import ServeProcess, free_port, save_tiny

PROMPTS = [[4, 5, 6], [9, 3, 7, 2], [11, 12]]
FAKES = {"sglang": fake_sglang, "vllm": fake_vllm}


async def _generate(url: str, draft, tok) -> list[list[int]]:
    async with EdgeClient(url, TorchDrafter(draft), tok, depth=3, chat=False) as c:
        return [(await c.generate(prompt_ids=p, max_new_tokens=20)).token_ids
                for p in PROMPTS]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_serve_backend_engine_equals_the_torch_server(engine, target, draft, tok,
                                                      tmp_path):
    model = save_tiny(tmp_path / "tiny")
    with BackgroundServer(create_app(target, tok)) as ref_srv:
        want = asyncio.run(_generate(ref_srv.url, draft, tok))
    with BackgroundServer(FAKES[engine](target)) as fake:
        extra = ["--backend-model", "tiny"] if engine == "vllm" else []
        srv = ServeProcess(tmp_path, engine, [
            "--model", model, "--backend", engine, "--backend-url", fake.url,
            "--backend-top-n", "16", "--insecure-no-auth", *extra])
        try:
            health = srv.wait_healthy()
            got = asyncio.run(_generate(srv.url, draft, tok))
            st, body = conftest.RawHTTP(srv.url)("POST", "/v1/sessions", wire.pack(
                {"prompt_ids": [4, 5], "sampling": {"temperature": 0.8, "top_k": 32}}))
        finally:
            srv.stop()
    log = srv.log.read_text()
    assert got == want and health["vocab_size"] == 64
    assert f"through the {engine} engine at {fake.url} (top-16 logprobs" in log, log
    assert st == 422 and json.loads(body)["error"]["code"] == "not_exact_on_backend"


def one_line_error(r) -> str:
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 or lines[0].startswith("Usage:"), r.output
    return lines[-1]


@pytest.mark.parametrize("args,hint,words", [
    (["--backend-url", "http://x:1"], "--backend-url", "sglang|vllm only"),
    (["--backend-top-n", "5"], "--backend-top-n", "sglang|vllm only"),
    (["--backend", "sglang"], "--backend-url", "needs the engine's URL"),
    (["--backend", "vllm", "--backend-url", "x:1"], "--backend-url", "http://HOST:PORT"),
    (["--backend", "sglang", "--backend-url", "http://x:1", "--backend-model", "m"],
     "--backend-model", "vllm only"),
    (["--backend", "sglang", "--backend-url", "http://x:1", "--replicas", "2"],
     "--replicas", "scales inside the engine"),
    (["--backend", "vllm", "--backend-url", "http://x:1", "--ray-address", "auto"],
     "--ray-address", "scales inside the engine"),
    (["--backend", "sglang", "--backend-url", "http://x:1", "--early-exit", "12"],
     "--early-exit", "FSD early verdicts"),
    (["--backend", "sglang", "--backend-url", "http://x:1", "--wisv-head", "h.st"],
     "--wisv-head", "semantic acceptance"),
    (["--backend", "sglang", "--backend-url", "http://x:1", "--free-rows", "16"],
     "--free-rows", "token trees need the torch verifier"),
    (["--backend", "sglang", "--backend-url", "http://x:1", "--row-invariant", "off"],
     "--row-invariant", "single torch verifier"),
    (["--row-invariant", "fast", "--replicas", "2"], "--row-invariant",
     "single torch verifier")])
def test_backend_misuse_is_one_line(args, hint, words):
    r = CliRunner().invoke(specrelay_cli.main, ["serve", "--insecure-no-auth", "--port",
                                                str(free_port()), *args])
    msg = one_line_error(r)
    assert hint in msg and words in msg, msg


def test_serve_help_documents_the_backend():
    out = CliRunner().invoke(specrelay_cli.main, ["serve", "--help"]).output
    for opt in ("--backend [torch|sglang|vllm]", "--backend-url", "--backend-top-n",
                "--backend-model", "top_k <= N"):
        assert opt in out


LIVE = [(e, os.environ.get(f"SPECRELAY_{e.upper()}_URL")) for e in ("sglang", "vllm")]


@pytest.mark.skipif(not any(u for _, u in LIVE), reason="no live SGLang/vLLM engine "
                    "here (needs a GPU machine); set SPECRELAY_SGLANG_URL to run")
def test_live_engine_scores_a_greedy_generation():
    """Against a live engine serving ``$SPECRELAY_ENGINE_MODEL`` (a model spec this
    machine has the tokenizer and config of; default smollm2-135m; vLLM's served name
    ``$SPECRELAY_VLLM_MODEL``, default that spec): target-only greedy through the scoring
    server twice gives the same output (1..16 tokens), and top_k 32 > N is refused."""
    from cloud_api.inprocess import InProcessTransport
    from cloud_api.scoring.engines import engine_verifier
    from cloud_api.service import CloudService
    from edge_sdk.protocol.sampling import SamplingConfig
    from edge_sdk.transport import RemoteError

    spec = os.environ.get("SPECRELAY_ENGINE_MODEL", "smollm2-135m")
    for engine, url in LIVE:
        if not url:
            continue
        verifier, tok = engine_verifier(engine, url, spec, 20,
                                        os.environ.get("SPECRELAY_VLLM_MODEL", spec))
        svc = CloudService(None, tok, verifier=verifier)

        async def run():
            async with EdgeClient("inproc://", None, tok, chat=False,
                                  transport=InProcessTransport(svc)) as c:
                outs = [(await c.generate("def fib(n):", max_new_tokens=16,
                                          target_only=True)).token_ids for _ in range(2)]
                with pytest.raises(RemoteError) as e:
                    await c.generate("x", max_new_tokens=4, sampling=SamplingConfig(
                        temperature=0.8, top_k=32))
                return outs, e.value.status
        (a, b), status = asyncio.run(run())
        assert a == b and 0 < len(a) <= 16 and status == 422, engine
