"""Quantized layer linears under tensor parallelism (issue 35): each device runs the Mosaic dequantizing matmul on
its own shard of a quantized weight (`models.linear.tp_matmul`: one shard_map; column-parallel wq / wk / wv / w_gate /
w_up on their output columns, row-parallel wo / w_down on their K rows and a psum over "tp"), where the kernel
takes that shard (`models.gpt.qmatmul_plan`), instead of XLA dequantizing a dense copy of every layer's weight.

Traced for two compile-only H100s (nothing compiled): the plan, the kernel calls inside the shard_maps on each
device's shard, no dense float array of a served weight. On 2 simulated CPU devices (tests/quant_tp_check.py, its
own process): the sharded model's logits, the kernel's code run per shard in GPU interpret mode, equal the
single-device model's. The deviceless compile of an engine step is in the bench tier (test_bench below)."""

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
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jpa.kv.cache import KVCache
from jpa.models import ModelConfig, sharding
from jpa.models.gpt import decode, qmatmul_plan
from jpa.testing.jaxprs import equations
from jpa.testing.procs import fast_compile_env
from jpa.tools import deviceless
from jpa.tools.traffic import abstract_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL = "jpa_mosaic_qmatmul"
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
ROW_PARALLEL = ("wo", "w_down")
NEEDS_GPU_PACKAGES = pytest.mark.skipif(deviceless.missing_packages() is not None,
                                        reason=str(deviceless.missing_packages()))


def _config(ffn_dim):
    # vocab 384, 40 pages: no other array of the step has a layer weight's element count
    return ModelConfig(family="llama", vocab_size=384, d_model=256, num_layers=2, num_q_heads=4, num_kv_heads=2,
                       head_dim=64, ffn_dim=ffn_dim, max_seq_len=256, tie_embeddings=False)


@pytest.fixture(scope="module")
def h100x2():
    return deviceless.Compiler("h100", num_devices=2)


def _h100():
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"))


def _traced_decode(compiler, model, rows=4):
    """(qmatmul_plan, jaxpr) of a decode step of `model` (sharded on compiler.tp_mesh) traced for its GPUs."""
    mesh = compiler.tp_mesh
    graphdef, state = nnx.split(model)
    cache = KVCache.create(model.cache_config(40, 16))
    plans = {}

    def step(state, cache, tokens, seq_lens, slots, tables):
        m = nnx.merge(graphdef, state)
        plans["plan"] = qmatmul_plan(m, tokens.shape[0], mesh)
        return decode(m, cache, tokens, seq_lens, slots, tables, mesh=mesh)[0]

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    with jax.sharding.use_abstract_mesh(compiler.mesh), deviceless.mosaic_arch((9, 0)):
        jaxpr = jax.make_jaxpr(step)(state, cache, i32(rows), i32(rows), i32(rows), i32(rows, 4))
    return plans["plan"], jaxpr


