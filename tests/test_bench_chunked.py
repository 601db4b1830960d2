"""benchmarks/bench_chunked.py end to end on the tiny random model: the --quick path runs, every token
is accounted for, a warm pass compiles nothing, and the long prompts land while others decode."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_chunked.py"
SMALL = ["--tiny", "--quick", "--long-min", "200", "--long-max", "300", "--max-new", "16", "--long-new", "3",
         "--steps-per-call", "2", "--max-model-len", "512", "--budgets", "32"]


def bench_chunked(*argv):
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600)


@pytest.mark.soak
def test_quick_run_on_tiny_model(tmp_path):
    out, png = tmp_path / "chunked.json", tmp_path / "chunked.png"
    proc = bench_chunked(*SMALL, "--out", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    work = report["workload"]
    assert [r["max_new"] for r in work["short"]] == [16, 16]
    assert all(200 <= r["prompt_tokens"] <= 300 + 120 for r in work["long"]), "long prompts in the asked range (+ one question)"
    expected = sum(r["max_new"] for r in work["short"] + work["long"])
    names = ["separate"] + (["unified-32"] if report["unified_available"] else [])
    assert list(report["systems"]) == names
    for name, s in report["systems"].items():
        w = s["warm"]
        assert w["generated_tokens"] == expected, name
        assert w["compiles_in_pass"] == 0 and w["compile_seconds_in_pass"] == 0, f"{name}: warm pass compiled"
        assert s["cold"]["compiled_programs"] >= 1 and s["cold"]["compile_seconds"] > 0, name
        assert s["outputs_cold_vs_warm"]["identical"] == s["outputs_cold_vs_warm"]["requests"] == 4, name
        # Both long prompts arrived while the short requests were decoding: some of their gaps
        # fall in a prefill window.
        assert w["itl_during_prefill_ms"]["n"] >= 2, name
        assert len(s["timeline"]["prefill_windows"]) == 2
        for key in ("ttft_ms", "itl_ms", "itl_during_prefill_ms"):
            assert 0 <= w[key]["p50"] <= w[key]["p99"] <= w[key]["max"] and math.isfinite(w[key]["max"]), (name, key)
        assert w["gen_tok_s"] > 0 and w["total_tok_s"] > w["gen_tok_s"]
    if report["unified_available"]:
        r = report["ratios"]["unified-32"]
        assert set(r["targets"]) == {"throughput_not_lost", "throughput_loss_within_rep_spread",
                                    "p99_itl_during_prefill_cut", "compile_time_cut"}
        assert "outputs_vs_separate" in report["systems"]["unified-32"]


@pytest.mark.parametrize("argv,msg", [
    pytest.param(["--budgets", "a,b"], "--budgets must be comma-separated integers", marks=pytest.mark.soak),
    pytest.param(["--budgets", "0"], "--budgets must name at least one budget >= 1", marks=pytest.mark.soak),
    pytest.param(["--long-min", "900", "--long-max", "800"], "--long-max (800) must be >= --long-min (900)",
                 marks=pytest.mark.soak),
    pytest.param(["--num-short", "6", "--num-long", "4"], "--max-seqs (8) must hold --num-short + --num-long (10)",
                 marks=pytest.mark.soak),
    (["--long-max", "2000"], "--max-model-len (2048) must hold"),
])
def test_bad_flags_exit_2_with_a_message(argv, msg):
    proc = bench_chunked(*argv)
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr[-2000:]
