"""Weight-only quantization (issue 35): int8 / fp8 (e4m3) weights, one scale per output channel,
dequantized inside each matmul (jpa.core.quant, models.GPT(quantization=)).

The quantized model is checked against the float model whose weights are the quantized ones
dequantized (`GPT.dequantized()`: q * scale): that isolates the matmul path from quantization error,
so the tolerance is float32's. Against the original float model the gap is the quantization error,
bounded loosely. The engine's greedy tokens and logprobs are checked against the dequantized model
run without a cache (teacher-forced on the engine's own completions) in the bench tier
(tests/test_bench_quant.py), with the model grid: the main tier keeps the fast checks.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpa import models
from jpa.args import QUANTIZATIONS, EngineArgs, Parser, UsageError
from jpa.core.quant import WEIGHT_QUANTIZATIONS, dequantize_weight, quantize_weight
from jpa.engine import EngineConfig, SamplingParams
from jpa.llm import LLM, build_engine
from jpa.models import GPT, PRESETS, forward_dense, sharding
from jpa.models.gpt import QUANT_AXIS
from jpa.models.linear import DENSE, Packed, format_of

HF_QWEN3 = "tests/data/hf/qwen3"


def _logprobs(model, tokens):
    return np.asarray(jax.nn.log_softmax(forward_dense(model, tokens), axis=-1))


def test_cli_choices_are_the_core_quantizations():
    assert set(QUANTIZATIONS) == set(models.LOAD_QUANTIZATIONS) > set(WEIGHT_QUANTIZATIONS)


def test_quantize_weight_by_hand():
    w = np.array([[1.0, -2.0], [0.5, 4.0]], np.float32)  # [in, out]: scales per column 1/127, 4/127
    q, s = quantize_weight(w, "int8")
    np.testing.assert_allclose(s, [1 / 127, 4 / 127], rtol=1e-7)
    # -2 / (4/127) = -63.5 and 0.5 / (1/127) = 63.5 round to even (-64, 64).
    np.testing.assert_array_equal(q, [[127, -64], [64, 127]])
    assert q.dtype == np.int8
    qj, sj = quantize_weight(jnp.asarray(w), "int8")  # the device path gives the same bytes
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_array_equal(np.asarray(sj), s)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("axis", [-2, -1])
def test_quantize_weight_error_is_bounded(quantization, axis):
    rng = np.random.default_rng()
    w = rng.standard_normal((3, 40, 24)).astype(np.float32) * rng.uniform(0.01, 3, (3, 1, 24)).astype(np.float32)
    w[1, :, 5] = 0.0  # an all-zero output channel (axis -2) / a zero slice (axis -1)
    w[2, 7, :] = 0.0
    q, s = quantize_weight(w, quantization, axis)
    assert q.dtype == WEIGHT_QUANTIZATIONS[quantization] and s.dtype == np.float32
    assert s.shape == tuple(np.delete(np.array(w.shape), axis % 3))
    back = dequantize_weight(q, s, axis)
    err = np.abs(back - w)
    se = np.expand_dims(s, axis)
    if quantization == "int8":
        assert np.all(err <= se / 2 * (1 + 1e-6))
    else:  # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 (step 2^-9)
        assert np.all(err <= np.abs(w) * 2.0 ** -4 + se * 2.0 ** -9)
    assert np.all(back[w == 0] == 0)
    # The channel's largest magnitude maps to the dtype's largest value exactly.
    np.testing.assert_allclose(np.max(np.abs(back), axis=axis), np.max(np.abs(w), axis=axis), rtol=1e-6)


def check_model_equals_its_dequantized_weights(name, quantization, tol):
    """(tests/test_bench_quant.py runs this over models and formats.)"""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    fp, _ = models.load(name, seed=seed)
    qm, _ = models.load(name, seed=seed, quantization=quantization)
    assert qm.quantization == quantization
    assert qm.layers.wq[...].dtype == WEIGHT_QUANTIZATIONS[quantization]
    assert qm.layers.wq_scale[...].shape == (fp.config.num_layers, fp.config.num_q_heads * fp.config.head_dim)
    assert qm.tok_embeddings[...].dtype == WEIGHT_QUANTIZATIONS[quantization]
    # Each QUANT_AXIS weight is 1 byte a value (not float32's 4) plus an f32 scale per channel.
    saved = scales = 0
    for path, var in nnx.to_flat_state(nnx.state(qm, nnx.Param)):
        name = sharding._name(path)
        if name in QUANT_AXIS:
            saved += 3 * var.get_value().size
        elif name.endswith("_scale"):
            scales += 4 * var.get_value().size
    assert saved > 0.5 * fp.weight_bytes()
    assert qm.weight_bytes() == fp.weight_bytes() - saved + scales
    tokens = jnp.asarray(rng.integers(0, fp.config.vocab_size, (2, 11)), jnp.int32)
    got, deq, want = _logprobs(qm, tokens), _logprobs(qm.dequantized(), tokens), _logprobs(fp, tokens)
    np.testing.assert_allclose(got, deq, atol=2e-5, rtol=0)  # the kernel path: float32 rounding only
    gap = np.abs(got - want).max()
    assert 0 < gap < tol, gap  # quantization error: present, and small


def check_engine_greedy_tokens_and_logprobs_equal_the_dequantized_model():
    """(Run by tests/test_bench_quant.py: an engine compile costs ~30 s here.)"""
    from jpa.testing.engine import context_gpt

    gpt, tok = context_gpt(1)  # sharp logits: greedy choices are decided by margins far above rounding
    qm = gpt.quantized("int8")
    deq = qm.dequantized()
    llm = LLM.from_model(qm, tok, max_seqs=3, page_size=8, num_pages=48, steps_per_call=4, max_model_len=96)
    prompts = ["hello world", "the quick brown fox jumps over", "paged"]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True, logprobs=0))
    seqs = [tok.encode(p) + list(o.token_ids) for p, o in zip(prompts, outs)]
    width = max(map(len, seqs))  # right padding does not change earlier rows: one batch, one compile
    lps = _logprobs(deq, jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32))  # [B, T, vocab]
    for ids, out, lp in zip(seqs, outs, lps):
        n = len(ids) - len(out.token_ids)
        rows = lp[n - 1:len(ids) - 1]  # the rows that predicted each completion token
        assert list(rows.argmax(-1)) == list(out.token_ids)
        np.testing.assert_allclose(out.logprobs, rows[np.arange(len(rows)), out.token_ids], atol=1e-4)


@pytest.mark.bench
def test_head_plans_keep_quantized_weights_and_the_function(tp=3):
    """tiny-llama at tp=3 pads heads (tests/test_bench_quant.py: tp=4 replicates them)."""
    rng = np.random.default_rng()
    qm, _ = models.load("tiny-llama", seed=int(rng.integers(1 << 30)), quantization="int8")
    new = sharding.with_heads(qm, sharding.plan_heads(qm.config, tp))
    assert new.quantization == "int8" and new.layers.wk[...].dtype == np.int8
    assert new.layers.wk_scale[...].shape[-1] == new.config.num_kv_heads * new.config.head_dim
    tokens = jnp.asarray(rng.integers(0, qm.config.vocab_size, (2, 9)), jnp.int32)
    np.testing.assert_allclose(_logprobs(new, tokens), _logprobs(qm, tokens), atol=2e-5)
    # The scales are sharded with their weights' output axis.
    specs = dict((sharding._name(p), s) for p, s in nnx.to_flat_state(sharding.param_specs(nnx.state(new))))
    assert specs["wq_scale"] == jax.sharding.PartitionSpec(None, "tp")
    assert specs["wo_scale"] == jax.sharding.PartitionSpec(None)
    assert specs["tok_embeddings_scale"] == jax.sharding.PartitionSpec("tp")


def check_checkpoint_quantized_on_the_host_equals_quantized_on_the_device():
    """(Run by tests/test_bench_quant.py.)"""
    host, _ = models.load(HF_QWEN3, dtype=jnp.float32, quantization="int8")
    dense, _ = models.load(HF_QWEN3, dtype=jnp.float32)
    dev = dense.quantized("int8")
    a, b = nnx.to_flat_state(nnx.state(host, nnx.Param)), dict(nnx.to_flat_state(nnx.state(dev, nnx.Param)))
    assert {p for p, _ in a} == set(b) and any(sharding._name(p) == "wq_scale" for p, _ in a)
    for path, var in a:
        x, y = np.asarray(var.get_value()), np.asarray(b[path].get_value())
        assert x.dtype == y.dtype, path
        x, y = x.astype(np.float32), y.astype(np.float32)
        if x.dtype == np.int8 or sharding._name(path) in QUANT_AXIS:
            # NumPy and XLA may round a quotient that lands on .5 apart: one step, rarely.
            assert np.abs(x - y).max() <= 1 and np.mean(x != y) < 1e-3, path
        else:
            np.testing.assert_allclose(x, y, rtol=1e-6, err_msg=str(path))


def test_draft_model_is_loaded_with_the_target_quantization(monkeypatch):
    qm, tok = models.load("tiny-llama", seed=1, quantization="int8")
    seen = []
    real = models.load

    def load(name, **kw):
        seen.append(kw)
        return real(name, **kw)

    monkeypatch.setattr(models, "load", load)
    config = EngineConfig(max_seqs=2, page_size=8, num_pages=32, max_model_len=64, speculative=dict(
        method="draft_model", model="tiny-llama", num_speculative_tokens=2))
    build_engine(qm, tok, config)
    assert seen and seen[0]["quantization"] == "int8"


def test_cli_flag_reaches_engine_args():
    ap = Parser()
    EngineArgs.add_cli_args(ap)
    args = EngineArgs.from_cli_args(ap.parse_args(["--quantization", "fp8"]))
    assert args.quantization == "fp8" and args.check() is args
    with pytest.raises(UsageError, match="argument --quantization: invalid choice: 'int4'"):
        ap.parse_args(["--quantization", "int4"])
    with pytest.raises(UsageError, match="--quantization must be one of int8, fp8, gguf, none; got .q4."):
        EngineArgs(quantization="q4").check()
    assert isinstance(ap, argparse.ArgumentParser)


@pytest.mark.parametrize("make", [
    lambda: GPT(PRESETS["tiny-llama"], rngs=nnx.Rngs(0), quantization="int4"),
    lambda: models.load("smollm2-135m", quantization="int4"),  # refused before any file is fetched
    lambda: LLM("tiny-llama", quantization="int4"),
    lambda: models.load(HF_QWEN3, quantization="nf4"),
])
def test_unsupported_quantization_is_one_clear_line(make):
    with pytest.raises(ValueError, match=r"^quantization must be one of \[.*\] or None; got '(int4|nf4)'$"):
        make()


def test_quantizing_twice_is_refused():
    qm, _ = models.load("tiny-llama", quantization="int8")
    with pytest.raises(ValueError, match="already quantized"):
        qm.quantized("fp8")


# ---- GGUF blocks kept packed (quantization "gguf") ----

def _gguf_blocks(w_rows, fmt):
    """(raw GGUF bytes, their numpy dequantization) of a float [rows, cols] tensor, by the gguf package."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[fmt]
    raw = quants.quantize(np.asarray(w_rows, np.float32), t)
    return raw, quants.dequantize(raw, t).reshape(w_rows.shape)


