"""Tensor parallelism (EngineConfig(tensor_parallel=N), models/sharding.py, jpa/sharding.py).

The sharded runs need 8 devices, which JAX fixes when it starts; this session has started it on
one CPU device, so they run once in a subprocess (tests/tp_check.py, 8 simulated CPU devices)
whose JSON report the tests below read. The head planning, the weight transforms and the errors
are checked here, in process.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpa import models
from jpa.engine import EngineConfig, LLMEngine
from jpa.core.sharding import head_parallel, tp_mesh
from jpa.models import sharding
from jpa.models.config import PRESETS, ModelConfig
from jpa.testing.procs import fast_compile_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Megatron: column-parallel q/k/v and gate/up, row-parallel o and down.
WEIGHT_SPECS = {"wq": [None, "tp"], "wk": [None, "tp"], "wv": [None, "tp"], "wo": ["tp", None],
                "w_up": [None, "tp"], "w_down": ["tp", None], "w_gate": [None, "tp"], "bq": ["tp"],
                "bo": [], "b_up": ["tp"], "b_down": []}
MODES = {("tiny-llama", 2): "split", ("tiny-llama", 4): "replicate", ("tiny-llama", 3): "pad",
         ("tiny-gpt2", 2): "split", ("tiny-gpt2", 3): "pad",
         ("smollm2-135m", 3): "split", ("smollm2-135m", 2): "pad", ("smollm2-135m", 4): "pad"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "report.json"
    env = fast_compile_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_check.py"), str(out)], capture_output=True,
                          text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    recs = json.loads(out.read_text())
    # The real SmolLM2 runs with tp_check.py --full (scripts' time, not the suite's).
    # Gemma-2 and Qwen3 run with tp_check.py --hf (CI's bench tier: tests/test_bench_tp_hf.py).
    # tiny-gpt2 at tp=3 (pad, with biases) runs with --hf (CI's bench tier: tests/test_bench_tp_hf.py).
    assert {pathlib.Path(r["model"]).name for r in recs} == {"tiny-llama"}
    return recs


def _sharded(report, presets_only=False):
    """Runs with tp > 1 (presets_only: of the named presets, whose shapes these tests know)."""
    return [r for r in report if r["tp"] > 1 and (r["model"] in PRESETS or not presets_only)]


@pytest.mark.bench
def test_greedy_outputs_identical_to_one_device(report):
    ref = {r["model"]: r["tokens"] for r in report if r["tp"] == 1}
    for r in _sharded(report):
        assert r["tokens"] == ref[r["model"]], (r["model"], r["tp"])
        assert all(len(t) > 0 for t in r["tokens"])
    runs = {(pathlib.Path(r["model"]).name, r["tp"]) for r in report}
    # Split (tiny-llama 2); pad (tiny-gpt2 3) runs with --hf (the bench tier; its function stays here:
    # test_replicated_or_padded_heads_compute_the_same_function); replicate (the Llama test checkpoint at
    # tp=4) runs over two processes in test_multihost.py; tiny-llama at 4 and 3 and SmolLM2's pad at 2 and 4
    # and split at 3 run with tp_check.py --full.
    assert runs >= {("tiny-llama", 2)}


@pytest.mark.bench
def test_sampled_outputs_and_logprobs_identical_to_one_device(report):
    """tiny-llama (the context-dependent weights of tests/engine_util) on random prompts, greedy and
    seeded-sampled: the same token ids and per-token logprobs (f32: within 1e-5) at every tp."""
    ref = next(r for r in report if r["model"] == "tiny-llama" and r["tp"] == 1)
    assert sum(ref["sampled"]) >= 2 and not all(ref["sampled"])
    runs = [r for r in report if r["model"] == "tiny-llama" and r["tp"] > 1]
    assert {r["tp"] for r in runs} >= {2}
    for r in runs:
        assert r["tokens"] == ref["tokens"], r["tp"]
        for k, (got, want) in enumerate(zip(r["logprobs"], ref["logprobs"])):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"tp {r['tp']} request {k}")


@pytest.mark.bench
def test_speculative_decoding_under_tensor_parallelism(report):
    """n-gram speculation at tp=2 (tp_check.py's extra tiny-llama run): drafts verified and
    accepted on the sharded model, and (the tests above) its outputs and logprobs are tp=1's."""
    (r,) = [r for r in report if r["speculative"]]
    assert r["tp"] == 2 and r["speculative"]["num_accepted_tokens"] > 0, r["speculative"]


@pytest.mark.bench
def test_logits_match_one_device(report):
    gaps = [(r["model"], r["tp"], r["logits_gap"]) for r in _sharded(report) if "logits_gap" in r]
    assert gaps and all(g < 1e-5 for _, _, g in gaps), gaps


@pytest.mark.bench
def test_compiled_once_per_run(report):
    for r in report:
        # One program for the whole run: the unified step (chunked prefill).
        assert r["step_compiles"] == 1, r["model"]
        assert r["pool_whole"], (r["model"], r["tp"])


@pytest.mark.bench
def test_cache_and_weight_shardings(report):
    for r in _sharded(report, presets_only=True):
        # The stacked pools [num_layers, K, P, S_p, H] are split on their head axis only.
        assert r["cache_specs"] == ["[None, 'tp']"] and r["cache_devices"] == r["tp"], r
        # The page state and per-slot state are replicated: one allocation decision for all shards.
        assert r["page_state_specs"] == ["[]"] and r["slot_specs"] == ["[]"], r
        for name, spec in r["weight_specs"].items():  # stacked layer parameters: the layer axis unsplit
            assert spec == [None] + WEIGHT_SPECS[name], (r["model"], name, spec)
        vocab = PRESETS[r["model"]].vocab_size
        assert r["embedding_spec"] == (["tp", None] if vocab % r["tp"] == 0 else []), r


@pytest.mark.bench
def test_head_plans(report):
    for r in _sharded(report, presets_only=True):
        assert r["mode"] == MODES[(r["model"], r["tp"])], r["head_plan"]
        c = PRESETS[r["model"]]
        plan = sharding.plan_heads(c, r["tp"])
        assert r["local_kv_heads"] == plan.num_kv_heads // r["tp"]


# ---- in process (one device) ----

@pytest.mark.parametrize("nq,nk,tp,mode,q,k", [
    (32, 8, 8, "split", 32, 8), (32, 8, 2, "split", 32, 8), (4, 2, 4, "replicate", 4, 4),
    (8, 1, 8, "replicate", 8, 8), (9, 3, 3, "split", 9, 3), (9, 3, 9, "replicate", 9, 9),
    (9, 3, 2, "pad", 12, 4), (9, 3, 4, "pad", 12, 4), (4, 2, 3, "pad", 6, 3), (12, 6, 4, "pad", 16, 8),
    (4, 4, 1, "split", 4, 4)])
def test_plan_heads(nq, nk, tp, mode, q, k):
    c = dataclasses.replace(PRESETS["tiny-llama"], num_q_heads=nq, num_kv_heads=nk)
    p = sharding.plan_heads(c, tp)
    assert (p.mode, p.num_q_heads, p.num_kv_heads) == (mode, q, k)
    # Every device holds whole kv heads and the q heads that read them.
    assert p.num_kv_heads % tp == 0 and p.num_q_heads % tp == 0
    assert (p.num_q_heads // tp) % (p.num_q_heads // p.num_kv_heads) == 0 or (p.num_kv_heads // tp) == 1


@pytest.mark.parametrize("name,tp", [("tiny-llama", 4), ("tiny-llama", 3), ("tiny-gpt2", 3), ("tiny-llama", 5)])
def test_replicated_or_padded_heads_compute_the_same_function(name, tp):
    rng = np.random.default_rng()
    gpt, _ = models.load(name, seed=int(rng.integers(1 << 30)))
    plan = sharding.plan_heads(gpt.config, tp)
    assert plan.mode != "split"
    new = sharding.with_heads(gpt, plan)
    assert (new.config.num_q_heads, new.config.num_kv_heads, new.config.ffn_dim) == (
        plan.num_q_heads, plan.num_kv_heads, plan.ffn_dim)
    tokens = jnp.asarray(rng.integers(0, gpt.config.vocab_size, (2, 9)), jnp.int32)
    want, got = models.forward_dense(gpt, tokens), models.forward_dense(new, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_abstract_model_takes_a_replicate_plan():
    """An abstract model (nnx.eval_shape, as the deviceless compiles build one) is rebuilt with the
    planned heads: shapes only, kv projections widened to one head per device."""
    config = PRESETS["tiny-llama"]
    gpt = nnx.eval_shape(lambda: models.GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    plan = sharding.plan_heads(config, 4)
    assert plan.mode == "replicate"
    new = sharding.with_heads(gpt, plan)
    leaves = jax.tree_util.tree_leaves(nnx.state(new, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert new.config.num_kv_heads == 4
    wk = [x for path, x in nnx.to_flat_state(nnx.state(new, nnx.Param)) if sharding._name(path) == "wk"][0]
    assert wk.shape[-1] == 4 * config.head_dim


def test_parameter_without_a_rule_is_named():
    with pytest.raises(ValueError, match="'w_mystery' has no tensor-parallel rule"):
        sharding.param_specs({"layers": {0: {"w_mystery": jnp.ones(4)}}})


def test_embeddings_option_is_checked():
    with pytest.raises(ValueError, match="embeddings must be"):
        sharding.plan_heads(PRESETS["tiny-llama"], 2, embeddings="rows")
    # A vocabulary that does not divide falls back to replicated embeddings.
    assert sharding.plan_heads(PRESETS["tiny-llama"], 3).embeddings == "replicated"
    assert sharding.plan_heads(PRESETS["tiny-llama"], 2).embeddings == "vocab"


def test_too_many_devices_is_a_clear_error():
    n = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=f"tensor_parallel={n} needs {n} devices.*xla_force_host_platform"):
        tp_mesh(n)


def test_engine_config_and_model_checks():
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1"):
        EngineConfig(tensor_parallel=0)
    gpt, tok = models.load("tiny-llama")
    adapter = models.GPTForEngine(gpt)

    class NoShard:  # an EngineModel without shard()
        config, dtype, params = adapter.config, adapter.dtype, adapter.params

    for name in ("prefill", "decode", "ragged"):   # every method of the protocol but shard()
        if hasattr(adapter, name):
            setattr(NoShard, name, staticmethod(getattr(adapter, name)))

    with pytest.raises(TypeError, match="needs a model with shard"):
        LLMEngine(NoShard(), tok, EngineConfig(tensor_parallel=2, num_pages=8))


def test_no_mesh_is_the_single_device_code():
    f = lambda x: x  # noqa: E731
    assert head_parallel(f, None, (), ()) is f


def test_abstract_model_shards_to_sharded_shapes():
    """The deviceless compile path: an nnx.eval_shape model becomes ShapeDtypeStructs with
    NamedShardings of the planned shapes (a 1-device mesh here; 8 GPUs in gpu_compile_check)."""
    c = ModelConfig(**{**dataclasses.asdict(PRESETS["tiny-llama"]), "num_q_heads": 6, "num_kv_heads": 3})
    abstract = nnx.eval_shape(lambda: models.GPT(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    mesh = tp_mesh(1)
    gpt, plan = sharding.shard(abstract, mesh)
    wk = gpt.layers.wk.get_value()  # stacked: [num_layers, d_model, K * H], the layer axis never split
    assert isinstance(wk, jax.ShapeDtypeStruct) and wk.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    assert wk.shape == (c.num_layers, c.d_model, 3 * c.head_dim)
    assert plan.mode == "split" and gpt.config.num_kv_heads == 3
