#!/usr/bin/env python3
"""KV offload's swap programs compiled for an H100 that is not here (deviceless, `jpa.tools.deviceless`).

Pool: SmolLM2-135M in bf16 (30 layers, 3 kv heads, head_dim 64, pages of 16 tokens), `--num-pages`
pages (default 4096: 1.4 GiB). Block: `--block` pages (default 8). Compiles
  - swap out (`jpa.kv.offload._gather`, output in memory kind pinned_host), and
  - swap in's scatter (`jpa.kv.offload._scatter_block`, the block an argument in pinned_host, the
    pool donated),
  - prefix-cache spill (`jpa.kv.offload._gather_pages`: `--block` evicted pages, one output per
    page in pinned_host), and
  - a host hit's restore scatter (`jpa.kv.offload._scatter_pages`: `--block` spilled pages, each an
    argument in pinned_host, into the donated pool),
and reports from the compiled programs: where the block lives (the HLO layout's memory space S(5)
is host memory), the host<->device copies XLA scheduled, whether the donated pool is aliased
(`memory_analysis().alias_size_in_bytes`), temporaries, and any pool-shaped copy.

Found (JAX 0.12.0.1): a compile-only CUDA device has no memories (`addressable_memories()` is
empty), and the `pinned_host` memory kind is dropped when lowering for it (no memory-kind
annotation, no S(5) buffer, host bytes 0): the host placement cannot be shown deviceless. It is
shown on this CPU backend, whose device has `pinned_host` (tests/test_kv_offload.py checks the
blocks live there). What the deviceless compile does show: the swap-in scatter updates the donated
pool in place (aliased, no pool-shaped copy, no temporaries) and the swap-out reads only its pages.

    .venv/bin/python scripts/offload_compile_check.py            # needs the `gpu` extra (compile-only CUDA)
"""

import argparse
import json
import re

from jpa.tools.deviceless import configure_environment

configure_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jpa.kv.cache import CacheConfig, KVCache  # noqa: E402
from jpa.kv.offload import _gather, _gather_pages, _scatter_block, _scatter_pages  # noqa: E402
from jpa.tools.deviceless import Compiler  # noqa: E402
from jpa.tools.hlo import hlo_type, pool_copies  # noqa: E402


def facts(compiled, pool_shape, dtype) -> dict:
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    return dict(host_buffers=len(re.findall(r"S\(5\)", hlo)),
                copy_starts=hlo.count("copy-start"), dynamic_update_slices=hlo.count("dynamic-update-slice"),
                scatters=hlo.count(" scatter("), gathers=hlo.count(" gather("),
                pool_copies=len(pool_copies(hlo, {hlo_type(pool_shape, dtype)})),
                alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
                argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                host_argument_bytes=getattr(mem, "host_argument_size_in_bytes", None),
                host_output_bytes=getattr(mem, "host_output_size_in_bytes", None))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    c = Compiler(args.target)
    dev = c.device
    sh = SingleDeviceSharding(dev)
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    cfg = CacheConfig(30, 3, 64, args.num_pages, 16, "bfloat16")
    cache = jax.eval_shape(lambda: KVCache.create(cfg))
    def on(tree, s):
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)
    cache_d = on(cache, sh)
    pages_per_seq = 128
    tables = jax.ShapeDtypeStruct((16, pages_per_seq), jnp.int32, sharding=sh)
    i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
    out = {}
    with jax.sharding.use_abstract_mesh(c.mesh):
        g = jax.jit(lambda cc, t, s: _gather(cc, t, s, size=args.block), out_shardings=host)
        compiled = g.lower(cache_d, tables, i32).compile()
        out["swap_out"] = facts(compiled, cache.k.shape, cache.k.dtype)
        block = jax.eval_shape(lambda cc: jax.tree_util.tree_map(lambda a: a[:, :, : args.block], cc), cache)
        s = jax.jit(_scatter_block, donate_argnums=(0,), static_argnames=("page_size",))
        compiled = s.lower(cache_d, tables, on(block, host), jax.ShapeDtypeStruct((), jnp.bool_, sharding=sh), i32,
                           i32, i32, page_size=16).compile()
        out["swap_in_scatter"] = facts(compiled, cache.k.shape, cache.k.dtype)
        ids = jax.ShapeDtypeStruct((args.block,), jnp.int32, sharding=sh)
        compiled = jax.jit(_gather_pages, out_shardings=host).lower(cache_d, ids).compile()
        out["spill"] = facts(compiled, cache.k.shape, cache.k.dtype)
        page = jax.eval_shape(lambda cc: jax.tree_util.tree_map(lambda a: a[:, :, :1], cc), cache)
        r = jax.jit(_scatter_pages, donate_argnums=(0,))
        compiled = r.lower(cache_d, tables, (on(page, host),) * args.block,
                           jax.ShapeDtypeStruct((), jnp.bool_, sharding=sh), i32, ids).compile()
        out["restore_scatter"] = facts(compiled, cache.k.shape, cache.k.dtype)
    out.update(device_memories=[m.kind for m in getattr(dev, "addressable_memories", lambda: [])()],
               target=args.target, pool_bytes=cfg.nbytes, block_pages=args.block,
               block_bytes=args.block * cfg.bytes_per_page)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
