"""LoRA adapters under tensor parallelism (models.sharding.lora_specs / plan_lora, the engine's slots on the mesh).

The sharded runs need several devices, which JAX fixes when it starts, so they run in a subprocess
(tests/lora_tp_check.py, 2 simulated CPU devices; 4 in the bench tier) whose JSON report the tests read. The
slot transforms of a head plan are checked here, in process."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jpa.models import lora, sharding
from jpa.models.config import ModelConfig
from jpa.testing.procs import fast_compile_env

from lora_data import GOLDEN  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4   # float32: the sharded sums differ from one device's only in their order


def _report(tmp_path, *args):
    out = tmp_path / "report.json"
    env = fast_compile_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "lora_tp_check.py"), str(out), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check_report(r, sizes):
    one, *sharded = r["runs"]
    assert [x["tp"] for x in r["runs"]] == list(sizes)
    # the batch ran each adapter (its rows are transformers + peft's tokens, not the base's)
    prompts, names = list(GOLDEN["prompts"]), ["base"] + r["names"]
    assert one["tokens"] == [GOLDEN["greedy"][who][key]["ids"] for who in names for key in prompts]
    assert len({tuple(map(tuple, one["tokens"][i * len(prompts):(i + 1) * len(prompts)]))
                for i in range(len(names))}) == len(names)
    for run in sharded:
        assert run["tokens"] == one["tokens"], run["tp"]
        for a, b in zip(one["logprobs"], run["logprobs"]):
            np.testing.assert_allclose(b, a, atol=TOL, rtol=0, err_msg=f"tp={run['tp']}")
        # column-parallel targets: B split on out; row-parallel (wo, w_down): A split on in
        col, row = {"a": [], "b": [None, None, None, "tp"]}, {"a": [None, None, "tp", None], "b": []}
        assert run["specs"] == {n: row if n in ("wo", "w_down") else col
                                for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
        lu = run["load_unload"]
        assert (lu["traces"], lu["compiles"]) == (0, 0), lu
        assert lu["fresh_tokens"] == GOLDEN["greedy"]["all_r8_rs"][prompts[0]]["ids"]
        assert lu["names_after"] == r["names"]


def test_mixed_adapters_tp2_equal_tp1_and_load_unload_never_compiles(tmp_path):
    """tests/lora_tp_check.py on 2 CPU devices: one batch of every committed PEFT adapter and the base (two device
    slots for four adapters: LRU swaps) gives at tensor_parallel=2 the tensor_parallel=1 greedy tokens (which are
    transformers + peft's) with logprobs within 1e-4; the slots lie split as their base weights are; loading a new
    adapter, running it beside another and unloading it under tp=2 compiles and traces nothing."""
    _check_report(_report(tmp_path), (1, 2))


@pytest.mark.bench
def test_mixed_adapters_tp4_replicated_kv_heads_equal_tp1(tmp_path):
    """The same at tensor_parallel=4 on 4 CPU devices, where the tiny Llama's 2 kv heads are replicated
    (`plan_heads` "replicate"): each wk / wv adapter's B columns are repeated with the base weight's."""
    _check_report(_report(tmp_path, "--tp4"), (1, 2, 4))


CONFIG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_q_heads=9, num_kv_heads=3, head_dim=8,
                     ffn_dim=50, max_seq_len=64, family="llama")


def _random_adapter(config, rank, rng):
    """Host slot arrays of a fresh random adapter with every target (read_adapter's layout)."""
    return {n: {"a": rng.standard_normal((config.num_layers, i, rank)).astype(np.float32),
                "b": rng.standard_normal((config.num_layers, rank, o)).astype(np.float32)}
            for n, (i, o) in lora.target_shapes(config).items()}


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_planned_adapter_is_the_planned_base_weight(tp):
    """An adapter's weight A B, planned with the model's heads (`plan_lora`: SmolLM2-like 9 q / 3 kv heads and
    ffn 50 padded at tp 2 and 4, split at 3; a 2 kv-head model replicated at 4), equals that weight planned as a
    base weight is (`with_heads`' transform: padded or repeated heads, padded ffn), at the planned shapes, and
    the planned arrays divide into the slots' split axes."""
    rng = np.random.default_rng(tp)
    configs = [CONFIG] + ([dataclasses.replace(CONFIG, num_q_heads=4, num_kv_heads=2)] if tp == 4 else [])
    for config in configs:
        plan = sharding.plan_heads(config, tp)
        planned_c = dataclasses.replace(config, num_q_heads=plan.num_q_heads, num_kv_heads=plan.num_kv_heads,
                                        ffn_dim=plan.ffn_dim)
        one = _random_adapter(config, 3, rng)
        out = sharding.plan_lora(one, config, plan)
        specs = sharding.lora_specs(out)
        for name, (i, o) in lora.target_shapes(planned_c).items():
            a, b = out[name]["a"], out[name]["b"]
            assert (a.shape, b.shape) == ((config.num_layers, i, 3), (config.num_layers, 3, o)), name
            for layer in range(config.num_layers):
                want = sharding._transform(name, one[name]["a"][layer] @ one[name]["b"][layer], config, plan)
                np.testing.assert_allclose(a[layer] @ b[layer], want, rtol=1e-5, atol=1e-5, err_msg=name)
            for k, x in (("a", a), ("b", b)):
                for axis, s in enumerate(specs[name][k]):
                    assert s is None or x.shape[axis - 1] % tp == 0, (name, k)
        if plan.mode != "split" or plan.ffn_dim != config.ffn_dim:
            assert any(out[n]["b"].shape != one[n]["b"].shape or out[n]["a"].shape != one[n]["a"].shape
                       for n in out)
