"""Helpers shared by the examples: connect to a running ``specrelay serve`` or start a
signed verification server in this process (like ``specrelay demo``)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
    tmodel, _ = load_model(target, dtype="auto")
    with local_server(tmodel, tokenizer) as b:
        yield b


def load_draft(name: str | None, target: str | None = None):
    """``(TorchDrafter, tokenizer)`` for a draft name (default: the draft paired with
    ``target``, ``edge_sdk.models.default_draft``)."""
    from exporters.onnx.first_use import build_drafter
    from edge_sdk.models import DEFAULT_TARGET, default_draft, load_tokenizer

    drafter, tok = build_drafter(name or default_draft(target), dtype="auto")
    return drafter, tok or load_tokenizer(target or DEFAULT_TARGET)
