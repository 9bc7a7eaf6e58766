"""``specrelay`` command line: serve, generate, demo, keys, export, draft, bench."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import click

from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # no "Loading weights" bar

#: The default pair (kept in step with ``edge_sdk.models.DEFAULT_TARGET/DEFAULT_DRAFT``,
#: which this module does not import at start-up to keep ``--help`` fast).
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b+onnx-int4"
#: SmolLM2-135M and its trained 6-layer draft: the small pair of the fast tests.
SMOLLM2_TARGET, SMOLLM2_DRAFT = "smollm2-135m", "smollm2-135m-draft"


def default_draft(target: str | None = None) -> str:
    """The draft paired with ``target`` (``edge_sdk.models.default_draft``)."""
    from edge_sdk import models

    return models.default_draft(target)


DTYPE_CHOICE = ["auto", "float32", "bfloat16"]
DTYPE_HELP = ("Target dtype. auto = bfloat16 where the CPU has AMX/AVX512-BF16 (a 9-token "
              "verify pass then costs about a 1-token one; greedy output may differ from "
              "target-only only at bf16 near-ties, which are counted), else float32 (exact "
              "greedy identity up to 1e-4 ties).")


def make_drafter(spec: str):
    """A drafter from a model spec with an optional runtime suffix
    (``qwen2.5-coder-0.5b+onnx-int4``; ``edge_sdk.drafters.runtime``), or an ONNX export
    folder (``specrelay_onnx.json``).

    Returns ``(drafter, tokenizer or None)``; ONNX folders carry no tokenizer (use the
    target's: draft and target share it). A first use of an ONNX runtime exports the
    draft into the cache (~90 s for the 0.5B draft); torch drafts load in ``auto`` dtype
    (bfloat16 where the CPU computes it natively): the draft never touches exactness."""
    from exporters.onnx.first_use import build_drafter

    return build_drafter(spec, dtype="auto", echo=lambda m: click.echo(m, err=True))


def sampling_options(f):
    opts = [
        click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0,
                     show_default=True,
                     help="0 = greedy (token-for-token identical to the target)."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Keep the k most likely tokens (0: all)."),
        click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True),
                     default=1.0, show_default=True,
                     help="Nucleus sampling: the smallest set with this probability mass."),
        click.option("--repetition-penalty", type=click.FloatRange(min=0.0, min_open=True),
                     default=1.0, show_default=True, help="1 = off."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed of the edge's and the cloud's draws (same seed, same "
                     "output)."),
        click.option("--max-new-tokens", type=click.IntRange(1, 8192), default=96,
                     show_default=True, help="Tokens to generate (1..8192)."),
        click.option("--offline-timeout", type=click.FloatRange(min=0.0), default=5.0,
                     show_default=True, help="Seconds to keep retrying an unreachable API "
                     "before giving up."),
        click.option("--depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=6,
                     show_default=True, help="Draft depth (tokens per block; 6 measured "
                     "best for the default pair: a 7-token verify pass costs about a "
                     "1-token one)."),
        click.option("--controller", type=click.Choice(["fixed", "heuristic", "caac",
                                                       "ucb-specstop"]),
                     default="fixed", show_default=True,
                     help="Draft-depth policy (RAPID; UCB-SpecStop); fixed uses --depth."),
        click.option("--proactive", type=click.Choice(["off", "ipdg", "npdg"]),
                     default="ipdg", show_default=True, help="Draft the next block while "
                     "one is verified (RAPID): ipdg interruptible, npdg not, off: "
                     "stop-and-wait."),
        click.option("--send-ahead/--no-send-ahead", default=True, show_default=True,
                     help="Pipelined verification: send a proactive block before the "
                     "previous verdict (the cloud verifies it only if its assumed prefix "
                     "is confirmed). Needs --proactive ipdg|npdg."),
        click.option("--proactive-roots", type=click.IntRange(1, MAX_DRAFT_TOKENS),
                     default=1, show_default=True, help="Guessed bonus tokens (b > 1: a tree)."),
        click.option("--ngram", is_flag=True, help="Prompt-lookup n-gram drafts in front "
                     "of the model draft."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--mode", type=click.Choice(["asym", "standard"]), default="asym",
                     show_default=True, help="asym: compact protocol; standard: baseline "
                     "uploading the full draft distribution."),
        click.option("--target-only", is_flag=True,
                     help="Generate with the target alone (the identity reference)."),
        click.option("--chat/--no-chat", default=True, show_default=True,
                     help="Wrap the prompt in the chat template."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _sampling(kw):
    from edge_sdk import SamplingConfig

    return SamplingConfig(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
                          repetition_penalty=kw["repetition_penalty"])


def check_url(url: str) -> None:
    """Raises click.BadParameter unless ``url`` is an http(s) URL with a host."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise click.BadParameter(f"{url!r} is not an http:// or https:// URL",
                                 param_hint="--url")


