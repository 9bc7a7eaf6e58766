"""specrelay edge SDK: draft locally, verify in the cloud, get the target's exact output.

Public API: :class:`EdgeClient`, :class:`GenerationResult`, :class:`TokenEvent`,
:class:`SamplingConfig`, :func:`generate` (synchronous convenience wrapper).
"""

from edge_sdk.client import CloudUnreachable, EdgeClient, GenerationResult, TokenEvent
from edge_sdk.protocol.sampling import SamplingConfig

__all__ = ["EdgeClient", "GenerationResult", "TokenEvent", "SamplingConfig", "generate",
           "CloudUnreachable"]


def generate(base_url: str, drafter, tokenizer, prompt: str, **kw) -> GenerationResult:
    """Run one generation synchronously (``asyncio.run``); see :meth:`EdgeClient.generate`.
    Client options (depth, mode, signer, ...) and request options may be mixed in ``kw``."""
    import asyncio
    import inspect

    client_keys = set(inspect.signature(EdgeClient).parameters) - {"base_url", "drafter",
                                                                   "tokenizer"}
    ckw = {k: kw.pop(k) for k in list(kw) if k in client_keys}

    async def run():
        async with EdgeClient(base_url, drafter, tokenizer, **ckw) as c:
            return await c.generate(prompt, **kw)

    return asyncio.run(run())
