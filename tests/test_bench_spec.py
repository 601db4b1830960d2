"""benchmarks/bench_spec.py on the tiny random model: it runs, the two systems' outputs are identical,
and its figures are consistent (drafts verified, accepted <= drafted, speed ratios of the rows)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.soak
def test_tiny_run(tmp_path):
    out = tmp_path / "spec.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_spec.py"), "--model", "tiny-llama",
                           "--batches", "2", "--max-new", "16", "--workloads", "grounded", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    plain, spec = r["rows"]
    assert (plain["system"], spec["system"]) == ("plain", "ngram") and spec["identical"] == "8/8"
    assert plain["generated_tokens"] == spec["generated_tokens"] > 0 and plain["draft_tokens"] == 0
    assert spec["draft_tokens"] >= spec["accepted_tokens"] > 0
    assert spec["speedup"] == round(spec["tok_s"] / plain["tok_s"], 3)
    assert "| grounded | 2 |" in proc.stdout
