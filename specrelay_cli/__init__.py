"""``specrelay`` command line: serve, generate, demo, edge-serve, keys, export, draft, bench,
fsd, wisv.

The group :data:`main` and its error policy live here; each command lives in its own
module (``serve``, ``generate`` with ``demo``, ``edge_serve``, ``fsd``, ``wisv``) or in its package
(``cloud_api.keys_cli``, ``exporters.cli``, ``exporters.distill``, ``bench.cli``).
Run as ``specrelay`` or ``python -m specrelay_cli``."""

from __future__ import annotations

import os

import click

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # no "Loading weights" bar

from bench.cli import bench  # noqa: E402
from cloud_api.keys_cli import keys  # noqa: E402
from exporters.cli import export  # noqa: E402
from specrelay_cli import edge_serve, fsd, generate, serve, wisv  # noqa: E402
from specrelay_cli.lazy import LazyGroup  # noqa: E402

__all__ = ["main", "EXTRA_OF_MODULE"]

EXTRA_OF_MODULE = {"onnxruntime": "edge", "onnx": "export", "onnxscript": "export",
                   "limits": "cloud", "prometheus_client": "cloud", "matplotlib": "bench",
                   "xllamacpp": "bench", "tensorrt": "jetson", "ray": "ray"}
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
    from edge_sdk.protocol.signing import InvalidApiKey

    if isinstance(e, InvalidApiKey):
        return f"{e}: check --api-key / SPECRELAY_API_KEY"
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

    def parse_args(self, ctx, args):
        # ``specrelay generate ... --debug`` works like ``specrelay --debug generate ...``
        if "--debug" in args[1:]:
            args = ["--debug"] + [a for a in args if a != "--debug"]
        return super().parse_args(ctx, args)

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


def _log_to_stderr(debug: bool) -> None:
    """One-time steps (GGUF assembly and dequantisation, draft export) say what they do:
    the ``edge_sdk`` logger prints bare messages on stderr (stdout stays the result)."""
    import logging

    lg = logging.getLogger("edge_sdk")
    if not any(getattr(h, "_specrelay", False) for h in lg.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        h._specrelay = True
        lg.addHandler(h)
    lg.setLevel(logging.DEBUG if debug else logging.INFO)
    lg.propagate = False


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
    _log_to_stderr(debug)


def _distill_command() -> click.Command:
    from exporters.distill.cli import distill_command   # imports torch: only when used

    return distill_command


@main.group(cls=LazyGroup, lazy={"distill": _distill_command})
def draft():
    """Create draft models for a target."""


main.add_command(serve.serve)
main.add_command(generate.generate)
main.add_command(generate.demo)
main.add_command(edge_serve.edge_serve, "edge-serve")
main.add_command(keys)
main.add_command(export)
main.add_command(bench)
main.add_command(fsd.fsd)
main.add_command(wisv.wisv)
