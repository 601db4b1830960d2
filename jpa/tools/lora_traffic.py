"""The memory traffic of one decode step of the engine with LoRA adapters, compiled for an H100 that is not here.

Compiles the engine's unified step with --enable-lora (Llama-3-8B's shapes in bfloat16 by default; `--model
smollm2` for SmolLM2-135M's; `--max-loras` slots of rank `--rank` on all seven targets) deviceless, as
scripts/gpu_traffic.py does for the plain step, and prints for one iteration of its decode loop the bytes read
and written by purpose against the ideal: every base weight once, every adapter slot once (max_loras active
adapters, each read once: the LoRA slots count as weights), the live KV once, the new KV once. Each linear's
LoRA term runs under a lax.cond (skipped when no row has an adapter); `jpa.tools.traffic` counts a
conditional's costliest branch, so this is the step with adapters in use. Without --enable-lora the same
step is printed first (`--no-baseline` skips it).

    jpa tools traffic-lora --max-seqs 64
    jpa tools traffic-lora --model smollm2 --max-seqs 16 --max-loras 4 --rank 16

A deviceless-compile figure: bytes the compiled program moves, not a measured time.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jpa.tools.engine_checks import LLAMA_SHAPED


def compile_step(config, *, max_seqs, context, budget, page_size, pool_gib, lora, target):
    from flax import nnx

    from jpa.engine.runner import ModelRunner
    from jpa.kv.cache import CacheConfig
    from jpa.models import GPT, GPTForEngine
    from jpa.models import lora as lora_mod
    from jpa.tools.deviceless import Compiler
    from jpa.tools.traffic import decode_step, engine_spec, summary, table, traffic

    model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    cache_cfg = CacheConfig.from_memory(int(pool_gib * 2 ** 30), num_layers=config.num_layers,
                                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                        page_size=page_size, dtype="bfloat16")
    runner = ModelRunner(model, cache_cfg, max_seqs=max_seqs, pages_per_seq=max(2048, context) // page_size,
                         steps_per_call=8, stop_ids=(config.eos_token_id,), allocate=False, block_tokens=budget)
    runner.set_block_tokens(budget)   # the GPU default: the whole budget in one pass
    slots = None
    if lora is not None:
        slots = jax.eval_shape(lambda: lora_mod.empty_slots(config, *lora, jnp.bfloat16))
        runner.lora = slots   # abstract: nothing is allocated or written (`enable_lora` would write zeros)
    args = (*runner.state(), runner.step_inputs(budget)) + (() if slots is None else (slots,))
    jit_options = dict(runner.jit_options("cuda"))
    options = jit_options.pop("compiler_options", {})
    pools = [((config.num_layers, config.num_kv_heads, cache_cfg.num_pages, page_size, config.head_dim),
              "bfloat16")] * 2
    name = f"unified step{'' if lora is None else f' + LoRA {lora[0]} x r{lora[1]}'}"
    rec = Compiler(target).compile(name, runner.step_function, args, jit_options=jit_options, pool_shapes=pools,
                                   keep_hlo=True, compiler_options=options)
    if "error" in rec:
        raise RuntimeError(rec["error"])
    weights = runner.params if slots is None else (runner.params, slots)
    spec, ideal = engine_spec(weights, config, pools, max_seqs=max_seqs, context=context, page_size=page_size)
    if slots is not None:   # a layer's slice of the slots ([N, in, R], [N, R, out]: the layer axis is axis 1)
        from jpa.tools.hlo import hlo_type
        for leaf in jax.tree_util.tree_leaves(slots):
            dims = (leaf.shape[0],) + tuple(leaf.shape[2:])
            spec.weight_types |= {(hlo_type(dims, leaf.dtype).split("[")[0], dims)}
        spec.__post_init__()
    step = decode_step(traffic(rec["hlo"], spec))
    s = summary(step, ideal)
    lora_bytes = 0 if slots is None else sum(int(np.prod(x.shape)) * 2 for x in jax.tree_util.tree_leaves(slots))
    print(f"\n{name}: {max_seqs} seqs x {context} tokens, H100 deviceless (compile {rec['seconds']:.0f} s); "
          f"adapter slots {lora_bytes / 1e6:.1f} MB")
    print(table(s))
    print("  the kernels moving the most bytes that are neither weights nor KV:")
    moved = lambda r: (r["read"].get("other", 0) + r["written"].get("other", 0)) * r["executions"]  # noqa: E731
    for r in sorted(step, key=moved, reverse=True)[:8]:
        print(f"    {(r['kernel'] or r['fused'] or r['op'])[:40]:<40} x{r['executions']:<4} "
              f"{moved(r) / 1e6:8.2f} MB  {r['type'][:100]}")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama3-8b", "smollm2"], default="llama3-8b")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--pool-gib", type=float, default=8.0)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args(argv)
    from jpa.models import PRESETS, ModelConfig

    config = ModelConfig(**LLAMA_SHAPED) if args.model == "llama3-8b" else PRESETS["smollm2-135m"]
    common = dict(max_seqs=args.max_seqs, context=args.context, budget=args.budget, page_size=16,
                  pool_gib=args.pool_gib, target=args.target)
    if not args.no_baseline:
        compile_step(config, lora=None, **common)
    compile_step(config, lora=(args.max_loras, args.rank), **common)
    return 0

