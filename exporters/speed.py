"""Draft decode speed and greedy agreement per runtime, single sequence, fixed threads.

Backends (``--backends``, comma-separated):

=================  =========================================================
``torch-bf16``     the HF model in bfloat16 (the reference draft)
``torch-fp32``     the same weights in float32
``torch-int8``     float32 model, every ``nn.Linear`` (LM head included) dynamically
                   quantised to int8 (``torch.ao.quantization.quantize_dynamic``)
``onnx-fp32``      ``<onnx>/`` (exported first when missing)
``onnx-fp16``      ``<onnx>/fp16/``
``onnx-int8``      ``<onnx>/int8/`` (MatMulNBits, 8 bits)
``onnx-int4``      ``<onnx>/int4/`` (MatMulNBits)
``onnx-<sub>``     any other export folder ``<onnx>/<sub>/``
=================  =========================================================

Reproduce the Qwen2.5-Coder-0.5B table (1 thread, ~100-token context, agreement with
the bf16 draft over 64 greedy tokens on a code and a chat prompt)::

    python -m exporters.speed qwen2.5-coder-0.5b --onnx /tmp/q05-onnx --threads 1 \\
        --backends torch-bf16,torch-fp32,torch-int8,onnx-fp32,onnx-fp16,onnx-int4

Speed: ``ms_per_token`` is the median of ``--steps`` one-token decode steps after a
``--context``-token prefill and ``--warmup`` untimed steps, best of ``--repeats``
(the CPU may be shared: the best repeat is the least disturbed one).

Agreement: the reference (``--reference``, default ``torch-bf16``) greedy-decodes
``--agree-steps`` tokens per prompt; each backend is teacher-forced along that
sequence (``greedy_agreement`` = fraction of steps whose argmax equals the reference's,
the per-token agreement a draft would see) and also decodes freely
(``free_run_identical_prefix`` = tokens identical before the first divergence, mean
over prompts). Backends are built, measured and freed one at a time (memory).
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import click
import torch

#: Real prompts for the agreement check: (label, text), wrapped in the chat template.
AGREEMENT_PROMPTS = (
    ("code", "Write a Python function `merge_intervals(intervals)` that merges "
             "overlapping intervals and returns them sorted. Include a docstring."),
    ("chat", "What are three practical tips for staying focused while working from "
             "home? Keep it short."),
)
#: Text repeated to build the timing prompt (content does not change the cost).
_TIMING_TEXT = ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n"
                "    while lo <= hi:\n        mid = (lo + hi) // 2\n"
                "        if items[mid] == target:\n            return mid\n")

BACKENDS = ("torch-bf16", "torch-fp32", "torch-int8", "onnx-fp32", "onnx-fp16",
            "onnx-int8", "onnx-int4")


class Backend:
    """One sequence through a runtime: ``forward(ids [k]) -> float32 logits [k, V]``
    appends to the KV cache; ``reset()`` empties it."""

    def __init__(self, label: str, forward: Callable, reset: Callable, keep=None):
        self.label, self.forward, self.reset = label, forward, reset
        self.keep = keep  # objects the closures need (model, session)


def torch_backend(label: str, model) -> Backend:
    """A HF causal LM (any dtype, quantised Linears allowed) with its KV cache."""
    from edge_sdk.kvmodel import KVModel

    kv = KVModel(model)
    return Backend(label, kv.forward, kv.rebuild, keep=kv)


def onnx_backend(label: str, folder: str | Path, threads: int) -> Backend:
    """An export folder on onnxruntime's CPU provider with ``threads`` intra-op threads."""
    from edge_sdk.drafters.onnx import OnnxRunner

    r = OnnxRunner(folder, providers="cpu", threads=threads)
    return Backend(label, r.forward, r.reset, keep=r)


