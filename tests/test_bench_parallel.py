"""benchmarks/bench_parallel.py --quick on the tiny random model: it runs, and its figures say what
parallel sampling must do (samples identical to separate copies, the prompt computed once, fewer
pages at peak, n - 1 copies on write per partly filled last page)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.soak
def test_quick_run_on_the_tiny_model(tmp_path):
    out = tmp_path / "parallel.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_parallel.py"), "--model", "tiny-llama",
                           "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    par, cop, s = r["systems"]["parallel"], r["systems"]["copies"], r["summary"]
    assert s["identical_samples"] == s["samples"] == 8 * 4
    assert cop["prompt_tokens_computed"] == 4 * par["prompt_tokens_computed"]
    assert par["peak_pages_in_use"] < cop["peak_pages_in_use"] and s["pages_saved"] > 0
    assert par["cow_copies"] > 0 and cop["cow_copies"] == 0
    assert par["pool_whole"] and cop["pool_whole"] and par["compiles_during_run"] == 0
