"""The plan of a bench run: its profiles, sampling variants and requests, and the cells
(mode x profile x workload x sampling, and concurrency for the concurrent modes) in the
order they run."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from bench.config import DEFAULT_CONCURRENCY, SAMPLING_PRESETS, BenchConfig
from bench.linkem.profiles import PROFILES, Profile
from bench.modes.base import BenchRequest
from bench.report.labels import SLOW_SUFFIX, split_contention, workload_label
from specrelay_data.workloads import Prompt, load_workload

__all__ = ["Cell", "sampling_config", "profile", "encode_requests", "concurrency_values",
           "is_concurrent", "requests_per_cell", "cell_prompts", "plan_cells"]


@dataclass(frozen=True)
class Cell:
    """One measured cell: the profile's name, workload, sampling variant, mode class,
    concurrency (None: a sequential mode), its requests and tokens per request."""

    profile: str
    workload: str
    sampling: str
    mode: type
    concurrency: int | None
    requests: list
    max_new_tokens: int


def sampling_config(name: str):
    """The :class:`SamplingConfig` of a preset name. Raises ValueError for an unknown one."""
    from edge_sdk.protocol.sampling import SamplingConfig

    try:
        return SamplingConfig(**SAMPLING_PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown sampling variant {name!r}; choose from "
                         f"{sorted(SAMPLING_PRESETS)}") from None


def profile(p) -> Profile:
    """A profile by name; ``<name>+slow`` is that link under edge contention
    (:mod:`bench.contention`). Raises ValueError for an unknown name."""
    if isinstance(p, Profile):
        return p
    base, slow = split_contention(p)
    try:
        prof = PROFILES[base]
    except KeyError:
        raise ValueError(f"unknown profile {p!r}; choose from {list(PROFILES)} "
                         f"(+ '{SLOW_SUFFIX}' for the edge-contention variant)") from None
    return dataclasses.replace(prof, name=p) if slow else prof


def encode_requests(tok, prompts: list[Prompt], label: str, seed: int) -> list[BenchRequest]:
    """The prompts encoded (chat template for chat prompts), request ``i`` seeded
    ``seed * 1000 + i``."""
    from edge_sdk.models import encode_prompt

    return [BenchRequest(p.id, label, tuple(encode_prompt(tok, p.text, p.kind == "chat")),
                         seed * 1000 + i) for i, p in enumerate(prompts)]


def is_concurrent(mode_cls) -> bool:
    return bool(getattr(mode_cls, "concurrent", False))


def concurrency_values(cfg: BenchConfig) -> list[int]:
    """The run's concurrency values, deduplicated in order. Raises ValueError below 1."""
    vals = [int(c) for c in (cfg.concurrency or [DEFAULT_CONCURRENCY])]
    if not vals or min(vals) < 1:
        raise ValueError("concurrency values must be >= 1")
    return list(dict.fromkeys(vals))


def requests_per_cell(prompts: int, concurrency: int) -> int:
    """Requests in a concurrent cell: whole waves of C, at least ``prompts``
    (``C * ceil(prompts / C)``), so every lane stays busy until the last wave."""
    c = max(1, int(concurrency))
    return c * max(1, math.ceil(int(prompts) / c))


def cell_prompts(prompts: Sequence, n: int, more: Sequence | None = None) -> list:
    """``n`` prompts for a concurrent cell: the first ``n`` of ``more`` (a longer list
    from the same workload, same order) or of ``prompts``, cycled when too short (a
    repeated prompt's id suffixed ``#k``, the k-th repeat)."""
    src = list(more) if more is not None and len(more) > len(prompts) else list(prompts)
    if not src:
        return []
    out = []
    for i in range(n):
        p, k = src[i % len(src)], i // len(src)
        out.append(p if k == 0 else dataclasses.replace(p, id=f"{p.id}#{k}"))
    return out


def _concurrent_cells(cfg: BenchConfig, prof: Profile, w: str, s: str, mcls, conc, tok,
                      prompt_sets: dict, more: dict) -> list[Cell]:
    """One cell per concurrency value C, on ``C * ceil(prompts / C)`` requests (more
    prompts from the same workload, loaded once into ``more``, else the prompts
    cycled)."""
    max_new_c = cfg.concurrent_max_new_tokens or cfg.max_new_tokens
    out = []
    for c in conc:
        n = requests_per_cell(len(prompt_sets[w]), c)
        if cfg.prompt_sets is None and n > len(prompt_sets[w]) and w not in more:
            more[w] = load_workload(w, None, cfg.seed)
        prompts = cell_prompts(prompt_sets[w], n, more.get(w))
        out.append(Cell(prof.name, w, s, mcls, c, encode_requests(
            tok, prompts, workload_label(w, s, cfg.sampling), cfg.seed), max_new_c))
    return out


def plan_cells(cfg: BenchConfig, mode_classes, profiles, pairs, prompt_sets, tok,
               reqs) -> list[Cell]:
    """The run's cells in order: per profile, per (workload, sampling) pair of ``pairs``,
    per mode. Sequential modes run the workload's prompts (``reqs[(w, s)]``) one after
    another; concurrent modes run once per concurrency value (:func:`_concurrent_cells`),
    restricted to ``cfg.concurrent_profiles`` / ``concurrent_workloads``;
    ``cfg.mode_profiles`` / ``mode_workloads`` restrict single modes; a ``greedy_only``
    mode (``wisv``) skips the sampled variants. Raises ValueError for a concurrency value
    below 1."""
    conc = concurrency_values(cfg)
    cprof = set(cfg.concurrent_profiles) if cfg.concurrent_profiles else None
    cwork = set(cfg.concurrent_workloads) if cfg.concurrent_workloads else None
    mprof, mwork = cfg.mode_profiles or {}, cfg.mode_workloads or {}
    more: dict = {}
    cells = []
    for prof in profiles:
        for (w, s) in pairs:
            for mcls in mode_classes:
                if (mcls.name in mprof and prof.name not in mprof[mcls.name]) or \
                        (mcls.name in mwork and w not in mwork[mcls.name]):
                    continue
                if getattr(mcls, "greedy_only", False) and \
                        SAMPLING_PRESETS.get(s, {}).get("temperature", 1.0) != 0:
                    continue
                if not is_concurrent(mcls):
                    cells.append(Cell(prof.name, w, s, mcls, None, reqs[(w, s)],
                                      cfg.max_new_tokens))
                elif (cprof is None or prof.name in cprof) and \
                        (cwork is None or w in cwork):
                    cells += _concurrent_cells(cfg, prof, w, s, mcls, conc, tok,
                                               prompt_sets, more)
    return cells
