"""What the round traces of a bench run say about its pacing, from a ``requests.jsonl``.

    python -m bench.probes.round_pacing docs/figures/experiments/redraft-steps/requests.jsonl

1. What the paced depth reads, per (mode, profile): the median send -> verdict seconds
   ``T`` of blocks not drafted proactively, the median seconds per proactive draft step
   ``tau`` (``t_ready - t_send`` over the steps drafted while a block was verified), and
   ``T / tau``.
2. Where a request's decode time goes, per (mode, profile, workload), over consecutive
   rounds: the medians of the cycle (verdict to next verdict), of send -> verdict and of
   verdict -> next send, and the seconds the edge drafted with nothing in flight (the
   sum of the positive verdict -> next send gaps: the cloud idles unless other requests
   keep it busy) against the decode seconds (wall time less TTFT); the mean verdict ->
   next send after a round that accepted its whole block (a hit: the next block was
   drafted behind it) and after one that did not (a miss: the next block is drafted
   after it); and the requests' blocks sent ahead (``ahead_blocks``), how many of those
   the verdict kept (``ahead_hits``), against their proactive hits (``proactive_hits``).
"""

from __future__ import annotations

import json
import statistics
import sys


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def pacing(rows: list[dict]) -> dict:
    """Part 1 (see the module docstring), keyed ``mode|profile``."""
    out = {}
    for key in sorted({(r["mode"], r["profile"]) for r in rows}):
        T, tau = [], []
        for r in rows:
            if (r["mode"], r["profile"]) != key:
                continue
            for t in r["metrics"].get("round_trace", []):
                if t["depth"] > 0 and not t["proactive_block"]:
                    T.append(t["t_response"] - t["t_send"])
                if t["t_ready"] is not None and t["proactive_steps"]:
                    tau.append((t["t_ready"] - t["t_send"]) / t["proactive_steps"])
        if T and tau:
            m_T, m_tau = statistics.median(T), statistics.median(tau)
            out["|".join(key)] = {"T_s": round(m_T, 3), "tau_s": round(m_tau, 4),
                                  "T_over_tau": round(m_T / m_tau, 2)}
    return out


def cycles(rows: list[dict]) -> dict:
    """Part 2 (see the module docstring), keyed ``mode|profile|workload``; seconds."""
    out = {}
    for key in sorted({(r["mode"], r["profile"], r["workload"]) for r in rows}):
        cyc, flight, gap, exposed, decode = [], [], [], 0.0, 0.0
        after = {True: [], False: []}       # verdict -> next send, by "the round hit"
        ahead = used = hits = 0
        for r in rows:
            if (r["mode"], r["profile"], r["workload"]) != key:
                continue
            m = r["metrics"]
            decode += m["wall_s"] - m["ttft_s"]
            ahead += int(m.get("ahead_blocks", 0) or 0)
            used += int(m.get("ahead_hits", 0) or 0)
            hits += int(m.get("proactive_hits", 0) or 0)
            tr = m.get("round_trace", [])
            for a, b in zip(tr, tr[1:]):
                cyc.append(b["t_response"] - a["t_response"])
                flight.append(b["t_response"] - b["t_send"])
                gap.append(b["t_send"] - a["t_response"])
                exposed += max(0.0, gap[-1])
                if a["depth"] > 0:
                    after[a["accepted"] == a["depth"]].append(gap[-1])
        if cyc:
            out["|".join(key)] = {
                "rounds": len(cyc), "cycle_s": round(statistics.median(cyc), 3),
                "send_to_verdict_s": round(statistics.median(flight), 3),
                "verdict_to_send_s": round(statistics.median(gap), 3),
                "exposed_drafting_s": round(exposed, 1), "decode_s": round(decode, 1),
                "after_hit_s": _mean(after[True]), "after_miss_s": _mean(after[False]),
                "misses": len(after[False]), "ahead_blocks": ahead, "ahead_hits": used,
                "proactive_hits": hits}
    return out


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def main(path: str) -> dict:
    rows = _rows(path)
    out = {"pacing": pacing(rows), "cycles": cycles(rows)}
    for key, v in out["pacing"].items():
        print(f"{key:>30}: T {v['T_s'] * 1e3:6.1f} ms, tau {v['tau_s'] * 1e3:5.1f} ms, "
              f"T/tau {v['T_over_tau']:4.1f}")
    for key, v in out["cycles"].items():
        print(f"{key:>40}: medians over {v['rounds']} rounds: cycle "
              f"{v['cycle_s'] * 1e3:5.0f} ms, verdict->send "
              f"{v['verdict_to_send_s'] * 1e3:5.0f}, send->verdict "
              f"{v['send_to_verdict_s'] * 1e3:5.0f}; "
              f"drafting with nothing in flight {v['exposed_drafting_s']:.1f} of "
              f"{v['decode_s']:.1f} s of decode; verdict->send after a hit "
              f"{_ms(v['after_hit_s'])}, after a miss {_ms(v['after_miss_s'])} "
              f"({v['misses']} misses); {v['ahead_blocks']} blocks sent ahead "
              f"({v['ahead_hits']} kept), {v['proactive_hits']} proactive hits")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1])
