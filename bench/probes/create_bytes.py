"""Bytes of the session-create request for the bench's prompts: the prompt's ids as the
msgpack integer array against ``prompt_packed`` (:func:`edge_sdk.protocol.wire.pack_prompt`),
and the whole greedy create body with every field spelled out against the SDK's body
(:meth:`edge_sdk.session.SessionParams.body`: defaults left out, the shorter prompt form).

    python -m bench.probes.create_bytes [--prompts 4] [--workloads humaneval,mtbench]

Prompts are encoded as the bench encodes them (chat template of the default pair's
tokenizer); each body carries a 16-character ``request_id`` as the SDK's does. Prints one
line per workload and a JSON object of the totals.
"""

from __future__ import annotations

import argparse
import json


def main(prompts: int = 4, workloads: str = "humaneval,mtbench") -> dict:
    from bench.cells import encode_requests
    from edge_sdk.models import load_tokenizer, tokenizer_fingerprint
    from edge_sdk.protocol import wire
    from edge_sdk.protocol.sampling import SamplingConfig
    from edge_sdk.session import SessionParams
    from specrelay_data.workloads import load_workload

    tok = load_tokenizer("qwen2.5-coder-1.5b")
    V, fp, rid = len(tok), tokenizer_fingerprint(tok), {"request_id": "x" * 16}
    params = SessionParams(SamplingConfig(), 0, "asym", 32, 4, fp, V, V)
    out = {}
    for w in workloads.split(","):
        row = dict.fromkeys(("ids_array", "ids_packed", "body_explicit", "body_sdk"), 0)
        for r in encode_requests(tok, load_workload(w)[:prompts], w, 0):
            ids = [int(t) for t in r.prompt_ids]
            row["ids_array"] += len(wire.pack(ids))
            row["ids_packed"] += len(wire.pack_prompt(ids))
            explicit = {"prompt_ids": ids, "sampling": SamplingConfig().to_dict(), "seed": 0,
                        "max_new_tokens": 32, "tokenizer_hash": fp, "mode": "asym",
                        "support_k": 32, "n_proposals": 4, "vocab_size": V, **rid}
            row["body_explicit"] += len(wire.pack(explicit))
            row["body_sdk"] += len(wire.pack({**params.body(ids, 32), **rid}))
        print(w, prompts, "prompts:", row, flush=True)
        out[w] = row
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--workloads", default="humaneval,mtbench")
    a = ap.parse_args()
    main(a.prompts, a.workloads)
