"""``specrelay edge-serve``: an OpenAI-compatible API on the edge device
(:mod:`edge_sdk.openai_server`): the draft runs here, the cloud verifies."""

from __future__ import annotations

import click

from edge_sdk.defaults import DEFAULT_DEPTH, DEFAULT_PROACTIVE
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS, MAX_NEW_TOKENS
from specrelay_cli.options import make_drafter

__all__ = ["edge_serve"]


def _draft_and_tokenizer(draft: str | None):
    """``(drafter, tokenizer, draft spec)``; the tokenizer of the default target when
    the draft has none (ONNX exports). The draft's runtime and dtype never touch
    exactness."""
    if draft is None:
        from edge_sdk.models import default_draft
        draft = default_draft()
    drafter, tok = make_drafter(draft)
    if tok is None:
        from edge_sdk.models import DEFAULT_TARGET, load_tokenizer

        tok = load_tokenizer(DEFAULT_TARGET)
    return drafter, tok, draft


def _check_options(url: str, host: str, port: int, proactive: str) -> None:
    """Refuse, before the draft loads: a bad ``--url``, a busy ``--port``, and an
    explicit ``--send-ahead`` without proactive drafting."""
    from click.core import ParameterSource

    from specrelay_cli.probe import check_url
    from specrelay_cli.serve import check_port_free

    check_url(url)
    check_port_free(host, port)
    ctx = click.get_current_context()
    if proactive == "off" and ctx.get_parameter_source("send_ahead") in (
            ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
        raise click.UsageError("--send-ahead needs --proactive ipdg, npdg, fsd or fsd+ipdg")


def _warn_about_cloud(url: str, signer, ca_cert: str | None) -> None:
    """One warning line when the cloud does not answer or refuses the key (edge-serve
    starts anyway: requests wait for the cloud, /health reports it)."""
    from specrelay_cli.probe import check_key, probe_api

    try:
        probe_api(url, ca_cert, 0.0)
    except click.ClickException as e:
        click.echo(f"WARNING: {e.format_message()}; starting anyway (requests wait up "
                   "to --offline-timeout, /health reports the cloud)", err=True)
        return
    refused = check_key(url, signer, ca_cert)
    if refused:
        click.echo(f"WARNING: the cloud refuses the key ({refused}): every request will "
                   "fail until --api-key is fixed", err=True)


@click.command("edge-serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The cloud verification API (specrelay serve).")
@click.option("--api-key", envvar="SPECRELAY_API_KEY", default=None,
              help="Key for the cloud API (env SPECRELAY_API_KEY); omit for an "
                   "--insecure-no-auth server.")
@click.option("--draft", default=None, help="Draft model (default: the demo draft).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=DEFAULT_DEPTH,
              show_default=True,
              help="Draft depth (tokens per block).")
@click.option("--model-name", default="specrelay", show_default=True,
              help="The model name reported to OpenAI clients.")
@click.option("--default-max-tokens", type=click.IntRange(1, MAX_NEW_TOKENS), default=256,
              show_default=True,
              help=f"Chat max_tokens when a request gives none (1..{MAX_NEW_TOKENS}).")
@click.option("--on-cloud-loss", type=click.Choice(["wait", "draft_only"]),
              default="wait", show_default=True,
              help="wait: retry until the cloud is back (never unverified tokens); "
                   "draft_only: continue with the draft, tokens flagged verified=false.")
@click.option("--proactive", type=click.Choice(["off", "ipdg", "npdg", "fsd", "fsd+ipdg"]),
              default=DEFAULT_PROACTIVE, show_default=True,
              help="Draft the next block while one is verified (off: stop-and-wait; "
                   "fsd, fsd+ipdg: from the cloud's early verdict).")
@click.option("--send-ahead/--no-send-ahead", default=True, show_default=True,
              help="Send a proactive block before the previous verdict (pipelined "
                   "verification; needs --proactive other than off).")
@click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="CA certificate to trust for an https:// cloud URL.")
@click.option("--offline-timeout", type=click.FloatRange(min=0.0), default=10.0,
              show_default=True, help="Seconds a request waits for an unreachable "
              "cloud before it is answered 503 (with --on-cloud-loss wait).")
@click.option("--acceptance", type=click.Choice(["exact", "semantic"]), default="exact",
              show_default=True, help="Acceptance of requests that do not set the "
              "`acceptance` field: exact (the target's output) or semantic (WISV, lossy; "
              "greedy requests only, flagged in the response's specrelay object).")
def edge_serve(url, api_key, draft, host, port, depth, model_name, default_max_tokens,
               on_cloud_loss, proactive, send_ahead, ca_cert, offline_timeout, acceptance):
    """Serve an OpenAI-compatible API on the edge (draft here, verify in the cloud).

    Point an OpenAI client at http://HOST:PORT/v1 (any api_key)."""
    import ssl

    from aiohttp import web

    from edge_sdk.openai_server import create_edge_app
    from edge_sdk.protocol.signing import Signer

    _check_options(url, host, port, proactive)
    signer = Signer.from_api_key(api_key) if api_key else None
    _warn_about_cloud(url, signer, ca_cert)
    drafter, tok, draft = _draft_and_tokenizer(draft)
    app = create_edge_app(url, drafter, tok, signer=signer, depth=depth,
                          model_name=model_name, default_max_tokens=default_max_tokens,
                          on_cloud_loss=on_cloud_loss, proactive=proactive,
                          send_ahead=send_ahead and proactive != "off",
                          offline_timeout_s=offline_timeout, acceptance=acceptance,
                          ssl_context=(ssl.create_default_context(cafile=ca_cert)
                                       if ca_cert else None))
    click.echo(f"OpenAI-compatible endpoint on http://{host}:{port}/v1 "
               f"(draft {draft}, cloud {url})", err=True)
    # SIGTERM: stop accepting, give in-flight requests a short grace period, then
    # cancel them (a request waiting out --offline-timeout must not hold the exit)
    web.run_app(app, host=host, port=port, print=None, shutdown_timeout=3.0)
