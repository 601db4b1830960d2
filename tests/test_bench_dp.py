"""benchmarks/bench_dp.py on the tiny random model: it runs both systems, every request succeeds, the
router spreads the burst over both replicas, nothing compiles during a measurement, and the JSON
carries the figures and the CPU caveat."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from router_util import require_router

pytestmark = [pytest.mark.bench, pytest.mark.soak]   # CI's bench tier (.ci/run), not ./run test

ROOT = pathlib.Path(__file__).parents[1]


def test_tiny_run(tmp_path):
    require_router()
    out = tmp_path / "dp.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JPA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_dp.py"), "--num-prompts", "8",
                           "--rates", "inf", "--input-mean", "32", "--output-mean", "8", "--max-input", "64", "--max-output", "16",
                           "--max-model-len", "128", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "same cores" in r["note"] and r["model"] == "tiny-llama"
    direct, dp2 = r["systems"]
    assert (direct["system"], direct["replicas"], direct["router"]) == ("direct", 1, None)
    assert (dp2["system"], dp2["replicas"], dp2["router"]["policy"]) == ("dp2", 2, "cache_aware")
    for s in (direct, dp2):
        (row,) = s["results"]
        assert row["rate"] == "inf" and row["completed"] == row["requests"] == 8 and row["failed"] == 0
        assert row["request_throughput"] > 0 and row["output_throughput"] > 0
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"]
        assert sum(row["requests_per_replica"]) == 8 and row["compilations_during_run"] == 0
    # Eight requests at once: cache_aware sends prompts it has not seen to the least-loaded replica.
    assert min(dp2["results"][0]["requests_per_replica"]) > 0
    assert "| dp2 | inf |" in proc.stdout
