"""``specrelay serve``: the signed verification API for a target model."""

from __future__ import annotations

import os

import click

from specrelay_cli.options import DEFAULT_TARGET, DTYPE_CHOICE, DTYPE_HELP

DEFAULT_TOP_N = 20   # cloud_api.scoring.engines.DEFAULT_TOP_N (not imported: fast --help)

__all__ = ["serve"]


def check_port_free(host: str, port: int, option: str = "--port") -> None:
    """Raises click.ClickException when ``host:port`` cannot be bound (in use, or not an
    address of this machine); the message names ``option``."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror} "
                                   f"(another server holds the port? choose {option})") from None


def _check_ports(host: str, port: int, metrics_host: str, metrics_port: int | None) -> None:
    """Both listeners can be bound (checked before minutes of model loading)."""
    check_port_free(host, port)
    if metrics_port is not None:
        if metrics_port == port:
            raise click.BadParameter("must differ from --port", param_hint="--metrics-port")
        check_port_free(metrics_host, metrics_port, "--metrics-port")


def _open_key_store(keys_db: str | None):
    """``(SQLiteKeyStore, what the start-up line says about auth)``; warns on stderr when
    the store has no active key (every request would be refused)."""
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
    return store, auth


def _tls_context(tls_cert: str | None, tls_key: str | None):
    """A server SSL context of the PEM pair, or None (http)."""
    if not tls_cert:
        return None
    import ssl

    ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ssl_ctx.load_cert_chain(tls_cert, tls_key)
    return ssl_ctx


def check_wisv_options(head: str, strict: float | None, relaxed: float | None) -> None:
    """Refuse bad ``--wisv-*`` values before any model loads (click.BadParameter)."""
    from cloud_api.wisv.threshold import ThresholdPolicy

    kw = {k: v for k, v in (("strict", strict), ("relaxed", relaxed)) if v is not None}
    try:
        ThresholdPolicy(**kw)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--wisv-strict/--wisv-relaxed") from None
    low = head.strip().lower()
    if low not in ("off", "auto") and not os.path.isfile(head):
        raise click.BadParameter(f"no such head file: {head}", param_hint="--wisv-head")


def semantic_setting(target, preset: str, wisv: dict):
    """The server's :class:`cloud_api.wisv.serving.SemanticAcceptance` for the
    ``--wisv-*`` options of a loaded ``target`` (None: off). Raises click.BadParameter
    with the loader's one-line reason."""
    from cloud_api.wisv.serving import semantic_for

    try:
        return semantic_for(wisv["head"], int(target.config.hidden_size), preset,
                            strict=wisv["strict"], relaxed=wisv["relaxed"],
                            max_per_block=wisv["max_per_block"],
                            guard=wisv.get("guard"))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--wisv-head") from None


def semantic_note(sem) -> str:
    """The start-up line's WISV note ("" when off)."""
    if sem is None:
        return ""
    p = sem.policy
    return (f"; semantic acceptance (WISV, opt-in per session): threshold "
            f"{p.strict:g}..{p.relaxed:g}, at most {sem.max_per_block} per block, "
            f"token guard {sem.guard}")


def _embedded_app(*, model, dtype, threads, max_batch, max_wait_ms, store,
                  metrics_address, unauth_rpm, early_exit, wisv, free_rows=None,
                  row_invariant="exact") -> tuple:
    """The single-server app (target loaded in this process): ``(app, the start-up
    line's early-exit and WISV notes)``. Raises click.BadParameter (--early-exit,
    --wisv-head)."""
    from cloud_api.app import create_app
    from cloud_api.exit_select import early_head_for
    from edge_sdk.models import load_model

    from edge_sdk.packed import packed_default
    target, tok = load_model(model, dtype=dtype, threads=threads, packed=packed_default())
    try:
        head = early_head_for(target, tok, early_exit, model)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--early-exit") from None
    sem = semantic_setting(target, model, wisv)
    app = create_app(target, tok, key_store=store, max_batch=max_batch,
                     max_wait_s=max_wait_ms / 1000, metrics_address=metrics_address,
                     unauth_per_window=unauth_rpm or None, early_head=head, semantic=sem,
                     free_rows=free_rows, row_invariant=row_invariant)
    return app, ((f"; early exit: layer {head.layer} ({head.name})" if head else "")
                 + semantic_note(sem))


