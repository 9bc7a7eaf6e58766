"""``specrelay generate`` (against a running verification API) and ``specrelay demo``
(a local signed server, the default pair, the speed-up over the target alone)."""

from __future__ import annotations

import asyncio
import json

import click

from edge_sdk.defaults import DEFAULT_PROACTIVE_MIN_HIT, DEFAULT_SIBLINGS
from specrelay_cli.options import (DEFAULT_DRAFT, DEFAULT_TARGET, DTYPE_CHOICE, DTYPE_HELP,
                                   SMOLLM2_DRAFT, default_draft, make_drafter,
                                   sampling_config, sampling_options)
from specrelay_cli.local import LOCAL_OPTIONS, run_local
from specrelay_cli.probe import check_key, check_url, probe_api


def local_options(f):
    """Decorate a command with the ``--local`` options (:mod:`specrelay_cli.local`)."""
    for o in reversed(LOCAL_OPTIONS):
        f = o(f)
    return f

__all__ = ["generate", "demo", "run_generation", "divergence_report", "print_result"]


def _client_options(kw: dict) -> dict:
    """EdgeClient keyword arguments of the parsed options (``controller auto``: the
    SDK's default policy; send-ahead only with a proactive mode)."""
    proactive = kw.get("proactive", "off")
    return dict(depth=kw["depth"], mode=kw["mode"], chat=kw["chat"],
                controller=(None if kw.get("controller", "auto") == "auto"
                            else kw["controller"]),
                proactive=proactive, proactive_roots=kw.get("proactive_roots", 1),
                proactive_min_hit=kw.get("proactive_min_hit", DEFAULT_PROACTIVE_MIN_HIT),
                send_ahead=kw.get("send_ahead", False) and proactive != "off",
                siblings=kw.get("siblings", DEFAULT_SIBLINGS) or None,
                offline_timeout_s=kw.get("offline_timeout", 300.0),
                acceptance=kw.get("acceptance", "exact"))


async def run_generation(url, drafter, tok, prompt, kw, signer, ca_cert=None):
    """One generation of ``prompt`` through a signed :class:`Transport` to ``url``
    (``drafter`` None: the target alone). ``kw``: the parsed sampling options.
    Returns the :class:`edge_sdk.GenerationResult`."""
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
    async with EdgeClient(url, drafter, tok, transport=transport,
                          **_client_options(kw)) as c:
        return await c.generate(prompt, sampling=sampling_config(kw), seed=kw["seed"],
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


_TABLE_METRICS = ("acceptance_rate", "mean_accepted_length", "ttft_s", "tpot_s",
                  "throughput_tok_s", "uplink_bytes_per_token", "downlink_bytes_per_token",
                  "target_passes_per_token", "target_seconds_per_token",
                  "wasted_draft_tokens", "sibling_rows", "sibling_hits",
                  "correction_mode_counts", "tv_budget_spent",
                  "near_tie_tokens", "semantic_accepted_tokens")


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_result(res, as_json: bool, title: str, note: str | None = None,
                 extra: dict | None = None):
    """One JSON object on stdout, or the text and a metrics table (rich)."""
    if as_json:
        out = res.to_dict()
        out.update(extra or {})
        click.echo(json.dumps(out))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.rule()
    con.print(title, style="bold", markup=False, highlight=False)   # rule titles get cut
    con.print(res.text, markup=False, highlight=False)
    con.print(f"[dim]finish_reason={res.finish_reason}  tokens={len(res.token_ids)}[/dim]")
    if res.finish_reason == "length":
        con.print("[dim](stopped at --max-new-tokens; raise it for the whole answer)[/dim]")
    t = Table(title="metrics")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in _TABLE_METRICS:
        t.add_row(k, _cell(res.metrics[k]))
    for k, v in (extra or {}).items():
        t.add_row(k, _cell(v))
    con.print(t)
    if res.semantic_accepted_tokens:
        con.print(f"[yellow]lossy output: {res.semantic_accepted_tokens} token(s) accepted "
                  "semantically (WISV), not exactly the target's[/yellow]")
    if note:
        con.print(f"[yellow]{note}[/yellow]")


@click.command()
@click.argument("prompt")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--api-key", envvar="SPECRELAY_API_KEY", default=None,
              help="API key (env SPECRELAY_API_KEY); omit for an --insecure-no-auth server.")
