"""Draft decode speed: onnxruntime export vs torch, single sequence, fixed threads.

Reproduce (exports first if the folder has no model)::

    python -m exporters.speed smollm2-135m@4 --onnx /tmp/smollm2-135m-4-onnx --threads 2

Prints tokens/s of one-token decode steps (KV cache ~prompt+steps long) for torch
float32 and every ONNX variant found in the folder (``.``, ``fp16/``, ``int4/``), and the
ratio to torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch


def _time_decode(forward, prompt: Sequence[int], steps: int, warmup: int) -> float:
    """Seconds per one-token step (median of ``steps``) after a prompt prefill."""
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


def measure(model, onnx_dirs: dict[str, str | Path], threads: int = 2, steps: int = 64,
            prompt_len: int = 32, warmup: int = 4, repeats: int = 2) -> dict:
    """Decode tokens/s for torch and each ONNX export.

    Args:
        model: the HF causal LM (float32) the exports came from.
        onnx_dirs: label -> export folder.
        threads: torch intra-op threads and onnxruntime intra-op threads.
        steps: timed one-token steps per repeat; prompt_len: prefill tokens first.
        repeats: alternate torch/ONNX runs this many times and keep each one's best
            (the CPU is shared; the best repeat is the least disturbed).
    Returns:
        ``{"threads", "steps", "prompt_len", "torch_tok_s", "<label>_tok_s",
        "<label>_speedup"}`` (tokens per second, speedup = onnx / torch).
    """
    from edge_sdk.drafters.onnx import OnnxRunner
    from edge_sdk.kvmodel import KVModel
    from exporters.onnx import default_prompt

    torch.set_num_threads(threads)
    prompt = default_prompt(int(model.config.vocab_size), prompt_len, seed=1)
    runners = {k: OnnxRunner(v, providers="cpu", threads=threads)
               for k, v in onnx_dirs.items()}
    best: dict[str, float] = {}
    for _ in range(repeats):
        kv = KVModel(model)
        s = _time_decode(kv.forward, prompt, steps, warmup)
        best["torch"] = min(best.get("torch", s), s)
        for k, r in runners.items():
            r.reset()
            s = _time_decode(r.forward, prompt, steps, warmup)
            best[k] = min(best.get(k, s), s)
    out = {"threads": threads, "steps": steps, "prompt_len": prompt_len,
           "torch_tok_s": round(1.0 / best["torch"], 1)}
    for k in runners:
        out[f"{k}_tok_s"] = round(1.0 / best[k], 1)
        out[f"{k}_speedup"] = round(best["torch"] / best[k], 2)
    return out


def find_variants(folder: str | Path) -> dict[str, Path]:
    """label -> folder for the float32 export and any ``fp16``/``int4`` variants."""
    folder = Path(folder)
    found = {"onnx_fp32": folder} if (folder / "model.onnx").exists() else {}
    for v in ("fp16", "int4"):
        if (folder / v / "model.onnx").exists():
            found[f"onnx_{v}"] = folder / v
    return found


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m@4",
                    help="model spec (edge_sdk.models.resolve) or draft folder")
    ap.add_argument("--onnx", default=None,
                    help="export folder (default /tmp/specrelay-onnx/<model>); exported "
                         "with --int4 if it holds no model.onnx")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fp16", action="store_true", help="include the fp16 variant (slow "
                    "on CPU: most fp16 kernels fall back to casts)")
    a = ap.parse_args(argv)

    from edge_sdk.models import load_model
    from exporters.onnx import export_onnx

    model, _ = load_model(a.model, threads=a.threads)
    folder = Path(a.onnx or f"/tmp/specrelay-onnx/{a.model.replace('/', '_')}")
    if not (folder / "model.onnx").exists():
        print(f"exporting {a.model} -> {folder} ...", flush=True)
        export_onnx(model, folder, int4=True, parity=False, source=a.model)
    dirs = find_variants(folder)
    if not a.fp16:
        dirs.pop("onnx_fp16", None)
    res = {"model": a.model, **measure(model, dirs, threads=a.threads, steps=a.steps,
                                       prompt_len=a.prompt_len, repeats=a.repeats)}
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
