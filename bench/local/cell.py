"""One local-target bench cell in a fresh process, so that its peak RSS is its own:
``python -m bench.local.cell '<json spec>'`` prints one JSON object on stdout.

The spec: ``target``, ``method`` (``cats`` / ``ar``), ``budget`` (fraction or bytes),
``storage`` (profile name), ``dtype``, ``threads``, ``requests`` (a list of
``{prompt_id, workload, prompt_ids, seed}``), ``sampling`` (a SamplingConfig dict),
``max_new_tokens``, ``depth``, ``beam``, ``nodes`` (None or absent: the plan's).

The answer: ``rss_after_import_bytes`` (the interpreter + torch + transformers, before
any weight), ``rss_after_load_bytes``, ``peak_rss_bytes`` (``ru_maxrss`` at the end:
the whole process, Python included), the plan, and one record per request (token ids,
stats).
"""

from __future__ import annotations

import json
import resource
import sys


def _rss_now() -> int:
    """Current resident set size of this process (bytes, /proc/self/statm)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # KiB on Linux


def run(spec: dict) -> dict:
    """Build the session of ``spec``, run its requests, measure memory."""
    import torch

    from edge_sdk.local_target.session import build_local
    from edge_sdk.protocol.sampling import SamplingConfig

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    rss0, peak0 = _rss_now(), _peak()
    from cloud_api.exit_fit import calibration_text as calibration

    sess = build_local(spec["target"], spec["budget"], spec["storage"], spec["dtype"],
                       spec["method"], calibration, spec.get("depth"))
    sess.beam, sess.nodes = spec.get("beam"), spec.get("nodes")
    rss1 = _rss_now()
    cfg = SamplingConfig.from_dict(spec["sampling"])
    recs = []
    for r in spec["requests"]:
        toks, st = sess.generate(r["prompt_ids"], spec["max_new_tokens"], cfg, r["seed"])
        recs.append({"prompt_id": r["prompt_id"], "workload": r["workload"],
                     "seed": r["seed"], "token_ids": toks, "stats": st.to_dict()})
    return {"rss_after_import_bytes": rss0, "peak_rss_after_import_bytes": peak0,
            "rss_after_load_bytes": rss1, "peak_rss_bytes": _peak(),
            "local": sess.describe(), "records": recs}


if __name__ == "__main__":
    out = run(json.loads(sys.argv[1]))
    sys.stdout.write("\n@@RESULT@@" + json.dumps(out) + "\n")
