"""benchmarks/bench_structured.py --tiny --quick: it runs, and its figures hold together (one compiled
program, the unconstrained half made all its tokens in both systems, masks were computed for the
constrained half, whose finished outputs validate against the schema)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")
ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.soak
def test_quick_run_on_the_tiny_model(tmp_path):
    out = tmp_path / "structured.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_structured.py"), "--tiny", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    mixed, none = r["systems"]["mixed"], r["systems"]["none"]
    n, new = r["num_requests"], r["max_new"]
    assert mixed["free_tokens"] == n // 2 * new and none["free_tokens"] == n // 2 * new
    assert mixed["masks"] == mixed["constrained_tokens"] > 0 and none["masks"] == 0
    assert r["constrained_outputs_valid"] is True and r["step_compiles"] == 1
    assert 0 < r["compile_ms_mean"] <= r["compile_ms_max"] and r["mask_ms_per_token"] > 0
