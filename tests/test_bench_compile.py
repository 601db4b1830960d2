"""scripts/bench_compile.py end to end at its smallest: the CPU part for the Llama-shaped random
model at 1 layer, one fresh-process compile of a small engine's step. The JSON has every field the
before/after comparison of issue 24 reads, with sane values, and nothing came from a compilation
cache. The ratios and goals are checked on stand-in worker results (no compiling)."""

import importlib.util
import json
import pathlib

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "bench_compile.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_compile_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def script():
    return load_script()


def test_smallest_cpu_run(script, tmp_path, capsys):
    out = tmp_path / "compile.json"
    engine = "max_seqs=2,max_num_batched_tokens=16,steps_per_call=1,max_model_len=256"
    assert script.main(["--only", "cpu", "--models", "", "--layers", "1", "--reps", "1", "--engine", engine,
                        "--json", str(out)]) == 0
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
    assert "| llama-1 | 1 |" in capsys.readouterr().out

    # --compare of a report with itself: every shared figure at 1.00x.
    script.main(["--compare", str(out), str(out)])
    table = capsys.readouterr().out
    assert "| cpu llama-1 total_seconds |" in table and "1.00x" in table


def test_ratios_and_goals(script, monkeypatch):
    """part_cpu on stand-in worker results: 80 / 8 layers and the SmolLM2 goal."""
    seconds = {("smollm2-135m", None): 4.0, ("llama", 8): 2.0, ("llama", 80): 4.0}

    def fake(kind, spec, timeout=None):
        t = seconds[(spec["model"], spec["layers"])]
        return dict(model=spec["model"], num_layers=spec["layers"] or 30, weights="random", params=1, pool_bytes=1,
                    optimized_hlo_lines=1, while_loops=2, temp_bytes=0, trace_seconds=t / 4, lower_seconds=t / 4,
                    compile_seconds=t / 2, total_seconds=t, total_cpu_seconds=t, cache_events={},
                    loadavg_before=[0, 0, 0], loadavg_after=[0, 0, 0])

    monkeypatch.setattr(script, "run_worker", fake)
    out = script.part_cpu(script.parse_args(["--models", "smollm2-135m", "--layers", "80,8", "--reps", "3"]))
    assert list(out["results"]) == ["smollm2-135m", "llama-8", "llama-80"]
    assert len(out["results"]["llama-80"]["runs"]) == 3
    assert out["ratios"]["llama-80/llama-8 total_seconds"] == 2.0
    assert out["goals"]["smollm2 <= 5 s"] == dict(value=4.0, met=True)
    assert out["goals"]["llama-80 / llama-8 <= 1.5"] == dict(value=2.0, met=False)


@pytest.mark.parametrize("argv,msg", [
    (["--only", "gpu"], "--only: unknown part(s) ['gpu']"),
    (["--layers", "8,x"], "--layers must be comma-separated integers"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--models", "gpt2"], "--models: choose from"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--engine", "max_seqs"], "--engine must be FIELD=INT pairs"),
    (["--engine", "num_slots=4"], "--engine: unknown field(s) ['num_slots']"),
])
def test_bad_flags_exit_2_with_a_message(script, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        script.parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
