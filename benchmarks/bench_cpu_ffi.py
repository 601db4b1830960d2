#!/usr/bin/env python3
"""The CPU's C++ loop over Q4_1 blocks (`jpa.ops.cpu_qmatmul`, an XLA FFI custom call) against XLA's
dequantize-then-dot, by rows, at SmolLM2-135M's layer shapes.

XLA's CPU dot takes no dequantizing operand (benchmarks/bench_cpu_matmul.py measures every expression of
it); the loop (one thread, AVX2 / FMA / F16C, the codes read once per block for all rows, f32
accumulation) is checked against dequantize-then-dot on fresh random blocks, then both are timed:
best of --reps, ms for one layer's 7 matmuls. Where `jpa.ops.qmatmul` takes it (`cpu_qmatmul.MAX_ROWS`)
is read off this table.

    ./run python benchmarks/bench_cpu_ffi.py --rows 1,4,16
"""

import argparse
import json
import sys

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_cpu_matmul import best_ms, q4_1, ref_layer  # noqa: E402
from jpa.ops.cpu_qmatmul import library_reason, q4_1_matmul  # noqa: E402


def ffi_layer(x, codes, d, m):   # one weight (layer None), as the model's stacked call reads one layer
    return q4_1_matmul(x, codes, d, m)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    why = library_reason()
    if why is not None:
        raise SystemExit(why)
    rng = np.random.default_rng()
    per_layer = {(576, 576): 2, (576, 192): 2, (576, 1536): 2, (1536, 576): 1}   # wq wo, wk wv, gate up, down
    out = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        tot = {"dequant_dot": 0.0, "ffi_q4_1": 0.0}
        for (k, n), count in per_layer.items():
            w = q4_1(rng, k, n)
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            ref, got = np.asarray(jax.jit(ref_layer)(x, *w)), np.asarray(jax.jit(ffi_layer)(x, *w))
            err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            if err > 1e-5:
                raise SystemExit(f"the FFI kernel differs from dequantize-then-dot at {rows}x{k}x{n}: {err}")
            for name, f in (("dequant_dot", ref_layer), ("ffi_q4_1", ffi_layer)):
                tot[name] += count * best_ms(jax.jit(f), (x, *w), args.reps)
        out[rows] = {name: round(v, 3) for name, v in tot.items()}
        print(f"[bench] rows {rows}: {out[rows]} ms a layer", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
