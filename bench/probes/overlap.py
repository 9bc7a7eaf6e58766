"""How much a verify pass and a draft step slow each other when they run at the same
time on this machine's two cores (the bench's cloud on core 0, its edge on core 1).

    python -m bench.probes.overlap [--phase-s 20] [--block 9]

Proactive drafting (IPDG) and blocks sent ahead overlap the edge's drafting with the
cloud's verification; on two separate machines that overlap is free, but the bench runs
both on one box, where the two cores share the last-level cache and the DRAM channels,
and both models stream their weights from memory on every pass. This probe measures
that interference directly, in three phases of ``--phase-s`` seconds:

1. the target alone (core 0): back-to-back verify passes of ``--block`` tokens after a
   200-token context (bf16, one thread, the serving engine's packed linears, the cache
   cropped back after each pass);
2. the target and the draft together: the edge's default drafter (ONNX int4, one
   thread, core 1) steps back-to-back at the same time;
3. the draft alone.

Prints the median seconds of each side alone and overlapped and their ratios (> 1:
slower while the other runs). Each role runs in its own process, pinned with
``taskset``; samples are classified by a shared wall clock (``time.time``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b+onnx-int4"


def _role(role: str, block: int, stop: Path, out: Path) -> None:
    """One side's loop: print ``ready``, then time passes until ``stop`` exists;
    write ``[[t_start, seconds], ...]`` (wall clock) to ``out``."""
    import torch

    torch.set_num_threads(1)
    if role == "target":
        from edge_sdk.kvmodel import KVModel
        from edge_sdk.models import load_model
        from edge_sdk.packed import packed_default

        m, _ = load_model(TARGET, dtype="bfloat16", packed=packed_default())
        kv = KVModel(m)
        kv.forward(list(range(1000, 1200)))
        ids = list(range(500, 500 + block))

        def once():
            kv.forward(ids)
            kv.crop(200)
    else:
        from exporters.onnx.first_use import build_drafter

        d, _ = build_drafter(DRAFT, dtype="bfloat16", threads=1)
        d.sync(list(range(1000, 1200)))
        n = [0]

        def once():
            d.step(500 + n[0] % 300)
            n[0] += 1
            if d.cache_len() > 400:
                d.sync(list(range(1000, 1200)))
    once()
    print("ready", flush=True)
    rows = []
    while not stop.exists():
        t0w, t0 = time.time(), time.perf_counter()
        once()
        rows.append([t0w, time.perf_counter() - t0])
    out.write_text(json.dumps(rows))


def _spawn(role: str, cpu: int, block: int, tmp: Path) -> subprocess.Popen:
    cmd = ["taskset", "-c", str(cpu), sys.executable, "-m", "bench.probes.overlap",
           "--role", role, "--block", str(block), "--tmp", str(tmp)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_ready(p: subprocess.Popen) -> None:
    for line in p.stdout:
        if line.strip() == "ready":
            return
    raise RuntimeError(f"probe role exited with {p.wait()} before it was ready")


def _median(rows, lo: float, hi: float) -> tuple[float, int]:
    xs = [d for t, d in rows if t >= lo and t + d <= hi]
    return (statistics.median(xs) if xs else float("nan")), len(xs)


def main(phase_s: float = 20.0, block: int = 9) -> dict:
    with tempfile.TemporaryDirectory(prefix="overlap-") as d:
        return _phases(Path(d), phase_s, block)


def _phases(tmp: Path, phase_s: float, block: int) -> dict:
    stops = {r: tmp / f"{r}.stop" for r in ("target", "draft")}
    tgt = _spawn("target", 0, block, tmp)
    _wait_ready(tgt)
    t_a = time.time()
    time.sleep(phase_s)                              # 1. the target alone
    t_load = time.time()
    drf = _spawn("draft", 1, block, tmp)
    _wait_ready(drf)
    t_b = time.time()
    time.sleep(phase_s)                              # 2. both
    stops["target"].touch()
    tgt.wait()
    t_c = time.time()
    time.sleep(phase_s)                              # 3. the draft alone
    stops["draft"].touch()
    drf.wait()
    t_d = time.time()
    trows = json.loads((tmp / "target.json").read_text())
    drows = json.loads((tmp / "draft.json").read_text())
    res = {"block": block, "phase_s": phase_s}
    res["target_alone_s"], res["target_alone_n"] = _median(trows, t_a, t_load)
    res["target_overlapped_s"], res["target_overlapped_n"] = _median(trows, t_b, t_c)
    res["draft_overlapped_s"], res["draft_overlapped_n"] = _median(drows, t_b, t_c)
    res["draft_alone_s"], res["draft_alone_n"] = _median(drows, t_c, t_d)
    res["target_slowdown"] = res["target_overlapped_s"] / res["target_alone_s"]
    res["draft_slowdown"] = res["draft_overlapped_s"] / res["draft_alone_s"]
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--block", type=int, default=9)
    ap.add_argument("--role", choices=("target", "draft"))
    ap.add_argument("--tmp")
    a = ap.parse_args()
    if a.role:
        tmp = Path(a.tmp)
        _role(a.role, a.block, tmp / f"{a.role}.stop", tmp / f"{a.role}.json")
    else:
        main(a.phase_s, a.block)
