"""The 4-bit dequantizing matmul (issue 35): the Mosaic GPU kernel in GPU interpret mode against NumPy's
dequantize-then-matmul, its input checks, and its deviceless compile for an H100 and an A100 inside a scan
over stacked layers: codes and scales read once a layer, no dense float copy of a weight written."""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jpa.testing.jaxprs import equations
from jpa.core.quant import dequantize_blocks
from jpa.ops import qmatmul as op
from jpa.pallas.mosaic import qmatmul as kernel
from jpa.tools import deviceless

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16


def _stack(rng, layers, k, n, group, with_min, scale_dtype=np.float16):
    codes = rng.integers(0, 256, (layers, k // 2, n)).astype(np.uint8)
    d = rng.uniform(0.005, 0.05, (layers, k // group, n)).astype(scale_dtype)
    m = rng.uniform(-0.4, 0.4, (layers, k // group, n)).astype(scale_dtype) if with_min else None
    return codes, d, m


@pytest.mark.parametrize("rows,k,n,group,with_min,scale_dtype", [
    (3, 256, 128, 32, True, np.float16),     # GGUF Q4_1: 32-value groups with minimums, m_warps 1
    # GPTQ / Q4_0 form: (q - 8) * d, 128-value groups, m_warps 2
    pytest.param(20, 256, 64, 128, False, np.float16, marks=pytest.mark.bench),
    # AWQ-like f32 minimums, 64-value groups, m_warps 4
    pytest.param(64, 128, 64, 64, True, np.float32, marks=pytest.mark.bench),
], ids=["q4_1-g32", "q4_0-g128", "f32-min-g64"])
def test_kernel_in_interpret_mode_equals_numpy_dequantize_then_matmul(rows, k, n, group, with_min, scale_dtype):
    rng = np.random.default_rng()
    codes, d, m = _stack(rng, 3, k, n, group, with_min, scale_dtype)
    x = rng.normal(size=(rows, k)).astype(BF16)
    layer = 2
    got = np.asarray(kernel.qmatmul(jnp.asarray(x), codes, d, m, layer=layer, interpret=True))
    # The kernel's weight: q * d + m in f32, rounded to bf16 once (as dequantize_blocks); products summed in f32.
    w = dequantize_blocks(codes[layer], d[layer], None if m is None else m[layer], -2, np.float32)
    want = x.astype(np.float32) @ w.astype(BF16).astype(np.float32)
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    # Against the float32 weight (no rounding): within bf16's rounding of w.
    exact = op.reference(x.astype(np.float32), codes, d, m, layer)
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())
    # A different layer gives a different product: the kernel reads the layer it is given.
    other = np.asarray(kernel.qmatmul(jnp.asarray(x), codes, d, m, layer=0, interpret=True))
    assert not np.allclose(other, got)


@pytest.mark.parametrize("rows,fmt", [(5, "int8"), pytest.param(40, "fp8", marks=pytest.mark.bench)])
def test_8bit_kernel_in_interpret_mode_equals_numpy(rows, fmt):
    """int8 / float8_e4m3fn values with per-channel scales (jpa.core.quant.quantize_weight): widened exactly,
    summed in f32, then scaled, as the XLA path (x @ q.astype(bf16)) * scale."""
    from jpa.core.quant import quantize_weight
    rng = np.random.default_rng()
    q, scale = quantize_weight(rng.normal(size=(2, 256, 128)).astype(np.float32), fmt)
    x = rng.normal(size=(rows, 256)).astype(BF16)
    got = np.asarray(kernel.qmatmul_scaled(jnp.asarray(x), q, scale, layer=1, interpret=True))
    want = (x.astype(np.float32) @ q[1].astype(np.float32)) * scale[1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="does not fit q"):
        kernel.qmatmul_scaled(jnp.asarray(x), q, scale[:, :64], interpret=True)


def _form_call(form, rng, x, layers, k, n, layer, gguf_q8_0=False):
    """One form of the kernel on layer `layer` of a fresh random [layers, k, n] stack: (got, want, exact), want
    NumPy's dequantize-then-matmul with the weight rounded to bf16 as the kernel rounds it, exact in f32.
    gguf_q8_0: the Q8_0 form's codes and scales as GGUF writes them (`_gguf_grouped`), else random ones."""
    from jpa.core.quant import quantize_weight
    xf = x.astype(np.float32)
    if form == "q4_1":
        codes, d, m = _stack(rng, layers, k, n, 32, True)
        got = kernel.qmatmul(jnp.asarray(x), codes, d, m, layer=layer, interpret=True)
        want = xf @ dequantize_blocks(codes[layer], d[layer], m[layer], -2, np.float32).astype(BF16).astype(np.float32)
        return np.asarray(got), want, op.reference(xf, codes, d, m, layer)
    if form == "int8":
        q, scale = quantize_weight(rng.normal(size=(layers, k, n)).astype(np.float32), "int8")
        got = kernel.qmatmul_scaled(jnp.asarray(x), q, scale, layer=layer, interpret=True)
        want = (xf @ q[layer].astype(np.float32)) * scale[layer]
        return np.asarray(got), want, want
    if gguf_q8_0:
        (codes, d, _, _, _), oracle = _gguf_grouped(rng, "Q8_0", layers, k, n)
        w = oracle[layer]
    else:
        codes = rng.integers(-127, 128, (layers, k, n)).astype(np.int8)
        d = rng.uniform(1e-3, 1e-2, (layers, k // 32, n)).astype(np.float16)
        w = dequantize_blocks(codes[layer], d[layer], None, -2, np.float32)
    got = kernel.qmatmul_grouped(jnp.asarray(x), codes, d, layer=layer, interpret=True)
    want = xf @ w.astype(BF16).astype(np.float32)
    exact = op.reference(xf, codes, d, None, layer)
    if gguf_q8_0:
        np.testing.assert_allclose(exact, xf @ w, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    return np.asarray(got), want, exact


def _check_form(got, want, exact):
    """The kernel's f32 output equals the bf16-rounded weight's product closely and the exact one loosely."""
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


@pytest.mark.parametrize("rows", [100, pytest.param(200, marks=pytest.mark.bench)])
@pytest.mark.parametrize("form", ["q4_1", "int8", "Q8_0"])
def test_row_tiles_in_interpret_mode_equal_numpy(form, rows):
    """Over 64 rows (a ragged prompt pass, a verify pass) the kernel runs a grid of 64-row tiles x 64-column
    tiles: 100 rows are 2 tiles (the last one 36 rows and padding), 200 rows 4, over 2 column tiles. Every form
    (4-bit Q4_1, 8-bit per channel, 8-bit with group scales) equals NumPy's dequantize-then-matmul (the weight
    rounded to bf16 once; the per-channel scale after the f32 sum), on layer 1 of 2."""
    rng = np.random.default_rng()
    layers, k, n, layer = 2, 128, 128, 1
    x = rng.normal(size=(rows, k)).astype(BF16)
    assert kernel.row_tiles(rows) == -(-rows // 64)
    _check_form(*_form_call(form, rng, x, layers, k, n, layer))


@pytest.mark.parametrize("form", ["q4_1", "int8", "Q8_0"])
def test_k_a_multiple_of_64_in_interpret_mode_equals_numpy(form):
    """K = 576 (SmolLM2's d_model: 4 x 128 + 64) walks K 64 values a step (`k_step`: 9 steps, double buffered);
    every form (4-bit Q4_1, 8-bit per channel, 8-bit with group scales: GGUF Q8_0) equals NumPy's
    dequantize-then-matmul on layer 1 of 2, and K = 1536 (SmolLM2's w_down) keeps the 128-value step."""
    assert kernel.k_step(576) == 64 and kernel.k_step(1536) == 128 and kernel.k_step(4096) == 128
    rng = np.random.default_rng()
    layers, k, n, layer, rows = 2, 576, 128, 1, 5
    x = rng.normal(size=(rows, k)).astype(BF16)
    _check_form(*_form_call(form, rng, x, layers, k, n, layer, gguf_q8_0=True))


def test_smollm2_linears_and_tied_head_take_the_kernel_on_an_h100_and_an_a100():
    """SmolLM2-135M's shapes in its GGUF form (Q4_1 layers, a tied Q8_0 table; d_model 576, not a multiple of
    128): traced for an H100 and an A100 (nothing compiled), every layer linear is kept stacked for the Mosaic
    kernel (`stacked_packed`) and the tied head is served (`tied_head_served`) at 1 and 64 rows; on this CPU
    neither. int8 per channel at K = 576 too; K not a multiple of 64 is still refused."""
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from jpa.models.config import PRESETS
    from jpa.models.gpt import stacked_packed, tied_head_served
    from jpa.tools.traffic import abstract_model

    from flax import nnx

    model = abstract_model(PRESETS["smollm2-135m"], "Q4_1:Q8_0")
    assert model.embeddings_columns and model.tok_embeddings.get_value().shape == (576, 49152)
    assert model.tok_embeddings_bscale.get_value().shape == (576 // 32, 49152)
    assert model.layers.w_down.get_value().shape == (30, 1536 // 2, 576)  # Q4_1 codes [L, K / 2, N]
    with pytest.raises(ValueError, match="a packed head form as 'Q4_1:Q8_0'; got 'int8:Q8_0'"):
        abstract_model(PRESETS["smollm2-135m"], "int8:Q8_0")
    graphdef, state = nnx.split(model)
    found = {}

    def served(state, where):  # traced: the layer weights' dtypes are read inside the trace
        model = nnx.merge(graphdef, state)
        found[where] = {rows: (set(stacked_packed(model, rows)), tied_head_served(model, rows)) for rows in (1, 64)}
        return jnp.zeros(())

    linears = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    for kind, cores, cc in (("NVIDIA H100 80GB HBM3", 132, (9, 0)), ("NVIDIA A100-SXM4-80GB", 108, (8, 0))):
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                            abstract_device=AbstractDevice(device_kind=kind, num_cores=cores, platform="cuda"))
        with jax.sharding.use_abstract_mesh(mesh), deviceless.mosaic_arch(cc):  # Mosaic lowers for the target
            jax.make_jaxpr(served, static_argnums=1)(state, kind)
            assert op.scaled_kernel_serves(1, 576, 1536, np.int8, jnp.bfloat16)
            assert op.kernel_serves(1, 576, 192, 32, np.int8, jnp.bfloat16)  # wk / wv: 3 kv heads x 64
            assert not op.kernel_serves(1, 544, 1536, 32, np.uint8, jnp.bfloat16)  # 544 = 8 x 64 + 32
        assert found[kind] == {1: (linears, True), 64: (linears, True)}, (kind, found[kind])
    jax.make_jaxpr(served, static_argnums=1)(state, "cpu")
    assert found["cpu"] == {1: (set(), False), 64: (set(), False)}


def test_kernel_serves_every_row_count_on_an_h100():
    """The engine's passes over more than 64 rows (a 512-row ragged prompt pass, a 64 x 5-row verify pass) take
    the kernel on an H100 (traced for one, nothing compiled), as a decode step does; on this CPU none does."""
    import jax

    with jax.sharding.use_abstract_mesh(_h100_mesh()):
        for rows in (1, 64, 65, 320, 512):
            assert op.kernel_serves(rows, 4096, 14336, 32, np.uint8, jnp.bfloat16), rows
            assert op.kernel_serves(rows, 4096, 14336, 32, np.int8, jnp.bfloat16), rows
            assert op.scaled_kernel_serves(rows, 4096, 14336, np.int8, jnp.bfloat16), rows
    assert not op.kernel_serves(320, 4096, 14336, 32, np.uint8, jnp.bfloat16)


def test_kernel_order_of_k_is_a_permutation_within_blocks():
    x = np.arange(64, dtype=np.float32)[None]
    p = np.asarray(kernel.permute_k(jnp.asarray(x)))[0]
    assert sorted(p) == list(range(64))
    # slot 16c + 2i + h holds value 8c + i + 16h (block 0), shifted by 32 in block 1
    assert list(p[:6]) == [0, 16, 1, 17, 2, 18] and list(p[16:18]) == [8, 24] and p[32] == 32
    p8 = np.asarray(kernel.permute_k8(jnp.asarray(x)))[0]
    assert sorted(p8) == list(range(64)) and list(p8[:4]) == [0, 8, 1, 9] and list(p8[16:18]) == [16, 24]


def test_kernel_rejects_shapes_it_cannot_take():
    rng = np.random.default_rng(0)
    codes, d, m = _stack(rng, 1, 256, 128, 32, True)
    # Any number of rows (row tiles of 64); N is bounded by the grid's y axis (65535 column tiles of 64).
    assert kernel.unsupported_reason(100_000, 256, 128, 32, np.uint8) is None
    assert "65535 column tiles" in kernel.unsupported_reason(4, 256, 64 * 65536, 32, np.uint8)
    with pytest.raises(ValueError, match=r"does not fit codes \[1, 128, 128\]"):
        kernel.qmatmul(jnp.zeros((2, 128), jnp.bfloat16), codes, d, m, interpret=True)
    with pytest.raises(ValueError, match="minimums"):
        kernel.qmatmul(jnp.zeros((2, 256), jnp.bfloat16), codes, d, m[:, :4], interpret=True)
    assert kernel.unsupported_reason(4, 256, 96, 32, np.uint8) is not None  # N not a multiple of 64
    assert kernel.unsupported_reason(4, 576, 128, 32, np.uint8) is None  # K a multiple of 64: the 64-value step
    assert "multiple of 64" in kernel.unsupported_reason(4, 544, 128, 32, np.uint8)  # 544 = 8 x 64 + 32
    assert kernel.unsupported_reason(4, 256, 128, 32, np.int8) is not None  # 8-bit codes
    assert kernel.unsupported_reason(4, 256, 128, 32, np.uint8, jnp.float32) is not None


def test_plain_jax_path_off_the_gpu_equals_numpy():
    """On this CPU `packed_matmul` is the dequantize-then-dot path (the kernel serves NVIDIA GPUs)."""
    rng = np.random.default_rng()
    codes, d, m = _stack(rng, 2, 256, 128, 32, True)
    x = rng.normal(size=(5, 256)).astype(np.float32)
    assert not op.kernel_serves(5, 256, 128, 32, np.uint8, jnp.bfloat16)
    got = np.asarray(op.packed_matmul(jnp.asarray(x), codes, d, m, layer=1, compute_dtype=jnp.float32))
    np.testing.assert_allclose(got, op.reference(x, codes, d, m, 1), rtol=1e-5, atol=1e-5)


COMPILE = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import jax, jax.numpy as jnp
from jpa.ops.dispatch import current_target
from jpa.ops.qmatmul import packed_matmul, scaled_matmul
from jpa.tools import traffic as tr
L, K, N, G, M = 2, 1024, 2048, 32, 4
def fn(x, codes, d, m):
    def layer(x, i):
        y = packed_matmul(x, codes, d, m, layer=i, compute_dtype=jnp.bfloat16)
        return x + y[:, :K].astype(x.dtype), None
    return jax.lax.scan(layer, x, jnp.arange(L, dtype=jnp.int32))[0]
def fn8(x, q, scale):
    def layer(x, i):
        y = scaled_matmul(x, q, scale, layer=i, compute_dtype=jnp.bfloat16)
        return x + y[:, :K].astype(x.dtype), None
    return jax.lax.scan(layer, x, jnp.arange(L, dtype=jnp.int32))[0]
S = jax.ShapeDtypeStruct
cases = [(fn, (S((M, K), jnp.bfloat16), S((L, K // 2, N), jnp.uint8), S((L, K // G, N), jnp.float16),
               S((L, K // G, N), jnp.float16))),
         (fn8, (S((M, K), jnp.bfloat16), S((L, K, N), jnp.int8), S((L, N), jnp.float32)))]
out = {}
for target, (fn, args) in [(t, c) for t in ("h100", "a100") for c in cases]:
    target = target + ("" if fn.__name__ == "fn" else "-int8")
    rec = deviceless.Compiler(target.split("-")[0]).compile(target, fn, args, keep_hlo=True,
                                                             compiler_options=tr.WEIGHTS_IN_PLACE)
    out[target] = tr.stacked_weight_record(rec, args[1:], L)
print(json.dumps(out))
"""


@pytest.mark.soak
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_kernel_compiles_for_h100_and_a100_and_reads_each_layer_once():
    """A scan over 2 stacked Q4_1 layers calling `packed_matmul` with the layer index (and over 2 int8 ones
    calling `scaled_matmul`), compiled for an H100
    (TMA copies) and an A100 (cp.async) without one: the Mosaic kernel runs (no ptxas spills), reads
    exactly the stack's codes and scales over the scan (one layer a call), and no kernel writes a copy
    of a weight (dense or sliced). The dense copy of today's plain-JAX path would fail `written == 0`."""
    check_compiled_in_place(run_compile(COMPILE))


@pytest.mark.soak
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_row_tiles_compile_for_h100_and_a100_and_read_each_layer_once():
    """200 rows (4 row tiles of 64: a prompt pass or a verify pass, not a decode step) through the 4-bit and the
    int8 per-channel kernel, and the 8-bit group-scaled one (Q8_0), in a scan over 2 stacked layers compiled for
    an H100 (TMA) and an A100 (cp.async): one Mosaic call each, no ptxas spills, no weight written, the stack
    counted read once (the row tiles re-read a layer's weight tiles from L2: jpa.tools.traffic counts HBM)."""
    out = run_compile(COMPILE.replace("L, K, N, G, M = 2, 1024, 2048, 32, 4", "L, K, N, G, M = 2, 1024, 2048, 32, 200"))
    out.update(run_compile(COMPILE_GROUPED.replace("for target, fmt, M in CASES:",
                                                   "for target, fmt, M in [('h100', 'Q8_0', 200), ('a100', 'Q8_0', 200)]:")))
    assert len(out) == 6
    check_compiled_in_place(out)


def run_compile(code: str) -> dict:
    """The JSON last line of `code` run in a fresh interpreter (its own XLA flags; the kernel not turned off)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE", "XLA_FLAGS",
                                                             "JPA_QMATMUL")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_compiled_in_place(out: dict) -> None:
    """Every target's compile: one Mosaic qmatmul call without spills, the stack read once, nothing written."""
    for target, r in out.items():
        assert r["ok"] and r["mosaic"] == 1, (target, r)
        k = r["kernels"]["jpa_mosaic_qmatmul"]
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (target, k)
        assert r["written"] == 0 and r["copies"] == 0, (target, r)
        assert r["read"] == r["stack"], (target, r)


def test_q4_k_kernel_in_interpret_mode_equals_gguf_dequantize_then_matmul():
    """GGUF Q4_K kept as jpa keeps it (nibbles, uint8 sub-block scales / minimums, f16 super-block d / -dmin):
    the kernel forms each group's scale d2 * sc and minimum m2 * m in f32 from the stored values, and its
    product equals x @ gguf.quants.dequantize(W) (the weight rounded to bf16 once, products summed in f32)."""
    from gguf import GGMLQuantizationType, quants

    from jpa.core.quant import K_FORMATS, unpack_k_blocks

    rng = np.random.default_rng()
    layers, k, n, rows = 2, 512, 64, 5
    raws = rng.integers(0, 256, (layers, n, k // 256, K_FORMATS["Q4_K"])).astype(np.uint8)
    for at in (0, 2):  # sane f16 d and dmin; every code, sub-scale and minimum bit random
        raws[..., at:at + 2] = rng.uniform(5e-4, 2e-3, raws.shape[:3] + (1,)).astype(np.float16).view(np.uint8)
    raws = raws.reshape(layers, n, -1)
    kept = [unpack_k_blocks(r, "Q4_K", n, k) for r in raws]  # each (codes, d, m, d2, m2) of [N, K / ...]
    codes, d, m, d2, m2 = (np.stack([np.ascontiguousarray(p[i].T) for p in kept]) for i in range(5))
    assert codes.shape == (layers, k // 2, n) and d.dtype == np.uint8 and d2.shape == (layers, 2, n)
    x = rng.normal(size=(rows, k)).astype(BF16)
    for layer in range(layers):
        w = quants.dequantize(raws[layer], GGMLQuantizationType.Q4_K).reshape(n, k).T  # the oracle, f32 [K, N]
        want = x.astype(np.float32) @ w.astype(BF16).astype(np.float32)
        got = np.asarray(kernel.qmatmul(jnp.asarray(x), codes, d, m, d2, m2, layer=layer, interpret=True))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
        np.testing.assert_allclose(op.reference(x, codes, d, m, layer, d2, m2), x.astype(np.float32) @ w,
                                   rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="takes its super-block scales d2 and minimums m2"):
        kernel.qmatmul(jnp.asarray(x), codes, d, None, d2, m2, interpret=True)
    with pytest.raises(ValueError, match="do not fit sub-block scales"):
        kernel.qmatmul(jnp.asarray(x), codes, d, m, d2[:, :, :32], m2[:, :, :32], interpret=True)
    with pytest.raises(ValueError, match="reads them as uint8"):
        kernel.qmatmul(jnp.asarray(x), codes, d.astype(np.float32), m, d2, m2, interpret=True)
    # Off the GPU (this CPU) `packed_matmul` dequantizes the Q4_K layer and dots: the same product.
    assert not op.kernel_serves(rows, k, n, 32, np.uint8, jnp.bfloat16, d2=d2, sub_dtypes=(np.uint8, np.uint8))
    plain = op.packed_matmul(jnp.asarray(x, jnp.float32), codes, d, m, d2, m2, layer=1, compute_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(plain), op.reference(x, codes, d, m, 1, d2, m2), rtol=1e-5, atol=1e-4)


# GGUF block bytes: (values a block, bytes a block, offsets of the block's f16 scales)
GGUF_BYTES = {"Q8_0": (32, 34, (0,)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}


def _gguf_grouped(rng, fmt, layers, k, n):
    """Random GGUF `fmt` tensors [n, k] (every code and sub-scale bit random, sane f16 scales) as jpa keeps
    them for the matmul ([L, K, N] codes, [L, K / G, N] scales, ...) and the oracle gguf.quants.dequantize's
    f32 weights [L, K, N]."""
    from gguf import GGMLQuantizationType, quants

    from jpa.core.quant import unpack_gguf_rows, unpack_k_blocks

    per, nbytes, at = GGUF_BYTES[fmt]
    raws = rng.integers(0, 256, (layers, n, k // per, nbytes)).astype(np.uint8)
    for a in at:
        raws[..., a:a + 2] = rng.uniform(5e-4, 2e-3, raws.shape[:3] + (1,)).astype(np.float16).view(np.uint8)
    raws = raws.reshape(layers, n, -1)
    unpack = (lambda r: unpack_gguf_rows(r, fmt, n, k) + (None, None)) if fmt == "Q8_0" else \
        (lambda r: unpack_k_blocks(r, fmt, n, k))
    kept = [unpack(r) for r in raws]  # each (codes, d, m, d2, m2) of [N, K / ...]
    parts = [None if kept[0][i] is None else np.stack([np.ascontiguousarray(p[i].T) for p in kept]) for i in range(5)]
    oracle = np.stack([quants.dequantize(r, getattr(GGMLQuantizationType, fmt)).reshape(n, k).T for r in raws])
    return parts, oracle


def _fp8_block_grouped(rng, layers, k, n):
    """Random block-wise FP8 weights (e4m3 codes [out, in], f32 scales per 128 x 128 block) through
    jpa.core.quant.fp8_block, and the f32 weights q * s [L, K, N]."""
    from jpa.core.quant import fp8_block

    parts, oracle = [], []
    for _ in range(layers):
        q = np.clip(rng.normal(scale=100, size=(n, k)), -448, 448).astype(ml_dtypes.float8_e4m3fn)  # e4m3fn's range
        s = rng.uniform(1e-4, 1e-3, (n // 128, k // 128)).astype(np.float32)
        parts.append(fp8_block(q, s, [128, 128]))
        oracle.append((q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)).T)
    return [np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]), None, None, None], np.stack(oracle)


def _mixed_grouped(rng, layers, k, n):
    """The form `PackedWeight.stack` gives layers of mixed K-quant types (a Q4_K_M file's ffn_down: Q4_K in some
    layers, Q6_K in others): int8 codes, f32 scales and minimums per 16 values; the f32 weights [L, K, N]."""
    codes = rng.integers(-32, 32, (layers, k, n)).astype(np.int8)
    d = rng.uniform(1e-3, 3e-2, (layers, k // 16, n)).astype(np.float32)
    m = rng.uniform(-0.3, 0.3, (layers, k // 16, n)).astype(np.float32)
    return [codes, d, m, None, None], dequantize_blocks(codes, d, m, -2, np.float32)


@pytest.mark.parametrize("fmt,rows", [
    ("Q6_K", 3),
    pytest.param("Q8_0", 20, marks=pytest.mark.bench),
    pytest.param("Q5_K", 64, marks=pytest.mark.bench),
    pytest.param("fp8-block", 9, marks=pytest.mark.bench),
    pytest.param("mixed", 33, marks=pytest.mark.bench),
])
def test_grouped_8bit_kernel_in_interpret_mode_equals_gguf_dequantize_then_matmul(fmt, rows):
    """8-bit codes with group scales, as jpa keeps GGUF Q8_0 (int8 codes, f16 scale per 32), Q6_K (codes
    -32..31, int8 scales per 16, f16 super-block scales), Q5_K (codes 0..31, uint8 scales and minimums per
    32, f16 d / -dmin), block-wise FP8 (e4m3, f32 per 128 x 128) and mixed K-quant layers (int8 codes, f32
    scales and minimums per 16): the kernel's product equals x @ W with
    W (layer 1 of 2) from gguf.quants.dequantize (or q * s) rounded to bf16 once, products summed in f32."""
    rng = np.random.default_rng()
    layers, k, n = 2, 256, 128 if fmt == "fp8-block" else 64
    make = {"fp8-block": _fp8_block_grouped, "mixed": _mixed_grouped}.get(fmt)
    parts, oracle = make(rng, layers, k, n) if make else _gguf_grouped(rng, fmt, layers, k, n)
    codes, d, m, d2, m2 = parts
    assert codes.shape == (layers, k, n) and codes.dtype != np.uint8
    x = rng.normal(size=(rows, k)).astype(BF16)
    for layer in (1,):
        want = x.astype(np.float32) @ oracle[layer].astype(BF16).astype(np.float32)
        got = np.asarray(kernel.qmatmul_grouped(jnp.asarray(x), codes, d, m, d2, m2, layer=layer, interpret=True))
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
        # jpa's own dequantizer (the plain-JAX path and the engine's dense reference) is the oracle's weight
        np.testing.assert_allclose(op.reference(x, codes, d, m, layer, d2, m2), x.astype(np.float32) @ oracle[layer],
                                   rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_grouped_8bit_kernel_rejects_what_it_cannot_take():
    rng = np.random.default_rng(0)
    (codes, d, m, d2, m2), _ = _gguf_grouped(rng, "Q5_K", 1, 256, 64)
    x = jnp.zeros((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"does not fit codes \[1, 256, 64\]"):
        kernel.qmatmul_grouped(jnp.zeros((2, 128), jnp.bfloat16), codes, d, m, d2, m2, interpret=True)
    with pytest.raises(ValueError, match="minimums m2 come with"):
        kernel.qmatmul_grouped(x, codes, d, None, d2, m2, interpret=True)
    with pytest.raises(ValueError, match="do not fit sub-block scales"):
        kernel.qmatmul_grouped(x, codes, d, m, d2[:, :, :32], m2[:, :, :32], interpret=True)
    with pytest.raises(ValueError, match="int8 / uint8 scales"):
        kernel.qmatmul_grouped(x, codes, d.astype(np.float32), m, d2, m2, interpret=True)
    with pytest.raises(ValueError, match="reads int8 or float8_e4m3fn"):
        kernel.qmatmul_grouped(x, codes.view(np.uint8), d, m, d2, m2, interpret=True)
    assert kernel.unsupported_reason_grouped(4, 256, 64, 8, np.int8) is not None  # groups under 16 values
    assert kernel.unsupported_reason_grouped(4, 384, 64, 96, np.int8) is not None  # 96 neither divides nor is a multiple of 128
    assert kernel.unsupported_reason_grouped(4, 512, 64, 256, np.int8) is None
    # K = 576 walks 64 values a step: groups dividing 64 or multiples of it (dividing K)
    assert kernel.unsupported_reason_grouped(4, 576, 64, 32, np.int8) is None
    assert kernel.unsupported_reason_grouped(4, 576, 64, 192, np.int8) is None
    assert "K step there (64)" in kernel.unsupported_reason_grouped(4, 576, 64, 96, np.int8)


def _h100_mesh():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_K", "Q6_K", "fp8-block"])
def test_new_8bit_formats_stay_in_the_kernel_on_a_gpu(fmt):
    """No dense copy returns (traced for an H100, nothing compiled): a Llama whose layer linears (and, for the
    GGUF forms, its Q8_0 / Q6_K head) are stored as jpa keeps Q8_0 / Q5_K / Q6_K / block-wise FP8 has every
    linear kept stacked for the Mosaic kernel (`stacked_packed`), and its head is the kernel (its mma.sync):
    no dequantizing convert of a head-sized array."""
    import jax

    from jpa.models import ModelConfig
    from jpa.models.gpt import stacked_packed
    from jpa.tools.traffic import HEAD_FORMS, abstract_model

    config = ModelConfig(family="llama", vocab_size=512, d_model=256, num_layers=2, num_q_heads=4, num_kv_heads=2,
                         head_dim=64, ffn_dim=768, max_seq_len=256, tie_embeddings=False)
    from flax import nnx

    graphdef, state = nnx.split(abstract_model(config, fmt))
    kept = {}

    def head(state, h, where):
        model = nnx.merge(graphdef, state)
        kept[where] = stacked_packed(model, 4)
        return model.logits(h)

    h = jax.ShapeDtypeStruct((4, 256), jnp.float32)
    with jax.sharding.use_abstract_mesh(_h100_mesh()):
        jaxpr = jax.make_jaxpr(head, static_argnums=2)(state, h, "h100")
    jax.make_jaxpr(head, static_argnums=2)(state, h, "cpu")
    assert set(kept["h100"]) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}, kept
    assert kept["cpu"] == ()  # on this CPU: the plain-JAX path
    eqns = list(equations(jaxpr.jaxpr))
    prims = {e.primitive.name for e in eqns}
    head_converts = [e for e in eqns if e.primitive.name == "convert_element_type"
                     and np.prod(e.outvars[0].aval.shape) >= 256 * 512]
    if fmt in HEAD_FORMS:
        assert "mma" in prims and not head_converts, " ".join(sorted(prims))  # the kernel's mma.sync
    else:  # a block-FP8 checkpoint's head is bf16: a plain dot
        assert "mma" not in prims, " ".join(sorted(prims))



COMPILE_GROUPED = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import jax, jax.numpy as jnp
from jpa.ops.qmatmul import packed_matmul
from jpa.tools import traffic as tr
L, K, N = 2, 1024, 2048
S = jax.ShapeDtypeStruct
PARTS = ("codes", "d", "m", "d2", "m2")
out = {}
for target, fmt, M in CASES:
    form = tr.PACKED_FORMS[fmt]  # the abstract model's layout of the format: {part: (dtype, divisor of K)}
    names = [p for p in PARTS if p in form]
    def fn(x, *arrs):
        kw = dict(zip(names, arrs))
        def layer(x, i):
            y = packed_matmul(x, *(kw.get(p) for p in PARTS), layer=i, compute_dtype=jnp.bfloat16)
            return x + y[:, :K].astype(x.dtype), None
        return jax.lax.scan(layer, x, jnp.arange(L, dtype=jnp.int32))[0]
    args = (S((M, K), jnp.bfloat16), *(S((L, K // form[p][1], N), form[p][0]) for p in names))
    name = f"{target}-{fmt}-{M}"
    rec = deviceless.Compiler(target).compile(name, fn, args, keep_hlo=True, compiler_options=tr.WEIGHTS_IN_PLACE)
    out[name] = tr.stacked_weight_record(rec, args[1:], L)
print(json.dumps(out))
"""

# (target, format, rows): fp8 codes on Hopper only (Ampere has no float8 conversion: XLA's path serves it)
GROUPED_CASES = [(t, f, m) for t in ("h100", "a100") for f in ("Q8_0", "Q5_K", "Q6_K", "fp8-block")
                 for m in (16, 32, 64) if not (t == "a100" and f == "fp8-block")]


@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
@pytest.mark.parametrize("cases", [pytest.param([("h100", "Q5_K", 4)], marks=pytest.mark.bench),
                                   pytest.param(GROUPED_CASES, marks=pytest.mark.soak)], ids=["subset", "grid"])
def test_grouped_kernel_compiles_for_h100_and_a100_and_reads_each_layer_once(cases):
    """The 8-bit group-scaled kernel (GGUF Q8_0 / Q5_K / Q6_K as jpa keeps them, block-wise FP8) in a scan over
    2 stacked layers calling `packed_matmul` with the layer index, compiled for an H100 (TMA) and an A100
    (cp.async) without one: one Mosaic call, no ptxas spills, the stack's codes and scales read once, no weight
    written (the dense bf16 copy XLA's path makes would fail `written == 0`). "grid": 16 / 32 / 64 rows of
    every format (SOAK)."""
    out = run_compile(COMPILE_GROUPED.replace("for target, fmt, M in CASES:", f"for target, fmt, M in {cases!r}:"))
    assert len(out) == len(cases)
    check_compiled_in_place(out)


@pytest.mark.soak
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_k_a_multiple_of_64_compiles_for_h100_and_a100_and_reads_each_layer_once():
    """K = 576 (SmolLM2's d_model; the kernel's 64-value K step) through the 4-bit Q4_1 kernel, the int8
    per-channel one and the Q8_0 group-scaled one, in a scan over 2 stacked layers compiled for an H100 (TMA) and
    an A100 (cp.async): one Mosaic call each, no ptxas spills, the stack read once, no weight written."""
    out = run_compile(COMPILE.replace("L, K, N, G, M = 2, 1024, 2048, 32, 4", "L, K, N, G, M = 2, 576, 2048, 32, 4"))
    out.update(run_compile(COMPILE_GROUPED.replace("L, K, N = 2, 1024, 2048", "L, K, N = 2, 576, 2048").replace(
        "for target, fmt, M in CASES:", "for target, fmt, M in [('h100', 'Q8_0', 4), ('a100', 'Q8_0', 4)]:")))
    assert len(out) == 6
    check_compiled_in_place(out)
