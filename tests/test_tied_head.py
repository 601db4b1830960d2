"""A tied quantized head through the Mosaic dequantizing matmul (issue 35): the embedding table kept
[d_model, vocab] (`models.gpt.set_embeddings_layout`) is the head's [in, out] codes, read as stored; the
lookup gathers the tokens' columns. Checked against NumPy (the kernel in GPU interpret mode), against
today's [vocab, d_model] layout (embed exactly, logits, dequantized, weight bytes), traced for an H100
(the head is the kernel: no head-sized dequantizing convert) and compiled for one without a GPU (no
dense float copy of the table written)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jpa.testing.jaxprs import equations
from jpa.core.quant import dequantize_blocks, quantize_weight
from jpa.models import GPT, GPTForEngine, ModelConfig
from jpa.models.gpt import PackedWeight, set_embeddings_layout, set_packed, tied_head_served
from jpa.pallas.mosaic import qmatmul as kernel
from jpa.tools import deviceless

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16
# K = d_model a multiple of the kernel's 128, N = vocab of its 64
CONFIG = ModelConfig(family="llama", vocab_size=256, d_model=128, num_layers=1, num_q_heads=2, num_kv_heads=1,
                     head_dim=64, ffn_dim=256, max_seq_len=256, tie_embeddings=True)


def _table(rng, fmt, vocab, d):
    """A random quantized embedding table as jpa keeps it in rows ([vocab, ...], blocks along d_model):
    (parts {suffix: array}, its float32 [vocab, d] value)."""
    if fmt in ("int8", "fp8"):
        q, scale = quantize_weight(rng.standard_normal((vocab, d)).astype(np.float32), fmt, -1)
        q, scale = np.asarray(q), np.asarray(scale)
        return {"": q, "_scale": scale}, q.astype(np.float32) * scale[:, None]
    if fmt == "Q8_0":
        codes = rng.integers(-127, 128, (vocab, d)).astype(np.int8)
        parts = {"": codes, "_bscale": rng.uniform(0.005, 0.05, (vocab, d // 32)).astype(np.float16)}
    else:  # Q4_1: two 4-bit codes a byte, f16 scales and minimums per 32
        parts = {"": rng.integers(0, 256, (vocab, d // 2)).astype(np.uint8),
                 "_bscale": rng.uniform(0.005, 0.05, (vocab, d // 32)).astype(np.float16),
                 "_bmin": rng.uniform(-0.4, 0.4, (vocab, d // 32)).astype(np.float16)}
    w = dequantize_blocks(parts[""], parts["_bscale"], parts.get("_bmin"), -1, np.float32)
    return parts, w


@pytest.mark.parametrize("fmt,rows", [("Q8_0", 3), ("int8", 20), pytest.param("Q8_0", 64, marks=pytest.mark.bench)])
def test_tied_head_kernel_in_interpret_mode_equals_numpy(fmt, rows):
    """The table's codes transposed ([d_model, vocab], scales [d_model / 32, vocab] or f32[vocab]): the same
    bytes, no requantization, are `qmatmul_grouped`'s / `qmatmul_scaled`'s [K, N] weight; the kernel equals
    x @ W.T of the table dequantized by NumPy."""
    rng = np.random.default_rng()
    vocab, d = 192, 256
    parts, w = _table(rng, fmt, vocab, d)
    x = rng.normal(size=(rows, d)).astype(BF16)
    if fmt == "int8":
        got = kernel.qmatmul_scaled(jnp.asarray(x), parts[""].T, parts["_scale"], interpret=True)
        want = (x.astype(np.float32) @ parts[""].T.astype(np.float32)) * parts["_scale"]
        tol = 1e-5
    else:
        got = kernel.qmatmul_grouped(jnp.asarray(x), parts[""].T, parts["_bscale"].T, interpret=True)
        want = x.astype(np.float32) @ w.T.astype(BF16).astype(np.float32)  # W rounded to bf16 once, as the kernel
        tol = 2e-4
    got = np.asarray(got)
    assert got.shape == (rows, vocab) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
    exact = x.astype(np.float32) @ w.T
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def _model(fmt, seed=0):
    """A tiny tied llama (bfloat16) whose embedding table is a random `fmt` table, in rows."""
    model = GPT(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed), quantization=fmt if fmt in ("int8", "fp8") else None)
    parts, _ = _table(np.random.default_rng(seed), fmt, CONFIG.vocab_size, CONFIG.d_model)
    if fmt in ("int8", "fp8"):
        model.tok_embeddings.set_value(jnp.asarray(parts[""]))
        model.tok_embeddings_scale.set_value(jnp.asarray(parts["_scale"]))
    else:
        set_packed(model, "tok_embeddings", PackedWeight(parts[""], parts["_bscale"], parts.get("_bmin"), -1))
        model.quantization = "gguf"
    return model


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "int8", "fp8"])
def test_columns_layout_equals_rows_layout(fmt):
    """The table kept [d_model, vocab]: embed() gathers the tokens' columns and equals the rows' lookup
    exactly; logits (here on the CPU: the codes dequantized where the dot reads them, as the untied head's
    path), dequantized() and weight_bytes() equal today's; one copy (the arrays transposed, none added);
    and back to rows gives the same arrays."""
    model = _model(fmt)
    tokens = jnp.asarray([[0, 5, 255], [17, 3, 300]], jnp.int32)  # 300: past the table, clipped as before
    positions = jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, CONFIG.d_model)), jnp.float32)
    before = dict(embed=np.asarray(model.embed(tokens, positions)), logits=np.asarray(model.logits(h)),
                  deq=np.asarray(model.dequantized().tok_embeddings[...].astype(jnp.float32)),
                  nbytes=model.weight_bytes(), table=np.asarray(model.tok_embeddings[...]))
    leaves = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    set_embeddings_layout(model, True)
    assert model.embeddings_columns and model.tok_embeddings[...].shape[-1] == CONFIG.vocab_size
    np.testing.assert_array_equal(np.asarray(model.embed(tokens, positions)), before["embed"])
    np.testing.assert_allclose(np.asarray(model.logits(h)), before["logits"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(model.dequantized().tok_embeddings[...].astype(jnp.float32)),
                                  before["deq"])
    assert model.weight_bytes() == before["nbytes"]
    assert len(jax.tree.leaves(nnx.state(model, nnx.Param))) == leaves
    set_embeddings_layout(model, False)
    assert not model.embeddings_columns
    np.testing.assert_array_equal(np.asarray(model.tok_embeddings[...]), before["table"])


def test_engine_keeps_rows_on_the_cpu():
    """On this CPU the kernel does not serve: the engine keeps the table in rows (CPU outputs unchanged);
    a float or untied table never serves."""
    model = _model("Q8_0")
    assert not tied_head_served(model)
    GPTForEngine(model)
    assert not model.embeddings_columns
    dense = GPT(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert not tied_head_served(dense)
    with pytest.raises(ValueError, match="columns=True wants a quantized embedding table"):
        set_embeddings_layout(dense, True)
    assert set_embeddings_layout(dense, False) is dense  # rows already: nothing to do


def _h100_mesh():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"))



@pytest.mark.parametrize("fmt", ["Q8_0", "int8", "fp8"])
def test_tied_head_is_the_kernel_on_an_h100(fmt):
    """Traced for an H100 (nothing compiled): an abstract tied model (`abstract_model`: SmolLM2's form, Q8_0
    table; or int8 / fp8) keeps its table [d_model, vocab], `tied_head_served` says so, and its head is the
    kernel's mma.sync with no head-sized dequantizing convert; in rows (today's layout) it is the convert."""
    from jpa.tools.traffic import abstract_model

    config = ModelConfig(family="llama", vocab_size=512, d_model=256, num_layers=2, num_q_heads=4, num_kv_heads=2,
                         head_dim=64, ffn_dim=768, max_seq_len=256, tie_embeddings=True)
    h = jax.ShapeDtypeStruct((4, 256), jnp.float32)
    found = {}
    for columns in (True, False):
        graphdef, state = nnx.split(abstract_model(config, fmt, embeddings_columns=columns))
        served = {}

        def head(state, h):
            model = nnx.merge(graphdef, state)
            served["h100"] = tied_head_served(model, 4)
            return model.logits(h)

        with jax.sharding.use_abstract_mesh(_h100_mesh()):
            jaxpr = jax.make_jaxpr(head)(state, h)
        eqns = list(equations(jaxpr.jaxpr))
        converts = [e for e in eqns if e.primitive.name == "convert_element_type"
                    and np.prod(e.outvars[0].aval.shape) >= 256 * 512]
        found[columns] = ("mma" in {e.primitive.name for e in eqns}, len(converts), served["h100"])
    assert found[True] == (True, 0, True), found
    assert not found[False][0] and found[False][1] >= 1, found


COMPILE = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import jax, jax.numpy as jnp
from flax import nnx
from jpa.models import ModelConfig
from jpa.tools import traffic as tr
config = ModelConfig(family="llama", vocab_size=4096, d_model=512, num_layers=1, num_q_heads=8, num_kv_heads=2,
                     head_dim=64, ffn_dim=1024, max_seq_len=256, tie_embeddings=True)
out = {}
for fmt, columns in CASES:
    graphdef, state = nnx.split(tr.abstract_model(config, fmt, embeddings_columns=columns))
    def fn(state, h):
        return nnx.merge(graphdef, state).logits(h)
    args = (state, jax.ShapeDtypeStruct((8, 512), jnp.float32))
    leaves = [v for k, v in nnx.to_flat_state(state) if k[0].startswith("tok_embeddings")]
    leaves = [jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype) for v in leaves]
    rec = deviceless.Compiler("h100").compile(f"{fmt}-{columns}", fn, args, keep_hlo=True,
                                              compiler_options=tr.WEIGHTS_IN_PLACE)
    spec = tr.Spec(weight_types=tr.weight_types_of(leaves), dense_sizes=tr.dense_sizes_of(leaves))
    s = tr.summary(tr.select(tr.traffic(rec["hlo"], spec)))
    out[f"{fmt}-{columns}"] = dict(ok=rec["ok"], problems=rec["problems"], mosaic=rec["mosaic_calls"],
                                   read=s["weights"]["read"], written=s["weights"]["written"],
                                   copies=len(s["weight_copies"]), table=sum(a.size * a.dtype.itemsize for a in leaves))
print(json.dumps(out))
"""


