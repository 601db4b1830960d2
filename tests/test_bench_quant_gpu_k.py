"""GGUF Q4_K through the Mosaic dequantizing matmul, the bench tier: the kernel compiled for an H100 (TMA) and an
A100 (cp.async) without one, in a scan over stacked layers, with the K-quant's stored scales (uint8 sub-block
scales and minimums, f16 super-block d / -dmin) read as they are: no ptxas spills, the stack's bytes read once
over the scan, nothing of a weight written (the kernel forms each group's scale d2 * sc in registers).
tests/test_quant_gpu.py keeps the kernel's values against gguf.quants.dequantize in interpret mode."""

import pytest

from jpa.tools import deviceless
from test_quant_gpu import check_compiled_in_place, run_compile

pytestmark = pytest.mark.bench

COMPILE_Q4_K = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import jax, jax.numpy as jnp
from jpa.ops.qmatmul import packed_matmul
from jpa.tools import traffic as tr
L, K, N = 2, 1024, 2048
def fn(x, codes, d, m, d2, m2):
    def layer(x, i):
        y = packed_matmul(x, codes, d, m, d2, m2, layer=i, compute_dtype=jnp.bfloat16)
        return x + y[:, :K].astype(x.dtype), None
    return jax.lax.scan(layer, x, jnp.arange(L, dtype=jnp.int32))[0]
S = jax.ShapeDtypeStruct
weights = (S((L, K // 2, N), jnp.uint8), S((L, K // 32, N), jnp.uint8), S((L, K // 32, N), jnp.uint8),
           S((L, K // 256, N), jnp.float16), S((L, K // 256, N), jnp.float16))
out = {}
for target, M in [(t, m) for t in ("h100", "a100") for m in (4, 64)]:  # 16 rows (m_warps 1) and 64 (m_warps 4)
    args = (S((M, K), jnp.bfloat16), *weights)
    rec = deviceless.Compiler(target).compile(target, fn, args, keep_hlo=True, compiler_options=tr.WEIGHTS_IN_PLACE)
    out[f"{target}-{M}"] = tr.stacked_weight_record(rec, args[1:], L)
print(json.dumps(out))
"""


@pytest.mark.soak
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_q4_k_kernel_compiles_for_h100_and_a100_and_reads_the_stored_scales_once():
    """~6 s (16 and 64 rows on each target). The plain-JAX path (JPA_QMATMUL=0, or kernel_serves refusing d2,
    as before) would fail `mosaic == 1` and `written == 0`: it writes each layer's dense bf16 weight."""
    out = run_compile(COMPILE_Q4_K)
    assert set(out) == {"h100-4", "h100-64", "a100-4", "a100-64"}
    check_compiled_in_place(out)


@pytest.mark.soak
def test_engine_gpu_step_reads_q4_k_weights_once_without_a_dense_copy():
    """~40 s (SOAK): tests/test_bench_quant.py's engine-step check with Q4_K layer weights: a 2-layer Llama's
    unified step compiled for an H100 runs its 7 layer linears as the Mosaic kernel (17 Mosaic calls with the
    3 attention kernels), the decode step reads each stored byte once and no weight matrix is written."""
    import test_bench_quant

    test_bench_quant.test_engine_gpu_step_reads_4bit_weights_once_without_a_dense_copy("Q4_K")


@pytest.mark.soak
@pytest.mark.parametrize("quantization", ["Q6_K", "fp8-block"])
def test_engine_gpu_step_reads_8bit_group_scaled_weights_once(quantization):
    """1.5-2 min each on the loaded 2-core VM (SOAK): the engine's unified step of a 2-layer Llama whose layer
    linears are GGUF Q6_K (and its untied head Q6_K, as the K-quant files keep it) or block-wise FP8 (bf16 head),
    compiled for an H100: every linear and the Q6_K head are the Mosaic kernel (`qmatmul_grouped`) wherever the
    program computes them, the decode step reads each stored byte once and no weight matrix is written (before,
    XLA wrote a dense bf16 copy of each, the head's too)."""
    import json

    from test_bench_quant import ENGINE_STEP_4BIT
    from test_quant_gpu import run_compile

    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        pytest.skip("the compile-only GPU packages are not installed (pip install -e '.[gpu]')")
    out = run_compile(ENGINE_STEP_4BIT.replace("QUANT", quantization))
    assert out["matrix_copies"] == [], json.dumps(out["matrix_copies"])
    w = out["weights"]
    assert w["written"] == 0 and w["ideal"] <= w["read"] <= 1.01 * w["ideal"], w
    c = out["checks"]
    head = 3 if quantization == "Q6_K" else 0  # the head's calls: one in each program branch that computes logits
    assert c["ok"] and c["mosaic_calls"] == 3 + 2 * 7 + head, c