def test_gguf_blocks_unpack_to_the_gguf_package_values():
    from jpa.core.quant import dequantize_blocks, unpack_gguf_rows

    rng = np.random.default_rng()
    for fmt in ("Q8_0", "Q4_0", "Q4_1"):
        w = rng.standard_normal((5, 96)).astype(np.float32)
        raw, want = _gguf_blocks(w, fmt)
        codes, d, m = unpack_gguf_rows(raw, fmt, 5, 96, name="t")
        j = lambda a: None if a is None else jnp.asarray(a)
        np.testing.assert_array_equal(np.asarray(dequantize_blocks(j(codes), j(d), j(m), axis=-1)), want)
        mt = None if m is None else m.T
        np.testing.assert_array_equal(np.asarray(dequantize_blocks(j(codes.T), j(d.T), j(mt), axis=-2)), want.T)


def test_packed_gguf_model_equals_the_model_dequantized_at_load():
    """A tiny llama whose weights are real Q8_0 / Q4_0 / Q4_1 blocks (written by the gguf package) kept
    packed: its logits equal those of the same blocks dequantized by NumPy into a dense model."""
    from jpa.models.gpt import PackedWeight, expected_shapes
    from jpa.models.smollm2 import _packed_linear, _unpermute_qk
    from jpa.core.quant import unpack_gguf_rows

    c = PRESETS["tiny-llama"]
    rng = np.random.default_rng()
    fmts = {"wq": "Q4_1", "wk": "Q4_0", "wv": "Q8_0", "wo": "Q4_1", "w_gate": "Q4_0", "w_up": "Q4_1",
            "w_down": "Q8_0"}
    heads = {"wq": c.num_q_heads, "wk": c.num_kv_heads}
    shapes = expected_shapes(c)
    packed, dense = {}, {}
    emb = (rng.standard_normal((c.vocab_size, c.d_model)) * 0.5).astype(np.float32)
    raw, deq = _gguf_blocks(emb, "Q8_0")
    packed["tok_embeddings"] = PackedWeight(*unpack_gguf_rows(raw, "Q8_0", *emb.shape), -1)
    dense["tok_embeddings"] = deq
    packed["norm"] = dense["norm"] = rng.uniform(0.5, 1.5, c.d_model).astype(np.float32)
    packed["layers"], dense["layers"] = [], []
    for _ in range(c.num_layers):
        pl, dl = {}, {}
        for name, shape in shapes["layers"].items():
            if name not in fmts:
                pl[name] = dl[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
                continue
            w_rows = (rng.standard_normal(shape[::-1]) * 0.3).astype(np.float32)  # GGUF's [out, in]
            raw, deq = _gguf_blocks(w_rows, fmts[name])
            n = heads.get(name)
            pl[name] = _packed_linear(*unpack_gguf_rows(raw, fmts[name], *w_rows.shape), n)
            dl[name] = (deq if n is None else _unpermute_qk(deq, n)).T.copy()
        packed["layers"].append(pl)
        dense["layers"].append(dl)
    pm = GPT.from_weights(c, packed)
    dm = GPT.from_weights(c, dense)
    assert pm.quantization == "gguf" and pm.layers.wq[...].dtype == np.uint8 and pm.layers.wv[...].dtype == np.int8
    assert pm.layers.wq[...].shape == (c.num_layers, c.d_model // 2, c.num_q_heads * c.head_dim)
    assert pm.weight_bytes() < 0.35 * dm.weight_bytes()
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, (2, 10)), jnp.int32)
    np.testing.assert_allclose(_logprobs(pm, tokens), _logprobs(dm, tokens), atol=2e-5, rtol=0)
    deq_model = pm.dequantized()
    for name in fmts:
        np.testing.assert_array_equal(np.asarray(getattr(deq_model.layers, name)[...]),
                                      np.asarray(getattr(dm.layers, name)[...]))


