"""benchmarks/bench_prefix.py: its --quick path end to end on the tiny random model, and its workload
builders (system prompt cut to a token count, distinct questions)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_prefix.py"


def test_workload_builders():
    from jpa.models.tokenizer import ByteTokenizer
    from jpa.tools import bench

    tok = ByteTokenizer()
    for n in (40, 600, 5000):  # 5000 > the policy's length: it is repeated
        text = bench.build_system_prompt(tok, n)
        assert n - 30 <= len(tok.encode(text)) <= n, n
        assert bench.POLICY.startswith(text[:30])
    base = list(bench.PROMPTS) + [bench.PROMPTS[0], "one more"]  # a repeat is dropped
    qs = bench.distinct_questions(100, base)
    assert len(qs) == len(set(qs)) == 100
    assert qs[:len(bench.PROMPTS) + 1] == list(bench.PROMPTS) + ["one more"]


@pytest.mark.soak
def test_quick_run_tiny_model(tmp_path):
    out, png = tmp_path / "prefix.json", tmp_path / "prefix.png"
    # The persistent compilation cache (a fresh folder) lets the second engine reuse the first
    # one's compiled step: the same program, caching on or off.
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--quick", "--num-requests", "8",
           "--system-tokens", "96", "--max-new", "4", "--max-seqs", "4", "--max-num-batched-tokens", "64",
           "--warmup-requests", "1", "--out", str(out), "--plot", str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "target end-to-end throughput >= 2x" in r.stdout and "8/8 requests identical" in r.stdout
    rep = json.loads(out.read_text())
    assert png.stat().st_size > 0
    for key in ("machine", "workload", "engine_config", "warmup", "results", "ratios", "targets", "output_equality"):
        assert key in rep, key
    assert {"load_average_before", "load_average_after", "cpu_count"} <= set(rep["machine"])
    w = rep["workload"]
    assert w["num_requests"] == 8 and w["max_new_tokens"] == 4 and 66 <= w["system_prompt_tokens"] <= 96
    assert w["shared_prefix_tokens"] >= w["system_prompt_tokens"]  # the template's system header too
    off, on = rep["results"]["off"], rep["results"]["on"]
    for r_ in (off, on):
        for key in ("prefill_tokens", "tok_s", "req_s", "ttft_p50_s", "ttft_p99_s", "peak_pages_used",
                    "peak_pages_held_between_rounds", "prefix_hit_rate", "wall_seconds"):
            assert key in r_, key
        assert r_["generated_tokens"] == 8 * 4
        assert len(r_["ttft_s"]) == 8 and 0 < r_["ttft_p50_s"] <= r_["ttft_p99_s"] <= r_["wall_seconds"]
        assert r_["compiles_in_run"] == 0 and r_["pool_whole_after_flush"]
    # Off computes every prompt token; on serves the shared full pages from the cache.
    assert off["prefill_tokens"] == sum(w["prompt_tokens"]) and off["prefix_hit_tokens"] == 0
    assert on["prefill_tokens"] == off["prefill_tokens"] - on["prefix_hit_tokens"]
    assert on["prefix_hit_tokens"] > 0 and on["prefill_tokens"] < off["prefill_tokens"]
    assert rep["ratios"]["prefill_reduction"] == 1 - on["prefill_tokens"] / off["prefill_tokens"]
    # The measured "on" run starts cold: the warm-up's cached pages were flushed.
    assert rep["warmup"]["on"]["flushed_pages"] > 0 and rep["warmup"]["on"]["pool_whole_after_flush"]
    eq = rep["output_equality"]
    assert eq["identical_requests"] == eq["requests"] == 8 and not eq["mismatches"]
