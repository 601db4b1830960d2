"""Weight-only quantization, the bench tier: the engine check and the model-level checks of
tests/test_quant.py over models and formats (each compiles engines or models: tens of seconds)."""

import pytest

import test_quant

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("name,quantization,tol", [("tiny-llama", "int8", 0.05), ("tiny-gpt2", "int8", 0.05),
                                                   ("tiny-llama", "fp8", 0.2), ("tiny-gpt2", "fp8", 0.2)])
def test_quantized_model_equals_its_dequantized_weights(name, quantization, tol):
    test_quant.check_model_equals_its_dequantized_weights(name, quantization, tol)


def test_checkpoint_quantized_on_the_host_equals_quantized_on_the_device():
    test_quant.check_checkpoint_quantized_on_the_host_equals_quantized_on_the_device()


def test_head_plans_replicate_quantized_heads():
    test_quant.test_head_plans_keep_quantized_weights_and_the_function(tp=4)


@pytest.mark.soak
def test_engine_greedy_tokens_and_logprobs_equal_the_dequantized_model():
    test_quant.check_engine_greedy_tokens_and_logprobs_equal_the_dequantized_model()


@pytest.mark.parametrize("fmt", [
    pytest.param("awq", marks=pytest.mark.soak),
    pytest.param("gptq", marks=pytest.mark.soak),
    pytest.param("gptq-actorder", marks=pytest.mark.soak),
    "fp8-channel",
    pytest.param("packed-asym", marks=pytest.mark.soak),
])
def test_engine_on_a_quantized_checkpoint_equals_it_loaded_dense(tmp_path, fmt):
    """~25 s each: an engine compile (tests/test_quant_hf.py keeps each format's logits against NumPy's
    dequantize-then-matmul in the main tier)."""
    import test_quant_hf

    test_quant_hf.check_engine_equals_the_checkpoint_loaded_dense(tmp_path, fmt)


@pytest.mark.soak
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2"])
@pytest.mark.parametrize("fmt", ["awq", "fp8-channel", "packed-asym"])
def test_quantized_checkpoints_of_every_family(tmp_path, family, fmt):
    """~3 s each: q/k/v biases (qwen2), q/k norms and bf16 weights (qwen3), tied heads, Gemma-2's
    norms and soft caps under each checkpoint layout (tests/test_quant_hf.py keeps llama's)."""
    import jax.numpy as jnp
    import numpy as np

    import test_quant_hf
    from jpa import models

    qdir, rdir = test_quant_hf.write_quantized(tmp_path, fmt, base_dir=f"tests/data/hf/{family}")
    qm, _ = models.load(qdir, dtype=jnp.float32)
    ref, _ = models.load(rdir, dtype=jnp.float32)
    assert qm.quantization == test_quant_hf._qconfig(fmt)["quant_method"]
    tokens = jnp.asarray(np.random.default_rng().integers(0, 200, (2, 9)), jnp.int32)
    np.testing.assert_allclose(test_quant_hf._logprobs(qm, tokens), test_quant_hf._logprobs(ref, tokens),
                               atol=1e-4, rtol=0)


ENGINE_STEP_4BIT = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
from jpa.tools import traffic as tr
cfg = dict(family="llama", vocab_size=640, d_model=256, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
           ffn_dim=768, max_seq_len=2048, rope_base=500000.0, norm_eps=1e-5, tie_embeddings=False,
           bos_token_id=256, eos_token_id=257)
r = tr.engine_traffic("h100", cfg, max_seqs=4, context=256, pool_gib=0.25, label="llama-small", budget=BUDGET,
                      quantization="QUANT")
s = r["summary"]
print(json.dumps(dict(matrix_copies=r["matrix_copies"], checks=r["checks"], weights=s["weights"],
                      calls=[k["what"] for k in r["top"]])))
"""


@pytest.mark.soak
@pytest.mark.parametrize("quantization", ["Q4_1", "gptq"])
def test_engine_gpu_step_reads_4bit_weights_once_without_a_dense_copy(quantization):
    """~40 s each (SOAK): the engine's unified step of a 2-layer Llama with Q4_1 (GGUF, 32-value groups) or GPTQ
    g128 (Q4_0 form) layer weights, compiled for an H100 without one: the layers' linears are the Mosaic
    dequantizing matmul (7 a layer body, beside 3 attention kernels, in the ragged pass and the decode
    loop), the decode step reads each weight's stored bytes once, and no kernel anywhere in the program
    writes a weight matrix (no dense bf16 copy, no layer slice). tests/test_quant_gpu.py keeps the
    kernel-level form of this check."""
    check_engine_step_4bit(quantization, budget=64)


@pytest.mark.soak
def test_engine_gpu_prompt_pass_over_64_rows_reads_4bit_weights_once():
    """~90 s (SOAK): as above at a 256-token budget, so the ragged prompt pass runs 256 rows through the
    dequantizing matmul (4 row tiles of 64: the kernel's grid; before row tiles the kernel refused more than
    64 rows and that pass wrote a dense bf16 copy of every layer weight): the same kernel calls, no weight
    written, each weight's stored bytes read once."""
    check_engine_step_4bit("Q4_1", budget=256)


def check_engine_step_4bit(quantization: str, budget: int) -> None:
    """Compiles ENGINE_STEP_4BIT for an H100 (2 layers, 4 sequences, a `budget`-token ragged pass) and checks
    that every layer linear is the Mosaic kernel and no weight is written."""
    import json
    import os
    import subprocess
    import sys

    from jpa.tools import deviceless
    from test_traffic import ROOT

    missing = deviceless.missing_packages()
    if missing is not None:
        pytest.skip(missing)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE", "XLA_FLAGS", "JPA_QMATMUL")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = ENGINE_STEP_4BIT.replace("QUANT", quantization).replace("BUDGET", str(budget))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["matrix_copies"] == [], out["matrix_copies"]
    w = out["weights"]
    assert w["written"] == 0 and w["ideal"] <= w["read"] <= 1.01 * w["ideal"], w
    c = out["checks"]
    assert c["ok"] and c["mosaic_calls"] == 3 + 2 * 7, c