@pytest.mark.parametrize("data,fmt,msg", [
    (np.zeros(100, np.uint8), "Q4_1", r"tensor blk.3.ffn_up.weight \(Q4_1\) holds 100 bytes of uint8; a \[4, 64\] "
                                      r"Q4_1 tensor has 160 uint8: truncated or corrupt"),
    (np.zeros(160, np.uint8), "IQ4_XS", r"tensor blk.3.ffn_up.weight has type IQ4_XS; jpa keeps \['Q4_0', 'Q4_1', "
                                        r"'Q4_K', 'Q5_K', 'Q6_K', 'Q8_0'\] packed"),
    (np.zeros(100, np.uint8), "Q6_K", r"tensor blk.3.ffn_up.weight \(Q6_K\) has 64 columns, not a multiple of 256"),
])
def test_corrupt_or_unsupported_gguf_tensor_is_one_line_naming_it(data, fmt, msg):
    from jpa.core.quant import unpack_gguf_rows

    with pytest.raises(ValueError, match="^" + msg):
        unpack_gguf_rows(data, fmt, 4, 64, name="blk.3.ffn_up.weight")


def test_gguf_quantization_needs_a_gguf_model():
    with pytest.raises(ValueError, match="quantization 'gguf' keeps a GGUF file's blocks; tiny-llama is not"):
        models.load("tiny-llama", quantization="gguf")
    with pytest.raises(UsageError, match="--quantization gguf keeps a GGUF file's blocks"):
        EngineArgs(model="tiny-llama", quantization="gguf").check()


