"""The draft's prefill of one long prompt, in chunks against one graph call: seconds
and the process's peak resident memory.

    python -m bench.probes.long_prefill [DRAFT_DIR] [--tokens 6000] [--chunks 512,0]
        [--threads 2]

Each chunk size runs in a fresh process (peak RSS is per process): an
:class:`~edge_sdk.drafters.onnx.OnnxRunner` on the export folder (default: the
first-use int4 export of the default draft) appends ``--tokens`` token ids (a
repeating run of ordinary ids: the cost does not depend on which) from an empty cache,
``PREFILL_CHUNK`` set to the chunk size (0: the whole prompt in one graph call, the
behaviour before chunked prefill). Prints one line per chunk size and a JSON object
(``seconds``, ``peak_rss_mb``, ``cache_len``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def one(draft: str, tokens: int, chunk: int, threads: int) -> dict:
    """Prefill in this process; returns seconds, peak RSS (MB) and the cache length."""
    import edge_sdk.drafters.onnx as onnx_mod

    if chunk:
        onnx_mod.PREFILL_CHUNK = chunk
    else:
        onnx_mod.PREFILL_CHUNK = tokens + 1
    runner = onnx_mod.OnnxRunner(draft, threads=threads)
    ids = [100 + i % 5000 for i in range(tokens)]
    t0 = time.perf_counter()
    runner.forward_np(ids, last=1)
    return {"chunk": chunk, "tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "cache_len": runner.cache_len()}


def main(argv=None) -> dict:
    from edge_sdk.drafters.runtime import onnx_cache_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--chunks", default="512,0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    draft = a.draft or str(onnx_cache_path("qwen2.5-coder-0.5b", "int4"))
    if a.one is not None:                      # the child process
        print(json.dumps(one(draft, a.tokens, a.one, a.threads)))
        return {}
    out = {"draft": draft, "runs": []}
    for chunk in (int(c) for c in a.chunks.split(",")):
        res = subprocess.run([sys.executable, "-m", "bench.probes.long_prefill", draft,
                              "--tokens", str(a.tokens), "--threads", str(a.threads),
                              "--one", str(chunk)], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
        if res.returncode:
            row = {"chunk": chunk, "tokens": a.tokens, "failed": res.returncode,
                   "stderr": res.stderr.strip().splitlines()[-1:]}
        else:
            row = json.loads(res.stdout.strip().splitlines()[-1])
        out["runs"].append(row)
        print(f"chunk {chunk or 'none'}: {row}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