def probe_api(url: str, ca_cert: str | None, wait_s: float) -> None:
    """``GET /healthz`` through the SDK's :class:`Transport` until it answers or ``wait_s``
    seconds pass (at least one try). Raises click.ClickException with what to do:
    nothing listening, an untrusted certificate (never retried), or not the API."""
    import ssl
    import time

    from edge_sdk.client import UNREACHABLE
    from edge_sdk.transport import RemoteError, TLSVerifyError, Transport

    ctx = ssl.create_default_context(cafile=ca_cert) if ca_cert else None

    async def once():
        t = Transport(url, retries=0, timeout_s=5.0, ssl_context=ctx)
        try:
            await t.request("GET", "/healthz")
        finally:
            await t.close()

    t0 = time.monotonic()
    while True:
        try:
            return asyncio.run(once())
        except TLSVerifyError as e:
            raise click.ClickException(str(e)) from None
        except RemoteError as e:
            raise click.ClickException(f"{url}/healthz answered HTTP {e.status}: is this a "
                                       "specrelay verification API?") from None
        except (*UNREACHABLE, OSError) as e:
            if time.monotonic() - t0 >= wait_s:
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise click.ClickException(
                    f"cannot reach {url}: is `specrelay serve` running there? ({reason}; "
                    f"gave up after {time.monotonic() - t0:.0f} s, --offline-timeout "
                    "waits longer)") from None
            time.sleep(0.5)


async def _generate(url, drafter, tok, prompt, kw, signer, ca_cert=None):
    from edge_sdk import EdgeClient
    from edge_sdk.transport import Transport

    ssl_ctx = None
    if ca_cert:
        import ssl

        ssl_ctx = ssl.create_default_context(cafile=ca_cert)
    transport = Transport(url, signer=signer, ssl_context=ssl_ctx)
    if kw.get("ngram") and drafter is not None:
        from edge_sdk.drafters.ngram import NgramDrafter

        drafter = NgramDrafter(base=drafter)
    async with EdgeClient(url, drafter, tok, depth=kw["depth"], mode=kw["mode"],
                          chat=kw["chat"], transport=transport,
                          controller=(None if kw.get("controller", "fixed") == "fixed"
                                      else kw["controller"]),
                          proactive=kw.get("proactive", "off"),
                          proactive_roots=kw.get("proactive_roots", 1),
                          send_ahead=(kw.get("send_ahead", False)
                                      and kw.get("proactive", "off") != "off"),
                          offline_timeout_s=kw.get("offline_timeout", 300.0)) as c:
        return await c.generate(prompt, sampling=_sampling(kw), seed=kw["seed"],
                                max_new_tokens=kw["max_new_tokens"], stop=kw["stop"],
                                target_only=kw["target_only"])


def divergence_report(ref, res) -> dict:
    """Greedy identity policy (README "Exactness"): where a speculative result differs
    from the target-only one, the first differing token must be a near-tie of the
    target (top-2 logit gap below ``sampling.NEAR_TIE_GAP`` of its dtype) in one run.
    Returns ``near_tie_divergences`` (0/1), ``hard_divergences`` (0/1, a bug) and
    ``first_divergence`` (token index or None)."""
    from edge_sdk.metrics import classify_divergence

    i, kind = classify_divergence(ref.token_ids, ref.metrics.get("near_tie_positions", []),
                                  res.token_ids, res.metrics.get("near_tie_positions", []))
    return {"first_divergence": i, "near_tie_divergences": int(kind == "near_tie"),
            "hard_divergences": int(kind == "hard")}