ENGINE_BACKENDS = ("sglang", "vllm")


def check_backend_options(backend: str, url: str | None, top_n: int | None,
                          served: str | None, replicas: int, ray_address: str | None,
                          early_exit: str, wisv_head: str) -> None:
    """Refuse ``--backend*`` combinations before anything loads (click.BadParameter
    naming the option): engine options without an engine backend, an engine backend
    without its URL, with replicas (the engine scales itself) or with FSD / WISV (they
    read the target's hidden states)."""
    if backend == "torch":
        for hint, value in (("--backend-url", url), ("--backend-top-n", top_n),
                            ("--backend-model", served)):
            if value is not None:
                raise click.BadParameter("applies to --backend sglang|vllm only",
                                         param_hint=hint)
        return
    if not url or not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"--backend {backend} needs the engine's URL "
                                 "(http://HOST:PORT)", param_hint="--backend-url")
    if served is not None and backend != "vllm":
        raise click.BadParameter("applies to --backend vllm only", param_hint="--backend-model")
    if replicas > 1 or ray_address:
        raise click.BadParameter(f"--backend {backend} scales inside the engine: serve "
                                 "one ingress (--replicas 1, no --ray-address)",
                                 param_hint="--replicas" if replicas > 1 else "--ray-address")
    for hint, value, what in (("--early-exit", early_exit, "FSD early verdicts"),
                              ("--wisv-head", wisv_head, "semantic acceptance")):
        if value.strip().lower() not in ("auto", "off"):
            raise click.BadParameter(f"{what} read the target's hidden states: "
                                     "--backend torch only", param_hint=hint)


def _engine_app(*, backend, url, top_n, served, model, dtype, max_batch, max_wait_ms,
                store, metrics_address, unauth_rpm, **_) -> tuple:
    """The app verifying through a scoring engine (tokenizer and config of ``model``,
    no target weights): ``(app, where it verifies)``. Raises FileNotFoundError /
    OSError / ValueError (unknown model: one line via the CLI's error mapping)."""
    from cloud_api.app import create_app
    from cloud_api.scoring.engines import engine_verifier

    verifier, tok = engine_verifier(backend, url, model, top_n, served or model,
                                    engine_dtype(dtype))
    app = create_app(None, tok, key_store=store, max_batch=max_batch,
                     max_wait_s=max_wait_ms / 1000, metrics_address=metrics_address,
                     unauth_per_window=unauth_rpm or None, verifier=verifier)
    return app, (f" through the {backend} engine at {url} (top-{top_n} logprobs per "
                 f"position: exact for greedy and top_k <= {top_n}; target weights not "
                 "loaded here)")


def engine_dtype(dtype: str) -> str:
    """The engine's compute dtype as ``--dtype`` names it (auto: bfloat16)."""
    return "bfloat16" if dtype == "auto" else dtype


def _build_app(replicas: int, ray_address: str | None, early_exit, wisv: dict,
               engine: dict | None, kw: dict) -> tuple:
    """``(app, where it verifies, early-exit and WISV note)``: through a scoring engine
    (``engine``: backend, url, top_n, served), the embedded server, or the ingress over
    Ray Serve replicas (``--replicas`` > 1 or ``--ray-address``; no semantic acceptance
    there: an explicit ``--wisv-head PATH`` is refused)."""
    if engine is not None:
        app, where = _engine_app(**engine, **kw)
        return app, where, ""
    if replicas > 1 or ray_address:
        if wisv["head"].strip().lower() not in ("off", "auto"):
            raise click.BadParameter("semantic acceptance is single-server only "
                                     "(--replicas 1)", param_hint="--wisv-head")
        from specrelay_cli.serve_ray import serve_replicated

        app, where = serve_replicated(replicas=replicas, ray_address=ray_address, **kw)
        return app, f" over {where}", ""
    app, note = _embedded_app(early_exit=early_exit, wisv=wisv, **kw)
    return app, "", note


@click.command()
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
@click.option("--free-rows", type=click.IntRange(min=0), default=None,
              help="Token rows a target pass holds at about the cost of one, advertised "
              "so that clients size their sibling trees to it (default: 16 for bf16 on "
              "an AMX CPU, else 0: no trees unless a client asks for them).")
