"""The CPU's loop over Q4_1 blocks (`jpa.ops.cpu_qmatmul`, an XLA FFI custom call that
`jpa.ops.qmatmul.packed_matmul` takes on a CPU for a few rows): equal to dequantize-then-dot on fresh
random blocks (every layer of a stack, read in place; one weight), called where its rules say, refused
(XLA's path) elsewhere with the reason; the engine's outputs on a Q4_1 model equal XLA's path's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpa.core.quant import pack_nibbles
from jpa.ops import cpu_qmatmul, qmatmul


def _blocks(rng, layers, k, n):
    """Random Q4_1 blocks of `layers` stacked [k, n] weights: codes u8[L, k / 2, n], d, m f16[L, k / 32, n]."""
    codes = np.stack([pack_nibbles(rng.integers(0, 16, (k, n)), axis=-2) for _ in range(layers)])
    d = rng.uniform(0.001, 0.03, (layers, k // 32, n)).astype(np.float16)
    m = rng.uniform(-0.2, 0.05, (layers, k // 32, n)).astype(np.float16)
    return codes, d, m


def _matmul(x, codes, d, m, layer):
    return jax.jit(lambda x, c, d, m, i: qmatmul.packed_matmul(x, c, d, m, layer=i, compute_dtype=jnp.float32))(
        x, codes, d, m, layer)


@pytest.mark.parametrize("rows,k,n", [(1, 64, 24), (3, 96, 40), (4, 576, 200), (2, 1536, 13)])
def test_loop_equals_dequantize_then_dot(rows, k, n):
    """Every layer of a stack (the kernel reads it in place by index), N not a multiple of the 8-lane
    vector (the tail loop), one weight (layer None): within f32 rounding of NumPy's dequantize-then-dot."""
    assert cpu_qmatmul.unsupported_reason(rows, k, 32, np.uint8, np.float16, True, jnp.float32) is None
    rng = np.random.default_rng()
    codes, d, m = _blocks(rng, 3, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for layer in range(3):
        got, want = np.asarray(_matmul(x, codes, d, m, layer)), qmatmul.reference(x, codes, d, m, layer)
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    got = jax.jit(lambda x, c, d, m: qmatmul.packed_matmul(x, c, d, m, layer=None, compute_dtype=jnp.float32))(
        x, codes[1], d[1], m[1])
    np.testing.assert_allclose(np.asarray(got), qmatmul.reference(x, codes, d, m, 1), rtol=0,
                               atol=2e-6 * np.abs(want).max())
    hlo = jax.jit(lambda x, c, d, m: qmatmul.packed_matmul(x, c, d, m, layer=2, compute_dtype=jnp.float32)).lower(
        x, codes, d, m).as_text()
    assert cpu_qmatmul.TARGET in hlo, "the product is the CPU loop's custom call"


@pytest.mark.parametrize("args,why", [
    ((5, 576, 32, np.uint8, np.float16, True, jnp.float32), "serves at most 4"),
    ((1, 576, 32, np.uint8, np.float16, False, jnp.float32), "takes Q4_1 blocks"),
    ((1, 576, 32, np.int8, np.float16, False, jnp.float32), "takes Q4_1 blocks"),
    ((1, 576, 64, np.uint8, np.float16, True, jnp.float32), "f16 scales per 32"),
    ((1, 576, 32, np.uint8, np.float32, True, jnp.float32), "f16 scales per 32"),
    ((1, 576, 32, np.uint8, np.float16, True, jnp.bfloat16), "computes in float32"),
])
def test_refusals_name_the_rule(args, why):
    assert why in cpu_qmatmul.unsupported_reason(*args)
    m, k, group, codes_dtype, d_dtype, has_min, compute = args
    assert not qmatmul.kernel_serves(m, k, 64, group, codes_dtype, compute,
                                     sub_dtypes=(d_dtype, np.float16 if has_min else None))


def test_turned_off_keeps_xlas_path(monkeypatch):
    """JPA_CPU_QMATMUL=0: refused with the reason, and packed_matmul takes the dequantizing dot (no custom call),
    with the same result."""
    monkeypatch.setenv("JPA_CPU_QMATMUL", "0")
    assert "JPA_CPU_QMATMUL=0" in cpu_qmatmul.unsupported_reason(1, 64, 32, np.uint8, np.float16, True, jnp.float32)
    rng = np.random.default_rng()
    codes, d, m = _blocks(rng, 2, 64, 16)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    hlo = jax.jit(lambda x, c, d, m: qmatmul.packed_matmul(x, c, d, m, layer=1, compute_dtype=jnp.float32)).lower(
        x, codes, d, m).as_text()
    assert cpu_qmatmul.TARGET not in hlo
    np.testing.assert_allclose(np.asarray(_matmul(x, codes, d, m, 1)), qmatmul.reference(x, codes, d, m, 1),
                               rtol=0, atol=2e-6)


@pytest.mark.bench   # two SmolLM2-135M engines (two compiles; the first also builds the loop): about 60 s
def test_smollm2_engine_with_the_loop_equals_xlas_path(monkeypatch):
    """The real model's Q4_1 layers (one user, greedy, fresh random prompt): the engine with the CPU loop gives
    XLA's path's tokens, their logprobs within 1e-4."""
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams
    from jpa.models import GPTForEngine, load

    gpt, tok = load("smollm2-135m")
    prompt = [int(t) for t in np.random.default_rng().integers(1000, 40000, 12)]
    params = SamplingParams(max_new_tokens=16, greedy=True, ignore_eos=True)
    cfg = EngineConfig(max_seqs=1, page_size=16, num_pages=8, max_num_batched_tokens=16, steps_per_call=4)
    outputs = []
    for on in (True, False):
        if not on:
            monkeypatch.setenv("JPA_CPU_QMATMUL", "0")
        eng = LLMEngine(GPTForEngine(gpt), tok, cfg)
        outputs.append(eng.generate([prompt], params)[0])
        assert (cpu_qmatmul.TARGET in eng.runner.lower(16).as_text()) == on   # the decode loop's one row
    loop, xla = outputs
    assert loop.token_ids == xla.token_ids
    np.testing.assert_allclose(loop.logprobs, xla.logprobs, rtol=0, atol=1e-4)
