"""``specrelay bench --scale-out``: embedded vs the Ray ingress over 1 and 2 replicas
(:mod:`bench.replicas`), on the tiny random model: three rows of identical outputs,
JSON + PNG written, the overhead-not-scaling note printed. A real CLI subprocess (its
local Ray cluster ends with it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="needs the [ray] extra: pip install -e \".[ray]\"")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_scale_out_writes_json_png_and_the_note(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "specrelay_cli", "bench", "--scale-out",
                        "--concurrency", "4", "--max-new-tokens", "4", "--out", str(out)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "overhead, not scaling" in r.stdout
    res = json.loads((out / "replicas.json").read_text())
    assert [row["setup"] for row in res["rows"]] == ["embedded", "ray x1", "ray x2"]
    assert all(row["identical"] and row["tokens"] == 16 for row in res["rows"])
    assert all(row["throughput_tok_s"] > 0 for row in res["rows"])
    assert res["model"] == "tiny" and "not scaling" in res["note"]
    assert (out / "replicas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_scale_out_takes_one_concurrency():
    from click.testing import CliRunner

    import specrelay_cli

    r = CliRunner().invoke(specrelay_cli.main, ["bench", "--scale-out", "--concurrency",
                                                "4,8"])
    assert r.exit_code == 2 and "one --concurrency value" in r.output