@click.option("--row-invariant", type=click.Choice(("exact", "fast", "off")),
              default="exact", show_default=True, envvar="SPECRELAY_ROW_INVARIANT",
              help="Row-invariant verify passes (greedy output bit for bit the target's, "
              "also in bf16): exact = always; fast = except batched passes of more rows "
              "than the kernels keep alike (~27 on Qwen here; those follow the near-tie "
              "policy, at their old cost); off = the model's own kernels "
              "(env SPECRELAY_ROW_INVARIANT).")
@click.option("--db", "--keys-db", "keys_db", default=None,
              help="API key store, as `specrelay keys --db` (default: $SPECRELAY_KEYS_DB, "
              "else ~/.config/specrelay/keys.sqlite3).")
@click.option("--insecure-no-auth", is_flag=True,
              help="Serve WITHOUT request signing (local development only).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM certificate (chain): serve https.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM private key of --tls-cert.")
@click.option("--unauth-rpm", type=click.IntRange(min=0), default=600, show_default=True,
              help="Per-IP budget of unauthenticated requests (refused signatures, "
                   "/healthz, /metrics) per minute; 0: no limit.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve /metrics on this port of --metrics-host instead of on the API "
                   "port (which then answers 404 for /metrics).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Interface of --metrics-port.")
@click.option("--early-exit", default="auto", show_default=True,
              metavar="off|auto|fit|LAYER|untrained:LAYER",
              help="FSD early verdicts (streamed to clients that ask, before the final "
              "one): auto = the preset's calibrated exit layer if its fitted head is cached "
              "(specrelay fsd calibrate), else off; fit = fit it now if missing (about a "
              "minute); LAYER = that decoder layer (fitted on first use); "
              "untrained:LAYER = the final norm and LM head applied at that layer, "
              "nothing fitted (for tests). Single server only (--replicas 1).")
@click.option("--replicas", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Verifier replicas on Ray Serve (needs the [ray] extra), each loading "
              "the target and holding its own sessions; this server stays the signed "
              "ingress and a session-affine Serve router sends every request of a "
              "session to its replica (Serve restarts a replica that dies). 1 without "
              "--ray-address: one embedded server, no Ray.")
@click.option("--ray-address", default=None, metavar="HOST:PORT|auto",
              help="Join this Ray cluster (replicas go where it has CPUs; several "
              "`serve` ingress workers on one cluster share the replicas (the Serve "
              "application specrelay-verifier, reused when it serves the same model), "
              "the replay cache and the rate limits). Default with --replicas > 1: "
              "start a local cluster.")
@click.option("--backend", type=click.Choice(("torch",) + ENGINE_BACKENDS), default="torch",
              show_default=True, help="Where the target's scores come from: torch = the "
              "target loaded here (or in each replica); sglang / vllm = a serving engine "
              "at --backend-url scores context + drafts (top-N logprobs per position) "
              "and this server applies the acceptance rule. Engine backends load only "
              "--model's tokenizer and config (the engine must serve that checkpoint), "
              "verify greedy and top_k <= N exactly and refuse other sampling configs "
              "(422); --dtype names the engine's dtype (auto: bfloat16); no replicas, "
              "FSD or WISV.")
@click.option("--backend-url", default=None, metavar="URL",
              help="The engine: http://HOST:PORT of `python -m sglang.launch_server` "
              "(POST /generate) or `vllm serve` (POST /v1/completions).")
@click.option("--backend-top-n", type=click.IntRange(1, 1000), default=None,
              help="Logprobs the engine returns per position [default: 20] (vLLM: at "
              "most its --max-logprobs).")
@click.option("--backend-model", default=None, metavar="NAME",
              help="vLLM's served model name [default: --model].")
@click.option("--wisv-head", default="auto", show_default=True, metavar="PATH|auto|off",
              help="WISV decision head for semantic (lossy) acceptance, which a session "
              "must ask for (acceptance: semantic; greedy only): auto = the shipped head "
              "of the target preset (cloud_api/assets/wisv/<preset>.safetensors) if "
              "present, else off; PATH = a head file with its .json manifest; off = "
              "semantic sessions are refused (422). Exact sessions never see the head.")
@click.option("--wisv-strict", type=float, default=None,
              help="Head-probability threshold on a good link (default 0.9).")
