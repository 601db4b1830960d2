"""Tensor parallelism of the Hugging Face families with their own layer code (Gemma-2: soft caps,
alternating sliding windows, post-norms; Qwen3: q/k RMSNorm) and of tiny-gpt2 at tp=3 (heads padded, with
biases), on 8 simulated CPU devices in a process of their own (tests/tp_check.py --hf): greedy tokens
identical to one device, one compile per run, and the cache sharded over the tp devices; tiny-gpt2's
logits within 1e-5 of one device's and its biases split as Megatron's. tiny-llama (split) runs in the main
tier (tests/test_tensor_parallel.py), which keeps pad's function in process."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jpa.testing.procs import fast_compile_env

pytestmark = [pytest.mark.bench, pytest.mark.soak]   # CI's bench tier (.ci/run), not ./run test

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_hf_families_under_tensor_parallelism(tmp_path):
    out = tmp_path / "report.json"
    env = fast_compile_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_check.py"), str(out), "--hf"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    recs = json.loads(out.read_text())
    runs = {(pathlib.Path(r["model"]).name, r["tp"]) for r in recs}
    assert runs == {("gemma2", 1), ("gemma2", 2), ("qwen3", 1), ("qwen3", 2), ("tiny-gpt2", 1), ("tiny-gpt2", 3)}
    (gpt2,) = [r for r in recs if r["model"] == "tiny-gpt2" and r["tp"] == 3]
    assert gpt2["mode"] == "pad" and gpt2["logits_gap"] < 1e-5, gpt2
    assert gpt2["cache_specs"] == ["[None, 'tp']"] and gpt2["local_kv_heads"] == 2, gpt2   # 4 heads -> 6 on 3
    assert {k: gpt2["weight_specs"][k] for k in ("bq", "bo", "b_up", "b_down")} == {
        "bq": [None, "tp"], "bo": [None], "b_up": [None, "tp"], "b_down": [None]}, gpt2["weight_specs"]
    ref = {r["model"]: r["tokens"] for r in recs if r["tp"] == 1}
    for r in recs:
        assert r["step_compiles"] == 1 and r["pool_whole"], (r["model"], r["tp"])
        assert all(len(t) > 0 for t in r["tokens"])
        if r["tp"] > 1:
            assert r["tokens"] == ref[r["model"]], (r["model"], r["tp"])
            assert r["cache_devices"] == r["tp"], r
