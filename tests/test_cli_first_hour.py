"""A new user's first hour with the CLI: unreachable or untrusted servers and bad values
fail fast with one line (no traceback, no model load), and the options exist."""

from __future__ import annotations

import socket
import ssl
import time

import click
from click.testing import CliRunner

import specrelay_cli
from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from tests.test_tls import _self_signed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args):
    t0 = time.monotonic()
    r = CliRunner().invoke(specrelay_cli.main, list(args))
    return r, time.monotonic() - t0


def one_line_error(r) -> str:
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 or lines[0].startswith("Usage:"), r.output
    return lines[-1]


def test_unreachable_api_fails_within_seconds_with_the_hint():
    url = f"http://127.0.0.1:{_free_port()}"
    r, dt = run("generate", "Hi", "--url", url)        # default --offline-timeout 5 s
    msg = one_line_error(r)
    assert r.exit_code == 1 and dt < 8.0
    assert msg.startswith("Error: cannot reach " + url) and "specrelay serve" in msg
    r, dt = run("generate", "Hi", "--url", url, "--offline-timeout", "0")
    assert r.exit_code == 1 and dt < 2.0


def test_untrusted_certificate_is_named_and_not_retried(tmp_path, target, tok):
    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    with BackgroundServer(create_app(target, tok), ssl_context=ctx) as srv:
        r, dt = run("generate", "Hi", "--url", srv.url, "--offline-timeout", "30")
        assert "--ca-cert" in one_line_error(r) and dt < 5.0   # not waited out


def test_https_to_a_plain_http_server_says_use_http(target, tok):
    with BackgroundServer(create_app(target, tok)) as srv:
        url = srv.url.replace("http://", "https://")
        r, dt = run("generate", "Hi", "--url", url, "--offline-timeout", "30")
        msg = one_line_error(r)
        assert "use an http:// URL" in msg and "--ca-cert" not in msg and dt < 5, msg


def test_a_malformed_key_names_where_keys_come_from(target, tok):
    with BackgroundServer(create_app(target, tok)) as srv:
        for bad, why in [("sr_live_nope", "malformed API key"),
                         ("sr_live_" + "Q" * 60, None)]:
            r, _ = run("generate", "Hi", "--url", srv.url, "--api-key", bad)
            msg = one_line_error(r)
            assert "--api-key / SPECRELAY_API_KEY" in msg and "sr_live_" in msg, msg
            assert why is None or why in msg


def test_sdk_raises_certificate_errors_at_once(tmp_path, target, draft, tok):
    import asyncio

    import pytest

    from edge_sdk import EdgeClient
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.transport import TLSVerifyError

    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    with BackgroundServer(create_app(target, tok), ssl_context=ctx) as srv:
        async def main():
            async with EdgeClient(srv.url, TorchDrafter(draft), tok, chat=False,
                                  offline_timeout_s=60) as c:
                return await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=4)
        t0 = time.monotonic()
        with pytest.raises(TLSVerifyError, match="CA certificate"):
            asyncio.run(main())
        assert time.monotonic() - t0 < 5.0
        trusted = ssl.create_default_context(cafile=str(cert))

        async def trusting():
            async with EdgeClient(srv.url, TorchDrafter(draft), tok, chat=False,
                                  ssl_context=trusted) as c:
                return await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=4)
        assert len(asyncio.run(trusting()).token_ids) == 4


def test_bad_values_are_refused_before_any_model_loads():
    url = f"http://127.0.0.1:{_free_port()}"
    for args, needle in [(["--top-p", "1.5"], "--top-p"),
                         (["--temperature", "-1"], "--temperature"),
                         (["--max-new-tokens", "0"], "--max-new-tokens"),
                         (["--max-new-tokens", "100000"], "--max-new-tokens"),
                         (["--repetition-penalty", "0"], "--repetition-penalty"),
                         (["--proactive-min-hit", "1"], "--proactive-min-hit"),
                         (["--proactive", "npdg", "--proactive-min-hit", "0.3"],
                          "--proactive-min-hit"),
                         (["--siblings", "wide"], "--siblings"),
                         (["--siblings", "9"], "--siblings")]:
        r, dt = run("generate", "Hi", "--url", url, *args)
        assert r.exit_code == 2 and needle in r.output and dt < 2.0, (args, r.output)
    r, _ = run("generate", "", "--url", url)
    assert r.exit_code == 2 and "prompt is empty" in r.output
    for bad in ("not-a-url", "ftp://127.0.0.1:1"):
        r, _ = run("generate", "Hi", "--url", bad)
        assert r.exit_code == 2 and "--url" in r.output
    r, dt = run("generate", "Hi", "--url", url, "--api-key", "sr_live_garbage")
    assert r.exit_code == 1 and "Error:" in one_line_error(r) and dt < 2.0


