#!/usr/bin/env python3
"""Which x @ W on GGUF blocks XLA's CPU backend runs fastest, at SmolLM2-135M's shapes, by rows.

Each variant is a jitted function of (x, the stored blocks), fresh random inputs, checked against
the reference (dequantize the whole weight to f32, then one dot: what models.linear's Packed did on
CPU) before it is timed; time = best of --reps calls (the machine is shared: the best is the least
disturbed), in ms.

  dequant_dot   the reference: dequantize_blocks -> f32 [K, N] -> jnp.dot
  fused         one reduction over K of x * (q * d + m): XLA fuses the unpacking into the reduce
  block_reduce  per block: t[m, b, n] = sum_j x[m, b, j] q[b, j, n] (a fused reduce), then
                sum_b d t + (sum_j x) @ m
  block_dot     the same, the block sums as one batched dot_general over the blocks (q converted to f32)
  dense_f32     no blocks: the weight dequantized once beforehand, f32, [in, out] (for the head, the table
                transposed: models.gpt.set_dense_head's copy; for the layers, the floor, 4 bytes a value)
  int8_dot      x quantized to int8 per block (as llama.cpp does), an int8 x int8 -> int32 batched
                dot over the blocks, then the scales (changes the result: activations rounded)

Weights: Q4_1 [576, 576], [576, 192], [576, 1536], [1536, 576] (the layers), and the Q8_0 tied head
(the [49152, 576] table, blocks along d_model, y = x @ table.T).

    ./run python benchmarks/bench_cpu_matmul.py --rows 1,4,16,32
"""

import argparse
import json
import sys
import time

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jpa.core.quant import dequantize_blocks, pack_nibbles  # noqa: E402


