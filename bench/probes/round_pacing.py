"""What the paced depth reads from a bench run: per (mode, profile), the median send ->
verdict seconds ``T`` of blocks not drafted proactively and the median seconds per
proactive draft step ``tau`` (``t_ready - t_send`` over the steps drafted while a block
was verified), from the round traces of a ``requests.jsonl``, and ``T / tau``.

    python -m bench.probes.round_pacing docs/figures/experiments/redraft-steps/requests.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)]
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
            print(f"{key[0]:>16} {key[1]:>12}: T {m_T * 1e3:6.1f} ms, tau "
                  f"{m_tau * 1e3:5.1f} ms, T/tau {m_T / m_tau:4.1f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1])