def time_decode(forward: Callable, prompt: Sequence[int], steps: int, warmup: int) -> float:
    """Seconds per one-token step (median of ``steps``) after prefilling ``prompt``."""
    from edge_sdk.protocol.sampling import greedy_token

    logits = forward(list(prompt))[-1]
    times = []
    for i in range(warmup + steps):
        tok = int(greedy_token(logits))
        t0 = time.perf_counter()
        logits = forward([tok])[-1]
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def greedy_tokens(b: Backend, prompt: Sequence[int], steps: int,
                  forced: Sequence[int] | None = None) -> list[int]:
    """The argmax at each of ``steps`` positions, decoding freely or teacher-forced along
    ``forced``."""
    from edge_sdk.protocol.sampling import greedy_token

    b.reset()
    logits = b.forward(list(prompt))[-1]
    out = []
    for i in range(steps):
        tok = int(greedy_token(logits))
        out.append(tok)
        if i + 1 < steps:
            logits = b.forward([forced[i] if forced is not None else tok])[-1]
    b.reset()
    return out


def agreement(b: Backend, prompts: Sequence[Sequence[int]],
              references: Sequence[Sequence[int]],
              kinds: Sequence[str] | None = None) -> dict:
    """Teacher-forced greedy agreement and free-run identical prefix of ``b`` against
    the reference sequences (one per prompt); ``kinds`` (e.g. code / chat, one per
    prompt) adds the agreement per kind."""
    agree = total = 0
    prefix, by_kind = [], {}
    kinds = list(kinds) if kinds is not None else ["all"] * len(prompts)
    for prompt, ref, kind in zip(prompts, references, kinds):
        forced = greedy_tokens(b, prompt, len(ref), forced=ref)
        a = sum(x == y for x, y in zip(forced, ref))
        agree, total = agree + a, total + len(ref)
        k = by_kind.setdefault(kind, [0, 0])
        k[0], k[1] = k[0] + a, k[1] + len(ref)
        free = greedy_tokens(b, prompt, len(ref))
        prefix.append(next((i for i, (x, y) in enumerate(zip(free, ref)) if x != y),
                           len(ref)))
    return {"greedy_agreement": round(agree / max(total, 1), 4),
            "per_kind": {k: round(v[0] / max(v[1], 1), 4) for k, v in by_kind.items()},
            "agreement_tokens": total,
            "free_run_identical_prefix": round(sum(prefix) / max(len(prefix), 1), 1)}


def timing_prompt(tokenizer, vocab: int, length: int) -> list[int]:
    """A ``length``-token prompt of real code (random ids without a tokenizer)."""
    if tokenizer is None:
        from exporters.onnx.parity import default_prompt

        return default_prompt(vocab, length, seed=1)
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(_TIMING_TEXT, add_special_tokens=False)
    return ids[:length]


def agreement_prompts(tokenizer, vocab: int, workload_prompts: int = 0
                      ) -> list[tuple[str, list[int]]]:
    """``(kind, ids)`` for the :data:`AGREEMENT_PROMPTS` (chat template), plus
    ``workload_prompts`` HumanEval prompts (kind code, raw completion) and as many
    MT-Bench questions (kind chat, chat template) from :mod:`specrelay_data.workloads`.
    Without a tokenizer: two fixed random-id prompts."""
    if tokenizer is None:
        from exporters.onnx.parity import default_prompt

        return [("random", default_prompt(vocab, 24, seed=s)) for s in (2, 3)]
    from edge_sdk.models import encode_prompt

    out = [(kind, encode_prompt(tokenizer, text, chat=True))
           for kind, text in AGREEMENT_PROMPTS]
    if workload_prompts:
        from specrelay_data.workloads import load_workload

        for name, kind in (("humaneval", "code"), ("mtbench", "chat")):
            for p in load_workload(name, workload_prompts, seed=0):
                out.append((kind, encode_prompt(tokenizer, p.text, chat=p.kind == "chat")))
    return out


