"""A weight-only quantised ONNX draft's decode cost and its agreement with the target,
one variant beside another (e.g. int4 with 32, 64 or 128 weights per scale).

    python -m bench.probes.draft_quant DIR [DIR ...]
        [--requests docs/figures/single16-1206/requests.jsonl] [--steps 30] [--cpu 1]
        [--torch-prefill]

``DIR``: an export folder (``model.onnx`` + ``specrelay_onnx.json``). For each:

- **decode ms/token**: one-token calls after a 150-token context, median of ``--steps``
  (one thread pinned to ``--cpu``; the variants alternate, so a noisy minute hits all);
- **agreement**, teacher-forced on the target's own greedy continuations, read from a
  bench run's ``requests.jsonl`` (its ``cloud-ar`` records: the target alone, bit-exact
  in bf16): one prefill of prompt + continuation with logits on every continuation
  row; ``first`` = the fraction of positions where the draft's argmax is the target's
  token; ``acc@8`` = the mean, over start positions, of leading matches in a run of 8
  (the accepted length of a depth-8 chain, Leviathan et al. 2023, §3.1: a greedy
  draft conditioned on the true prefix proposes exactly these tokens).

``--torch-prefill``: each ``DIR`` is also judged with its prompt prefilled by the same
draft in torch bf16 (:mod:`edge_sdk.drafters.prefill`, the export manifest's
``source`` model) and the continuation teacher-forced through the graph, as the edge
drafts with it; reported as ``DIR+torch-prefill`` (same decode cost) with the prompts'
prefill ms both ways and the process's resident memory (``VmRSS``, MB) before and
after loading the torch model.

Output: one line per variant and workload, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _continuations(path: str) -> list[tuple[str, str, list[int]]]:
    """``(workload, prompt id, target tokens)`` of the run's ``cloud-ar`` records."""
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("mode") == "cloud-ar":
                out.append((r["workload"], r["prompt_id"], [int(t) for t in r["token_ids"]]))
    if not out:
        raise SystemExit(f"{path}: no cloud-ar records (run the bench with cloud-ar)")
    return out


def _rss_mb() -> float | None:
    """This process's resident memory in MB (``VmRSS``; None without ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _agreement(runner, prompt: list[int], cont: list[int], depth: int,
               prefill=None) -> tuple[int, int, int, float]:
    """(matches, positions, sum of accepted lengths over start positions, prompt
    prefill seconds) of one prompt; ``prefill``: a TorchPrefill fills ``prompt[:-1]``."""
    import numpy as np

    from bench.probes.skip_agreement import accepted_run

    runner.reset()
    t0 = time.perf_counter()
    if prefill is not None:
        prefill.extend(runner, prompt[:-1])
    else:
        runner.forward_np(prompt[:-1], last=1)
    pre_s = time.perf_counter() - t0
    logits = runner.forward_np(prompt[-1:] + cont[:-1], last=len(cont))
    hit = (np.asarray(logits).argmax(-1) == np.asarray(cont)).tolist()
    runs = sum(accepted_run(hit[i:i + depth]) for i in range(len(hit)))
    return sum(hit), len(hit), runs, pre_s


def main(argv=None) -> dict:
    from bench.cells import encode_requests
    from edge_sdk.drafters.onnx import OnnxRunner
    from edge_sdk.models import load_tokenizer
    from specrelay_data.workloads import load_workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--requests", default="docs/figures/single16-1206/requests.jsonl")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--torch-prefill", action="store_true")
    a = ap.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})
    tok = load_tokenizer(a.target)
    conts = _continuations(a.requests)
    prompts = {}
    for w in sorted({c[0] for c in conts}):
        wanted = {c[1] for c in conts if c[0] == w}
        texts = [p for p in load_workload(w) if p.id in wanted]
        for r in encode_requests(tok, texts, w, 0):
            prompts[(w, r.prompt_id)] = [int(t) for t in r.prompt_ids]
    runners = {d: OnnxRunner(d, threads=1) for d in a.dirs}
    w0, pid0, cont0 = conts[0]
    ctx = (prompts[(w0, pid0)] + cont0 * 3)[:150]      # a 150-token context to decode after
    times = {d: [] for d in a.dirs}
    for r in runners.values():
        r.reset()
        r.forward_np(ctx, last=1)
    for _ in range(a.steps):
        for d, r in runners.items():
            t0 = time.perf_counter()
            r.forward_np(ctx[:1], last=1)
            times[d].append(1e3 * (time.perf_counter() - t0))
            r.crop(len(ctx))
    judged = [(d, d, r, None) for d, r in runners.items()]
    rss = {}
    if a.torch_prefill:
        from edge_sdk.drafters.prefill import load_prefill

        for d, r in runners.items():
            before = _rss_mb()
            pf = load_prefill(r.manifest["source"], threads=1)
            pf.extend(r, ctx[:40])                          # warm the torch path
            judged.append((d + "+torch-prefill", d, r, pf))
            rss[d] = {"rss_mb_graph_only": before, "rss_mb_with_torch": _rss_mb()}
    out = {"requests": a.requests, "depth": a.depth, "variants": {}}
    for name, d, r, pf in judged:
        per, pre_s = {}, 0.0
        for w, pid, cont in conts:
            m, n, acc, ps = _agreement(r, prompts[(w, pid)], cont, a.depth, pf)
            s = per.setdefault(w, [0, 0, 0.0])
            s[0] += m
            s[1] += n
            s[2] += acc
            pre_s += ps
        q = r.manifest.get("quantization") or {}
        v = {"decode_ms": round(statistics.median(times[d]), 2),
             "block_size": q.get("block_size"), "bits": q.get("bits"),
             "bytes": os.path.getsize(r.model_path),
             "prompt_prefill_ms": round(1e3 * pre_s / len(conts), 1),
             **(rss.get(d, {}) if pf is not None else {})}
        for w, (m, n, acc) in per.items():
            v[w] = {"first": round(m / n, 4), f"acc@{a.depth}": round(acc / n, 3),
                    "positions": n}
            print(f"{name}: {w} first {m / n:.4f} acc@{a.depth} {acc / n:.3f} "
                  f"({n} positions); decode {v['decode_ms']} ms/token, prompt prefill "
                  f"{v['prompt_prefill_ms']} ms")
        out["variants"][name] = v
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
