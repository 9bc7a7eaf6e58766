"""What a bench run measures: :class:`BenchConfig`, the sampling presets and the
``--quick`` preset (:data:`QUICK`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from bench.linkem.profiles import PROFILES

__all__ = ["BenchConfig", "SAMPLING_PRESETS", "QUICK", "DEFAULT_CONCURRENCY"]

DEFAULT_CONCURRENCY = 8
"""Concurrency of the concurrent modes when none is configured."""

SAMPLING_PRESETS = {"greedy": {"temperature": 0.0}, "sample": {"temperature": 0.7, "top_p": 0.9}}
"""Sampling variants by name (``SamplingConfig`` fields)."""


@dataclass
class BenchConfig:
    """What to measure. Times in seconds, lengths in tokens.

    Attributes:
        modes: registered mode names (``bench.modes.MODES``).
        profiles: profile names of ``linkem.PROFILES`` or :class:`Profile` objects.
        workloads: ``"mtbench"`` / ``"humaneval"``.
        sampling: variants from :data:`SAMPLING_PRESETS` (``"greedy"``, ``"sample"``).
        prompts: prompts per workload. seed: prompt shuffle and request seeds.
        max_new_tokens: tokens generated per request. depth: draft depth.
        concurrent_depth: draft depth of the concurrent modes (None: ``depth``).
        target, draft: model sources: a ``load_model`` spec string (preset, path,
            ``name@N``) or a picklable zero-argument callable returning
            ``(model, tokenizer)``; ``draft=None`` picks the CLI's default draft.
        dtype: torch dtype name for both models.
        cloud_cpus, edge_cpus: CPU ids for each side (None: split what is available).
        cloud_threads, edge_threads: torch threads per side (None: number of CPUs).
        peer_cpus, peer_threads: CPU ids and threads of the peer engines (None: the
            cloud's CPUs; threads: the number of ``peer_cpus`` if given, else the
            cloud's). Raises ValueError (at the run's start) for a CPU not available.
        auth: sign requests with an ephemeral key (False: unauthenticated server).
        edge_slowdown: factor (>= 1) on each draft forward after ``slowdown_at_s``.
        slowdown_at_s: seconds after the start of each run when contention starts.
        edge_load: busy processes pinned to the edge CPUs from ``slowdown_at_s`` on.
        warmup: one short unmeasured request per mode before measuring.
        prompt_sets: explicit prompts per workload name (tests); overrides loading.
        server_kw: extra ``create_app``/``CloudService`` options (max_batch, ...).
        mode_options: per-mode options (``EdgeContext.options``), by mode name.
        concurrency: requests in flight for the concurrent modes (``pipeline``,
            ``no-pipeline``, ``runahead``, ``standard-sd-concurrent``,
            ``pipeline-standard``: ``concurrent = True``); each runs once
            per value, reported under the profile label ``<profile>@c<C>``, with
            ``C * ceil(prompts / C)`` requests per cell. None: [8]. Sequential modes
            ignore it.
        concurrent_profiles, concurrent_workloads: restrict the concurrent modes to
            these profiles / workloads (None: all of the run's).
        concurrent_max_new_tokens: tokens per request in concurrent cells (None:
            ``max_new_tokens``).
        mode_profiles, mode_workloads: per mode name, the profiles / workloads it runs
            on (None, or a mode not listed: all of the run's).
    """

    modes: list = field(default_factory=lambda: ["cloud-ar", "standard-sd", "specrelay",
                                                 "sr-ahead"])
    profiles: list = field(default_factory=lambda: list(PROFILES))
    workloads: list = field(default_factory=lambda: ["mtbench", "humaneval"])
    sampling: list = field(default_factory=lambda: ["greedy", "sample"])
    prompts: int = 5
    seed: int = 0
    max_new_tokens: int = 64
    depth: int = 4
    target: object = "qwen2.5-coder-1.5b"
    draft: object = None
    dtype: str = "auto"
    cloud_cpus: Sequence[int] | None = None
    edge_cpus: Sequence[int] | None = None
    cloud_threads: int | None = None
    edge_threads: int | None = None
    peer_cpus: Sequence[int] | None = None
    peer_threads: int | None = None
    auth: bool = True
    edge_slowdown: float = 1.0
    slowdown_at_s: float = 0.0
    edge_load: int = 0
    warmup: bool = True
    prompt_sets: dict | None = None
    server_kw: dict = field(default_factory=dict)
    mode_options: dict = field(default_factory=dict)
    concurrency: list | None = None
    concurrent_profiles: list | None = None
    concurrent_workloads: list | None = None
    concurrent_max_new_tokens: int | None = None
    concurrent_depth: int | None = None
    mode_profiles: dict | None = None
    mode_workloads: dict | None = None


_QUICK_BASIC = ["cloud-ar", "standard-sd", "sr-paced"]       # medium
_QUICK_FIXED = ["caac", "stop-and-wait"]                      # medium and medium+slow
_QUICK_SLOW = ["fixed-3", "ipdg", "ipdg-skip", "npdg"]          # medium+slow, at --depth
_QUICK_PEERS = ["llamacpp-ar", "llamacpp-spec"]               # medium
_QUICK_CONCURRENT = ["pipeline", "no-pipeline"]               # weak, 8 requests
QUICK = dict(modes=_QUICK_BASIC + _QUICK_FIXED + _QUICK_SLOW + _QUICK_PEERS
             + _QUICK_CONCURRENT,
             profiles=["medium", "medium+slow", "weak"],
             workloads=["humaneval"],
             sampling=["greedy"], prompts=4, max_new_tokens=32, concurrency=[8],
             concurrent_profiles=["weak"], concurrent_workloads=["humaneval"],
             concurrent_max_new_tokens=32, concurrent_depth=1,
             edge_slowdown=3.0, slowdown_at_s=3.0,
             mode_profiles={**{m: ["medium"] for m in _QUICK_BASIC + _QUICK_PEERS},
                            **{m: ["medium", "medium+slow"] for m in _QUICK_FIXED},
                            **{m: ["medium+slow"] for m in _QUICK_SLOW}},
             mode_workloads=None)
"""``--quick`` settings (the default pair; 4 greedy HumanEval prompts x 32 tokens per
cell, 15 cells). On ``medium``: the target alone (``cloud-ar``), ``standard-sd``, the
SDK's default (``sr-paced``: the paced depth + IPDG + blocks sent ahead) and the
llama.cpp peers. On ``medium`` and ``medium+slow`` (3x slower draft forwards from 3 s
into each run): CAAC and stop-and-wait at ``--depth`` (on ``medium`` the best fixed
depth in every run on this pair: fixed depths 3 and 5 measured 0.79-0.92x of it). On
``medium+slow`` only: fixed depth 3 (the best fixed depth there in one run of three),
IPDG (also skipping branches predicted to miss: ``ipdg-skip``) and NPDG at ``--depth`` --
only there can a verdict arrive while a proactive branch is still being drafted, so only
there does IPDG's interruption act (on ``medium`` every proactive branch is finished
before its verdict: IPDG/NPDG 0.99-1.01x there). The confirmed-prefix pipeline and its
strongest baseline, ``no-pipeline`` (the strongest in 3 of the 4 runs with all three on
this pair; ``runahead`` was 2 % above it in the fourth and 1-3 % below in the others,
``standard-sd-concurrent`` the weakest in all four), at 8 concurrent requests x 32
tokens, depth 1, on ``weak``. Ratio rows: uplink vs standard-sd and throughput vs
cloud-ar (the SDK's default), caac vs best-fixed, ipdg and ipdg-skip vs npdg /
stop-and-wait, pipeline vs the strongest baseline, and each peer's speculative gain.
Until 2026-12-06 it also ran fixed depths 3 and 5 on ``medium``, sr-paced and the
proactive modes on the other profile, ``runahead`` and ``standard-sd-concurrent`` (24
cells, 14.9 min on a 2-core AMX Xeon); ``--modes`` and ``--profiles`` still run any of
them. ``specrelay`` (stop-and-wait at ``--depth``) is the ``stop-and-wait`` row here: the
same client, not run twice. Its wall time on that box: see the README."""