def _print_result(res, as_json: bool, title: str, note: str | None = None,
                  extra: dict | None = None):
    if as_json:
        out = res.to_dict()
        out.update(extra or {})
        click.echo(json.dumps(out))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.rule(title)
    con.print(res.text, markup=False, highlight=False)
    con.print(f"[dim]finish_reason={res.finish_reason}  tokens={len(res.token_ids)}[/dim]")
    t = Table(title="metrics")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("acceptance_rate", "mean_accepted_length", "ttft_s", "tpot_s",
              "throughput_tok_s", "uplink_bytes_per_token", "downlink_bytes_per_token",
              "target_passes_per_token", "target_seconds_per_token", "wasted_draft_tokens",
              "correction_mode_counts", "tv_budget_spent", "near_tie_tokens"):
        v = res.metrics[k]
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    for k, v in (extra or {}).items():
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    con.print(t)
    if note:
        con.print(f"[yellow]{note}[/yellow]")


EXTRA_OF_MODULE = {"onnxruntime": "edge", "onnx": "export", "onnxscript": "export",
                   "limits": "cloud", "prometheus_client": "cloud", "matplotlib": "bench",
                   "xllamacpp": "bench", "tensorrt": "jetson"}
"""Optional imports -> the pyproject extra that installs them."""


def _one_line(e: BaseException) -> str | None:
    """The one-line message for an error a user can act on; None: a bug (traceback)."""
    from edge_sdk.client import CloudUnreachable
    from edge_sdk.gguf_parts import PartsError
    from edge_sdk.transport import RemoteError, TLSVerifyError

    if isinstance(e, ModuleNotFoundError):
        extra = EXTRA_OF_MODULE.get((e.name or "").split(".")[0])
        return None if extra is None else (
            f"this command needs the [{extra}] extra (module {e.name!r} is missing): "
            f"pip install -c constraints.txt -e \".[{extra}]\"")
    if isinstance(e, (CloudUnreachable, TLSVerifyError, PartsError)):
        return str(e)
    if isinstance(e, RemoteError):
        hint = {401: " (check --api-key / SPECRELAY_API_KEY)",
                403: " (the key lacks a scope or its quota is spent)",
                429: " (rate limited: retry later)"}.get(e.status, "")
        return f"the API refused the request: {e}{hint}"
    if isinstance(e, OSError) and getattr(e, "errno", None) in (98, 48):   # EADDRINUSE
        return f"{e.strerror}: another server holds that port (choose --port)"
    if isinstance(e, (ValueError, FileNotFoundError)):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