def test_actionable_errors_are_one_line_unless_debug():
    from edge_sdk.client import CloudUnreachable

    @click.group(cls=specrelay_cli._Group)
    @click.option("--debug", is_flag=True)
    def g(debug):
        pass

    @g.command()
    def boom():
        raise CloudUnreachable("verification API unreachable for 5 s")

    @g.command()
    def bug():
        raise KeyError("a bug")

    r = CliRunner().invoke(g, ["boom"])
    assert one_line_error(r) == "Error: verification API unreachable for 5 s"
    r = CliRunner().invoke(g, ["--debug", "boom"])
    assert isinstance(r.exception, CloudUnreachable)
    r = CliRunner().invoke(g, ["bug"])
    assert isinstance(r.exception, KeyError)            # bugs keep their traceback


def test_version_and_tls_options_exist():
    r, _ = run("--version")
    assert r.exit_code == 0 and "specrelay" in r.output and "0." in r.output
    r, _ = run("edge-serve", "--help")
    assert "--ca-cert" in r.output and "--offline-timeout" in r.output
    r, _ = run("generate", "--help")
    assert "--offline-timeout" in r.output and "Examples" in r.output


def test_serve_refuses_a_busy_port_before_loading_a_model():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r, dt = run("serve", "--port", str(port), "--insecure-no-auth")
    assert "cannot listen on 127.0.0.1:" in one_line_error(r) and dt < 3.0


def test_serve_names_its_key_store_and_warns_when_empty(tmp_path):
    import os
    import subprocess
    import sys

    db = tmp_path / "empty.sqlite3"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "specrelay_cli", "serve", "--model",
                          "smollm2-135m", "--dtype", "float32", "--db", str(db), "--port",
                          str(_free_port())], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            lines.append(line)
            if line.startswith("serving ") or p.poll() is not None:
                break
        text = "".join(lines)
        assert f"new key store {db} has no active keys" in text, text
        assert "serving smollm2-135m (float32)" in text and f"key store {db} (0 active keys" in text
    finally:
        p.terminate()
        p.wait(30)