@click.option("--draft", default=None, help="Draft model: preset, path, or an ONNX "
              "export folder (OUT+onnx-int4: its int4 graph) "
              f"(default: {DEFAULT_DRAFT}; for a smollm2 --tokenizer: "
              f"{SMOLLM2_DRAFT}).")
@click.option("--tokenizer", default=DEFAULT_TARGET, show_default=True,
              help="Tokenizer source when the draft has none (ONNX exports).")
@click.option("--ca-cert", type=click.Path(exists=True), default=None,
              help="CA certificate to trust for an https:// server.")
@sampling_options
@local_options
def generate(prompt, url, api_key, draft, tokenizer, ca_cert, **kw):
    """Generate against a running verification API.

    \b
    Examples:
      specrelay generate "Write a haiku about robots" --api-key sr_live_...
      specrelay generate "Hi" --url https://api.example.com --ca-cert ca.pem
      specrelay generate "Hi" --temperature 0.7 --top-p 0.9 --seed 3 --json
      specrelay generate "def fib(n):" --local --memory-budget 1.5GB --storage emmc
    """
    from edge_sdk.generation import request_seed
    from edge_sdk.models import load_tokenizer
    from edge_sdk.protocol.signing import Signer

    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="PROMPT")
    kw["seed"] = request_seed(kw["seed"])            # a fresh one unless --seed
    if kw["local"]:
        if kw["acceptance"] != "exact":
            raise click.BadParameter("--local runs the target itself: exact only",
                                     param_hint="--acceptance")
        return run_local(prompt, kw)
    check_url(url)
    sampling_config(kw)                              # refuse bad values before any load
    _check_drafting(kw)
    signer = Signer.from_api_key(api_key) if api_key else None
    health = probe_api(url, ca_cert, kw["offline_timeout"])  # fail fast, before loading
    ctx_len = health.get("max_context")
    if isinstance(ctx_len, int) and kw["max_new_tokens"] >= ctx_len:
        raise click.BadParameter(f"{kw['max_new_tokens']} new tokens do not fit the "
                                 f"server's context of {ctx_len} tokens (prompt included)",
                                 param_hint="--max-new-tokens")
    refused = check_key(url, signer, ca_cert)
    if refused:
        raise click.ClickException(f"the API refused the key: {refused} (check --api-key "
                                   "/ SPECRELAY_API_KEY)")
    drafter, tok = (None, None) if kw["target_only"] else make_drafter(
        draft or default_draft(tokenizer))
    tok = tok or load_tokenizer(tokenizer)
    res = asyncio.run(run_generation(url, drafter, tok, prompt, kw, signer, ca_cert))
    print_result(res, kw["as_json"], "target only" if kw["target_only"] else "speculative")


def _untrained_note(draft: str) -> str | None:
    if not draft.endswith("@4"):
        return None
    return ("draft = the target's first 4 layers, untrained: it agrees with the target "
            "only ~5-8 % of the time, so expect little speed-up (run `specrelay draft "
            "distill` for a trained draft)")


def _near_tie_note(extra: dict) -> str | None:
    """The demo's word on a greedy output that differs from the target alone's only at
    a near-tie (allowed where a pass is not row-invariant, README "Exactness"), or None."""
    if extra.get("identical_to_target") is not False or extra.get("hard_divergences"):
        return None
    return (f"identical_to_target False: the outputs part at token "
            f"{extra.get('first_divergence')}, where the target's top two logits are a "
            "near-tie that rounding can flip in a pass the verifier does not make "
            "row-invariant (over 64 new tokens); the greedy policy allows this and counts "
            "it (near_tie_divergences), and 0 hard divergences means every other token "
            "is the target's")


def _policy(kw: dict) -> str:
    """The draft policy in words (``depth 8 + ipdg + send-ahead``)."""
    policy = {"fixed": f"depth {kw['depth']}",
              "auto": f"depth paced to the round trip, at most {kw['depth']}"}.get(
        kw["controller"], f"{kw['controller']} depth")
    if kw["proactive"] != "off":
        policy += f" + {kw['proactive']}" + (" + send-ahead" if kw["send_ahead"] else "")
    return policy


def _compare(srv, tok, prompt, kw, res) -> dict:
    """Run the target alone on ``srv``: throughput, speed-up and (greedy) identity."""
    ref = asyncio.run(run_generation(srv.url, None, tok, prompt, kw | {"target_only": True,
                                                                     "acceptance": "exact"},
                                     srv.signer))
    extra = {"target_only_throughput_tok_s": ref.metrics["throughput_tok_s"],
             "speedup_vs_target_only": (res.metrics["throughput_tok_s"]
                                        / ref.metrics["throughput_tok_s"])}
    if kw["temperature"] == 0:
        extra["identical_to_target"] = ref.token_ids == res.token_ids
        extra.update(divergence_report(ref, res))
    return extra


