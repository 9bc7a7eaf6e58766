"""An in-process signed verification API on a loopback port, with an ephemeral key.

What ``specrelay demo``, the examples and the load test run when no server is given:
the real app (:func:`cloud_api.app.create_app`, request signing and rate limits on)
served by :class:`cloud_api.server.BackgroundServer`, with one key created in an
in-memory key store for the lifetime of the server. The key is never written anywhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class LocalServer:
    """A running in-process API: ``url`` (``http://127.0.0.1:<port>``), the ``signer``
    for its ephemeral key, the raw ``api_key`` (``sr_live_...``), the ``app`` and the
    :class:`~cloud_api.server.BackgroundServer` (``server.loop`` is its event loop)."""

    url: str
    signer: object
    api_key: str
    app: object
    server: object = None


def ephemeral_key_store(name: str = "local-ephemeral", *, rpm: int = 100_000,
                        tpm: int = 10_000_000):
    """``(store, raw_key)``: an in-memory :class:`~cloud_api.keys.SQLiteKeyStore` with
    one key of scope ``verify`` and the given limits (requests / tokens per minute)."""
    from cloud_api.keys import SQLiteKeyStore

    store = SQLiteKeyStore(":memory:")
    _, raw_key = store.create(name, scopes=("verify",), rpm=rpm, tpm=tpm)
    return store, raw_key


@contextlib.contextmanager
def local_server(target, tokenizer, *, name: str = "local-ephemeral", rpm: int = 100_000,
                 tpm: int = 10_000_000, preset: str | None = None,
                 **app_kw) -> Iterator[LocalServer]:
    """Serve ``target`` (a loaded HF causal LM) signed, on a free loopback port.

    Args:
        target, tokenizer: the target model and its tokenizer.
        name, rpm, tpm: the ephemeral key's name and rate limits.
        app_kw: further :func:`cloud_api.app.create_app` options (``max_batch``,
            ``early_head``, ``semantic``: a :class:`cloud_api.wisv.serving.
            SemanticAcceptance` so that semantic sessions (WISV) run in this process;
            :func:`cloud_api.wisv.serving.semantic_for` builds one from a head file),
            or the ``serve`` options ``wisv_head`` (PATH, ``auto``: the shipped head of
            ``preset``, ``off``), ``wisv_strict``, ``wisv_relaxed``,
            ``wisv_max_per_block``.
        preset: the target's preset name (for ``wisv_head="auto"``).
    Yields:
        A :class:`LocalServer`; the server stops (in-flight requests finish) on exit.
    Raises:
        ValueError: a WISV head that cannot be loaded (one line naming the file).
    """
    from cloud_api.app import create_app
    from cloud_api.server import BackgroundServer
    from edge_sdk.protocol.signing import Signer

    from cloud_api.wisv.serving import take_options

    app_kw = take_options(app_kw, target, preset)
    store, raw_key = ephemeral_key_store(name, rpm=rpm, tpm=tpm)
    app = create_app(target, tokenizer, key_store=store, **app_kw)
    with BackgroundServer(app) as srv:
        yield LocalServer(srv.url, Signer.from_api_key(raw_key), raw_key, app, srv)