def test_edge_serve_shuts_down_promptly_with_a_request_pending():
    """SIGTERM while a chat request waits for an unreachable cloud: the process exits
    within seconds (in-flight requests get a bounded grace period), not after the
    offline timeout."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    import requests

    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "specrelay_cli", "edge-serve", "--url",
                          f"http://127.0.0.1:{_free_port()}", "--draft", "smollm2-135m-draft",
                          "--port", str(port), "--offline-timeout", "300"],
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except requests.ConnectionError:
                assert p.poll() is None, p.stderr.read()
                time.sleep(0.5)
        answer = {}

        def chat():
            try:
                answer["r"] = requests.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
            except requests.RequestException as e:        # the server went away
                answer["e"] = e

        t = threading.Thread(target=chat)
        t.start()
        time.sleep(2.0)                                   # the request is now waiting
        assert t.is_alive()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        assert time.monotonic() - t0 < 10
        t.join(30)
        assert not t.is_alive() and answer                # answered or disconnected
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)


def test_first_gguf_load_says_what_it_does(monkeypatch, tmp_path):
    """The minute-long first dequantisation of a GGUF checkpoint is announced on stderr
    (through the ``edge_sdk`` logger the CLI wires up); a cached load says nothing."""
    import logging

    from edge_sdk import models

    r, _ = run("keys", "--db", str(tmp_path / "k.sqlite3"), "list")
    assert r.exit_code == 0, r.output
    lg = logging.getLogger("edge_sdk")
    assert lg.level == logging.INFO and any(getattr(h, "_specrelay", False)
                                            for h in lg.handlers)
    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    grab = Grab()
    lg.addHandler(grab)
    try:
        monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
        models.load_model("smollm2-135m", dtype="float32")
        assert any(m.startswith("first load of SmolLM2-135M-Instruct.Q4_1.gguf: "
                                "dequantizing") for m in seen), seen
        assert any("converted in" in m for m in seen), seen
        seen.clear()
        models.load_model("smollm2-135m", dtype="float32")
        assert seen == []
    finally:
        lg.removeHandler(grab)


def test_serve_metrics_port_is_checked_before_loading():
    port = _free_port()
    r, dt = run("serve", "--port", str(port), "--metrics-port", str(port))
    assert "--metrics-port" in one_line_error(r) and dt < 5
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r, dt = run("serve", "--port", str(_free_port()), "--metrics-port",
                    str(busy.getsockname()[1]))
        assert "in use" in one_line_error(r) and dt < 5


def test_generate_checks_the_key_before_loading_the_draft(tmp_path, target, tok):
    """A refused key is reported in seconds, before the draft loads (the bogus --draft
    would fail later), and an unknown model name is one line, not a hub traceback."""
    from cloud_api.keys import SQLiteKeyStore
    from edge_sdk.protocol import signing as sg

    store = SQLiteKeyStore(tmp_path / "k.sqlite3")
    _, raw = store.create("ok", ["verify"])
    stranger = sg.format_api_key("Q" * sg.LOOKUP_LEN, "s" * 32)
    with BackgroundServer(create_app(target, tok, key_store=store)) as srv:
        r, dt = run("generate", "Hi", "--url", srv.url, "--api-key", stranger,
                    "--draft", "nosuch-model")
        msg = one_line_error(r)
        assert "refused the key" in msg and "unknown_key" in msg and dt < 5
        r, dt = run("generate", "Hi", "--url", srv.url, "--draft", "nosuch-model")
        msg = one_line_error(r)                            # no key at all
        assert "missing_credentials" in msg and "--api-key" in msg and dt < 5, msg
        r, _ = run("generate", "Hi", "--url", srv.url, "--api-key", raw, "--draft",
                   "nosuch-model", "--debug")               # --debug after the command
        assert r.exit_code != 0 and isinstance(r.exception, FileNotFoundError)
        r, _ = run("generate", "Hi", "--url", srv.url, "--api-key", raw, "--draft",
                   "nosuch-model")
        assert "unknown model 'nosuch-model': not a preset" in one_line_error(r)


def test_serve_names_an_unknown_model_in_one_line():
    r, _ = run("serve", "--model", "nosuch", "--insecure-no-auth", "--port",
               str(_free_port()))
    assert "unknown model 'nosuch'" in one_line_error(r)


def test_missing_files_and_bad_values_are_named_before_the_target_loads(tmp_path):
    """A .gguf path that is not there, a bad --draft, a bad --early-exit or --storage:
    one line naming the option, in the time it takes to start (no target load)."""
    gone = str(tmp_path / "nosuch.gguf")
    for args, needle in [(["demo", "--draft", gone, "Hi"], "--draft"),
                         (["demo", "--draft", str(tmp_path / "nodir"), "Hi"], "--draft"),
                         (["demo", "--target", f"{tmp_path}::x.gguf", "Hi"], "--target"),
                         (["serve", "--early-exit", "bogus", "--insecure-no-auth",
                           "--port", str(_free_port())], "--early-exit"),
                         (["generate", "Hi", "--local", "--storage", "floppy"],
                          "--storage")]:
        r, dt = run(*args)
        msg = one_line_error(r)
        assert r.exit_code == 2 and needle in msg and dt < 5, (args, r.output)
    r, _ = run("serve", "--model", gone, "--insecure-no-auth", "--port", str(_free_port()))
    assert f"model file {gone!r} not found" in one_line_error(r)
    r, _ = run("serve", "--help")
    assert "untrained:LAYER" in r.output


def test_demo_explains_a_near_tie_divergence():
    from specrelay_cli.generate import _near_tie_note

    note = _near_tie_note({"identical_to_target": False, "first_divergence": 7,
                           "near_tie_divergences": 1, "hard_divergences": 0})
    assert "token 7" in note and "near-tie" in note and "row-invariant" in note
    assert _near_tie_note({"identical_to_target": True}) is None
    assert _near_tie_note({"identical_to_target": False, "hard_divergences": 1}) is None


def test_the_int4_export_leaves_the_root_logger_alone():
    """onnxruntime's MatMulNBits quantiser calls logging.basicConfig(INFO) on import;
    importing it through the exporter leaves the root logger as it was (a fresh
    interpreter: the module may already be imported here)."""
    import subprocess
    import sys

    code = ("import logging; from exporters.onnx.quantize import _import_quantizer; "
            "_import_quantizer(); import onnxruntime.quantization.matmul_nbits_quantizer; "
            "assert logging.getLogger().handlers == [], logging.getLogger().handlers; "
            "assert logging.getLogger().level == logging.WARNING")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_edge_serve_checks_its_options_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [(("--port", "99999"), "--port"), (("--url", "foo"), "--url"),
                 (("--proactive", "off", "--send-ahead"), "--send-ahead needs"),
                 (("--default-max-tokens", "0"), "--default-max-tokens"),
                 (("--port", str(busy.getsockname()[1])), "choose --port")]
        for args, want in cases:
            r, dt = run("edge-serve", *args)
            assert want in r.output and r.exit_code != 0 and dt < 3, (args, r.output)
            assert "Traceback" not in r.output


def test_examples_fail_fast_on_a_dead_url():
    import subprocess
    import sys

    url = f"http://127.0.0.1:{_free_port()}"
    for cmd in (["examples/robot_agent.py"], ["examples/chat_app.py", "--prompt", "hi"]):
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, *cmd, "--url", url], capture_output=True,
                           text=True, timeout=60)
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert p.returncode == 1 and time.monotonic() - t0 < 20, p.stderr
        assert lines[-1].startswith(f"Error: cannot reach {url}") and len(lines) == 1


def test_a_key_check_is_a_signed_200_not_a_4xx_in_the_metrics(tmp_path, target, tok):
    """``GET /v1/key`` answers the signing key's record (never its secret); the key
    checks of ``generate`` and the examples use it, so an accepted key leaves no 4xx in
    the cloud's request counter. Refused and unsigned checks stay 401."""
    import asyncio
    import json
    import urllib.request

    from cloud_api.keys import SQLiteKeyStore
    from edge_sdk.protocol import signing as sg
    from edge_sdk.transport import Transport, key_refusal
    from examples._common import check_server

    store = SQLiteKeyStore(tmp_path / "k.sqlite3")
    rec, raw = store.create("robot-7", ["verify"], rpm=90)
    stranger = sg.format_api_key("Q" * sg.LOOKUP_LEN, "s" * 32)

    async def check(url, key):
        t = Transport(url, signer=sg.Signer.from_api_key(key) if key else None, retries=0)
        try:
            got = await t.request("GET", "/v1/key") if key == raw else None
            return got, await key_refusal(t)
        finally:
            await t.close()

    with BackgroundServer(create_app(target, tok, key_store=store)) as srv:
        (body, _), refused = asyncio.run(check(srv.url, raw))
        info = json.loads(body)
        assert refused is None and info["key_id"] == rec.key_id and info["name"] == "robot-7"
        assert info["scopes"] == ["verify"] and info["rpm"] == 90 and "secret" not in info
        check_server(srv.url, raw)                              # the examples' check
        r, _ = run("generate", "Hi", "--url", srv.url, "--api-key", raw, "--draft",
                   "nosuch-model")                              # the CLI's check passes
        assert "unknown model 'nosuch-model'" in one_line_error(r)
        ctx = json.loads(urllib.request.urlopen(srv.url + "/healthz").read())["max_context"]
        r, dt = run("generate", "Hi", "--url", srv.url, "--api-key", raw, "--draft",
                    "nosuch-model", "--max-new-tokens", str(ctx))   # before the draft loads
        msg = one_line_error(r)
        assert "--max-new-tokens" in msg and f"context of {ctx} tokens" in msg and dt < 5
        _, refused = asyncio.run(check(srv.url, stranger))
        assert refused.status == 401 and refused.code == "unknown_key"
        _, refused = asyncio.run(check(srv.url, None))
        assert refused.status == 401 and refused.code == "missing_credentials"
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    key_lines = [x for x in metrics.splitlines() if 'endpoint="GET /v1/key"' in x
                 and x.startswith("specrelay_requests_total")]
    by_status = {x.split('status="')[1].split('"')[0]: float(x.split()[-1])
                 for x in key_lines}
    assert by_status == {"200": 4.0, "401": 2.0}, key_lines
    with BackgroundServer(create_app(target, tok)) as srv:     # run without keys
        t = Transport(srv.url, retries=0)
        body, _ = asyncio.run(_get_closing(t, "/v1/key"))
        assert json.loads(body) == {"auth": "off", "key_id": None}


async def _get_closing(t, path):
    try:
        return await t.request("GET", path)
    finally:
        await t.close()