@click.command()
@click.argument("prompt", default="Write a Python function that checks whether a number "
                "is prime.")
@click.option("--target", default=DEFAULT_TARGET, show_default=True,
              help="Target model: a preset (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, "
              "smollm2-135m), a .gguf file, DIR::FILE.gguf or a local Hugging Face "
              "folder.")
@click.option("--draft", default=None, help=f"Draft model (default: {DEFAULT_DRAFT}; "
              f"for a smollm2 target: {SMOLLM2_DRAFT}).")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="Also run the target alone and report identity and speed ratio.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICE), default="auto", show_default=True,
              help=DTYPE_HELP)
@click.option("--wisv-head", default="auto", show_default=True, metavar="PATH|auto",
              help="With --acceptance semantic: the server's WISV decision head (auto: "
              "the target preset's shipped head).")
@sampling_options
def demo(prompt, target, draft, compare, dtype, wisv_head, **kw):
    """Start a local signed server with the default models, generate, print metrics."""
    from cloud_api.local import local_server
    from edge_sdk.generation import request_seed
    from edge_sdk.models import load_model
    from specrelay_cli.serve import check_wisv_options, semantic_setting

    sampling_config(kw)                              # refuse bad values before any load
    kw["seed"] = request_seed(kw["seed"])            # one seed for both runs of --compare
    semantic = kw["acceptance"] == "semantic"
    if semantic:
        check_wisv_options(wisv_head, None, None)
    draft = draft or default_draft(target)
    _check_models(target, draft)                     # both names, before loading either
    _check_drafting(kw)
    if not kw["as_json"]:
        click.echo(f"loading target {target} and draft {draft} ...", err=True)
    from edge_sdk.packed import packed_default

    tmodel, tok = load_model(target, dtype=dtype, packed=packed_default())
    sem = None
    if semantic:
        from cloud_api.wisv.serving import DEFAULT_MAX_PER_BLOCK

        sem = semantic_setting(tmodel, target, {"head": wisv_head, "strict": None,
                                                "relaxed": None,
                                                "max_per_block": DEFAULT_MAX_PER_BLOCK})
        if sem is None:
            raise click.BadParameter(f"no shipped WISV head for {target}: pass a head "
                                     "file (specrelay wisv train)", param_hint="--wisv-head")
    drafter, _ = make_drafter(draft)
    with local_server(tmodel, tok, name="demo-ephemeral", semantic=sem) as srv:
        res = asyncio.run(run_generation(srv.url, drafter, tok, prompt, kw, srv.signer))
        extra = (_compare(srv, tok, prompt, kw, res)
                 if compare and not kw["target_only"] else {})
    note = "\n".join(n for n in (_untrained_note(draft), _near_tie_note(extra)) if n)
    print_result(res, kw["as_json"], f"speculative ({draft} -> {target}, {_policy(kw)}, "
                 f"signed HTTP on {srv.url})", note or None, extra)


def _check_drafting(kw: dict) -> None:
    """click.BadParameter (one line) for drafting options that cannot go together,
    before any model loads: ``--proactive-min-hit`` above 0 needs ``--proactive ipdg``."""
    from edge_sdk.proactive import SKIPPING_MODES    # torch: not at CLI start-up

    proactive = kw.get("proactive", "off")
    if kw.get("proactive_min_hit") and proactive not in SKIPPING_MODES:
        raise click.BadParameter(f"needs --proactive ipdg, not {proactive}",
                                 param_hint="--proactive-min-hit")


def _check_models(target: str, draft: str) -> None:
    """click.BadParameter (one line) unless both model specs name something that is
    there (a preset, a file, a folder; the draft's runtime suffix aside)."""
    from edge_sdk.drafters.runtime import split_runtime
    from edge_sdk.models import PRESETS, resolve

    for hint, spec in (("--target", target), ("--draft", split_runtime(draft)[0])):
        if not isinstance(spec, str) or spec.split("@")[0] in PRESETS:
            continue                 # a preset resolves by assembling its parts: later
        try:
            resolve(spec)
        except (FileNotFoundError, ValueError) as e:
            raise click.BadParameter(str(e), param_hint=hint) from None
