"""Coverage-guided fuzzing (atheris, libFuzzer) of the wire decoders and the signed-request
parser.

    python -m fuzz TARGET [-runs=1000000] [-max_total_time=S] [libFuzzer flags...]
    python -m fuzz all --runs 1000000 [--out fuzz-results.json]

``TARGET`` is one of :data:`fuzz.targets.TARGETS`. The corpus starts from valid messages
built with the real encoders (:func:`fuzz.targets.seeds`); the code under test
(``edge_sdk.protocol``, ``cloud_api.auth``) is instrumented for coverage. A finding (an
exception other than the documented refusal, or a round-trip / forgery property
violation) stops the run with libFuzzer's crash report and a non-zero exit. ``all`` runs
every target in its own process and prints (and writes) one row per target: executions,
seconds, findings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time


#: the modules whose functions and methods are instrumented for coverage
INSTRUMENTED = ("edge_sdk.protocol", "cloud_api.auth", "cloud_api.keys", "fuzz.targets")


def _instrument(obj, module: str) -> None:
    import atheris

    if isinstance(obj, type) and obj.__module__ == module:
        for k, v in list(vars(obj).items()):
            f = getattr(v, "__func__", v)
            if callable(f) and getattr(f, "__code__", None) is not None:
                setattr(obj, k, type(v)(atheris.instrument_func(f))
                        if isinstance(v, (classmethod, staticmethod))
                        else atheris.instrument_func(f))
    elif callable(obj) and getattr(obj, "__module__", None) == module and \
            getattr(obj, "__code__", None) is not None:
        atheris.instrument_func(obj)


def _fuzz_one(name: str, flags: list[str]) -> None:
    import atheris

    from fuzz import targets

    # the packages under test, whichever finder imported them (an editable install's
    # finder bypasses atheris' import hook)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(INSTRUMENTED):
            for obj in list(vars(mod).values()):
                _instrument(obj, mod.__name__)
    target = targets.TARGETS[name]
    corpus = tempfile.mkdtemp(prefix=f"fuzz-{name}-")
    for i, seed in enumerate(targets.seeds(name)):
        with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
            f.write(seed)
    atheris.Setup([sys.argv[0], *flags, corpus], target)
    atheris.Fuzz()                                    # exits the process


def _run_all(runs: int, out: str | None) -> int:
    from fuzz.targets import TARGETS

    rows = []
    for name in TARGETS:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "fuzz", name, f"-runs={runs}",
                            "-print_final_stats=1", "-rss_limit_mb=2048",
                            f"-artifact_prefix={tempfile.gettempdir()}/fuzz-{name}-"],
                           capture_output=True, text=True)
        m = re.search(r"stat::number_of_executed_units:\s*(\d+)", p.stderr)
        rows.append({"target": name, "executions": int(m.group(1)) if m else None,
                     "seconds": round(time.monotonic() - t0, 1),
                     "findings": 0 if p.returncode == 0 else 1, "exit_code": p.returncode})
        r = rows[-1]
        print(f"{name:20s} {r['executions'] or 0:>10,} execs {r['seconds']:>8.1f} s  "
              f"findings {r['findings']}", flush=True)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["findings"] for r in rows) else 0


def main(argv: list[str]) -> int:
    from fuzz.targets import TARGETS

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("targets:", ", ".join(TARGETS))
        return 0
    if argv[0] == "all":
        runs = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 100_000
        out = argv[argv.index("--out") + 1] if "--out" in argv else None
        return _run_all(runs, out)
    if argv[0] not in TARGETS:
        print(f"Error: unknown target {argv[0]!r}; one of {', '.join(TARGETS)}",
              file=sys.stderr)
        return 2
    _fuzz_one(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