def _backend(label: str, model, onnx_dir, threads: int, log, held: dict) -> Backend | None:
    """Build backend ``label`` (None: an ``onnx-*`` export that is not there, logged).
    ``held["fp32"]`` keeps the float32 copy between ``torch-fp32`` and ``torch-int8``
    (which consumes it). Raises ValueError: an unknown label or no ``onnx_dir``."""
    from edge_sdk.drafters.torch import quantize_dynamic_int8

    if label == "torch-bf16":
        return torch_backend(label, model if next(model.parameters()).dtype == torch.bfloat16
                             else copy.deepcopy(model).to(torch.bfloat16))
    if label in ("torch-fp32", "torch-int8"):
        if held.get("fp32") is None:
            held["fp32"] = copy.deepcopy(model).float().eval()
        m = held["fp32"]
        if label == "torch-int8":
            m, held["fp32"] = quantize_dynamic_int8(held["fp32"]), None  # fp32 is consumed
        return torch_backend(label, m)
    if label.startswith("onnx-"):
        if onnx_dir is None:
            raise ValueError(f"{label} needs onnx_dir")
        v = label[len("onnx-"):]  # onnx-<sub> = onnx_dir/<sub> (onnx-fp32 = onnx_dir)
        folder = Path(onnx_dir) if v == "fp32" else Path(onnx_dir) / v
        if not (folder / "model.onnx").exists():
            log(f"{label}: no export at {folder}, skipped")
            return None
        return onnx_backend(label, folder, threads)
    raise ValueError(f"unknown backend {label!r} (one of {', '.join(BACKENDS)})")


def _speed(b: Backend, prompt, steps: int, warmup: int, repeats: int) -> dict:
    """``ms_per_token`` / ``tok_s`` of the best of ``repeats`` runs of
    :func:`time_decode`."""
    best = float("inf")
    for _ in range(repeats):
        b.reset()
        best = min(best, time_decode(b.forward, prompt, steps, warmup))
    return {"ms_per_token": round(best * 1000, 2), "tok_s": round(1.0 / best, 1)}


def _build_order(backends: Sequence[str], reference: str, agree_steps: int) -> list[str]:
    """The labels in build order: the reference first when agreement is checked."""
    order = list(backends)
    if agree_steps and reference in order:
        order.remove(reference)
        order.insert(0, reference)
    return order


def _add_speedups(results: dict) -> None:
    """``speedup_vs_<first label>`` in every result (ms/token ratio)."""
    first = next(iter(results), None)
    for label, res in results.items():
        res[f"speedup_vs_{first}"] = round(results[first]["ms_per_token"]
                                           / res["ms_per_token"], 2)


def measure(model, backends: Sequence[str], *, onnx_dir: str | Path | None = None,
            tokenizer=None, threads: int = 1, context: int = 96, steps: int = 24,
            warmup: int = 4, repeats: int = 3, agree_steps: int = 64,
            workload_prompts: int = 0, reference: str = "torch-bf16", log=print) -> dict:
    """ms/token and greedy agreement for each backend label (see the module docstring).

    Args:
        model: the HF causal LM (bfloat16 or float32; the torch backends are copies).
        backends: labels from :data:`BACKENDS`. onnx_dir: the export folder for the
            ``onnx-*`` labels. tokenizer: for real prompts (None: fixed random ids).
        threads: torch and onnxruntime intra-op threads.
        context: prefill tokens before the timed steps (the cache is then about
            ``context + warmup .. + steps`` long). agree_steps: 0 skips agreement.
        workload_prompts: extra HumanEval + MT-Bench prompts for the agreement check.
    Returns:
        ``{"threads", "context", "steps", "reference", "results": {label: {"ms_per_token",
        "tok_s", "speedup_vs_<first>", "greedy_agreement", ...}}}``.
    """
    torch.set_num_threads(threads)
    vocab = int(model.config.vocab_size)
    tprompt = timing_prompt(tokenizer, vocab, context)
    labelled = agreement_prompts(tokenizer, vocab, workload_prompts) if agree_steps else []
    kinds, aprompts = [k for k, _ in labelled], [p for _, p in labelled]
    refs, results, held = None, {}, {}
    for label in _build_order(backends, reference, agree_steps):
        t0 = time.perf_counter()
        b = _backend(label, model, onnx_dir, threads, log, held)
        if b is None:
            continue
        res = {"build_s": round(time.perf_counter() - t0, 2),
               **_speed(b, tprompt, steps, warmup, repeats)}
        if agree_steps:
            if refs is None:
                if label != reference:
                    raise ValueError(f"reference {reference} must be among the backends")
                refs = [greedy_tokens(b, p, agree_steps) for p in aprompts]
            res.update(agreement(b, aprompts, refs, kinds))
        results[label] = res
        log(f"{label}: {json.dumps(res)}")
        b.reset()
        del b
        gc.collect()
    held.clear()
    _add_speedups(results)
    return {"threads": threads, "context": context, "steps": steps, "warmup": warmup,
            "repeats": repeats, "agree_steps": agree_steps,
            "reference": reference if agree_steps else None,
            "prompts": kinds,
            "results": {k: results[k] for k in backends if k in results}}


