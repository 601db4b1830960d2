"""benchmarks/bench_ladder.py on the tiny model: it runs, and its figures hold together (both engines
made every token, the ladder compiled every shape once in the background, TTFTs measured; the
sweep ran each count of users on the shape that holds it)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test
ROOT = pathlib.Path(__file__).parents[1]
TINY = ["--model", "tiny-llama", "--max-seqs", "4", "--max-num-batched-tokens", "64", "--users", "4",
        "--max-new-tokens", "4", "--reps", "1", "--no-compile-cache"]


def bench(tmp_path, *args) -> dict:
    out = tmp_path / "ladder.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ladder.py"), *TINY, *args,
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_quick_run_on_the_tiny_model(tmp_path):
    r = bench(tmp_path, "--prompts", "1", "--lengths", "8,40")
    lad, off = r["compiles"]["ladder"], r["compiles"]["off"]
    assert off["shapes"] == [[4, 64]] and off["ladder_compiles"] == 0
    assert lad["shapes"] == [[1, 16], [2, 32], [4, 64]] and lad["ladder_compiles"] == 2
    for mode in ("off", "ladder"):
        m = r["medians"][mode]
        assert m["one_user_tok_s"] > 0 and m["users_tok_s"] > 0 and m["one_user_ttft_ms"] > 0
        assert m["ttft_len8_ms"] > 0 and m["ttft_len40_ms"] > 0 and m["ttft_under_load_ms"] > 0


def test_sweep_on_the_tiny_model(tmp_path):
    r = bench(tmp_path, "--lengths", "8", "--sweep", "1,3")["sweep"]
    assert r["off"]["1"]["shapes"] == [[4, 64]] and r["off"]["3"]["shapes"] == [[4, 64]]
    assert [1, 16] in r["ladder"]["1"]["shapes"] and r["ladder"]["3"]["shapes"] == [[4, 64]]
    assert all(v["tok_per_cpu_s"] > 0 and v["tok_s"] > 0 for by in r.values() for v in by.values())
