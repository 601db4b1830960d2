"""benchmarks/bench_multihost.py on the tiny model: the three configurations run, the 2-process run's
tokens equal the 1-process run's, and the ratios are those of the rows."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.soak]   # CI's bench tier (.ci/run), not ./run test

ROOT = pathlib.Path(__file__).parents[1]


def test_tiny_run(tmp_path):
    out = tmp_path / "multihost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_multihost.py"), "--requests", "3",
                           "--max-new", "8", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["processes"], r["tp"]) for r in rows] == [(1, 4), (2, 4), (1, 1)]
    assert all(r["same_tokens"] for r in rows) and all(r["decode_tokens"] > 0 for r in rows)
    for r in rows:
        assert r["vs_one_process"] == round(r["decode_tok_s"] / rows[0]["decode_tok_s"], 3)
    assert "| 2 processes, tp=4 |" in proc.stdout
