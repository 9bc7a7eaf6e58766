"""``specrelay bench --chaos``: load the pair, serve the target signed in-process, run
the fault matrix through the fault proxy, write ``chaos.json`` / ``chaos.md``.

Presets (:data:`PRESETS`; explicit ``--prompts``, ``--max-new-tokens``, ``--depth``,
``--sampling`` override them):

* ``quick`` (<= 5 minutes on 2 quiet cores with the small pair): 1 HumanEval prompt
  (its first 32 tokens) per sequential mode (the pipeline: 8), 12 new tokens, one fault per run (the 2nd matching
  request), the 30 s partition replaced by a 5 s one (noted in the table), one row on
  correction requests (the first dropped three times: the round is redone);
* ``full``: 3 prompts (first 64 tokens), 48 new tokens, faults on the 2nd and 5th
  matching requests (correction requests: the 1st and 3rd), every kind on correction
  requests too.

Both: greedy and seeded sampling (temperature 0.7, top-p 0.9), draft depth 4, the
client's per-request timeout 3 s, 2 transport retries, ``offline_timeout_s`` 60 s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from bench.chaos.faults import fault_matrix
from bench.chaos.matrix import PIPELINE, ChaosSettings, Server, run_matrix
from bench.chaos.report import print_table, write_outputs

__all__ = ["PRESETS", "ChaosFailed", "run_chaos", "select", "settings_for"]

PRESETS = {"quick": dict(prompts=1, max_new_tokens=12, at=(2,), prompt_tokens=32),
           "full": dict(prompts=3, max_new_tokens=48, at=(2, 5), prompt_tokens=64)}


class ChaosFailed(Exception):
    """A run lost or duplicated tokens, or raised an undocumented exception."""


def _prompts(tok, n: int, seed: int, length: int = 64) -> list[list[int]]:
    """``n`` HumanEval prompts (completion prompts, no chat template) as token ids, each
    cut to its first ``length`` tokens: the faults do not depend on the prompt, the
    prefill time (8 creates of a pipeline at once) does."""
    from specrelay_data.workloads import load_workload
    from edge_sdk.models import encode_prompt

    return [list(encode_prompt(tok, p.text, False))[:length]
            for p in load_workload("humaneval", n, seed)]


def settings_for(tok, quick: bool, prompts: int | None, max_new_tokens: int | None,
                 depth: int, seed: int, sampling: list[str]) -> tuple[ChaosSettings, tuple]:
    """The run's :class:`ChaosSettings` and the fault indices ``at``, from the preset
    and the explicit options (None: the preset's). Raises ValueError for an unknown
    sampling variant."""
    from bench.config import SAMPLING_PRESETS
    from edge_sdk.protocol.sampling import SamplingConfig

    p = PRESETS["quick" if quick else "full"]
    unknown = [s for s in sampling if s not in SAMPLING_PRESETS]
    if unknown:
        raise ValueError(f"unknown sampling variant {unknown[0]!r}")
    n = prompts or p["prompts"]
    ids = _prompts(tok, max(n, PIPELINE), seed, p["prompt_tokens"])
    s = ChaosSettings(prompts=ids[:n], pipeline_prompts=ids[:PIPELINE],
                      samplings={k: SamplingConfig(**SAMPLING_PRESETS[k]) for k in sampling},
                      max_new_tokens=max_new_tokens or p["max_new_tokens"], depth=depth,
                      seed=seed * 1000)
    return s, p["at"]


def _header(target: str, draft: str, dtype: str, s: ChaosSettings) -> str:
    return (f"- setup: target {target}, draft {draft}, {dtype}; {len(s.prompts)} prompt(s) "
            f"per sequential mode, {PIPELINE} in the pipeline; {s.max_new_tokens} new "
            f"tokens, depth {s.depth}; modes {', '.join(s.modes)}; sampling "
            f"{', '.join(s.samplings)}; client timeout {s.timeout_s:g} s, "
            f"{s.retries} retries, offline timeout {s.offline_timeout_s:g} s")


def _load(target: str, draft: str | None, dtype: str, log):
    import torch

    from edge_sdk.models import default_draft, load_model, resolve_dtype
    from exporters.onnx.first_use import build_drafter

    torch.set_num_threads(1)          # target thread + draft thread: one core each
    dtype = resolve_dtype(dtype)
    draft = draft or default_draft(target)
    model, tok = load_model(target, dtype=dtype)
    drafter, _ = build_drafter(draft, dtype=dtype, threads=1, echo=log)
    return model, tok, drafter, draft, dtype


def run_chaos(out_dir: str | Path, *, quick: bool, target: str, draft: str | None,
              dtype: str, prompts: int | None = None, max_new_tokens: int | None = None,
              depth: int = 4, seed: int = 0, sampling=("greedy", "sample"),
              log: Callable[[str], None] = print, faults=None, only=()) -> list:
    """Run the matrix (``faults``, default :func:`fault_matrix`; ``only``: the rows
    :func:`select` keeps), print the table, write the outputs; returns the rows.
    Raises ChaosFailed (after writing) when tokens were lost or duplicated, an
    undocumented exception was raised or a row's fault never fired; ValueError for bad
    options (``only`` matching no row included)."""
    from cloud_api.context import SERVICE
    from cloud_api.local import local_server

    t0 = time.perf_counter()
    model, tok, drafter, draft, dtype = _load(target, draft, dtype, log)
    s, at = settings_for(tok, quick, prompts, max_new_tokens, depth, seed, list(sampling))
    faults = select(faults if faults is not None else fault_matrix(s.timeout_s, quick, at),
                    list(only))
    with local_server(model, tok, max_batch=PIPELINE) as ls:
        verifier = ls.app[SERVICE].verifier
        srv = Server(ls.url, ls.signer, lambda: verifier.passes)
        rows = run_matrix(srv, drafter, tok, s, faults, log)
    header = _header(target, draft, dtype, s) + (
        "; correction rows: sampling only" if any(f.target == "correction" for f in faults)
        else "") + f"; {time.perf_counter() - t0:.0f} s"
    print_table(rows, header)
    for p in write_outputs(rows, out_dir, header):
        log(f"wrote {p}")
    bad = [r.fault for r in rows if r.lost or r.duplicated or r.undocumented
           or r.never_fired]
    if bad:
        raise ChaosFailed("tokens lost or duplicated, an undocumented exception, or a "
                          f"fault that never fired, under: {', '.join(bad)} (see "
                          f"{Path(out_dir) / 'chaos.md'})")
    return rows


def select(faults: list, only: list[str]) -> list:
    """The rows of ``faults`` whose name contains one of the strings ``only``
    (case-insensitive; empty: every row). Raises ValueError when none matches."""
    if not only:
        return faults
    keep = [f for f in faults if any(o.lower() in f.name.lower() for o in only)]
    if not keep:
        raise ValueError(f"no chaos row matches {', '.join(only)!r}")
    return keep

