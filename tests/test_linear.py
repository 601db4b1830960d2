"""models.linear (issue 48): one format object per weight format. Every format's `apply` is x @ its dequantized
weight (+ bias) on fresh random inputs, through XLA's dot and through the Mosaic matmul (GPU interpret mode);
the format a weight has is the one recorded where it was set, never read from the parameters' names, and the
record survives nnx.split / merge, nnx.eval_shape, stacking and models.sharding.shard."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpa.core.quant import quantize_weight
from jpa.core.sharding import tp_mesh
from jpa.models import GPT, ModelConfig, sharding
from jpa.models.gpt import PackedWeight, set_packed, set_scaled
from jpa.models.linear import DENSE, MXFP4, SCALED, Dense, Packed, Scaled, format_of, formats, set_format
from jpa.models.moe import FP4_E2M1, dequantize_mxfp4

CONFIG = ModelConfig(family="llama", vocab_size=128, d_model=64, num_layers=2, num_q_heads=2, num_kv_heads=1,
                     head_dim=32, ffn_dim=128, max_seq_len=64, tie_embeddings=False)
K, N = 256, 128  # [in, out] of the weights below: whole Q4_K super-blocks, the kernel's 64-column tiles


class Holder(nnx.Module):
    """A module holding one linear weight `wq` (a QUANT_AXIS name: blocks along `in`) and a bias."""

    def __init__(self, rng):
        self.wq = nnx.Param(jnp.asarray(rng.normal(0, 0.1, (K, N)), jnp.float32))
        self.bq = nnx.Param(jnp.asarray(rng.normal(0, 0.1, (N,)), jnp.float32))
        self.weight_formats = (("wq", DENSE),)


def _packed(rng, kind):
    """A random PackedWeight [K, N] of `kind` (blocks of 32 along K)."""
    g = K // 32
    d = lambda: rng.uniform(1e-3, 1e-2, (g, N)).astype(np.float16)  # noqa: E731
    if kind == "Q8_0":
        return PackedWeight(rng.integers(-127, 128, (K, N)).astype(np.int8), d(), None, -2)
    codes = rng.integers(0, 256, (K // 2, N)).astype(np.uint8)
    if kind == "Q4_0":
        return PackedWeight(codes, d(), None, -2)
    if kind == "Q4_1":
        return PackedWeight(codes, d(), rng.uniform(-0.1, 0, (g, N)).astype(np.float16), -2)
    if kind == "Q4_K":  # integer sub-block scales / minimums with f16 super-block ones
        sub = lambda: rng.integers(0, 64, (g, N)).astype(np.uint8)  # noqa: E731
        sup = lambda: rng.uniform(1e-4, 1e-3, (K // 256, N)).astype(np.float16)  # noqa: E731
        return PackedWeight(codes, sub(), sub(), -2, sup(), sup())
    if kind == "GPTQ act order":  # Q4_1 rows stored in a permuted order
        return dataclasses.replace(_packed(rng, "Q4_1"), perm=rng.permutation(K).astype(np.int32))
    raise AssertionError(kind)


FORMS = ["dense", "int8", "fp8", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "GPTQ act order"]


def _holder(rng, form):
    h = Holder(rng)
    if form in ("int8", "fp8"):
        set_scaled(h, "wq", *quantize_weight(np.asarray(h.wq[...]), form))
    elif form != "dense":
        set_packed(h, "wq", _packed(rng, form))
    return h


@pytest.mark.parametrize("form", FORMS)
def test_apply_is_x_times_the_dequantized_weight(form):
    rng = np.random.default_rng()
    h = _holder(rng, form)
    fmt = format_of(h, "wq")
    assert type(fmt) is {"dense": Dense, "int8": Scaled, "fp8": Scaled}.get(form, Packed)
    x = jnp.asarray(rng.normal(size=(2, 3, K)), jnp.float32)
    w = np.asarray(fmt.dequantize(h, "wq"), np.float64)  # [K, N] float: what the weight holds
    assert w.shape == (K, N)
    want = np.asarray(x, np.float64) @ w + np.asarray(h.bq[...], np.float64)
    got = np.asarray(fmt.apply(h, "wq", x, h.bq, dtype=jnp.float32))
    assert got.shape == (2, 3, N) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # the transposed weight ([out, in], the tied head's rows) gives x @ W.T
    if form in ("dense", "int8", "fp8"):
        t = Holder(rng)
        t.wq = nnx.Param(jnp.asarray(rng.normal(0, 0.1, (N, K)), jnp.float32))
        if form != "dense":
            set_scaled(t, "wq", *quantize_weight(np.asarray(t.wq[...]), form, -1))
        wt = np.asarray(format_of(t, "wq").dequantize(t, "wq", axis=-1), np.float64)  # [N, K]
        got = np.asarray(format_of(t, "wq").apply(t, "wq", x, dtype=jnp.float32, transpose=True))
        want = np.asarray(x, np.float64) @ wt.T
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("form, stacked", [("int8", False), ("GPTQ act order", True)])
def test_kernel_apply_equals_the_dot(form, stacked, monkeypatch):
    """The Mosaic matmul's path (GPU interpret mode) equals XLA's dot: one weight (a head) or a layer of a stack
    (the layer scan's kept weights)."""
    monkeypatch.setenv("JPA_QMATMUL", "interpret")
    rng = np.random.default_rng()
    h = _holder(rng, form)
    fmt = format_of(h, "wq")
    x = jnp.asarray(rng.normal(size=(4, K)), jnp.bfloat16)
    local = {sx: jax.ShapeDtypeStruct(getattr(h, "wq" + sx).get_value().shape, getattr(h, "wq" + sx).get_value().dtype)
             for sx in fmt.kernel_parts}
    assert fmt.unsupported_reason(4, local, jnp.bfloat16) is None  # the kernel serves it (an H100's rules)
    want = np.asarray(fmt.apply(h, "wq", x, h.bq, dtype=jnp.bfloat16))
    if stacked:  # a stack of 2 layers, the kernel reading layer 1
        for sx in fmt.kernel_parts:
            var = getattr(h, "wq" + sx)
            var.set_value(jnp.stack([jnp.zeros_like(var[...]), var[...]]))
        got = fmt.apply(h, "wq", x, h.bq, dtype=jnp.bfloat16, kernel=True, layer=jnp.int32(1))
    else:
        got = fmt.apply(h, "wq", x, h.bq, dtype=jnp.bfloat16, kernel=True, stacked=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_format_is_the_record_not_the_parameter_names():
    rng = np.random.default_rng()
    h = Holder(rng)
    h.wq_scale = nnx.Param(jnp.full((N,), 1e6, jnp.float32))  # a stray "_scale" beside a dense weight
    h.wq_bscale = nnx.Param(jnp.ones((K // 32, N), jnp.float16))
    assert format_of(h, "wq") is DENSE
    x = jnp.asarray(rng.normal(size=(3, K)), jnp.float32)
    want = np.asarray(x) @ np.asarray(h.wq[...])
    np.testing.assert_allclose(np.asarray(format_of(h, "wq").apply(h, "wq", x, dtype=jnp.float32)), want,
                               rtol=1e-5, atol=1e-5)
    set_format(h, "wq", SCALED)  # the record, not the names, says what the arrays are
    np.testing.assert_allclose(np.asarray(format_of(h, "wq").apply(h, "wq", x, dtype=jnp.float32)), want * 1e6,
                               rtol=1e-5)
    assert formats(h) == {"wq": SCALED}


def test_record_survives_split_eval_shape_stacking_and_sharding():
    model = nnx.eval_shape(lambda: GPT(CONFIG, rngs=nnx.Rngs(0), quantization="int8"))  # as the loaders build it
    assert formats(model) == {"tok_embeddings": SCALED, "output": SCALED}
    assert formats(model.layers) == {n: SCALED for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    rng = np.random.default_rng()
    L, d, f = CONFIG.num_layers, CONFIG.d_model, CONFIG.ffn_dim  # w_up [L, d, f] as Q4_1 blocks
    set_packed(model.layers, "w_up", PackedWeight(rng.integers(0, 256, (L, d // 2, f)).astype(np.uint8),
                                                  rng.uniform(1e-3, 1e-2, (L, d // 32, f)).astype(np.float16),
                                                  rng.uniform(-0.1, 0, (L, d // 32, f)).astype(np.float16), -2))
    want = formats(model.layers)
    assert want["w_up"] == Packed(("", "_bscale", "_bmin"))
    assert formats(nnx.merge(*nnx.split(model)).layers) == want
    assert formats(nnx.eval_shape(lambda: GPT(CONFIG, rngs=nnx.Rngs(0))).layers) == {n: DENSE for n in want}
    sharded, _ = sharding.shard(model, tp_mesh(1))
    assert formats(sharded.layers) == want and formats(sharded) == formats(model)


def test_mxfp4_experts_are_a_recorded_format():
    """A gpt-oss-style model records its experts as MXFP4 (models.moe takes their (codes, scales) `operand`), a
    float mixture of experts as Dense; the dequantized weight is e2m1 value times 2^(scale - 127), [E, in, out]."""
    config = dataclasses.replace(CONFIG, num_experts=4, experts_per_token=2, ffn_dim=64)
    dense = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    model = nnx.eval_shape(lambda: GPT(dataclasses.replace(config, expert_format="mxfp4"), rngs=nnx.Rngs(0)))
    names = ("experts_gate", "experts_up", "experts_down")
    assert {n: formats(dense.layers)[n] for n in names} == {n: DENSE for n in names}
    assert {n: formats(model.layers)[n] for n in names} == {n: MXFP4 for n in names}
    assert "w_up" not in formats(model.layers)  # no dense MLP in a mixture of experts
    rng = np.random.default_rng()
    codes = rng.integers(0, 256, (4, 64, 32)).astype(np.uint8)  # [E, out, in / 2]
    scales = rng.integers(120, 134, (4, 64, 2)).astype(np.uint8)  # [E, out, in / 32]
    model.layers.experts_up = nnx.Param(jnp.asarray(codes))
    model.layers.experts_up_scales = nnx.Param(jnp.asarray(scales))
    c, s = MXFP4.operand(model.layers, "experts_up")
    np.testing.assert_array_equal(np.asarray(c), codes)
    np.testing.assert_array_equal(np.asarray(s), scales)
    values = np.stack([FP4_E2M1[codes & 15], FP4_E2M1[codes >> 4]], -1).reshape(4, 64, 2, 32)  # [E, out, blocks, 32]
    want = np.swapaxes((values * 2.0 ** (scales.astype(np.int64) - 127)[..., None]).reshape(4, 64, 64), -1, -2)
    np.testing.assert_array_equal(np.asarray(MXFP4.dequantize(model.layers, "experts_up")), want)
    np.testing.assert_array_equal(np.asarray(dequantize_mxfp4(c, s, jnp.float32)), want)
    with pytest.raises(ValueError, match=r"weight experts_up holds MXFP4 experts: models.moe.moe_ffn routes x"):
        MXFP4.apply(model.layers, "experts_up", jnp.ones((1, 64)), dtype=jnp.float32)


def test_errors_name_the_weight_and_the_rule():
    h = Holder(np.random.default_rng())
    with pytest.raises(ValueError, match=r"records no format for weight 'wk'"):
        format_of(h, "wk")
    with pytest.raises(ValueError, match=r"fmt must be a models.linear format .* got str"):
        set_format(h, "wq", "packed")
    with pytest.raises(ValueError, match=r"kernel=True for weight wq: a dense weight: no dequantizing kernel"):
        format_of(h, "wq").apply(h, "wq", jnp.ones((1, K)), dtype=jnp.float32, kernel=True)
    with pytest.raises(ValueError, match=r"Packed.parts must hold '' and '_bscale' .* got \('', '_scale'\)"):
        Packed(("", "_scale"))
