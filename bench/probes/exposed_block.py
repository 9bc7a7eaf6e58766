"""An event model of pipelined rounds (IPDG + blocks sent ahead) and the depth of the
block drafted after a miss: rate and target passes per token against that depth.

    python -m bench.probes.exposed_block [--alphas 0.9,0.85] [--tau 0.038]
        [--verify 0.30] [--delay 0.025] [--depth 8] [--fresh 2,3,4,5,6,8]
        [--tokens 40000] [--bonus 0.9]

The cycle (one request, one edge core, one cloud core):

* after a miss nothing is in flight: the edge drafts an *exposed* block of ``fresh``
  tokens (``fresh * tau`` seconds, the cloud idle), then sends it;
* the cloud verifies blocks in arrival order, ``verify`` seconds per pass whatever the
  block's size (AMX: a 9-token pass costs a 1-token one), ``delay`` seconds each way;
* while a block is in flight the edge drafts the next one, ``depth`` tokens, on the
  assumption that the block is accepted whole and the bonus token is the draft's guess,
  and sends it as soon as it is drafted (a proactive hit: the cloud verifies back to back);
* each draft token is accepted with probability ``alpha`` independently; the bonus guess
  is right with probability ``bonus``; a rejection or a wrong guess is a miss.

Prints, per ``alpha``, the rate relative to ``fresh = depth`` and target passes per
committed token for each ``fresh``, then a JSON object. A model, not a measurement: the
bench (modes ``sr-paced`` / ``sr-paced-long``) measures the real thing.
"""

from __future__ import annotations

import argparse
import json
import random


def simulate(alpha: float, tau: float, verify: float, delay: float, depth: int,
             fresh: int, bonus: float = 0.9, tokens: int = 40000,
             seed: int = 0) -> tuple[float, float]:
    """-> (committed tokens per second, target passes per committed token)."""
    rng = random.Random(seed)
    t = cloud_free = verdict = 0.0
    done = passes = 0
    exposed = True
    while done < tokens:
        n = fresh if exposed else depth
        if exposed:
            t += n * tau                        # drafted with nothing in flight
        sent = t
        cloud_free = max(sent + delay, cloud_free) + verify
        verdict = cloud_free + delay
        passes += 1
        accepted = 0
        while accepted < n and rng.random() < alpha:
            accepted += 1
        done += accepted + 1                    # + the correction or the bonus token
        if accepted == n and rng.random() < bonus:
            t = sent + depth * tau              # the next block, drafted in the shadow
            exposed = False
        else:
            t = verdict                         # a miss: redraft from the verdict
            exposed = True
    return done / max(t, verdict), passes / done


def main(alphas: str = "0.9,0.85", tau: float = 0.038, verify: float = 0.30,
         delay: float = 0.025, depth: int = 8, fresh: str = "2,3,4,5,6,8",
         tokens: int = 40000, bonus: float = 0.9) -> dict:
    out = {"tau": tau, "verify": verify, "delay": delay, "depth": depth, "rows": []}
    for a in (float(x) for x in alphas.split(",")):
        base, _ = simulate(a, tau, verify, delay, depth, depth, bonus, tokens)
        cells = []
        for f in (int(x) for x in fresh.split(",")):
            rate, ppt = simulate(a, tau, verify, delay, depth, f, bonus, tokens)
            cells.append({"fresh": f, "rate_vs_depth": round(rate / base, 3),
                          "tok_s": round(rate, 2), "passes_per_token": round(ppt, 3)})
        out["rows"].append({"alpha": a, "cells": cells})
        print(f"alpha {a}: " + ", ".join(f"fresh {c['fresh']}: {c['rate_vs_depth']:.3f}x, "
                                         f"{c['passes_per_token']:.3f} passes/token"
                                         for c in cells))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", default="0.9,0.85")
    ap.add_argument("--tau", type=float, default=0.038)
    ap.add_argument("--verify", type=float, default=0.30)
    ap.add_argument("--delay", type=float, default=0.025)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--fresh", default="2,3,4,5,6,8")
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--bonus", type=float, default=0.9)
    x = ap.parse_args()
    main(x.alphas, x.tau, x.verify, x.delay, x.depth, x.fresh, x.tokens, x.bonus)
