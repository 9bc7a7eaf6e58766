"""Benchmark modes: how the edge produces a completion, behind one pluggable registry.

One mode family per file:

* :mod:`~bench.modes.baselines` — ``cloud-ar`` (the target alone, streamed) and
  ``standard-sd`` (full draft distribution on the uplink);
* :mod:`~bench.modes.speculative` — ``specrelay``, ``sr-ahead`` (the compact protocol);
* :mod:`~bench.modes.wisv` — ``wisv`` (the compact protocol with WISV's lossy semantic
  acceptance, greedy only);
* :mod:`~bench.modes.adaptive` — depth controllers, proactive drafting, fixed depths;
* :mod:`~bench.modes.concurrent` — C requests in flight: ``pipeline`` and its baselines;
* :mod:`~bench.modes.local` — ``local-offload-ar`` and ``cats``: the target on the
  device under a memory budget (no cloud; run by :mod:`bench.local.run`);
* :mod:`~bench.modes.peers` — llama.cpp and transformers (registered on the first mode
  lookup, not on import).

The machinery: :mod:`~bench.modes.base` (the contract), :mod:`~bench.modes.registry`,
:mod:`~bench.modes.measure` (HTTP exchanges, link bytes, latency breakdown),
:mod:`~bench.modes.edge_rounds` (the shared EdgeClient mechanism),
:mod:`~bench.modes.cloud_stream` (the streaming target-only client).

Adding a mode (CAAC, IPDG, a multi-request pipeline, ...)::

    @register_mode
    class MyMode(BenchMode):
        name = "my-mode"
        description = "..."
        async def run_request(self, req: BenchRequest) -> RequestRecord: ...

:meth:`BenchMode.run` (sequential by default) may be overridden to run many requests
concurrently; such a mode should put ``start_s``/``end_s`` in each request's metrics so
throughput is computed over the makespan.
"""
from bench.modes.base import BenchMode, BenchRequest, EdgeContext, RequestRecord, RunSetup
from bench.modes.registry import MODES, get_mode, mode_names, register_mode

# the built-in families register on import, in this order (``--list-modes`` order)
from bench.modes import baselines, speculative, wisv, adaptive, concurrent, local  # noqa: E402,F401,I001

__all__ = ["EdgeContext", "BenchRequest", "RequestRecord", "RunSetup", "BenchMode",
           "MODES", "register_mode", "get_mode", "mode_names"]
