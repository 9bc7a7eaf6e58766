"""Greedy identity of a run's outputs: speculative decoding must reproduce the target
alone token for token (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", §2.3), up to near-ties of the target's logits.

* :func:`greedy_divergences` — our modes against the target-alone reference, a
  divergence classified as a near-tie or a hard divergence (a bug); lossy modes
  (``wisv``) are left out;
* :func:`greedy_agreement` — the peer engines (other kernels and numerics, left out of
  the identity check) against our modes' tokens.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from edge_sdk.kvmodel import common_prefix
from edge_sdk.metrics import classify_divergence

__all__ = ["same_engine", "exact_mode", "greedy_divergences", "greedy_agreement"]


def same_engine(r: dict) -> bool:
    """False for a peer engine's record (``BenchMode.peer``: other kernels, other
    numerics; outside the identity check, see ``config.peer_greedy_agreement``)."""
    from bench.modes import get_mode

    try:
        return not getattr(get_mode(r["mode"]), "peer", False)
    except ValueError:          # a record of a mode this process does not know
        return True


def exact_mode(r: dict) -> bool:
    """False for a record of a lossy mode (``BenchMode.lossy``: ``wisv``'s semantic
    acceptance gives up the target's exact output by design; its outputs are judged by
    ``specrelay wisv eval``, not by the identity check)."""
    from bench.modes import get_mode

    try:
        return not getattr(get_mode(r["mode"]), "lossy", False)
    except ValueError:
        return True


def _groups(records: list[dict], greedy_labels: set[str]) -> dict[tuple, list]:
    """Our exact modes' greedy records by (profile, workload, prompt_id)."""
    groups: dict[tuple, list] = {}
    for r in records:
        if r["workload"] in greedy_labels and same_engine(r) and exact_mode(r):
            groups.setdefault((r["profile"], r["workload"], r["prompt_id"]), []).append(r)
    return groups


def greedy_divergences(records: list[dict], greedy_labels: set[str]) -> dict:
    """Greedy identity with near-ties counted, per request against the reference of its
    (profile, workload, prompt): the ``cloud-ar`` record (the target alone) when there is
    one, else the first mode's.

    A diverging request is a *near-tie divergence* when, at the first differing index,
    either run's target choice was a near-tie (``near_tie_positions``: top-2 logit gap
    below ``sampling.NEAR_TIE_GAP`` of the target dtype), else a *hard divergence*
    (which would be a bug). Returns counts ``compared``, ``identical``,
    ``near_tie_divergences``, ``hard_divergences`` and up to 10 ``examples``
    (mode, profile, workload, prompt_id, index).
    """
    out = {"compared": 0, "identical": 0, "near_tie_divergences": 0, "hard_divergences": 0,
           "examples": []}
    for key, rs in _groups(records, greedy_labels).items():
        ref = next((r for r in rs if r["mode"] == "cloud-ar"), rs[0])
        for r in rs:
            if r is ref:
                continue
            out["compared"] += 1
            i, kind = classify_divergence(
                ref["token_ids"], ref["metrics"].get("near_tie_positions") or [],
                r["token_ids"], r["metrics"].get("near_tie_positions") or [])
            if kind == "identical":
                out["identical"] += 1
                continue
            kind = f"{kind}_divergences"
            out[kind] += 1
            if len(out["examples"]) < 10:
                out["examples"].append({"mode": r["mode"], "profile": key[0],
                                        "workload": key[1], "prompt_id": key[2], "index": i,
                                        "kind": kind})
    return out


def _split_records(records: Sequence[dict], greedy_labels: set[str],
                   peer_names: set[str]) -> tuple[dict, dict]:
    """``(ref, own)``: per (profile, workload, prompt) the first non-peer mode's
    ``(mode, token_ids)``; per (peer mode, profile, workload, prompt) its token ids."""
    ref: dict[tuple, tuple[str, list]] = {}
    own: dict[tuple, list] = {}
    for r in records:
        if r["workload"] not in greedy_labels:
            continue
        key = (r["profile"], r["workload"], r["prompt_id"])
        if r["mode"] in peer_names:
            own[(r["mode"],) + key] = r["token_ids"]
        else:
            ref.setdefault(key, (r["mode"], r["token_ids"]))
    return ref, own


def _summarise(a: dict) -> None:
    """Replace the per-prompt lists of an agreement entry by their summaries."""
    pre, toks, ear = a.pop("prefix"), a.pop("tokens"), a.pop("engine_ar")
    a["mean_common_prefix"] = float(np.mean(pre)) if pre else None
    a["min_common_prefix"] = min(pre) if pre else None
    a["mean_tokens"] = float(np.mean(toks)) if toks else None
    a["identical_to_engine_ar"] = all(ear) if ear else None


def greedy_agreement(records: Sequence[dict], greedy_labels: set[str],
                     peer_names: set[str]) -> dict:
    """Per peer mode, how its greedy tokens compare with the target's: the first
    non-peer mode's output for the same (profile, workload, prompt) (our modes are
    exact, so any of them is the target's greedy output). ``{mode: {"reference",
    "prompts", "identical", "mean_common_prefix", "min_common_prefix", "mean_tokens",
    "identical_to_engine_ar"}}`` (the last: speculative peers against their own
    engine's target-only mode, None without it)."""
    from bench.modes.peers import gain_pairs

    ref, own = _split_records(records, greedy_labels, peer_names)
    pairs = gain_pairs()
    out: dict[str, dict] = {}
    for (mode, *key), ids in own.items():
        key = tuple(key)
        a = out.setdefault(mode, {"reference": None, "prompts": 0, "identical": 0,
                                  "prefix": [], "tokens": [], "engine_ar": []})
        if key in ref:
            ref_mode, ref_ids = ref[key]
            a["reference"] = ref_mode
            a["prompts"] += 1
            a["identical"] += int(list(ids) == list(ref_ids))
            a["prefix"].append(common_prefix(ids, ref_ids))
            a["tokens"].append(len(ids))
        ar = own.get((pairs.get(mode),) + key)
        if ar is not None:
            a["engine_ar"].append(list(ar) == list(ids))
    for a in out.values():
        _summarise(a)
    return out
