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


def test_engine_greedy_tokens_and_logprobs_equal_the_dequantized_model():
    test_quant.check_engine_greedy_tokens_and_logprobs_equal_the_dequantized_model()


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-actorder", "fp8-channel", "packed-asym"])
def test_engine_on_a_quantized_checkpoint_equals_it_loaded_dense(tmp_path, fmt):
    """~25 s each: an engine compile (tests/test_quant_hf.py keeps each format's logits against NumPy's
    dequantize-then-matmul in the main tier)."""
    import test_quant_hf

    test_quant_hf.check_engine_equals_the_checkpoint_loaded_dense(tmp_path, fmt)


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