@click.option("--wisv-relaxed", type=float, default=None,
              help="Threshold on a bad link (default 0.35); the threshold moves from "
              "strict to relaxed as the RTT + upload time the edge reports grows.")
@click.option("--wisv-max-per-block", type=click.IntRange(min=1), default=4,
              show_default=True, help="Most draft tokens of one block accepted "
              "semantically.")
@click.option("--wisv-guard", type=click.Choice(["operators", "off"]), default="off",
              show_default=True, help="operators: a mismatch where the draft or the "
              "target token is an operator, comparison, boolean keyword or number "
              "stays exact; off: every mismatch goes to the head.")
def serve(host, port, model, dtype, threads, max_batch, max_wait_ms, free_rows,
          row_invariant, keys_db,
          insecure_no_auth, tls_cert, tls_key, unauth_rpm, metrics_port, metrics_host,
          early_exit, replicas, ray_address, backend, backend_url, backend_top_n,
          backend_model, wisv_head, wisv_strict, wisv_relaxed, wisv_max_per_block,
          wisv_guard):
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

    Scale-out: --replicas N runs N verifier replicas on Ray Serve (local cluster, or
    --ray-address); a replica that dies is restarted by Serve and costs its sessions a
    re-creation from the confirmed prefix (the SDK does it). Streamed verify answers
    carry the final verdict only; /generate (target-only streaming) is single-server
    only.

    Serving engines: --backend sglang|vllm --backend-url URL verifies through the
    engine's scores (it holds the weights and the prefix cache; this server holds the
    sessions, signatures and the acceptance rule), e.g.

    \b
      specrelay serve --model qwen2.5-coder-1.5b --backend sglang \\
        --backend-url http://gpu-box:30000
    """
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    check_backend_options(backend, backend_url, backend_top_n, backend_model, replicas,
                          ray_address, early_exit, wisv_head)
    if free_rows is not None and backend != "torch":
        raise click.BadParameter("token trees need the torch verifier (--backend torch)",
                                 param_hint="--free-rows")
    if row_invariant != "exact" and (backend != "torch" or replicas > 1 or ray_address):
        raise click.BadParameter("the single torch verifier only (--backend torch, "
                                 "--replicas 1)", param_hint="--row-invariant")
    _check_ports(host, port, metrics_host, metrics_port)
    check_wisv_options(wisv_head, wisv_strict, wisv_relaxed)
    from cloud_api.exit_select import check_setting

    try:
        check_setting(early_exit)                    # before the target loads
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--early-exit") from None
    import logging

    from aiohttp import web

    from edge_sdk.models import resolve_dtype

    store, auth = None, "NONE (--insecure-no-auth: requests are not authenticated)"
    if not insecure_no_auth:
        store, auth = _open_key_store(keys_db)
    ssl_ctx = _tls_context(tls_cert, tls_key)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    metrics_address = None if metrics_port is None else (metrics_host, metrics_port)
    kw = {"model": model, "dtype": dtype, "threads": threads, "max_batch": max_batch,
          "max_wait_ms": max_wait_ms, "store": store, "unauth_rpm": unauth_rpm,
          "metrics_address": metrics_address}
    if free_rows is not None:
        kw["free_rows"] = free_rows
    if row_invariant != "exact":
        kw["row_invariant"] = row_invariant
    wisv = {"head": wisv_head, "strict": wisv_strict, "relaxed": wisv_relaxed,
            "max_per_block": wisv_max_per_block, "guard": wisv_guard}
    engine = None if backend == "torch" else {
        "backend": backend, "url": backend_url, "served": backend_model,
        "top_n": backend_top_n or DEFAULT_TOP_N}
    app, where, note = _build_app(replicas, ray_address, early_exit, wisv, engine, kw)
    metrics = f"; metrics on http://{metrics_host}:{metrics_port}/metrics" if \
        metrics_port else ""
    shown = resolve_dtype(dtype) if engine is None else engine_dtype(dtype)
    click.echo(f"serving {model} ({shown}) on "
               f"{'https' if ssl_ctx else 'http'}://{host}:{port}{where}; auth: {auth}"
               f"{note}{metrics}", err=True)
    # our structured access log replaces aiohttp's (which would log user agents etc.)
    web.run_app(app, host=host, port=port, ssl_context=ssl_ctx, shutdown_timeout=30,
                access_log=None, print=None)
