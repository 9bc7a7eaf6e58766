"""specrelay edge SDK: draft locally, verify in the cloud, get the target's exact output.

Public API: :class:`EdgeClient`, :class:`GenerationResult`, :class:`TokenEvent`,
:class:`CloudUnreachable`, :class:`RemoteError` (the API refused a request),
:class:`SamplingConfig`, :func:`check_api` (is the API up, is the key accepted: before
loading a model), :func:`generate` (synchronous convenience wrapper). Names load on first use, so ``import edge_sdk.protocol`` (what the
cloud shares with the edge) does not load the client.
"""

from __future__ import annotations

import importlib

__all__ = ["EdgeClient", "GenerationResult", "TokenEvent", "SamplingConfig", "generate",
           "CloudUnreachable", "RemoteError", "check_api"]

_LAZY = {"EdgeClient": "edge_sdk.client", "GenerationResult": "edge_sdk.client",
         "TokenEvent": "edge_sdk.client", "CloudUnreachable": "edge_sdk.client",
         "SamplingConfig": "edge_sdk.protocol.sampling",
         "RemoteError": "edge_sdk.transport", "check_api": "edge_sdk.preflight"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'edge_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def generate(base_url: str, drafter, tokenizer, prompt: str, **kw):
    """Run one generation synchronously (``asyncio.run``); see :meth:`EdgeClient.generate`.
    Client options (depth, mode, signer, ...) and request options may be mixed in ``kw``.
    Returns a :class:`GenerationResult`."""
    import asyncio
    import inspect

    from edge_sdk.client import EdgeClient

    client_keys = set(inspect.signature(EdgeClient).parameters) - {"base_url", "drafter",
                                                                   "tokenizer"}
    ckw = {k: kw.pop(k) for k in list(kw) if k in client_keys}

    async def run():
        async with EdgeClient(base_url, drafter, tokenizer, **ckw) as c:
            return await c.generate(prompt, **kw)

    return asyncio.run(run())
