"""Benchmark: paged decode attention, achieved GB/s and % of the device's peak HBM bandwidth.

Decode attention is memory-bound: every step must read each visible K and V token once. The
figure of merit is therefore

    GB/s = (bytes of K/V [+ scales] the step must read) / (median step time),

compared with the device's peak bandwidth (PEAK_GBPS, matched on the device kind). Each impl
is one column: "xla" (the reference path), "triton" (jpa.pallas.triton.decode), "mosaic"
(jpa.pallas.mosaic.decode, when that module exists) and "jax_deprecated" (JAX's deprecated
`jax.experimental.pallas.ops.gpu.paged_attention`, when it imports). Adding an impl is one entry
in IMPLS.

On a GPU:  python benchmarks/bench_kernels.py [--impls triton,xla] [--out results/bench_kernels.json]
On a CPU it says plainly that GPU figures need a GPU, and times the xla path on a small grid.
"""

import argparse
import importlib
import json
import os
import platform
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jpa
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

# Peak HBM/GDDR bandwidth in GB/s by device kind (first substring match wins; most specific first).
PEAK_GBPS = [
    ("H200", 4800.0),
    ("GH200", 4000.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),          # H100 SXM5 80GB HBM3
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),          # 40GB SXM4 / PCIe
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
]


def peak_gbps(device_kind: str) -> float | None:
    for name, gbps in PEAK_GBPS:
        if name.lower() in device_kind.lower():
            return gbps
    return None


# ---- impls: name -> (available() -> reason | None, make(opts) -> fn(q, k, v, tables, lens, ks, vs)) ----

def _jpa_impl(name):
    def available(on_gpu):
        if name == "xla":
            return None
        if not on_gpu:
            return "GPU kernels are only timed on a GPU (interpret mode is not a timing)"
        try:
            importlib.import_module(jpa.ops.dispatch.KERNEL_MODULES[name])
        except ImportError as e:
            return f"cannot import: {e}"
        return None

    def make(scale):
        def fn(q, k_pages, v_pages, tables, lens, k_scales, v_scales):
            return jpa.paged_decode(q, k_pages, v_pages, tables, lens, scale=scale,
                                    k_scales=k_scales, v_scales=v_scales, impl=name)
        return fn
    return available, make


def _jax_deprecated_available(on_gpu):
    if not on_gpu:
        return "a GPU is required"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")
    except ImportError as e:
        return f"cannot import: {e}"
    return None


def _jax_deprecated_make(scale):
    """Adapter: JAX's op takes lengths/scales positionally, has no softmax scale (we pre-scale q),
    splits every sequence into k_splits partitions that must divide pages_per_seq, and vmaps its
    pallas_call over the batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        mod = importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")

    def fn(q, k_pages, v_pages, tables, lens, k_scales, v_scales):
        pages_per_seq = tables.shape[1]
        k_splits = max(d for d in (1, 2, 4, 8, 16) if pages_per_seq % d == 0)
        per_part = pages_per_seq // k_splits
        ppcb = max(d for d in (1, 2, 4, 8) if per_part % d == 0)
        qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
        return mod.paged_attention(qs, k_pages, v_pages, tables, lens, k_scales, v_scales,
                                   k_splits=k_splits, pages_per_compute_block=ppcb)
    return fn


IMPLS = {
    "xla": _jpa_impl("xla"),
    "triton": _jpa_impl("triton"),
    "mosaic": _jpa_impl("mosaic"),
    "jax_deprecated": (_jax_deprecated_available, _jax_deprecated_make),
}


def make_case(batch, context, num_kv_heads, q_per_kv, head_dim, page_size, dtype, seed=0):
    """Uniform-length batch over a randomly permuted pool. Returns (args, bytes that must be read)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    quantized = dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    q_dtype = "bfloat16" if quantized else dtype
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    q = jax.random.normal(k1, (batch, num_kv_heads * q_per_kv, head_dim), q_dtype)
    if quantized:
        from jpa.core.quant import quantize
        k_pages, k_scales = quantize(jax.random.normal(k2, shape, jnp.bfloat16), dtype)
        v_pages, v_scales = quantize(jax.random.normal(k3, shape, jnp.bfloat16), dtype)
    else:
        k_pages = jax.random.normal(k2, shape, dtype)
        v_pages = jax.random.normal(k3, shape, dtype)
        k_scales = v_scales = None
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    tokens = batch * context * num_kv_heads
    nbytes = 2 * tokens * head_dim * np.dtype(dtype).itemsize + (2 * tokens * 4 if quantized else 0)
    return (q, k_pages, v_pages, tables, lens, k_scales, v_scales), nbytes


