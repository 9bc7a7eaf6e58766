"""Check an ONNX export against its source: float32 parity with the torch model
(:func:`check_parity`) and the greedy agreement of a quantised export with the float32
one (:func:`compare_exports`)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edge_sdk.drafters.onnx import MODEL_NAME, OnnxRunner
from edge_sdk.kvmodel import KVModel
from edge_sdk.protocol.sampling import greedy_token

#: Largest allowed |logit difference| of the float32 graph vs torch (logit units).
PARITY_ATOL = 1e-3
#: Prompt used for parity/agreement when a tokenizer is at hand.
PARITY_TEXTS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


def default_prompt(vocab_size: int, length: int = 16, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt [length] for parity checks without a tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def _onnx_path(p: str | os.PathLike) -> Path:
    p = Path(p)
    return p / MODEL_NAME if p.is_dir() else p


def _logit_diff(a, b) -> tuple[float, float, int]:
    """``(max, sum, count)`` of |a - b| over finite entries. Entries that are ``-inf`` in
    one (a reduced draft head masks ids that way) must be ``-inf`` in the other too,
    else the max is ``inf``."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):
        return math.inf, math.inf, int(fa.sum())
    d = (a[fa] - b[fb]).abs()
    if d.numel() == 0:
        return 0.0, 0.0, 0
    return float(d.max()), float(d.sum()), int(d.numel())


def check_parity(onnx_path: str | os.PathLike, model, steps: int = 64,
                 prompt: Sequence[int] | None = None, atol: float = PARITY_ATOL,
                 threads: int | None = None) -> dict:
    """Compare an ONNX export with the torch model it came from.

    The prompt [n] goes through both in one call (the ONNX call with an empty past),
    then ``steps`` greedy decode steps follow, one token per call, both fed torch's
    greedy token. At each step the ONNX argmax must equal torch's.

    Args:
        onnx_path: export folder or ``.onnx`` file. model: the HF model (eval).
        prompt: token ids (default: :func:`default_prompt`).
        atol: largest allowed |logit difference| (logit units).
    Returns:
        dict: ``max_abs_logit_diff`` (over prompt and decode logits), ``mean_abs_logit_diff``,
        ``greedy_identical`` (all ``steps`` argmaxes equal), ``greedy_matches``,
        ``first_mismatch`` (step index or None), ``steps``, ``prompt_len``, ``atol``,
        ``passed`` and ``seconds``.
    """
    t0 = time.perf_counter()
    runner = OnnxRunner(_onnx_path(onnx_path), providers="cpu", threads=threads)
    vocab = int(model.config.vocab_size)
    prompt = list(prompt) if prompt is not None else default_prompt(vocab)
    kv = KVModel(model)
    lt = kv.forward(prompt)
    lo = runner.forward(prompt)
    mx, sm, count = _logit_diff(lt, lo)
    diffs, sums = [mx], [sm]
    lt, lo = lt[-1], lo[-1]
    matches, first = 0, None
    for i in range(steps):
        tok = int(greedy_token(lt))
        if int(greedy_token(lo)) == tok:
            matches += 1
        elif first is None:
            first = i
        lt = kv.forward([tok])[-1]
        lo = runner.forward([tok])[-1]
        mx, sm, n = _logit_diff(lt, lo)
        diffs, sums, count = diffs + [mx], sums + [sm], count + n
    max_diff = max(diffs)
    res = {"steps": steps, "prompt_len": len(prompt), "max_abs_logit_diff": max_diff,
           "mean_abs_logit_diff": sum(sums) / max(count, 1), "greedy_matches": matches,
           "greedy_identical": matches == steps, "first_mismatch": first, "atol": atol}
    res["passed"] = bool(max_diff <= atol and res["greedy_identical"])
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def _greedy_run(runner: OnnxRunner, prompt: Sequence[int], steps: int,
                forced: Sequence[int] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy-decode ``steps`` tokens (or teacher-force ``forced``); returns the argmax at
    each step and the float32 logits rows [V] it saw."""
    runner.reset()
    logits = runner.forward(prompt)[-1]
    toks, rows = [], []
    for i in range(steps):
        tok = int(greedy_token(logits))
        toks.append(tok)
        rows.append(logits.numpy())
        if i + 1 < steps:
            logits = runner.forward([forced[i] if forced is not None else tok])[-1]
    return toks, rows


def compare_exports(variant: str | os.PathLike, reference: str | os.PathLike,
                    prompts: Sequence[Sequence[int]], steps: int = 64,
                    threads: int | None = None) -> dict:
    """Greedy agreement of a reduced-precision export with the float32 export.

    For each prompt the reference decodes ``steps`` greedy tokens; the variant is
    teacher-forced along that sequence (``greedy_agreement`` = fraction of steps whose
    argmax matches, the per-token agreement a draft would see) and also decodes freely
    (``free_run_identical_prefix`` = tokens identical before the first divergence,
    averaged over prompts; ``free_run_identical`` = prompts fully identical).

    A variant with a subset LM head (FR-Spec; its logits are -inf outside the kept ids)
    is compared on the kept ids only: the logit differences over its ``head_ids``
    columns, the agreement as is (a target token outside them is a disagreement).

    Returns:
        dict with those fields plus ``max_abs_logit_diff`` / ``mean_abs_logit_diff``
        (teacher-forced, logit units), ``prompts``, ``steps`` and ``head_vocab`` (the
        variant's kept rows, None for a full head).
    """
    ref = OnnxRunner(_onnx_path(reference), providers="cpu", threads=threads)
    var = OnnxRunner(_onnx_path(variant), providers="cpu", threads=threads)
    cols = var.head_ids
    agree = total = identical = 0
    prefix, max_d, sum_d, n_d = [], 0.0, 0.0, 0
    for prompt in prompts:
        rt, rrows = _greedy_run(ref, prompt, steps)
        vt, vrows = _greedy_run(var, prompt, steps, forced=rt)
        agree += sum(a == b for a, b in zip(rt, vt))
        total += steps
        for a, b in zip(rrows, vrows):
            if cols is not None:
                a, b = a[cols], b[cols]
            mx, sm, n = _logit_diff(a, b)
            max_d, sum_d, n_d = max(max_d, mx), sum_d + sm, n_d + n
        ft, _ = _greedy_run(var, prompt, steps)
        k = next((i for i, (a, b) in enumerate(zip(rt, ft)) if a != b), steps)
        prefix.append(k)
        identical += k == steps
    return {"prompts": len(prompts), "steps": steps,
            "greedy_agreement": agree / max(total, 1),
            "free_run_identical_prefix": sum(prefix) / max(len(prefix), 1),
            "free_run_identical": identical,
            "max_abs_logit_diff": max_d, "mean_abs_logit_diff": sum_d / max(n_d, 1),
            "head_vocab": None if cols is None else int(len(cols))}


