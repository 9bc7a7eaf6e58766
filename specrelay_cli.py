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
    from edge_sdk.drafters.runtime import build_drafter

    return build_drafter(spec, dtype="auto", echo=lambda m: click.echo(m, err=True))


def sampling_options(f):
    opts = [
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="0 = greedy (token-for-token identical to the target)."),
        click.option("--top-k", type=int, default=0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--max-new-tokens", type=int, default=96, show_default=True),
        click.option("--depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=6, show_default=True,
                     help="Draft depth gamma (tokens per block; 6 measured best for the "
                     "default pair: a 7-token verify pass costs about a 1-token one)."),
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
        click.option("--proactive-roots", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=1,
                     show_default=True, help="Guessed bonus tokens (b > 1: a tree)."),
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
                                      and kw.get("proactive", "off") != "off")) as c:
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


class _Group(click.Group):
    """Turns a missing optional dependency into one line naming the extra to install."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:
            extra = EXTRA_OF_MODULE.get((e.name or "").split(".")[0])
            if extra is None:
                raise
            raise click.ClickException(
                f"this command needs the [{extra}] extra (module {e.name!r} is missing): "
                f"pip install -c constraints.txt -e \".[{extra}]\"") from None


@click.group(cls=_Group)
def main():
    """specrelay: edge-cloud speculative decoding with the target model's exact output."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--model", default=DEFAULT_TARGET, show_default=True,
              help="Target: preset, HF path, or file.gguf.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICE), default="auto", show_default=True,
              help=DTYPE_HELP)
@click.option("--threads", type=int, default=None, help="torch threads for the target.")
@click.option("--max-batch", default=8, show_default=True)
@click.option("--max-wait-ms", default=0.0, show_default=True)
@click.option("--keys-db", default=None, help="API key database (default: keys CLI's).")
@click.option("--insecure-no-auth", is_flag=True,
              help="Serve WITHOUT request signing (local development only).")
@click.option("--tls-cert", type=click.Path(exists=True), default=None)
@click.option("--tls-key", type=click.Path(exists=True), default=None)
def serve(host, port, model, dtype, threads, max_batch, max_wait_ms, keys_db,
          insecure_no_auth, tls_cert, tls_key):
    """Serve the signed verification API for a target model."""
    from aiohttp import web

    from cloud_api.app import create_app
    from edge_sdk.models import load_model

    store = None
    if not insecure_no_auth:
        from cloud_api.keys import SQLiteKeyStore
        from cloud_api.keys_cli import DEFAULT_DB

        store = SQLiteKeyStore(keys_db or os.environ.get("SPECRELAY_KEYS_DB") or DEFAULT_DB)
    else:
        click.echo("WARNING: --insecure-no-auth: requests are not authenticated", err=True)
    ssl_ctx = None
    if tls_cert:
        import ssl

        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(tls_cert, tls_key)
    target, tok = load_model(model, dtype=dtype, threads=threads)
    app = create_app(target, tok, key_store=store, max_batch=max_batch,
                     max_wait_s=max_wait_ms / 1000)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # our structured access log replaces aiohttp's (which would log user agents etc.)
    web.run_app(app, host=host, port=port, ssl_context=ssl_ctx, shutdown_timeout=30,
                access_log=None)


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
    """Generate against a running verification API."""
    from edge_sdk.models import load_tokenizer
    from edge_sdk.protocol.signing import Signer

    signer = Signer.from_api_key(api_key) if api_key else None
    drafter, tok = make_drafter(draft or default_draft(tokenizer))
    tok = tok or load_tokenizer(tokenizer)
    if kw["target_only"]:
        drafter = None
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
    from cloud_api.app import create_app
    from cloud_api.keys import SQLiteKeyStore
    from cloud_api.server import BackgroundServer
    from edge_sdk.models import load_model
    from edge_sdk.protocol.signing import Signer

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
    store = SQLiteKeyStore(":memory:")
    _, raw_key = store.create("demo-ephemeral", scopes=("verify",), rpm=100_000,
                              tpm=10_000_000)
    signer = Signer.from_api_key(raw_key)
    with BackgroundServer(create_app(tmodel, tok, key_store=store)) as srv:
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
    from exporters.distill import distill_command

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