def time_fn(fn, args, iters, warmup=3):
    """Median seconds per call, each call timed from dispatch to block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="all",
                    help=f"comma list from {list(IMPLS)}, or 'all' (every available one)")
    ap.add_argument("--batch-sizes", default=None, help="comma list (GPU default 1,8,32,64,128,256)")
    ap.add_argument("--context-lens", default=None, help="comma list (GPU default 128,...,32768)")
    ap.add_argument("--q-per-kv", default=None, help="comma list of GQA ratios (GPU default 1,4,8)")
    ap.add_argument("--num-kv-heads", type=int, default=None, help="GPU default 8")
    ap.add_argument("--head-dim", type=int, default=None, help="GPU default 128")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", help="cache dtype (bfloat16, float16, int8, ...)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--max-cache-gb", type=float, default=16.0,
                    help="skip configs whose K+V pool exceeds this (GB)")
    ap.add_argument("--out", default="results/bench_kernels.json")
    a = ap.parse_args(argv)

    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    peak = peak_gbps(dev.device_kind) if on_gpu else None
    ints = lambda s, d: [int(x) for x in s.split(",")] if s else d  # noqa: E731
    if on_gpu:
        batches = ints(a.batch_sizes, [1, 8, 32, 64, 128, 256])
        contexts = ints(a.context_lens, [128, 512, 2048, 8192, 32768])
        ratios = ints(a.q_per_kv, [1, 4, 8])
        num_kv_heads, head_dim, iters = a.num_kv_heads or 8, a.head_dim or 128, a.iters or 20
    else:
        print(f"No GPU: jax sees {dev.platform} ({dev.device_kind}). GPU kernel figures (triton, "
              "mosaic, jax_deprecated) need an NVIDIA GPU; timing only the xla reference path on a "
              "small grid. GB/s below is CPU memory throughput, not a GPU figure.")
        batches = ints(a.batch_sizes, [1, 8])
        contexts = ints(a.context_lens, [128, 1024])
        ratios = ints(a.q_per_kv, [1, 4])
        num_kv_heads, head_dim, iters = a.num_kv_heads or 2, a.head_dim or 64, a.iters or 5

    wanted = list(IMPLS) if a.impls == "all" else a.impls.split(",")
    # xla first: its output is what the other columns' max_abs_err_vs_xla is measured against.
    wanted.sort(key=lambda n: n != "xla")
    impls, skipped = [], {}
    for name in wanted:
        if name not in IMPLS:
            raise SystemExit(f"--impls: unknown impl {name!r}; known: {sorted(IMPLS)}")
        reason = IMPLS[name][0](on_gpu)
        if reason is None:
            impls.append(name)
        else:
            skipped[name] = reason
    for name, reason in skipped.items():
        print(f"  skipping {name}: {reason}")
    print(f"device: {dev.device_kind}; peak {peak or 'unknown'} GB/s; cache {a.dtype}, "
          f"{num_kv_heads} kv heads, head_dim {head_dim}, page_size {a.page_size}")

    scale = head_dim ** -0.5
    fns = {name: jax.jit(IMPLS[name][1](scale)) for name in impls}
    rows = []
    for q_per_kv in ratios:
        for batch in batches:
            for context in contexts:
                pool_gb = 2 * batch * context * num_kv_heads * head_dim * np.dtype(a.dtype).itemsize / 1e9
                if pool_gb > a.max_cache_gb:
                    print(f"  skip B={batch} ctx={context}: pool {pool_gb:.1f} GB > --max-cache-gb")
                    continue
                args, nbytes = make_case(batch, context, num_kv_heads, q_per_kv, head_dim,
                                         a.page_size, a.dtype)
                want = None
                for name in impls:
                    row = dict(impl=name, batch=batch, context=context, q_per_kv=q_per_kv,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=a.page_size,
                               dtype=a.dtype, bytes=int(nbytes))
                    try:
                        out = np.asarray(fns[name](*args).astype(jnp.float32))
                        if want is None and name == "xla":
                            want = out
                        sec = time_fn(fns[name], args, iters)
                        gbps = nbytes / sec / 1e9
                        row.update(time_us=sec * 1e6, gbps=gbps,
                                   pct_peak=100 * gbps / peak if peak else None,
                                   max_abs_err_vs_xla=(float(np.max(np.abs(out - want)))
                                                       if want is not None else None))
                    except Exception as e:  # one failing impl must not end the sweep
                        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    rows.append(row)
                del args

    # Table: one line per config, one column per impl.
    head = f"{'G':>3} {'batch':>5} {'context':>7} {'MB read':>9} | " + " | ".join(
        f"{n:^26}" for n in impls)
    print(head + "\n" + "-" * len(head))
    keyf = lambda r: (r["q_per_kv"], r["batch"], r["context"])  # noqa: E731
    for key in sorted({keyf(r) for r in rows}):
        cells, mb = [], 0
        for name in impls:
            r = next((r for r in rows if keyf(r) == key and r["impl"] == name), None)
            mb = r["bytes"] / 1e6 if r else mb
            if r is None or "error" in r:
                cells.append(f"{'error' if r else '-':^26}")
            else:
                pct = f"{r['pct_peak']:5.1f}%" if r["pct_peak"] is not None else "n/a"
                cells.append(f"{r['time_us']:9.1f}us {r['gbps']:7.1f} {pct:>6}".rjust(26))
        print(f"{key[0]:>3} {key[1]:>5} {key[2]:>7} {mb:>9.2f} | " + " | ".join(cells))
    print("cells: median time per step, GB/s of K/V read, % of peak bandwidth")

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(device_kind=dev.device_kind, platform=dev.platform, on_gpu=on_gpu,
                       peak_gbps=peak, jax_version=jax.__version__, python=platform.python_version(),
                       impls=impls, skipped=skipped, results=rows), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
