"""Mixtures of experts under tensor parallelism, bench tier and SOAK (the main tier keeps the sharded MoE MLP
against one device, Qwen3-MoE's whole-model prefill logits at EP=2 and what each device holds:
tests/test_moe_ep.py).

- (SOAK) the whole tiny gpt-oss MXFP4 model (sinks, biases, 8 experts: 2 per device at EP=4, kv heads
  replicated) through models.prefill / models.decode with mesh= (the engine's model code): logits vs one device;
- (SOAK) the engine at tp = 1, 2, 4 (and 2 with n-gram speculation) on Qwen3-MoE ("ffn" layout) and gpt-oss
  MXFP4 ("experts"): greedy tokens and logprobs equal (8 engine compiles, ~5 minutes here);
- (bench) a deviceless compile of a tiny gpt-oss-like MoE layer expert-parallel over 8 H100s: its one
  collective is the experts' psum.
The 8-H100 compiles of Qwen3-30B-A3B and gpt-oss-120b shapes: SOAK (test_moe_tp_compiles_of_the_large_shapes)."""

import json

import numpy as np
import pytest

from jpa.tools import deviceless
from test_moe_ep import check_holdings, run_check

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

needs_gpu_packages = pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))


@pytest.mark.soak
def test_model_logits_under_expert_parallelism(tmp_path):
    (r,) = run_check(tmp_path, "model")
    assert (r["model"], r["tp"], r["layout"], r["auto"]) == ("gpt_oss_mxfp4", 4, "experts", "experts")
    assert r["plan"].startswith("tp=4 replicate") and "experts 2 of 8 per device" in r["plan"]
    # prefill logits of 3 random chunks and the next decode step's, f32: rounding only (a wrong expert's
    # contribution, a lost or doubled pair or bias moves them by O(1)).
    assert r["logits_gap"] < 5e-5 * max(1.0, r["logits_scale"]) and r["argmax_equal"], r
    check_holdings(r)
    assert {"experts_gate_scales", "experts_down_bias"} <= set(r["holdings"])


@pytest.mark.soak
def test_engine_greedy_tokens_and_logprobs_under_expert_parallelism(tmp_path):
    recs = run_check(tmp_path, "engine")
    ref = {r["model"]: r for r in recs if r["tp"] == 1}
    assert sorted((r["model"], r["tp"], bool(r["speculative"])) for r in recs) == sorted(
        [(m, tp, False) for m in ref for tp in (1, 2, 4)] + [(m, 2, True) for m in ref])
    for r in recs:
        assert r["step_compiles"] == 1 and r["pool_whole"], r
        assert r["tokens"] == ref[r["model"]]["tokens"], (r["model"], r["tp"])
        for got, want in zip(r["logprobs"], ref[r["model"]]["logprobs"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=5e-5, err_msg=f"{r['model']} tp={r['tp']}")
        if r["tp"] > 1:
            assert ("expert-parallel" if r["model"] == "gpt_oss_mxfp4" else "every expert's ffn") in r["head_plan"]


def compile_tp(tmp_path, *args):
    from test_gpu_compile import run_check as run_compile
    proc, report = run_compile(tmp_path, "--target", "h100", "--only", "tp", "--tp", "8", *args)
    (step,) = report["records"]
    assert proc.returncode == 0 and step["ok"], step.get("error") or step["problems"]
    return step


def check_moe_step(step, layout, d_model):
    assert step["expert_layout"] == layout and step["mosaic_calls"] == 3 * step["layers_per_body"]
    # In a layer: attention's wo all-reduce and the experts' psum, per model pass (ragged, decode loop).
    assert step["row_parallel_all_reduces"] == 2 * 2 * step["layers_per_body"]
    for where in ("collectives_per_step", "collectives_outside_loop"):
        assert set(step[where]) <= {"all-reduce", "all-gather"}, step[where]  # no all-to-all or permute
    # The only all-gathers are sampling's over the vocabulary shards (s32/f32[rows, k]), none of d_model.
    for where in ("collectives_per_step", "collectives_outside_loop"):
        for t in step[where].get("all-gather", {}).get("types", []):
            assert not t.endswith(f",{d_model}]"), t
    assert step["pool_copies"] == [] and step["alias_bytes"] >= step["pool_bytes"]
    specs = step["param_specs"]
    assert specs["router"] == "P(None,)"
    if layout == "experts":
        assert specs["experts_gate"] == specs["experts_down_scales"] == "P(None, 'tp')"


@pytest.mark.soak
@needs_gpu_packages
def test_moe_layer_expert_parallel_compile_for_8_h100s(tmp_path):
    """The fast case of the 8-H100 compiles (`jpa tools compile` --only moe-layer): a tiny
    gpt-oss-like layer's 8 MXFP4 experts, one per device, at 64 and 512 tokens: one all-reduce of
    f32[tokens, d_model] and nothing else, each device's arguments its own expert."""
    from test_gpu_compile import run_check as run_compile
    proc, report = run_compile(tmp_path, "--target", "h100", "--only", "moe-layer", "--tp", "8", "--model", "tiny-moe")
    recs = report["records"]
    assert proc.returncode == 0 and all(r["ok"] for r in recs), [(r["name"], r.get("error") or r["problems"])
                                                                 for r in recs]
    assert [r["tokens"] for r in recs] == [64, 512]
    for r in recs:
        assert r["expert_layout"] == "experts" and r["collectives"] == [f"all-reduce f32[{r['tokens']},256]"]
        replicated = 256 * 8 * 2 + 8 * 2  # the router [d_model, E] and its bias, bf16: on every device
        assert r["weight_bytes_per_device"] * 8 == r["weight_bytes_all"] + 7 * replicated


@pytest.mark.soak
@needs_gpu_packages
@pytest.mark.parametrize("model,layout,d_model", [("qwen3-30b-a3b", "ffn", 2048), ("gpt-oss-120b", "experts", 2880)])
def test_moe_tp_compiles_of_the_large_shapes(tmp_path, model, layout, d_model):
    """SOAK: the whole models' shapes (48 / 36 layers: a scan, depth-independent) on 8 H100s, as recorded in
    BENCHMARKS.md: weights + pool + temporaries within the GPU's memory (check_tp's own check)."""
    step = compile_tp(tmp_path, "--model", model)
    check_moe_step(step, layout, d_model)
    # 1/8 of the weights each (57 / 61 GiB in all: Qwen3-30B-A3B bf16, gpt-oss-120b MXFP4 experts; BENCHMARKS: 7.15 / 7.62)
    assert step["param_bytes_per_device"] < 8 * 2 ** 30
