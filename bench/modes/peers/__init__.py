"""Peer engines in ``specrelay bench``: llama.cpp and transformers, measured in the same run.

Registered bench modes (imported on the first :func:`bench.modes.get_mode` /
``mode_names`` lookup, never by ``import edge_sdk``):

* ``llamacpp-ar`` (baseline) — llama.cpp, the target GGUF alone, greedy/sampled as the
  run asks, through ``xllamacpp`` (llama.cpp's C++ server compiled into a Python
  extension, in process; it also listens on ``127.0.0.1``, on a free port, unused).
* ``llamacpp-spec`` — llama.cpp's own draft-model speculative decoding
  (``COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE``, the run's draft GGUF as the draft model,
  llama.cpp's default draft length and thresholds unless ``mode_options`` say
  otherwise: ``n_max``, ``n_min``, ``p_min``).
* ``hf-ar`` (baseline) — transformers ``model.generate`` with the target alone.
* ``hf-assisted`` — transformers assisted generation, ``generate(...,
  assistant_model=draft)`` (transformers' default assistant schedule).

The transformers pair is loaded with :func:`edge_sdk.models.load_model` in the run's
``--dtype`` (the same weights and dtype as our cloud's target); llama.cpp runs the GGUF
files themselves (Q4_K_M for the Qwen presets), so its greedy tokens may part from the
target's at near-ties: peers are left out of ``greedy_outputs_identical`` and reported in
``config.peer_greedy_agreement`` instead (:func:`bench.report.identity.greedy_agreement`).

Fairness: the same encoded prompts (the runner applies the chat template with
:func:`edge_sdk.models.encode_prompt`), ``max_new_tokens`` and sampling as our modes;
every peer computation runs on ONE worker thread pinned to the peers' CPUs
(``RunSetup.peer_cpus``, ``os.sched_setaffinity`` on that thread) with their thread
count (llama.cpp ``n_threads`` for target and draft, torch threads for transformers):
the cloud's CPUs and thread count unless ``--peer-cpus`` / ``--peer-threads`` name
others (a peer on both cores of the box against our 1 cloud + 1 edge core); the
threads llama.cpp / OpenMP start from it inherit its CPUs. Peers do
not cross the link emulator: they measure a single box, so their numbers repeat in every
profile up to noise. Models load once per bench run, on first use (the warm-up
request), and are freed by :meth:`~bench.modes.base.BenchMode.teardown_run`.

Metrics: the report's per-request fields (``committed_tokens``, ``wall_s``, ``ttft_s``,
``decode_s``; transformers: ``token_times_s`` from its streamer; llama.cpp: TTFT and
TPOT from its own timings; throughput = tokens / wall time, prefill included, as for
our modes) plus ``engine_timings``: llama.cpp's own ``timings``
(``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``prompt_per_second``,
``predicted_per_second``, ``draft_n``, ``draft_n_accepted``), transformers' target and
draft forward counts. Run level (:meth:`~bench.modes.peers.engine.PeerMode.run_metrics`): ``engine_prompt_tok_s``
and ``engine_eval_tok_s`` (llama.cpp's prompt / eval tokens per second over the cell),
``engine_config`` (engine, threads, CPUs, models, speculative settings). Speculative
gain rows (``llamacpp-spec`` / ``llamacpp-ar``, ``hf-assisted`` / ``hf-ar``) come from
:func:`bench.report.ratios.ratio_specs` (``gain_baseline``).

Install: ``pip install -c constraints.txt -e ".[bench]"`` (the ``xllamacpp`` wheel).
"""
from __future__ import annotations

from bench.modes.peers.engine import INSTALL_HINT, PeerUnavailable, require_xllamacpp
from bench.modes.registry import MODES

# the engines register on import, in this order (``--list-modes`` order)
from bench.modes.peers.llamacpp import LlamaCppARMode, LlamaCppSpecMode  # noqa: I001
from bench.modes.peers.hf import HFARMode, HFAssistedMode

__all__ = ["PeerUnavailable", "require_xllamacpp", "INSTALL_HINT", "LlamaCppARMode",
           "LlamaCppSpecMode", "HFARMode", "HFAssistedMode", "gain_pairs", "PEER_MODES"]

PEER_MODES = ("llamacpp-ar", "llamacpp-spec", "hf-ar", "hf-assisted")


def gain_pairs() -> dict[str, str]:
    """``{speculative peer mode: its engine's target-only mode}``."""
    return {n: c.gain_baseline for n, c in MODES.items()
            if getattr(c, "peer", False) and getattr(c, "gain_baseline", None)}
