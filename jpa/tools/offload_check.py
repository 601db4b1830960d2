#!/usr/bin/env python3
"""KV offload's programs compiled for an H100 that is not here (deviceless, `jpa.tools.deviceless`).

Pool: SmolLM2-135M in bf16 (30 layers, 3 kv heads, head_dim 64, pages of 16 tokens), `--num-pages`
pages (default 4096: 1.4 GiB). Block: `--block` pages (default 8). Compiles the programs the
engine runs (`jpa.kv.offload`):
  - swap out (`swap_out_program`: the slot's pages gathered and moved to host memory in the
    program, `jax.memory.Space.Host`, memory kind pinned_host),
  - swap in's scatter (`_scatter_block`: the block moved to the device in the program, the pool
    donated),
  - prefix-cache spill (`spill_program`: `--block` evicted pages, one output per page, moved to
    host memory in the program),
  - a host hit's restore scatter (`_scatter_pages`: `--block` spilled pages into the donated pool),
  - and (unless `--no-step`) the engine's unified step (ragged pass + decode loop, SmolLM2 bf16,
    `jpa.tools.engine_checks.engine_steps`, "plain"): it must hold no host transfer,
and checks in the compiled programs: where the outputs live (the HLO layout's memory space S(5) is
host memory; `memory_analysis().host_output_size_in_bytes`), the asynchronous copies XLA scheduled
(copy-start / copy-done: a host offload copy), whether the donated pool is aliased
(`alias_size_in_bytes`), temporaries, and any pool-shaped copy. Exit status 1 when a check fails.

Found (JAX 0.12.0.1): a compile-only CUDA device has no memories (`addressable_memories()` is
empty), and a sharding's memory kind is dropped for it (`SingleDeviceSharding(dev,
memory_kind="pinned_host").memory_kind` is None): an output or argument *sharding* in pinned_host
cannot be compiled deviceless. A transfer *inside* the program (`jax.device_put(x,
jax.memory.Space.Host)`, lowered to XLA's annotate_device_placement) survives, so the swap-out and
spill programs move their outputs to the host that way (the engine runs the same functions). The
swap-in and restore programs take their blocks as arguments: deviceless they are compiled with the
blocks in device memory (their host->device copy is the argument's placement, which cannot be
declared here); on this CPU backend, whose device has pinned_host, tests/test_kv_offload.py checks
the lowered programs take a pinned_host argument and move it to the device in the program.

    .venv/bin/jpa tools compile-offload [--json benchmarks/offload_compile_h100.json]   # the `gpu` extra
"""

import argparse
import json
import re

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jpa.kv.cache import CacheConfig, KVCache
from jpa.kv.offload import _scatter_block, _scatter_pages, spill_program, swap_out_program
from jpa.tools.deviceless import Compiler
from jpa.tools.hlo import hlo_type, pool_copies


def facts(compiled, pool_shape, dtype) -> dict:
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    entry = hlo.splitlines()[0]
    return dict(host_buffers=len(re.findall(r"S\(5\)", hlo)), host_outputs=entry.split("->", 1)[-1].count("S(5)"),
                copy_starts=hlo.count("copy-start("), copy_dones=hlo.count("copy-done("),
                annotations=hlo.count("annotate_device_placement"),
                dynamic_update_slices=hlo.count("dynamic-update-slice"),
                scatters=hlo.count(" scatter("), gathers=hlo.count(" gather("),
                pool_copies=len(pool_copies(hlo, {hlo_type(pool_shape, dtype)})),
                alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
                argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                host_argument_bytes=getattr(mem, "host_argument_size_in_bytes", None),
                host_output_bytes=getattr(mem, "host_output_size_in_bytes", None),
                host_temp_bytes=getattr(mem, "host_temp_size_in_bytes", None))