# ---- GGUF K-quants (Q4_K, Q5_K, Q6_K) kept packed ----

def _k_blocks(rng, fmt, rows, cols, scale=2e-3):
    """Random GGUF K-quant bytes [rows, cols / 256 * bytes] (every code, sub-scale and minimum bit random)
    with sane f16 super-block scales, and gguf.quants.dequantize's float values of them (the oracle; the
    gguf package cannot quantize K types)."""
    from gguf import GGMLQuantizationType, quants

    from jpa.core.quant import K_FORMATS

    raw = rng.integers(0, 256, (rows, cols // 256, K_FORMATS[fmt])).astype(np.uint8)
    for at in ([208] if fmt == "Q6_K" else [0, 2]):  # d (and dmin)
        raw[..., at:at + 2] = rng.uniform(scale / 4, scale, raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    return raw, quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(rows, cols)


def test_gguf_k_quants_unpack_to_the_gguf_package_values():
    from jpa.core.quant import K_FORMATS, dequantize_blocks, unpack_gguf_rows, unpack_k_blocks

    rng = np.random.default_rng()
    for fmt in K_FORMATS:
        raw, want = _k_blocks(rng, fmt, 3, 512)
        codes, d, m = unpack_gguf_rows(raw, fmt, 3, 512, name="t")
        assert codes.dtype == (np.uint8 if fmt == "Q4_K" else np.int8) and d.dtype == np.float32
        np.testing.assert_array_equal(dequantize_blocks(codes, d, m, axis=-1), want)  # NumPy, bit for bit
        codes, d, m, d2, m2 = unpack_k_blocks(raw, fmt, 3, 512, name="t")  # as kept: sub-block + super-block
        assert d.dtype == (np.int8 if fmt == "Q6_K" else np.uint8) and d2.shape == (3, 2)
        j = lambda a: None if a is None else jnp.asarray(a.T)
        got = dequantize_blocks(j(codes), j(d), j(m), axis=-2, d2=j(d2), m2=j(m2))
        np.testing.assert_array_equal(np.asarray(got), want.T)
    with pytest.raises(ValueError, match=r"^tensor t \(Q5_K\) holds 300 bytes of uint8; a \[2, 256\] Q5_K tensor "
                                         r"has 352 uint8: truncated or corrupt$"):
        unpack_gguf_rows(np.zeros(300, np.uint8), "Q5_K", 2, 256, name="t")


def test_k_quant_model_equals_the_model_dequantized_at_load():
    """A llama whose linears are K-quant blocks, mixed across layers as a Q4_K_M file mixes them (Q6_K
    ffn_down / attn_v in one layer, Q4_K / Q5_K in the other: stacked in one common form), kept
    packed: its logits equal the model of gguf's dequantized values."""
    import dataclasses

    from jpa.core.quant import unpack_k_blocks
    from jpa.models.gpt import PackedWeight, expected_shapes
    from jpa.models.smollm2 import _packed_linear, _unpermute_qk

    c = dataclasses.replace(PRESETS["tiny-llama"], d_model=256, ffn_dim=256, num_q_heads=4, num_kv_heads=2,
                            head_dim=64, vocab_size=300)
    rng = np.random.default_rng()
    fmts = [{"wq": "Q4_K", "wk": "Q5_K", "wv": "Q6_K", "wo": "Q4_K", "w_gate": "Q4_K", "w_up": "Q5_K",
             "w_down": "Q6_K"},
            {"wq": "Q4_K", "wk": "Q5_K", "wv": "Q4_K", "wo": "Q4_K", "w_gate": "Q4_K", "w_up": "Q5_K",
             "w_down": "Q4_K"}]
    heads = {"wq": c.num_q_heads, "wk": c.num_kv_heads}
    packed, dense = {}, {}
    raw, deq = _k_blocks(rng, "Q6_K", c.vocab_size, c.d_model, 0.05)
    emb = unpack_k_blocks(raw, "Q6_K", *deq.shape)
    packed["tok_embeddings"] = PackedWeight(*emb[:3], -1, *emb[3:])
    dense["tok_embeddings"] = deq
    packed["norm"] = dense["norm"] = rng.uniform(0.5, 1.5, c.d_model).astype(np.float32)
    packed["layers"], dense["layers"] = [], []
    for layer in fmts:
        pl, dl = {}, {}
        for name, shape in expected_shapes(c)["layers"].items():
            if name not in layer:
                pl[name] = dl[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
                continue
            raw, deq = _k_blocks(rng, layer[name], shape[1], shape[0])  # GGUF's [out, in]
            n = heads.get(name)
            blocks = unpack_k_blocks(raw, layer[name], shape[1], shape[0])
            pl[name] = _packed_linear(*blocks[:3], n, *blocks[3:])
            dl[name] = (deq if n is None else _unpermute_qk(deq, n)).T.copy()
        packed["layers"].append(pl)
        dense["layers"].append(dl)
    pm = GPT.from_weights(c, packed)
    dm = GPT.from_weights(c, dense)
    assert pm.layers.wq[...].dtype == np.uint8 and pm.layers.wk[...].dtype == np.int8  # Q4_K nibbles, Q5_K
    # Q4_K in both layers: nibbles, one-byte sub-block scales and minimums, f16 super-block d / -dmin
    assert pm.layers.wq_bscale[...].dtype == np.uint8 and pm.layers.wq_bscale2[...].shape == (2, 1, 256)
    # Q6_K / Q4_K mixed: one common form (int8 codes, f32 scales per 16, minimums)
    assert pm.layers.w_down[...].dtype == np.int8 and pm.layers.w_down_bscale[...].shape == (2, 256 // 16, 256)
    assert pm.tok_embeddings_bscale[...].dtype == np.int8 and pm.tok_embeddings_bscale2[...].shape == (300, 1)
    assert pm.weight_bytes() < 0.4 * dm.weight_bytes()
    # GPT.from_weights records the formats it set (models.linear), the K-quants' super-block parts with them
    assert format_of(pm.layers, "wq") == Packed(("", "_bscale", "_bmin", "_bscale2", "_bmin2"))
    assert format_of(pm.layers, "w_down") == Packed(("", "_bscale", "_bmin"))  # the common form
    assert format_of(dm.layers, "wq") == DENSE
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, (2, 10)), jnp.int32)
    np.testing.assert_allclose(_logprobs(pm, tokens), _logprobs(dm, tokens), atol=5e-5, rtol=0)