@pytest.mark.bench
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_tied_head_compiles_for_h100_without_a_dense_copy():
    """`GPT.logits` of a tied Q8_0 and int8 table compiled for an H100 without one: in columns one Mosaic
    call reads the table's codes and scales once and no table-sized float array is written; in rows (today's
    layout, the "before") XLA writes a dense copy of the table."""
    cases = [("Q8_0", True), ("Q8_0", False), ("int8", True)]
    code = COMPILE.replace("for fmt, columns in CASES:", f"for fmt, columns in {cases!r}:")
    env = {k: v for k, v in os.environ.items() if k != "JPA_QMATMUL"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["ok"] and not r["problems"], (name, r)
    for name in ("Q8_0-True", "int8-True"):
        r = out[name]
        assert r["mosaic"] == 1 and r["written"] < 0.01 * r["table"] and r["copies"] == 0, (name, r)
        assert r["table"] <= r["read"] <= 1.05 * r["table"], (name, r)
    before = out["Q8_0-False"]
    assert before["mosaic"] == 0 and before["written"] >= 4096 * 512 * 2, before  # a bf16 copy of the table


def test_sharding_plans_the_rows():
    """A table kept in columns goes back to [vocab, d_model] rows under a tensor-parallel mesh (models.sharding
    plans the rows; the kernel is not used there): the sharded table is the rows table."""
    from jpa.core.sharding import TP
    from jpa.models.sharding import shard

    model = _model("int8")
    want = np.asarray(model.tok_embeddings[...])
    set_embeddings_layout(model, True)
    mesh = jax.make_mesh((1,), (TP,), axis_types=(jax.sharding.AxisType.Explicit,))
    out, _ = shard(model, mesh)
    assert not out.embeddings_columns and out.tok_embeddings[...].shape == (CONFIG.vocab_size, CONFIG.d_model)
    np.testing.assert_array_equal(np.asarray(out.tok_embeddings[...]), want)


def _f32_model(fmt, seed=0):
    """`_model`'s tied table in a float32 model (the CPU's compute dtype for GGUF weights)."""
    model = _model(fmt, seed)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, state)
    model = nnx.merge(graphdef, state)
    model.dtype = jnp.float32
    return model


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "int8"])
def test_dense_head_equals_the_tables_head(fmt):
    """`set_dense_head`: one float32 [d_model, vocab] copy of a tied quantized table (the values the step
    dequantized, transposed once) gives the logits of the table's head on fresh random rows (the same
    products, summed in another order: f32 tolerance; an int8 table's scales multiplied before the dot
    instead of after), leaves the lookup exact, adds d_model * vocab floats, and dense=False drops it (the
    logits then bit for bit the table's again)."""
    from jpa.models.gpt import set_dense_head

    model = _f32_model(fmt, seed=int(np.random.default_rng().integers(1 << 16)))
    rng = np.random.default_rng()
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    h = jnp.asarray(rng.normal(size=(2, 5, CONFIG.d_model)), jnp.float32)
    logits, embed = np.asarray(model.logits(h)), np.asarray(model.embed(tokens, positions))
    nbytes = model.weight_bytes()
    assert set_dense_head(model) is model and model.head_dense
    assert model.output[...].shape == (CONFIG.d_model, CONFIG.vocab_size) and model.output[...].dtype == jnp.float32
    got = np.asarray(model.logits(h))
    np.testing.assert_allclose(got, logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    np.testing.assert_array_equal(np.asarray(model.embed(tokens, positions)), embed)
    assert model.weight_bytes() == nbytes + 4 * CONFIG.d_model * CONFIG.vocab_size
    set_dense_head(model, False)
    assert not model.head_dense and not hasattr(model, "output")
    np.testing.assert_array_equal(np.asarray(model.logits(h)), logits)


def test_engine_keeps_a_dense_head_on_the_cpu_once():
    """GPTForEngine on a CPU gives a tied quantized model the dense head (in place; a second engine over the
    same model shares it), a float model or an abstract one (deviceless compiles) none; set_dense_head
    refuses a table it cannot copy."""
    from jpa.models.gpt import dense_head_wanted, set_dense_head

    model = _model("Q4_1")
    assert dense_head_wanted(model)
    GPTForEngine(model)
    assert model.head_dense and not dense_head_wanted(model)
    copy = model.output[...]
    GPTForEngine(model)
    assert model.output[...] is copy
    dense = GPT(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert not dense_head_wanted(dense)
    GPTForEngine(dense)
    assert not dense.head_dense
    with pytest.raises(ValueError, match="set_dense_head wants a tied quantized embedding table"):
        set_dense_head(dense)
    from jpa.tools.abstract import abstract_model   # deviceless compiles: the step as stored, no copy
    abstract = abstract_model(CONFIG, "Q4_1", False)
    assert not dense_head_wanted(abstract)
    GPTForEngine(abstract)
    assert not abstract.head_dense


@pytest.mark.parametrize("fmt", ["Q8_0", "int8"])
def test_update_weights_recomputes_the_dense_head(fmt):
    """update_weights' hook (`GPTForEngine.complete_params`): new weights carry the dense head of THEIR
    table (a copy passed in stale, or none: a pytree of the model as loaded, is made anew); the rest as
    given; a model without the copy takes params as they are."""
    from jpa.models.gpt import dense_head_of

    eng = GPTForEngine(_model(fmt))
    fresh = _model(fmt, seed=int(np.random.default_rng().integers(1, 1 << 16)))  # another table
    fmt_obj = eng.dense_head_format
    want = np.asarray(dense_head_of(fmt_obj, fresh, eng.dtype))
    new = nnx.State(dict(eng.params))
    for sx in fmt_obj.parts:
        new["tok_embeddings" + sx] = nnx.Param(fresh.__getattribute__("tok_embeddings" + sx)[...])
    got = eng.complete_params(new)   # the old copy passed along: replaced
    np.testing.assert_array_equal(np.asarray(got["output"][...]), want)
    assert not np.array_equal(np.asarray(eng.params["output"][...]), want)
    assert got["norm"] is new["norm"]
    loaded = nnx.split(fresh)[1]   # the model's own pytree, no copy in it: the copy is added
    got = eng.complete_params(loaded)
    np.testing.assert_array_equal(np.asarray(got["output"][...]), want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(eng.params)
    plain = GPTForEngine(GPT(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    assert plain.complete_params(plain.params) is plain.params


@pytest.mark.bench   # loads SmolLM2-135M and runs it twice without a cache: about 15 s
def test_smollm2_dense_head_keeps_the_logprobs():
    """The real model (SmolLM2-135M's Q4_1 GGUF, its Q8_0 tied table): the dense head's next-token
    logprobs equal the table's within 1e-4 at every position of a fresh random prompt, the same argmax."""
    from jpa.models import load
    from jpa.models.gpt import forward_dense, set_dense_head

    model, _ = load("smollm2-135m")
    tokens = jnp.asarray(np.random.default_rng().integers(1000, 40000, (1, 24)), jnp.int32)
    run = jax.jit(lambda p, t: jax.nn.log_softmax(forward_dense(nnx.merge(graphdef, p), t), axis=-1))
    graphdef, params = nnx.split(model)
    before = np.asarray(run(params, tokens))
    set_dense_head(model)
    graphdef, params = nnx.split(model)
    after = np.asarray(run(params, tokens))
    assert np.max(np.abs(after - before)) <= 1e-4
    np.testing.assert_array_equal(after.argmax(-1), before.argmax(-1))


@pytest.mark.bench   # two engines over a tiny int8 model, two compiles: 36 s on the loaded 2-core VM
def test_engine_outputs_with_the_dense_head_equal_the_tables(monkeypatch):
    """Through the engine (tiny-llama with its tied table int8, on this CPU), one prompt alone and three at
    once: the dense head gives the table head's greedy tokens, their logprobs within 1e-5 (a dot over
    a few rows may sum in another order; at one row it is the same sum)."""
    import jpa.models.engine_model as engine_model
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams
    from jpa.models import load

    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 16))
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 9, 13)]
    params = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)

    def outputs(dense):
        gpt, tok = load("tiny-llama", quantization="int8", seed=seed)
        eng = LLMEngine(GPTForEngine(gpt), tok, EngineConfig(max_seqs=4, page_size=8, num_pages=64,
                                                             max_num_batched_tokens=32, steps_per_call=4))
        assert gpt.head_dense == dense
        return [o for p in prompts for o in eng.generate([p], params)] + eng.generate(prompts, params)

    dense = outputs(True)
    monkeypatch.setattr(engine_model, "dense_head_wanted", lambda model: False)
    table = outputs(False)
    for got, want in zip(dense, table):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


@pytest.mark.bench   # two engines over a tiny int8 model, two compiles: 17 s on the loaded 2-core VM
def test_update_weights_serves_the_new_tables_head():
    """An engine serving a tied int8 model on this CPU (the dense head), given another model's weights as the
    pytree of the model as loaded (no copy in it): its outputs are those of an engine built on the other
    model, greedy tokens and logprobs bit for bit (a stale head would keep the old table's logits)."""
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams
    from jpa.models import load

    rng = np.random.default_rng()
    seeds = [int(s) for s in rng.choice(1 << 16, 2, replace=False)]
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 9)]
    params = SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True)
    cfg = EngineConfig(max_seqs=4, page_size=8, num_pages=64, max_num_batched_tokens=32, steps_per_call=4)
    gpt, tok = load("tiny-llama", quantization="int8", seed=seeds[0])
    served = LLMEngine(GPTForEngine(gpt), tok, cfg)
    other, _ = load("tiny-llama", quantization="int8", seed=seeds[1])
    served.update_weights(nnx.split(other)[1])
    fresh = LLMEngine(GPTForEngine(other), tok, cfg)
    assert other.head_dense and gpt.head_dense
    for got, want in zip(served.generate(prompts, params), fresh.generate(prompts, params)):
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
