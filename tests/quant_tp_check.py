"""A quantized model tensor-parallel over 2 simulated CPU devices against the same model on one device, with the
Mosaic dequantizing matmul run per shard in GPU interpret mode; reported as JSON (run by tests/test_quant_tp.py).

JAX fixes its device count when it starts, so this runs in its own process:

    python tests/quant_tp_check.py OUT.json [--layers N] [--prefill]

(the script sets XLA_FLAGS=--xla_force_host_platform_device_count=2 and JAX_PLATFORMS=cpu itself). The model is a
small bfloat16 Llama with fresh random weights in three of the forms the kernel takes: wq / wk / wv / w_gate as
Q4_1 blocks (4-bit, column-parallel), wo / w_down as Q8_0 blocks (8-bit with group scales, row-parallel: each
device holds whole 32-value groups of K) and w_up int8 per output channel (column-parallel, its scales split with
it), and the head int8 per output channel (split on the vocabulary). The reference is the single-device model on XLA's path (this CPU: the layer's blocks dequantized where the
dot reads them); the sharded one runs under JPA_QMATMUL=interpret, so every layer linear is the kernel's code on
its device's shard inside `models.linear.tp_matmul`'s shard_map. Reported: the largest logit gap of a decode step
(and, with --prefill, of a prefill chunk) against the reference and the reference's largest logit; the
`qmatmul_plan` under the mesh; in the sharded decode step's jaxpr, each shard_map's Mosaic qmatmul calls with
their codes' shapes (one device's shard) and whether it sums over "tp" (psum).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jpa import models  # noqa: E402
from jpa.core.quant import quantize_weight  # noqa: E402
from jpa.core.sharding import tp_mesh  # noqa: E402
from jpa.kv.cache import KVCache  # noqa: E402
from jpa.models import GPT, ModelConfig, sharding  # noqa: E402
from jpa.models.gpt import PackedWeight, qmatmul_plan, set_packed, set_scaled  # noqa: E402
from jpa.testing.engine import gap_inputs  # noqa: E402
from jpa.testing.jaxprs import equations  # noqa: E402

KERNEL = "jpa_mosaic_qmatmul"


def quantized_model(rng, num_layers: int) -> GPT:
    """The small Llama of the module docstring (every sharded K and N a multiple of the kernel's 64 at tp=2)."""
    config = ModelConfig(family="llama", vocab_size=256, d_model=128, num_layers=num_layers, num_q_heads=4,
                         num_kv_heads=2, head_dim=64, ffn_dim=256, max_seq_len=256, tie_embeddings=False)
    model = GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    layers = model.layers
    shape = lambda name: getattr(layers, name).get_value().shape  # [L, in, out]  # noqa: E731
    for name in ("wq", "wk", "wv", "w_gate"):  # Q4_1: w = q * d + m, 32-value groups along `in`
        n_layers, k, n = shape(name)
        set_packed(layers, name, PackedWeight(
            rng.integers(0, 256, (n_layers, k // 2, n)).astype(np.uint8),
            rng.uniform(0.004, 0.03, (n_layers, k // 32, n)).astype(np.float16),
            rng.uniform(-0.2, 0.0, (n_layers, k // 32, n)).astype(np.float16), -2))
    for name in ("wo", "w_down"):  # Q8_0: w = q * d
        n_layers, k, n = shape(name)
        set_packed(layers, name, PackedWeight(
            rng.integers(-127, 128, (n_layers, k, n)).astype(np.int8),
            rng.uniform(2e-4, 2e-3, (n_layers, k // 32, n)).astype(np.float16), None, -2))
    q, scale = quantize_weight(rng.normal(0, 0.05, shape("w_up")).astype(np.float32), "int8")
    set_scaled(layers, "w_up", q, scale)
    q, scale = quantize_weight(rng.normal(0, 0.05, model.output.get_value().shape).astype(np.float32), "int8")
    set_scaled(model, "output", q, scale)  # the head int8 per vocabulary column: split on the vocabulary
    model.quantization = "gguf"
    return model


def run(model, mesh, inputs, prefill: bool):
    """[prefill logits (with prefill), decode logits] of `model` (sharded over mesh if set)."""
    (num_pages, page_size), pre_args, dec_args = inputs
    cache = KVCache.create(model.cache_config(num_pages, page_size))
    if mesh is not None:
        cache = jax.device_put(cache, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp")))
    out = []
    if prefill:
        lp, cache = jax.jit(lambda mod, ca, *a: models.prefill(mod, ca, *a, mesh=mesh))(model, cache, *pre_args)
        out.append(np.asarray(lp))
    else:  # the decode step's own K/V only: its lengths count one token
        dec_args = (dec_args[0], jnp.ones_like(dec_args[1]), *dec_args[2:])
    traced = jax.jit(lambda mod, ca, *a: models.decode(mod, ca, *a, mesh=mesh)).trace(model, cache, *dec_args)
    ld, _ = traced.lower().compile()(model, cache, *dec_args)
    return out + [np.asarray(ld)], traced.jaxpr


def kernel_calls(jaxpr):
    """[{"codes": [shapes of the codes operands of its Mosaic qmatmul calls], "psum": bool}] per shard_map of a
    (sharded decode step's) jaxpr that holds such a call."""
    out = []
    for e in equations(jaxpr.jaxpr):
        if e.primitive.name != "shard_map":
            continue
        inner = list(equations(e.params["jaxpr"]))
        calls = [x for x in inner if x.params.get("name") == KERNEL]
        if calls:
            # the kernel's operands: x, codes, scales...; the codes are the second
            out.append(dict(codes=[list(c.invars[1].aval.shape) for c in calls],
                            psum=any(x.primitive.name == "psum" for x in inner)))
    return out


def main(out_path, num_layers: int = 1, prefill: bool = False):
    assert len(jax.devices()) == 2, jax.devices()
    rng = np.random.default_rng()
    model = quantized_model(rng, num_layers)
    inputs = gap_inputs(model.config, rng)
    reference, _ = run(model, None, inputs, prefill)  # one device, XLA's path (the kernel does not serve a CPU)
    mesh = tp_mesh(2)
    sharded, _ = sharding.shard(model, mesh)
    os.environ["JPA_QMATMUL"] = "interpret"  # read while tracing: the kernel's code on each device's shard
    t0 = time.perf_counter()
    got, jaxpr = run(sharded, mesh, inputs, prefill)
    report = dict(
        gaps=[float(np.max(np.abs(a - b))) for a, b in zip(got, reference)],
        scale=[float(np.max(np.abs(a))) for a in reference],
        plan=qmatmul_plan(sharded, 3, mesh),
        calls=kernel_calls(jaxpr), sharded_seconds=round(time.perf_counter() - t0, 1),
        shapes={name: list(getattr(model.layers, name).get_value().shape)
                for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")},
        head=list(model.output.get_value().shape))
    pathlib.Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    args = sys.argv[1:]
    layers = int(args[args.index("--layers") + 1]) if "--layers" in args else 1
    main(args[0], layers, "--prefill" in args)
