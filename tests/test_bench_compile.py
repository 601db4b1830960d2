"""benchmarks/bench_compile.py end to end at its smallest: the CPU part for the Llama-shaped random
model at 1 layer, one fresh-process compile of a small engine's step. The JSON has every field the
before/after comparison of issue 24 reads, with sane values, and nothing came from a compilation
cache. The ratios and goals are checked on stand-in worker results (no compiling)."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_compile.py"


def bench_compile(*argv, check=True):
    """Runs the script (its CPU part compiles in fresh worker processes of its own)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.soak
def test_smallest_cpu_run(tmp_path):
    out = tmp_path / "compile.json"
    engine = "max_seqs=2,max_num_batched_tokens=16,steps_per_call=1,max_model_len=256"
    proc = bench_compile("--only", "cpu", "--models", "", "--layers", "1", "--reps", "1", "--engine", engine,
                         "--json", str(out))
    report = json.loads(out.read_text())
    assert report["machine"]["jax_version"] and len(report["started_loadavg"]) == 3
    cpu = report["cpu"]
    assert cpu["engine_config"]["max_num_batched_tokens"] == 16 and cpu["engine_config"]["page_size"] == 16
    assert list(cpu["results"]) == ["llama-1"] and cpu["reps"] == 1
    e = cpu["results"]["llama-1"]
    assert e["num_layers"] == 1 and e["weights"] == "random"
    (run,) = e["runs"]
    assert "error" not in run, run
    assert len(run["loadavg_before"]) == len(run["loadavg_after"]) == 3
    for key in ("trace", "lower", "compile"):
        assert 0 < e[f"{key}_seconds"] < 600 and 0 < e[f"{key}_cpu_seconds"] < 1200, key
    total = e["trace_seconds"] + e["lower_seconds"] + e["compile_seconds"]
    assert e["total_seconds"] == pytest.approx(total, rel=1e-6)
    assert e["optimized_hlo_lines"] > 100 and e["while_loops"] >= 2  # the ragged blocks and the decode loop
    assert e["cache_hits"] == 0, "a cold measurement must not be served from a compilation cache"
    assert any("disabled" in k for k in run["cache_events"]) and not any("hit" in k for k in run["cache_events"])
    assert cpu["ratios"] == {} and cpu["goals"] == {}
    assert "| llama-1 | 1 |" in proc.stdout

    # --compare of a report with itself: every shared figure at 1.00x.
    table = bench_compile("--compare", str(out), str(out)).stdout
    assert "| cpu llama-1 total_seconds |" in table and "1.00x" in table


def test_ratios_and_goals():
    """The CPU part's ratios and goals on stand-in medians: 80 / 8 layers and the SmolLM2 goal."""
    from jpa.tools.bench import compile_ratios_and_goals

    goals = dict(smollm2_compile_seconds=5.0, ratio_80_over_8=1.5)
    entry = lambda t: dict(trace_seconds=t / 4, lower_seconds=t / 4, compile_seconds=t / 2, total_seconds=t,
                           total_cpu_seconds=t)
    runs = {"smollm2-135m": entry(4.0), "llama-8": entry(2.0), "llama-80": entry(4.0)}
    ratios, met = compile_ratios_and_goals(runs, [80, 8], goals)
    assert ratios["llama-80/llama-8 total_seconds"] == 2.0 and ratios["llama-80/llama-8 trace_seconds"] == 2.0
    assert met["smollm2 <= 5 s"] == dict(value=4.0, met=True)
    assert met["llama-80 / llama-8 <= 1.5"] == dict(value=2.0, met=False)
    runs["smollm2-135m"] = entry(6.0)
    runs["llama-80"] = entry(2.5)
    ratios, met = compile_ratios_and_goals(runs, [80, 8], goals)
    assert met == {"smollm2 <= 5 s": dict(value=6.0, met=False), "llama-80 / llama-8 <= 1.5": dict(value=1.25, met=True)}
    assert compile_ratios_and_goals({"llama-1": entry(1.0)}, [1], goals) == ({}, {})


@pytest.mark.parametrize("argv,msg", [
    (["--only", "gpu"], "--only: unknown part(s) ['gpu']"),
    (["--layers", "8,x"], "--layers must be comma-separated integers"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--models", "gpt2"], "--models: choose from"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--engine", "max_seqs"], "--engine must be FIELD=INT pairs"),
    (["--engine", "num_slots=4"], "--engine: unknown field(s) ['num_slots']"),
])
def test_bad_flags_exit_2_with_a_message(argv, msg):
    proc = bench_compile(*argv, check=False)
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr[-2000:]
