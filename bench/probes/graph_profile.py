"""Where an ONNX draft's decode step goes, per operator, from onnxruntime's own profiler.

    python -m bench.probes.graph_profile DIR [DIR ...] [--context 300] [--steps 40]
        [--cpu 1]

``DIR``: an export folder (``model.onnx`` + ``specrelay_onnx.json``). For each, one
thread pinned to ``--cpu``: a ``--context``-token prefill, then ``--steps`` one-token
decode calls with onnxruntime's profiling on. Per decode step: the kernel time of each
operator type (ms and calls), all kernels together, and the session's whole run, whose
difference is the executor's per-node overhead. The profiler adds its own overhead to
both, so read the split, not the absolute step time (``draft_quant`` times the step).

Output: one block per folder, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter


def profile(folder: str, context: int, steps: int) -> dict:
    """Profile ``steps`` decode calls after a ``context``-token prefill of the export in
    ``folder``. Returns ``{"ops": {op: {"ms": per step, "calls": per step}}, "kernel_ms",
    "run_ms", "overhead_ms", "nodes"}`` (ms per decode step)."""
    import onnx

    from edge_sdk.drafters.onnx import OnnxRunner, make_session_options, resolve_model_dir

    so = make_session_options(1)
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:        # the profile file goes with it
        so.profile_file_prefix = os.path.join(tmp, "ort")
        r = OnnxRunner(folder, "cpu", session_options=so)
        vocab = min(r.vocab_size, 32000)
        r.forward_np([(7 * i + 11) % vocab for i in range(context)], last=1)
        for i in range(steps):
            r.forward_np([(13 * i + 5) % vocab], last=1)
        with open(r.session.end_profiling()) as f:
            events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    runs = runs[-steps:]          # the decode calls (a long prefill runs in several chunks)
    start = runs[0]["ts"]
    ms, calls = Counter(), Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            ms[e["args"]["op_name"]] += e["dur"] / 1000
            calls[e["args"]["op_name"]] += 1
    kernel = sum(ms.values()) / steps
    run = sum(e["dur"] for e in runs) / 1000 / steps
    nodes = len(onnx.load(str(resolve_model_dir(folder)[1]), load_external_data=False).graph.node)
    return {"ops": {op: {"ms": round(t / steps, 3), "calls": calls[op] // steps}
                    for op, t in ms.most_common()},
            "kernel_ms": round(kernel, 2), "run_ms": round(run, 2),
            "overhead_ms": round(run - kernel, 2), "nodes": nodes}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cpu", type=int, default=1)
    a = ap.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})
    out = {"context": a.context, "steps": a.steps, "graphs": {}}
    for d in a.dirs:
        p = out["graphs"][d] = profile(d, a.context, a.steps)
        print(f"{d}: {p['nodes']} nodes; per decode step {p['run_ms']} ms run, "
              f"{p['kernel_ms']} ms in kernels, {p['overhead_ms']} ms overhead")
        for op, v in list(p["ops"].items())[:12]:
            print(f"  {op:34s} {v['ms']:7.2f} ms  {v['calls']:4d} calls")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
