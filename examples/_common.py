"""Helpers shared by the examples: connect to a running ``specrelay serve`` or start a
signed verification server in this process (like ``specrelay demo``)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # no "Loading weights" bar

#: seconds a round waits for an unreachable cloud before the example gives up
OFFLINE_TIMEOUT_S = 10.0


def int_range(lo: int, hi: int):
    """An argparse ``type``: an integer in ``lo..hi`` (else argparse's usage error)."""
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is not in the range {lo}..{hi}")
        return v
    return parse


@dataclass
class Backend:
    """Where the cloud is and how to sign for it."""

    url: str
    signer: object | None
    api_key: str | None = None


@contextlib.contextmanager
def local_server(target, tokenizer) -> Iterator[Backend]:
    """A signed verification API for ``target`` on a loopback port, with an ephemeral
    in-memory API key (what ``specrelay demo`` does)."""
    from cloud_api.local import local_server as serve

    with serve(target, tokenizer, name="example-ephemeral") as srv:
        yield Backend(srv.url, srv.signer, srv.api_key)


class ExampleError(Exception):
    """Something the user can fix (no server at --url, a refused key): one line."""


def check_server(url: str, api_key: str | None) -> None:
    """Fail fast, before any model loads: ``url`` answers ``/healthz`` and, with a key,
    accepts it (:func:`edge_sdk.check_api`).

    Raises:
        ExampleError: nothing answers, it is not the API, or the key is refused.
    """
    import asyncio

    from edge_sdk.preflight import check_api
    from edge_sdk.protocol.signing import InvalidApiKey
    from edge_sdk.results import CloudUnreachable
    from edge_sdk.transport import RemoteError, TLSVerifyError

    try:
        asyncio.run(check_api(url, api_key))
    except InvalidApiKey as e:
        raise ExampleError(f"{e}: check --api-key / SPECRELAY_API_KEY") from None
    except (CloudUnreachable, ValueError) as e:
        raise ExampleError(str(e)) from None
    except (TLSVerifyError, OSError) as e:
        raise ExampleError(f"cannot reach {url}: {str(e).splitlines()[0] if str(e) else e!r}"
                           ) from None
    except RemoteError as e:
        if e.status in (401, 403):
            raise ExampleError(f"the API refused the key: {e}") from None
        raise ExampleError(f"{url} is not a specrelay API ({e})") from None


def run_main(main) -> None:
    """Run an example's ``main()``; errors a user can fix end in one ``Error:`` line
    on stderr and exit status 1."""
    import sys

    from edge_sdk.client import CloudUnreachable
    from edge_sdk.transport import RemoteError, TLSVerifyError

    try:
        main()
    except (ExampleError, CloudUnreachable, RemoteError, TLSVerifyError,
            FileNotFoundError, ValueError) as e:   # ValueError: a bad sampling value
        print(f"Error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)


@contextlib.contextmanager
def backend(url: str | None, api_key: str | None, target: str, tokenizer,
            log=print) -> Iterator[Backend]:
    """``url`` given: that server (signed with ``api_key`` when given). Else load
    ``target`` and serve it in-process."""
    if url:
        from edge_sdk.protocol.signing import Signer

        yield Backend(url, Signer.from_api_key(api_key) if api_key else None, api_key)
        return
    from edge_sdk.models import load_model

    log(f"loading target {target} (in-process signed server) ...")
    from edge_sdk.packed import packed_default

    tmodel, _ = load_model(target, dtype="auto", packed=packed_default())
    with local_server(tmodel, tokenizer) as b:
        yield b


def load_draft(name: str | None, target: str | None = None):
    """``(TorchDrafter, tokenizer)`` for a draft name (default: the draft paired with
    ``target``, ``edge_sdk.models.default_draft``)."""
    from exporters.onnx.first_use import build_drafter
    from edge_sdk.models import DEFAULT_TARGET, default_draft, load_tokenizer

    drafter, tok = build_drafter(name or default_draft(target), dtype="auto")
    return drafter, tok or load_tokenizer(target or DEFAULT_TARGET)