def q4_1(rng, k, n):
    """Random Q4_1 blocks of an [k, n] weight (blocks along k): codes u8[k / 2, n], d, m f16[k / 32, n]."""
    codes = pack_nibbles(rng.integers(0, 16, (k, n)), axis=-2)
    d = (rng.random((k // 32, n)) * 0.02 + 0.001).astype(np.float16)
    m = (-(rng.random((k // 32, n)) * 0.1)).astype(np.float16)
    return codes, d, m


def q8_0_rows(rng, v, k):
    """Random Q8_0 blocks of an [v, k] table (blocks along k): codes i8[v, k], d f16[v, k / 32]."""
    return rng.integers(-127, 128, (v, k)).astype(np.int8), (rng.random((v, k // 32)) * 0.01).astype(np.float16)


def ref_layer(x, codes, d, m):
    return jnp.dot(x, dequantize_blocks(codes, d, m, -2, jnp.float32))


def ref_head(x, codes, d):
    return jnp.dot(x, dequantize_blocks(codes, d, None, -1, jnp.float32).T)


def unpack(codes):  # u8[K / 2, N] -> f32[K / 32, 32, N] in GGUF's nibble order
    nb = codes.shape[0] // 16
    p = codes.reshape(nb, 16, -1)
    return jnp.concatenate([p & 15, p >> 4], axis=1).astype(jnp.float32)


def fused_layer(x, codes, d, m):
    k = codes.shape[0] * 2
    w = unpack(codes) * d.astype(jnp.float32)[:, None] + m.astype(jnp.float32)[:, None]
    return jnp.sum(x.reshape(-1, k, 1) * w.reshape(1, k, -1), axis=1)


def block_reduce_layer(x, codes, d, m):
    nb = codes.shape[0] // 16
    xb = x.reshape(-1, nb, 32)
    t = jnp.sum(xb[..., None] * unpack(codes)[None], axis=2)  # [M, nb, N]
    return jnp.sum(t * d.astype(jnp.float32), axis=1) + jnp.dot(xb.sum(-1), m.astype(jnp.float32))


def block_dot_layer(x, codes, d, m):
    nb = codes.shape[0] // 16
    xb = x.reshape(-1, nb, 32)
    t = jax.lax.dot_general(xb, unpack(codes), (((2,), (1,)), ((1,), (0,))))  # [nb, M, N]
    return jnp.einsum("bmn,bn->mn", t, d.astype(jnp.float32)) + jnp.dot(xb.sum(-1), m.astype(jnp.float32))


def quant_x(x, nb):
    xb = x.reshape(-1, nb, 32)
    sx = jnp.max(jnp.abs(xb), axis=-1) / 127.0
    xq = jnp.round(xb / jnp.where(sx == 0, 1.0, sx)[..., None]).astype(jnp.int8)
    return xb, xq, sx


def int8_layer(x, codes, d, m):
    nb = codes.shape[0] // 16
    xb, xq, sx = quant_x(x, nb)
    p = codes.reshape(nb, 16, -1)
    q = jnp.concatenate([p & 15, p >> 4], axis=1).astype(jnp.int8)
    t = jax.lax.dot_general(xq, q, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.int32)  # [nb, M, N]
    t = t.astype(jnp.float32) * sx.T[:, :, None]
    return jnp.einsum("bmn,bn->mn", t, d.astype(jnp.float32)) + jnp.dot(xb.sum(-1), m.astype(jnp.float32))


def fused_head(x, codes, d):
    v, k = codes.shape
    w = (codes.reshape(v, k // 32, 32).astype(jnp.float32) * d.astype(jnp.float32)[..., None]).reshape(v, k)
    return jnp.sum(x[:, None, :] * w[None], axis=-1)


def block_reduce_head(x, codes, d):
    v, k = codes.shape
    xb = x.reshape(-1, 1, k // 32, 32)
    t = jnp.sum(xb * codes.reshape(1, v, k // 32, 32).astype(jnp.float32), axis=-1)  # [M, V, nb]
    return jnp.sum(t * d.astype(jnp.float32), axis=-1)


def block_dot_head(x, codes, d):
    v, k = codes.shape
    xb = x.reshape(-1, k // 32, 32)
    t = jax.lax.dot_general(xb, codes.reshape(v, k // 32, 32).astype(jnp.float32),
                            (((2,), (2,)), ((1,), (1,))))  # [nb, M, V]
    return jnp.einsum("bmv,vb->mv", t, d.astype(jnp.float32))


def int8_head(x, codes, d):
    v, k = codes.shape
    _, xq, sx = quant_x(x, k // 32)
    t = jax.lax.dot_general(xq, codes.reshape(v, k // 32, 32), (((2,), (2,)), ((1,), (1,))),
                            preferred_element_type=jnp.int32)  # [nb, M, V]
    return jnp.einsum("bmv,vb->mv", t.astype(jnp.float32) * sx.T[:, :, None], d.astype(jnp.float32))


LAYER = {"dense_f32": jnp.dot, "dequant_dot": ref_layer, "fused": fused_layer, "block_reduce": block_reduce_layer,
         "block_dot": block_dot_layer, "int8_dot": int8_layer}
HEAD = {"dense_f32": jnp.dot, "dequant_dot": ref_head, "fused": fused_head, "block_reduce": block_reduce_head,
        "block_dot": block_dot_head, "int8_dot": int8_head}


def best_ms(f, args, reps=20):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * min(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=",".join(LAYER))
    ap.add_argument("--no-head", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    layers = {f"{k}x{n}": q4_1(rng, k, n) for k, n in ((576, 576), (576, 192), (576, 1536), (1536, 576))}
    per_layer = {"576x576": 2, "576x192": 2, "576x1536": 2, "1536x576": 1}  # wq wo, wk wv, gate up, down
    head = q8_0_rows(rng, 49152, 576)
    variants = args.variants.split(",")
    out = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        res = out.setdefault(rows, {})
        for name in variants:
            total = 0.0
            for shape, w in layers.items():
                x = jnp.asarray(rng.standard_normal((rows, w[0].shape[0] * 2)), jnp.float32)
                f = jax.jit(LAYER[name])
                if name == "dense_f32":   # the floor: the weight dequantized once, beforehand (4 bytes a value)
                    w = (jax.jit(lambda c, d, m: dequantize_blocks(c, d, m, -2, jnp.float32))(*w),)
                ref = np.asarray(jax.jit(ref_layer)(x, *layers[shape]))
                got = np.asarray(f(x, *w))
                err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                if name != "int8_dot" and err > 1e-5:
                    raise SystemExit(f"{name} {shape}: relative error {err}")
                ms = best_ms(f, (x, *w), args.reps)
                total += per_layer[shape] * ms
                res[f"{name} {shape}"] = dict(ms=round(ms, 4), rel_err=err)
            res[f"{name} one layer (7 matmuls)"] = round(total, 4)
            if not args.no_head:
                x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
                f, w = jax.jit(HEAD[name]), head
                if name == "dense_f32":   # models.gpt.set_dense_head: dequantized once, kept [d_model, vocab]
                    w = (jnp.transpose(jax.jit(lambda c, d: dequantize_blocks(c, d, None, -1, jnp.float32))(*head)),)
                ref = np.asarray(jax.jit(ref_head)(x, *head))
                got = np.asarray(f(x, *w))
                err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                if name != "int8_dot" and err > 1e-5:
                    raise SystemExit(f"{name} head: relative error {err}")
                res[f"{name} head"] = dict(ms=round(best_ms(f, (x, *w), max(3, args.reps // 4)), 3), rel_err=err)
            print(f"[bench] rows {rows} {name}: layer {total:.3f} ms, head "
                  f"{res.get(f'{name} head', {}).get('ms')} ms", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
