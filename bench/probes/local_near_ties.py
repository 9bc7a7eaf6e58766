"""Where a local bench run's ``cats`` output differs from ``local-offload-ar``'s (greedy),
is it a bf16 near-tie of the target alone's own logits?

    python -m bench.probes.local_near_ties docs/figures/cats/quant50 [more run folders]

For each (profile, prompt) of a run folder's ``requests.jsonl`` whose two outputs
differ, the offloaded target alone (a 50 % budget, unthrottled storage: the same
numerics as the bench's ``local-offload-ar``) replays ``local-offload-ar``'s tokens up
to the first difference with one-token passes, as it decoded them, and prints the top-2
logit gap there: ``near-tie`` when it is below ``sampling.NEAR_TIE_GAP["bfloat16"]``
and ``cats``'s token is one of the two, else ``HARD`` (a bug).
"""

from __future__ import annotations

import json
import sys


def main(argv=None) -> list[dict]:
    import torch

    from bench.local.run import _requests
    from edge_sdk.local_target.load import open_local_target
    from edge_sdk.metrics import classify_divergence
    from edge_sdk.protocol.sampling import near_tie_gap

    runs = list(argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(1)
    t = open_local_target("qwen2.5-coder-1.5b", 0.5, "ram", quant=False).target
    gap0, out = near_tie_gap("bfloat16"), []
    for d in runs:
        cfg = json.load(open(f"{d}/results.json"))["config"]
        prompts = {(r["workload"], r["prompt_id"]): r["prompt_ids"] for r in _requests(
            cfg["target"], cfg["workloads"], "greedy", cfg["prompts"], 0)}
        by: dict = {}
        for line in open(f"{d}/requests.jsonl"):
            x = json.loads(line)
            by.setdefault((x["profile"], x["workload"], x["prompt_id"]), {})[x["mode"]] = x
        for (prof, wl, pid), v in by.items():
            a, c = v["local-offload-ar"]["token_ids"], v["cats"]["token_ids"]
            j, _ = classify_divergence(a, [], c, [])
            row = {"run": d, "profile": prof, "prompt_id": pid, "diverges_at": j}
            if j is not None and j < min(len(a), len(c)):
                p = prompts[(wl, pid)]
                t.reset()
                t.run_layers(t.embed(p[:-1]), 0, t.num_layers)
                seq = p[-1:] + a[:j]
                for x in seq[:-1]:
                    t.forward([x])
                top = t.forward([seq[-1]])[0].topk(2)
                gap = float(top.values[0] - top.values[1])
                ties = [j] if gap < gap0 and c[j] in top.indices.tolist() else []
                kind = classify_divergence(a, ties, c, [])[1]
                row |= {"ar": a[j], "cats": c[j], "top2": top.indices.tolist(), "gap": gap,
                        "kind": "near-tie" if kind == "near_tie" else "HARD"}
            elif j is not None:
                row["kind"] = "HARD"                   # one output stops early
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    main()