def problems_of(out: dict, pool_bytes: int, block_bytes: int) -> list[str]:
    """The checks (empty: all hold)."""
    bad = []
    for name in ("swap_out", "spill"):
        f = out[name]
        if f["host_output_bytes"] != block_bytes or f["host_outputs"] < 1:
            bad.append(f"{name}: outputs not in host memory ({f['host_output_bytes']} of {block_bytes} bytes, "
                       f"{f['host_outputs']} S(5) outputs)")
        if f["copy_starts"] < 1 or f["copy_starts"] != f["copy_dones"]:
            bad.append(f"{name}: no asynchronous device->host copy (copy-start {f['copy_starts']})")
    for name in ("swap_out", "spill", "swap_in_scatter", "restore_scatter"):
        f = out[name]
        if f["pool_copies"]:
            bad.append(f"{name}: {f['pool_copies']} pool-shaped copies")
        # A gather to the host stages its block in device memory (one block of temporaries); nothing
        # near the pool's size.
        if f["temp_bytes"] > 2 * block_bytes:
            bad.append(f"{name}: {f['temp_bytes']} temporary bytes (> two blocks, {2 * block_bytes})")
    for name in ("swap_in_scatter", "restore_scatter"):
        if out[name]["alias_bytes"] < pool_bytes:
            bad.append(f"{name}: donated pool not aliased ({out[name]['alias_bytes']} of {pool_bytes} bytes)")
    step = out.get("engine_step")
    if step is not None:
        if not step["compiled"]:
            bad.append(f"engine step did not compile: {step.get('error')}")
        elif step["host_buffers"] or step["copy_starts"] or step["annotations"] or step["host_outputs"]:
            bad.append(f"engine step holds a host transfer: {step}")
    return bad


def engine_step(c: Compiler) -> dict:
    """The engine's unified step (plain), compiled: no host-memory buffer, no host copy in it."""
    from jpa.tools.engine_checks import engine_steps
    name, fn, args, jit_options, pools, _ = engine_steps(which=("plain",))[0]
    rec = c.compile(name, fn, args, jit_options=jit_options, pool_shapes=pools, keep_hlo=True)
    hlo = rec.pop("hlo", "")
    if "error" in rec:
        return dict(name=name, compiled=False, error=rec["error"])
    return dict(name=name, compiled=True, host_buffers=len(re.findall(r"S\(5\)", hlo)),
                copy_starts=hlo.count("copy-start("), annotations=hlo.count("annotate_device_placement"),
                host_outputs=hlo.splitlines()[0].split("->", 1)[-1].count("S(5)"),
                pool_copies=len(rec["pool_copies"]), alias_bytes=rec["alias_bytes"], pool_bytes=rec["pool_bytes"],
                seconds=rec["seconds"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--no-step", action="store_true", help="skip the engine step's compile (minutes)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    c = Compiler(args.target)
    dev = c.device
    sh = SingleDeviceSharding(dev)
    cfg = CacheConfig(30, 3, 64, args.num_pages, 16, "bfloat16")
    cache = jax.eval_shape(lambda: KVCache.create(cfg))
    def on(tree, s):
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)
    cache_d = on(cache, sh)
    pages_per_seq = 128
    tables = jax.ShapeDtypeStruct((16, pages_per_seq), jnp.int32, sharding=sh)
    i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=sh)
    ids = jax.ShapeDtypeStruct((args.block,), jnp.int32, sharding=sh)
    block = jax.eval_shape(lambda cc: jax.tree_util.tree_map(lambda a: a[:, :, : args.block], cc), cache)
    page = jax.eval_shape(lambda cc: jax.tree_util.tree_map(lambda a: a[:, :, :1], cc), cache)
    shape, dtype = cache.k.shape, cache.k.dtype
    out = {}
    with jax.sharding.use_abstract_mesh(c.mesh):
        # The engine's programs: `Mover` jits these same functions (with memory_kind "pinned_host").
        compiled = jax.jit(swap_out_program(args.block, "pinned_host")).lower(cache_d, tables, i32).compile()
        out["swap_out"] = facts(compiled, shape, dtype)
        s = jax.jit(_scatter_block, donate_argnums=(0,), static_argnames=("page_size",))
        compiled = s.lower(cache_d, tables, on(block, sh), flag, i32, i32, i32, page_size=16).compile()
        out["swap_in_scatter"] = facts(compiled, shape, dtype)
        compiled = jax.jit(spill_program("pinned_host")).lower(cache_d, ids).compile()
        out["spill"] = facts(compiled, shape, dtype)
        r = jax.jit(_scatter_pages, donate_argnums=(0,))
        compiled = r.lower(cache_d, tables, (on(page, sh),) * args.block, flag, i32, ids).compile()
        out["restore_scatter"] = facts(compiled, shape, dtype)
    if not args.no_step:
        out["engine_step"] = engine_step(c)
    out.update(device_memories=[m.kind for m in getattr(dev, "addressable_memories", lambda: [])()],
               target=args.target, pool_bytes=cfg.nbytes, block_pages=args.block,
               block_bytes=args.block * cfg.bytes_per_page)
    out["problems"] = problems_of(out, cfg.nbytes, args.block * cfg.bytes_per_page)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if out["problems"] else 0
