"""Resident memory of a serving load, with and without giving back the checkpoint pages.

    python -m bench.probes.load_rss [TARGET [DTYPE [TOKENS]]]
    python -m bench.probes.load_rss qwen2.5-coder-1.5b float32 16

Loads the target as the cloud loads it (oneDNN-prepacked linears, one thread) in two
fresh processes: ``release`` (what ``load_model(packed=True)`` does, see
:mod:`edge_sdk.mapped_pages`) and ``keep`` (the checkpoint pages the packing read stay
mapped in). Each reads ``VmRSS``, ``RssAnon`` and ``RssFile`` of ``/proc/self/status``
after the load and again after TOKENS greedy decode steps of a coding prompt, and hashes
its logits; both processes must agree bit for bit. Prints one line per process and one
JSON line last (bytes in GB).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time


def _status() -> dict:
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: round(int(d[k].split()[0]) * 1024 / 1e9, 3) for k in ("VmRSS", "RssAnon",
                                                                      "RssFile")}


def _one(target: str, dtype: str, tokens: int, mode: str) -> dict:
    import torch

    import edge_sdk.mapped_pages as mp
    from edge_sdk.kvmodel import KVModel
    from edge_sdk.models import encode_prompt, load_model
    from edge_sdk.packed import packed_default

    if mode == "keep":
        mp.release_checkpoint_pages = lambda maps: 0
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    m, tok = load_model(target, dtype=dtype, packed=packed_default())
    res = {"mode": mode, "load_s": round(time.perf_counter() - t0, 1),
           "after_load_gb": _status()}
    kv = KVModel(m)
    ids = encode_prompt(tok, "Write a Python function that checks whether a number is "
                             "prime.", chat=True)
    h = hashlib.sha256()
    logits = kv.forward(ids, last=1)
    out = []
    for _ in range(tokens):
        h.update(logits.float().numpy().tobytes())
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits = kv.forward([nxt])
    res.update(after_decode_gb=_status(), tokens=out, logits_sha256=h.hexdigest()[:16])
    return res


def main(target: str = "qwen2.5-coder-1.5b", dtype: str = "float32",
         tokens: str = "16") -> dict:
    runs = {}
    for mode in ("release", "keep"):
        p = subprocess.run([sys.executable, "-m", "bench.probes.load_rss", "--one", target,
                            dtype, tokens, mode], capture_output=True, text=True, check=True)
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        r = runs[mode]
        print(f"{mode:8s} load {r['load_s']} s; after load {r['after_load_gb']}; "
              f"after {tokens} tokens {r['after_decode_gb']}", flush=True)
    res = {"target": target, "dtype": dtype, "tokens": int(tokens),
           "identical": runs["release"]["logits_sha256"] == runs["keep"]["logits_sha256"],
           "vmrss_gb": {k: v["after_decode_gb"]["VmRSS"] for k, v in runs.items()},
           "runs": runs}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(_one(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))
    else:
        main(*sys.argv[1:4])