class _Group(click.Group):
    """Errors a user can act on end in one line (``Error: ...``, exit 1): a missing
    optional dependency names its extra, an unreachable API says so. ``--debug`` shows
    the traceback instead."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.Abort, click.exceptions.Exit):
            raise
        except Exception as e:  # noqa: BLE001 - mapped to one line or re-raised
            msg = None if ctx.params.get("debug") else _one_line(e)
            if msg is None:
                raise
            raise click.ClickException(msg) from None


@click.group(cls=_Group)
@click.version_option(package_name="specrelay", prog_name="specrelay")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line "
              "errors.")
def main(debug):
    """specrelay: edge-cloud speculative decoding with the target model's exact output.

    \b
    Try:  specrelay demo                   (local server + default pair, prints the speed-up)
          specrelay keys create --name app (an API key for a server)
          specrelay serve                  (the verification API on :8000)
          specrelay generate "Hello" --api-key sr_live_...
    """
    import logging

    # one-time steps (GGUF assembly and dequantisation, draft export) say what they do
    lg = logging.getLogger("edge_sdk")
    if not any(getattr(h, "_specrelay", False) for h in lg.handlers):
        h = logging.StreamHandler()                  # stderr: stdout stays the result
        h.setFormatter(logging.Formatter("%(message)s"))
        h._specrelay = True
        lg.addHandler(h)
    lg.setLevel(logging.DEBUG if debug else logging.INFO)
    lg.propagate = False


def _check_port_free(host: str, port: int) -> None:
    """Raises click.ClickException when ``host:port`` cannot be bound (in use, or not an
    address of this machine)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror} "
                                   "(another server holds the port? choose --port)") from None


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--model", default=DEFAULT_TARGET, show_default=True,
              help="Target: preset, HF path, or file.gguf.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICE), default="auto", show_default=True,
              help=DTYPE_HELP)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads for the target (default: torch's choice).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Most blocks (of different sessions) verified in one target pass.")
@click.option("--max-wait-ms", type=click.FloatRange(min=0.0), default=0.0,
              show_default=True, help="Milliseconds a pass waits for more blocks after "
              "the first (0: verify at once with whatever has arrived).")
@click.option("--db", "--keys-db", "keys_db", default=None,
              help="API key store, as `specrelay keys --db` (default: $SPECRELAY_KEYS_DB, "
              "else ~/.config/specrelay/keys.sqlite3).")
@click.option("--insecure-no-auth", is_flag=True,
              help="Serve WITHOUT request signing (local development only).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM certificate (chain): serve https.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM private key of --tls-cert.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve /metrics on this port of --metrics-host instead of on the API "
                   "port (which then answers 404 for /metrics).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Interface of --metrics-port.")
def serve(host, port, model, dtype, threads, max_batch, max_wait_ms, keys_db,
          insecure_no_auth, tls_cert, tls_key, metrics_port, metrics_host):
    """Serve the signed verification API for a target model.

    \b
    Examples:
      specrelay keys create --name robot-7 && specrelay serve
      specrelay serve --host 0.0.0.0 --tls-cert cert.pem --tls-key key.pem
      specrelay serve --model smollm2-135m --insecure-no-auth   (local development)

    /healthz and /metrics (Prometheus) answer without a signature; keep /metrics private
    with --metrics-port (its own listener, default interface 127.0.0.1) or a firewall.
    Each request is logged on stderr as one JSON line: endpoint, status, seconds,
    bytes_in, key_id, session (never prompts, tokens or secrets).
    """
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    _check_port_free(host, port)                  # before minutes of model loading
    if metrics_port is not None:
        if metrics_port == port:
            raise click.BadParameter("must differ from --port", param_hint="--metrics-port")
        _check_port_free(metrics_host, metrics_port)
    from aiohttp import web

    from cloud_api.app import create_app
    from edge_sdk.models import load_model, resolve_dtype

    store, auth = None, "NONE (--insecure-no-auth: requests are not authenticated)"
    if not insecure_no_auth:
        from cloud_api.keys import SQLiteKeyStore
        from cloud_api.keys_cli import db_path

        path = db_path(keys_db)
        new = not os.path.exists(path)
        store = SQLiteKeyStore(path)
        n = len(store.list(include_revoked=False))
        auth = f"signed requests, key store {path} ({n} active key{'' if n == 1 else 's'})"
        if n == 0:
            click.echo(f"WARNING: {'new' if new else 'the'} key store {path} has no active "
                       "keys, every request will be refused: create one with `specrelay "
                       f"keys create --name NAME --db {path}`", err=True)
    ssl_ctx = None
    if tls_cert:
        import ssl

        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(tls_cert, tls_key)
    target, tok = load_model(model, dtype=dtype, threads=threads)
    app = create_app(target, tok, key_store=store, max_batch=max_batch,
                     max_wait_s=max_wait_ms / 1000,
                     metrics_address=(None if metrics_port is None
                                      else (metrics_host, metrics_port)))
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    scheme = "https" if ssl_ctx else "http"
    click.echo(f"serving {model} ({resolve_dtype(dtype)}) on {scheme}://{host}:{port}; "
               f"auth: {auth}" + (f"; metrics on http://{metrics_host}:{metrics_port}/metrics"
                                  if metrics_port else ""), err=True)
    # our structured access log replaces aiohttp's (which would log user agents etc.)
    web.run_app(app, host=host, port=port, ssl_context=ssl_ctx, shutdown_timeout=30,
                access_log=None, print=None)


@main.command()
@click.argument("prompt")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--api-key", envvar="SPECRELAY_API_KEY", default=None,
              help="API key (env SPECRELAY_API_KEY); omit for an --insecure-no-auth server.")
@click.option("--draft", default=None, help="Draft model: preset, path, or an ONNX "
              f"export folder (default: {DEFAULT_DRAFT}; for a smollm2 --tokenizer: "
              f"{SMOLLM2_DRAFT}).")
@click.option("--tokenizer", default=DEFAULT_TARGET, show_default=True,
              help="Tokenizer source when the draft has none (ONNX exports).")
