"""Mixtures of experts under tensor parallelism (models.sharding.plan_experts, models.moe.expert_parallel):
the expert layouts' rule and errors in process; the sharded MoE MLP vs one device and what each device holds
on simulated CPU devices in a subprocess (tests/moe_ep_check.py ffn). The whole model's logits under
expert parallelism run in the bench tier (tests/test_bench_moe_ep.py), the engine at tp = 1, 2, 4 in SOAK."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jpa import models
from jpa.core.sharding import tp_mesh
from jpa.models import hf, sharding
from jpa.testing.procs import fast_compile_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "data" / "hf"


def run_check(tmp_path, mode, *extra):
    out = tmp_path / "report.json"
    env = fast_compile_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "moe_ep_check.py"), str(out), mode, *extra],
                          capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


def check_holdings(r):
    """Each device holds exactly its part of every expert parameter: "experts" the expert axis split
    (experts [d*E/N, (d+1)*E/N) on device d, MXFP4 codes, scales and biases with them), "ffn" every
    expert's ffn width split (gate/up columns, down rows; the down bias whole)."""
    tp, e, f = r["tp"], r["num_experts"], r["ffn_dim"]
    assert all(s is None for s in r["router_spec"]), r["router_spec"]  # replicated: every device routes every token
    for name, h in r["holdings"].items():
        assert h["ok"], (name, h)  # every shard equals the global array at its index
        (shard,) = h["shard_shapes"]
        full = h["global_shape"]
        if r["layout"] == "experts":
            assert h["spec"][:2] == [None, "tp"] and full[1] == e, (name, h)
            assert shard == [full[0], e // tp] + full[2:], (name, h)
        else:
            axis = [i for i, s in enumerate(h["spec"]) if s == "tp"]
            if name == "experts_down_bias":
                assert axis == [] and shard == full, (name, h)
            else:
                (a,) = axis
                assert shard[a] * tp == full[a] and shard[:a] + shard[a + 1:] == full[:a] + full[a + 1:], (name, h)
    if r["layout"] == "experts":
        per = e // tp
        assert r["experts_of_device"] == {str(d): list(range(d * per, (d + 1) * per)) for d in range(tp)}


@pytest.mark.bench
def test_sharded_moe_mlp_equals_one_device_and_devices_hold_their_experts(tmp_path):
    """Qwen3-MoE's 16 experts at EP=2 ("experts": 8 per device) and its ffn split over 4 ("ffn"): the
    layer's MoE MLP on fresh random tokens (1 token: the gathered form; 24: the blocked form) within
    f32 rounding of one device's, and at EP=2 the whole model's prefill logits; MXFP4 experts with biases
    split on their width (gpt-oss-20b's layout at tp=2) on synthetic codes."""
    recs = run_check(tmp_path, "ffn")
    (mx,) = [r for r in recs if r["kind"] == "mxfp4_ffn"]
    recs = [r for r in recs if r["kind"] == "ffn"]
    # MXFP4 experts (and their biases) split on their width: down's codes [E, D, F/2] hold F/4 bytes per device.
    assert mx["layout"] == "ffn" and mx["down_codes_shard"] == mx["down_codes"][:2] + [mx["down_codes"][2] // 2]
    # f32 rounding of sums over d_model 2880 whose terms (codes x scales up to 2^3) are far larger than the output:
    # 3.5e-6 x scale seen once on fresh inputs (2e-6 was too tight); a wrong split is off by the scale itself
    assert mx["scale"] > 1 and mx["gap"] < 1e-5 * mx["scale"], mx
    assert {(r["model"], r["tp"], r["layout"]) for r in recs} == {("qwen3_moe", 2, "experts"), ("qwen3_moe", 4, "ffn")}
    for r in recs:
        assert r["expert_layout"] == r["layout"] and r["auto"] == "ffn"
        for key in ("ffn_gap_decode", "ffn_gap_prefill"):
            gap, scale = r[key]
            assert scale > 0.1 and gap < 2e-6 * max(1.0, scale), (r["tp"], r["layout"], key, r[key])
        check_holdings(r)
    # The whole model's prefill logits at EP=2 (models.prefill with mesh=: the scan hands each layer's
    # experts to the sharded MLP): f32 rounding only.
    (r,) = [r for r in recs if r["layout"] == "experts"]
    assert r["prefill_logits_gap"] < 5e-5 * max(1.0, r["logits_scale"]) and r["logits_scale"] > 0.1, r


def test_expert_layout_rule_and_errors():
    q = hf.config_from_hf(json.loads((HF / "qwen3_moe" / "config.json").read_text()))  # 16 experts, width 32
    g = hf.config_from_hf(json.loads((HF / "gpt_oss_mxfp4" / "config.json").read_text()))  # 8 MXFP4 experts, 32
    assert (q.num_experts, q.ffn_dim, g.num_experts, g.ffn_dim, g.expert_format) == (16, 32, 8, 32, "mxfp4")
    assert sharding.plan_experts(q, 1) is None and sharding.plan_experts(q, 4) == "ffn"
    assert sharding.plan_experts(q, 4, "experts") == "experts"
    # MXFP4: one block of 32 per expert row cannot split; the 8 experts can (over 2, 4, 8).
    assert [sharding.plan_experts(g, n) for n in (2, 4, 8)] == ["experts"] * 3
    with pytest.raises(ValueError, match=r"layout 'ffn' needs .*ffn_dim=32 \(1 MXFP4 blocks of 32\)"):
        sharding.plan_experts(g, 2, "ffn")
    with pytest.raises(ValueError, match="layout 'experts' needs num_experts=16 divisible by 3"):
        sharding.plan_experts(q, 3, "experts")
    with pytest.raises(ValueError, match="tensor_parallel=3 does not fit this mixture of experts: num_experts=8 .*"
                                         "ffn_dim=32"):
        sharding.plan_experts(g, 3)
    with pytest.raises(ValueError, match="expert layout must be 'auto', 'experts' or 'ffn'"):
        sharding.plan_experts(q, 2, "rows")
    odd = dataclasses.replace(q, ffn_dim=30)  # width 30 over 4: the experts split instead
    assert sharding.plan_experts(odd, 4) == "experts"
    plan = sharding.plan_heads(odd, 4)
    assert plan.ffn_dim == 30 and "experts 4 of 16 per device" in plan.describe()


def test_abstract_moe_shards_by_layout():
    """The deviceless compile path: an abstract MoE model's expert params get the layout's specs (1-device mesh)."""
    q = hf.config_from_hf(json.loads((HF / "qwen3_moe" / "config.json").read_text()))
    abstract = nnx.eval_shape(lambda: models.GPT(q, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    P = jax.sharding.PartitionSpec
    specs = sharding.param_specs(nnx.state(abstract, nnx.Param), experts="experts")["layers"]
    assert specs["experts_gate"] == P(None, "tp") and specs["router"] == P(None)
    specs = sharding.param_specs(nnx.state(abstract, nnx.Param), experts="ffn")["layers"]
    assert (specs["experts_gate"], specs["experts_down"]) == (P(None, None, None, "tp"), P(None, None, "tp"))
    gpt, plan = sharding.shard(abstract, tp_mesh(1))
    assert plan.experts is None and gpt.expert_layout is None  # one device: the experts stay whole