def markdown_table(res: dict) -> str:
    """The results as a markdown table."""
    ref = res.get("reference") or "-"
    rows = [f"| backend | ms/token | tok/s | greedy agreement vs {ref} (per kind) | "
            "free-run identical prefix |", "|---|---|---|---|---|"]
    for label, r in res["results"].items():
        per = ", ".join(f"{k} {v:.3f}" for k, v in r.get("per_kind", {}).items())
        agr = f"{r['greedy_agreement']:.3f} ({per})" if "greedy_agreement" in r else "-"
        rows.append(f"| {label} | {r['ms_per_token']:.1f} | {r['tok_s']} | {agr} | "
                    f"{r.get('free_run_identical_prefix', '-')} |")
    return "\n".join(rows)


@click.command("speed", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, default="qwen2.5-coder-0.5b")
@click.option("--dtype", default="bfloat16", help="dtype the model is loaded in "
              "(the torch-* backends are copies; default bfloat16)")
@click.option("--onnx", "onnx_dir", default=None,
              help="export folder (default /tmp/specrelay-onnx/<model>); exported "
                   "(fp32 + int4, + fp16 when onnx-fp16 is asked for) if it holds "
                   "no model.onnx")
@click.option("--backends", default="torch-bf16,torch-fp32,onnx-fp32,onnx-int4",
              help=f"comma-separated, from: {','.join(BACKENDS)}")
@click.option("--threads", type=int, default=1)
@click.option("--context", type=int, default=96, help="prefill tokens")
@click.option("--steps", type=int, default=24, help="timed decode steps")
@click.option("--warmup", type=int, default=4)
@click.option("--repeats", type=int, default=3)
@click.option("--agree-steps", type=int, default=64, help="0 = no agreement check")
@click.option("--workload-prompts", type=int, default=0, help="also check "
              "agreement on N HumanEval + N MT-Bench prompts")
@click.option("--reference", default="torch-bf16")
@click.option("--json", "json_out", default=None, help="also write JSON here")
def speed_command(model, dtype, onnx_dir, backends, threads, context, steps, warmup,
                  repeats, agree_steps, workload_prompts, reference, json_out):
    """Draft decode speed and greedy agreement per runtime, single sequence, fixed
    threads.

    MODEL: model spec (edge_sdk.models.resolve) or draft folder (default
    qwen2.5-coder-0.5b). Prints the results as JSON, then as a markdown table.
    """
    from edge_sdk.models import load_model
    from exporters.onnx.export import export_onnx

    labels = [b.strip() for b in backends.split(",") if b.strip()]
    m, tok = load_model(model, dtype=dtype, threads=threads)
    folder = Path(onnx_dir or f"/tmp/specrelay-onnx/{model.replace('/', '_')}")
    if any(b.startswith("onnx-") for b in labels) and not (folder / "model.onnx").exists():
        print(f"exporting {model} -> {folder} ...", flush=True)
        export_onnx(m, folder, int4=True, fp16="onnx-fp16" in labels, parity=False,
                    source=model, threads=threads)
    res = {"model": model, **measure(m, labels, onnx_dir=folder, tokenizer=tok,
                                     threads=threads, context=context, steps=steps,
                                     warmup=warmup, repeats=repeats,
                                     agree_steps=agree_steps,
                                     workload_prompts=workload_prompts,
                                     reference=reference)}
    print(json.dumps(res, indent=2))
    print(markdown_table(res))
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    speed_command()