@click.option("--ca-cert", type=click.Path(exists=True), default=None,
              help="CA certificate to trust for an https:// server.")
@sampling_options
def generate(prompt, url, api_key, draft, tokenizer, ca_cert, **kw):
    """Generate against a running verification API.

    \b
    Examples:
      specrelay generate "Write a haiku about robots" --api-key sr_live_...
      specrelay generate "Hi" --url https://api.example.com --ca-cert ca.pem
      specrelay generate "Hi" --temperature 0.7 --top-p 0.9 --seed 3 --json
    """
    from edge_sdk.models import load_tokenizer
    from edge_sdk.protocol.signing import Signer

    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="PROMPT")
    check_url(url)
    _sampling(kw)                                    # refuse bad values before any load
    signer = Signer.from_api_key(api_key) if api_key else None
    probe_api(url, ca_cert, kw["offline_timeout"])   # fail fast, before loading models
    drafter, tok = (None, None) if kw["target_only"] else make_drafter(
        draft or default_draft(tokenizer))
    tok = tok or load_tokenizer(tokenizer)
    res = asyncio.run(_generate(url, drafter, tok, prompt, kw, signer, ca_cert))
    _print_result(res, kw["as_json"], "target only" if kw["target_only"] else "speculative")


@main.command()
@click.argument("prompt", default="Write a Python function that checks whether a number "
                "is prime.")
@click.option("--target", default=DEFAULT_TARGET, show_default=True)
@click.option("--draft", default=None, help=f"Draft model (default: {DEFAULT_DRAFT}; "
              f"for a smollm2 target: {SMOLLM2_DRAFT}).")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also run the target alone and report identity and speed ratio.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICE), default="auto", show_default=True,
              help=DTYPE_HELP)
@sampling_options
def demo(prompt, target, draft, compare, dtype, **kw):
    """Start a local signed server with the default models, generate, print metrics."""
    from cloud_api.local import local_server
    from edge_sdk.models import load_model

    draft = draft or default_draft(target)
    note = None
    if draft.endswith("@4"):
        note = ("draft = the target's first 4 layers, untrained: it agrees with the target "
                "only ~5-8 % of the time, so expect little speed-up (run `specrelay draft "
                "distill` for a trained draft)")
    if not kw["as_json"]:
        click.echo(f"loading target {target} and draft {draft} ...", err=True)
    tmodel, tok = load_model(target, dtype=dtype)
    drafter, _ = make_drafter(draft)
    with local_server(tmodel, tok, name="demo-ephemeral") as srv:
        signer = srv.signer
        res = asyncio.run(_generate(srv.url, drafter, tok, prompt,
                                    kw | {"target_only": kw["target_only"]}, signer))
        extra = {}
        if compare and not kw["target_only"]:
            ref = asyncio.run(_generate(srv.url, None, tok, prompt,
                                        kw | {"target_only": True}, signer))
            extra["target_only_throughput_tok_s"] = ref.metrics["throughput_tok_s"]
            extra["speedup_vs_target_only"] = (res.metrics["throughput_tok_s"]
                                               / ref.metrics["throughput_tok_s"])
            if kw["temperature"] == 0:
                extra["identical_to_target"] = ref.token_ids == res.token_ids
                extra.update(divergence_report(ref, res))
    policy = (f"depth {kw['depth']}" if kw["controller"] == "fixed"
              else f"{kw['controller']} depth")
    if kw["proactive"] != "off":
        policy += f" + {kw['proactive']}" + (" + send-ahead" if kw["send_ahead"] else "")
    _print_result(res, kw["as_json"], f"speculative ({draft} -> {target}, {policy}, "
                  f"signed HTTP on {srv.url})", note, extra)


def _mount():
    from cloud_api.keys_cli import keys
    from bench.cli import bench
    from edge_sdk.openai_server import edge_serve
    from exporters.cli import export
    from exporters.distill.cli import distill_command

    main.add_command(keys)
    main.add_command(export)

    @main.group()
    def draft():
        """Create draft models for a target."""

    draft.add_command(distill_command, "distill")
    main.add_command(bench)
    main.add_command(edge_serve, "edge-serve")


_mount()

if __name__ == "__main__":
    sys.exit(main())