@NEEDS_GPU_PACKAGES
@pytest.mark.parametrize("fmt,ffn_dim,served", [
    ("Q4_1", 448, ("wq", "wk", "wv", "wo")),  # ffn 448 / 2 = 224: not a multiple of the kernel's 64
    ("int8", 512, LINEARS),
    ("Q8_0", 512, LINEARS),
])
def test_each_device_runs_the_kernel_on_its_shard_on_an_h100(h100x2, fmt, ffn_dim, served):
    """Two H100s (compile-only devices, traced, nothing compiled), a Llama with its layer linears in `fmt`: every
    weight whose shard the kernel takes is one shard_map holding one Mosaic qmatmul call on that device's shard
    (column-parallel: codes [L, K(/ 2), N / 2]; row-parallel: [L, K(/ 2) / 2, N], with the psum), and no float
    array of such a weight's size (a dense copy, whole or one device's) appears anywhere in the step; a quantized
    head (int8; GGUF Q8_0's Q8_0 head), split on the vocabulary, is one more such call on each device's columns. At
    ffn 448 the MLP's shards (224 wide) are refused with the reason, and XLA's dense copy of them is seen: on
    one H100 the same model's MLP is served (the mesh made the difference)."""
    config = _config(ffn_dim)
    model = abstract_model(config, fmt)
    with jax.sharding.use_abstract_mesh(_h100()), deviceless.mosaic_arch((9, 0)):
        assert qmatmul_plan(model, 4) == {name: None for name in LINEARS}  # one device: every linear
    shapes = {name: getattr(model.layers, name).get_value().shape for name in LINEARS}  # codes [L, K(/ 2), N]
    sharded, _ = sharding.shard(model, h100x2.tp_mesh)
    plan, jaxpr = _traced_decode(h100x2, sharded)
    assert {n for n, why in plan.items() if why is None} == set(served), plan
    for name in set(LINEARS) - set(served):
        kind = "row" if name in ROW_PARALLEL else "column"
        assert "must be a multiple of 64" in plan[name] and f"2 devices' shard of the {kind}-parallel {name}" \
            in plan[name], plan[name]

    calls = []
    for e in equations(jaxpr.jaxpr):
        if e.primitive.name == "shard_map":
            inner = list(equations(e.params["jaxpr"]))
            kernels = [x for x in inner if x.params.get("name") == KERNEL]
            if kernels:
                calls.append(([tuple(k.invars[1].aval.shape) for k in kernels],
                              any(x.primitive.name == "psum" for x in inner)))
    want = []
    for name in served:
        L, k, n = shapes[name]
        want.append(([(L, k // 2, n)] if name in ROW_PARALLEL else [(L, k, n // 2)], name in ROW_PARALLEL))
    head = model.output.get_value().shape  # [d_model(/ 2), vocab]: quantized for int8 and GGUF Q8_0
    if fmt in ("int8", "Q8_0"):  # split on the vocabulary: each device's columns, as a stack of one layer
        want.append(([(1, head[0], head[1] // 2)], False))
    assert sorted(calls) == sorted(want), (calls, want)

    per = 2 if fmt.startswith("Q4") else 1  # values a code byte
    shapes["output"] = (1, *head)
    dense = lambda names: {s[1] * per * s[2] // d for s in (shapes[n] for n in names) for d in (1, 2)}  # noqa: E731
    copies = lambda names: [v.aval for v in _arrays(jaxpr.jaxpr)  # noqa: E731
                            if jnp.issubdtype(v.aval.dtype, jnp.floating) and np.prod(v.aval.shape) in dense(names)]
    assert not copies(served + (("output",) if fmt in ("int8", "Q8_0") else ())), copies(served)[:5]
    if set(served) != set(LINEARS):  # the refused weights' dense copies: the check sees them
        assert copies(["w_gate"])


def _arrays(jaxpr):
    """The outputs of every equation of `jaxpr` and its sub-jaxprs (scan bodies, shard_maps), not descending into
    kernels (their bodies hold SMEM / register tiles, not arrays of the program)."""
    for e in jaxpr.eqns:
        yield from e.outvars
        if e.primitive.name in ("mpmd_map", "custom_vmap_call", "pallas_call"):
            continue
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _arrays(inner)


def test_plan_refuses_groups_split_across_devices():
    """A row-parallel split that would cut a quantization group is refused with the reason naming the shard, never
    run on partial groups: AWQ's 128-value groups of w_down (K = 512: 4 groups) over 8 devices (`shard` itself
    refuses to place such scales; the plan reads only the mesh's "tp" size, so an abstract mesh stands in)."""
    model = abstract_model(_config(512), "awq")
    plan = qmatmul_plan(model, 4, AbstractMesh((8,), ("tp",), (AxisType.Auto,)))
    assert "w_down_bscale [2, 4, 256]" in plan["w_down"] and "do not split into 8 equal shards" in plan["w_down"]
    assert "row-parallel w_down: [64, 256] of [512, 256]" in plan["w_down"], plan["w_down"]


@pytest.mark.parametrize("args", [
    pytest.param([], marks=pytest.mark.bench),
    pytest.param(["--layers", "2", "--prefill"], marks=pytest.mark.soak),
], ids=["decode", "2-layers-prefill"])
def test_sharded_logits_equal_one_device_with_the_kernel_per_shard(args, tmp_path):
    """tests/quant_tp_check.py: a Llama with Q4_1 (wq, wk, wv, w_gate), Q8_0 (wo, w_down) and int8 per-channel
    (w_up) layer linears and an int8 head, fresh random weights, sharded over 2 CPU devices with the kernel's code
    run on each device's shard (GPU interpret mode), gives the single-device model's decode logits (XLA's path)
    within bf16 rounding; its decode step holds 8 shard_maps of one kernel call each (7 linears and the head), on
    each device's shard, the two row-parallel ones summed over "tp". (Without that psum the gap is about 70% of
    the largest logit: checked by hand.) "2-layers-prefill": two layers (the kernel reads layer i of the stack) and
    a prefill chunk's logits (24 rows) before the decode step."""
    out = tmp_path / "report.json"
    env = fast_compile_env({k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JPA_QMATMUL")})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "quant_tp_check.py"), str(out), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["plan"] == {name: None for name in LINEARS}, r["plan"]
    assert len(r["gaps"]) == (2 if "--prefill" in args else 1)
    for gap, scale in zip(r["gaps"], r["scale"]):
        assert gap <= 2e-2 * scale, (r["gaps"], r["scale"])
    s = r["shapes"]  # [L, K(/ 2), N] codes
    want = sorted([[list(s[n][:2]) + [s[n][2] // 2]], False] for n in ("wq", "wk", "wv", "w_gate", "w_up")) + [
        [[[s[n][0], s[n][1] // 2, s[n][2]]], True] for n in ROW_PARALLEL] + [[[[1, r["head"][0], r["head"][1] // 2]], False]]
    assert sorted([c["codes"], c["psum"]] for c in r["calls"]) == sorted(want), r["calls"]


COMPILE = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
from jpa.tools import traffic as tr
SHAPES = dict(family="llama", vocab_size=512, d_model=256, num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=64,
              ffn_dim=768, max_seq_len=2048, tie_embeddings=False)
r = tr.engine_traffic("h100", SHAPES, max_seqs=4, context=256, pool_gib=0.05, quantization=FMT, label="tiny",
                      tensor_parallel=2)
s = r["summary"]
from jpa.tools.hlo import collectives
coll = collectives(r["hlo"])
items = coll["step"] + coll["outside"]
row = [c for c in items if c["op"] == "all-reduce" and c["type"].startswith("f32[") and c["type"].endswith(",256]")]
print(json.dumps(dict(checks=r["checks"], weights=s["weights"], copies=len(tr.matrix_copies(s)),
                      row_sums=len(row), gathers=[c for c in items if c["op"] == "all-gather"],
                      kernels=sorted({k["name"].split(".")[0] for k in r["top"] if k["name"].startswith("mpmd_map")}))))
"""


@pytest.mark.soak
@NEEDS_GPU_PACKAGES
@pytest.mark.parametrize("fmt", ["Q4_0"])
def test_tp_engine_step_compiles_for_two_h100s_without_a_dense_copy(fmt):
    """The engine's unified step (a ragged pass, then the decode loop) of a small Llama with Q4_0 layer linears,
    tensor-parallel over two compile-only H100s, compiled deviceless (XLA's whole GPU pipeline, Mosaic's ptxas):
    one device's program holds the attention kernels and the 7 linears' Mosaic calls of both passes in its layer
    body (3 + 2 x 7 = 17), no ptxas spills, the weights read once (its shards: the ideal) and none written, no
    weight matrix materialized (the XLA path this replaces wrote a dense bf16 copy of each: `JPA_QMATMUL=0`), and
    the collectives are the dense path's: two f32[tokens, d_model] all-reduces a layer body and pass (the psums
    after wo and w_down), no all-gather of a weight."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE", "XLA_FLAGS",
                                                             "JPA_QMATMUL")}
    proc = subprocess.run([sys.executable, "-c", COMPILE.replace("FMT", repr(fmt))], capture_output=True, text=True,
                          timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["checks"]["ok"] and not r["checks"]["problems"], r["checks"]
    assert r["checks"]["mosaic_calls"] == 3 + 2 * len(LINEARS), r["checks"]
    w = r["weights"]
    assert w["written"] <= 0.01 * w["ideal"] and w["ideal"] <= w["read"] <= 1.01 * w["ideal"], w
    assert r["copies"] == 0, r
    # the collectives of the dense path: one f32[tokens, d_model] all-reduce after each row-parallel linear
    # (wo, w_down) of the layer body, in both passes; no weight (or shard) gathered
    # (the sampler's all-gathers over the vocabulary shards stay: f32 / s32 [seqs(, vocab)])
    weight_dims = {"256", "384", "768"}  # d_model, ffn / 2, ffn
    moved = [g["type"] for g in r["gathers"] if weight_dims & set(g["type"].split("[")[1].rstrip("]").split(","))]
    assert r["row_sums"] == 2 * 2 and not moved, (r["row_sums"], moved, r["gathers"])
