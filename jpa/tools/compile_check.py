"""Deviceless GPU compile tier: compile jpa's kernels and jitted steps for a GPU that is not here (--target:
h100, a100, a6000, l4, rtx6000pro, b200).

The command line over `jpa.tools` (deviceless.Compiler: XLA's whole GPU pipeline for a compile-only
GPU, ptxas included; kernel_checks and engine_checks: what is compiled and checked). It compiles

1. every decode-kernel configuration of a covering grid that the kernel's `unsupported_reason`
   accepts for the target (page sizes 8-256, head dims 64-256, q_per_kv 1-16, 16-bit, int8 and
   fp8 caches, every option, split-K on and off);
2. the ragged kernels (`jpa.ragged_paged_attention`) at a serving size: five dtype/shape configs
   ("fast"), plus every head dim with a 16-bit, int8, fp8 and float32 cache ("full");
   after each of 1. and 2. (or alone: `--only stacked`), stacked page pools: the kernels called in
   a loop over layers on ONE [L, K, P, S_p, H] pool per K/V (carried, written each layer, donated)
   with the loop index as the layer: one ragged config of 40 layers, 5 GiB per pool ("fast"), plus
   decode and ragged configs of 4-32 layers ("full"), each next to the registers of its per-layer twin;
3. the engine's unified step (`--only engine`) for SmolLM2-135M in bfloat16 with a pool of >= 1 GiB,
   attention chosen by `impl="auto"` for the target; or (`--only tp`, not part of "all") a
   Llama-shaped model or a mixture of experts (`--model`, `--expert-layout`) tensor-parallel over --tp
   compile-only GPUs of --hosts hosts:
   collectives per step and per layer, which of them cross hosts, the pool shards aliased,
   per-device memory within the GPU's.

For each it reports: compiled or the error; each kernel's grid, threads, shared memory, registers
and spills; whether the page pools reach the kernels uncopied. A jpa kernel that spills registers
fails its record. It exits non-zero on any failure.

jpa's Mosaic kernels are compiled for every target: the WGMMA ones on Hopper (and, for what they refuse
there, the mma.sync ones with TMA copies), the mma.sync ones on Ampere/Ada (cp.async), Blackwell and
the RTX PRO 6000 (TMA). (BENCHMARKS.md, "Mosaic GPU on an A100", was the first look at Mosaic GPU on an A100.)

Not covered here (needs a GPU): numerics and speed of compiled code (`scripts/gpu_validate.py`).

Needs the compile-only GPU packages: `pip install -e ".[gpu]"` (./run test installs them).

    jpa tools compile --target h100 [--subset fast|full] [--json PATH]
    jpa tools compile --target h100 --only stacked [--subset fast|full]
    jpa tools compile --target a100 --only auto   # which kernels impl="auto" compiles
    jpa tools compile --target h100 --only tp --tp 8
    jpa tools compile --target h100 --only tp --tp 16 --hosts 2 --model llama3-70b \
        --pool-gib 56 --max-seqs 128 --max-model-len 8192
    jpa tools compile --target h100 --only tp --tp 8 --model qwen3-30b-a3b   # MoE: experts sharded
    jpa tools compile --target h100 --only tp --tp 8 --model gpt-oss-120b
    jpa tools compile --target h100 --only moe-layer --tp 8 --model tiny-moe   # seconds
    jpa tools compile --target h100 --only ladder --max-seqs 32   # each step-shape rung
    jpa tools compile --markdown benchmarks/gpu_compile_*.json
"""

import argparse
import json
import pathlib
import sys
import time

import jax

from jpa.tools import deviceless
from jpa.tools.deviceless import TARGETS, markdown
from jpa.tools.engine_checks import MODEL_SHAPES, check_engine, check_moe_layer, check_tp, with_layers
from jpa.tools.kernel_checks import (check_auto, check_kernels, check_ragged, check_stacked_kernels,
                                     check_stacked_ragged)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(TARGETS))
    p.add_argument("--subset", choices=("fast", "full"), default="full",
                   help="fast: a spread-out subset of the kernel grid (CI); full: the covering grid")
    p.add_argument("--only", choices=("kernels", "ragged", "stacked", "engine", "all", "tp", "auto", "moe-layer",
                                       "ladder"),
                   default="all",
                   help="stacked: only the stacked-pool configurations of kernels and ragged (a loop over "
                        "layers, one [L, K, P, S_p, H] pool, the layer a traced index); "
                        "tp: the engine's unified step of a Llama-shaped model (--model) tensor-parallel over --tp "
                        "GPUs of --hosts hosts (not part of 'all'); moe-layer: one layer's experts of a mixture of "
                        "experts (--model) sharded over --tp GPUs, 64 and 512 tokens (not part of 'all')")
    p.add_argument("--engine-steps", default="plain,spec", help="the engine programs of --only engine: plain "
                   "and/or spec (n-gram speculative decoding), comma-separated")
    p.add_argument("--tp", type=int, default=8, help="GPUs of the tensor-parallel compile (--only tp)")
    p.add_argument("--embeddings", choices=("replicated", "vocab"), default="vocab",
                   help="how --only tp places the embeddings and the output head")
    p.add_argument("--layers", type=int, default=None, help="--only tp: layers of the Llama-shaped model "
                   "(default: the --model's)")
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama3-8b",
                   help="--only tp: the model shapes (random abstract bf16 weights; gpt-oss's experts MXFP4)")
    p.add_argument("--expert-layout", choices=("auto", "experts", "ffn"), default="auto",
                   help="--only tp with a mixture of experts: how the experts are sharded (models.sharding."
                        "plan_experts: 'experts' splits the expert axis, 'ffn' each expert's width)")
    p.add_argument("--hosts", type=int, default=1, help="--only tp: spread the --tp GPUs over this many hosts "
                   "(topology HOSTSx1x(TP/HOSTS): one NVLink domain per host) and report which collectives "
                   "cross hosts")
    p.add_argument("--pool-gib", type=float, default=8.0, help="--only tp: KV pool per device, GiB")
    p.add_argument("--max-seqs", type=int, default=64, help="--only tp / ladder: sequences of the decode loop")
    p.add_argument("--budget", type=int, default=512, help="--only ladder: the token budget of the full shape")
    p.add_argument("--max-model-len", type=int, default=4096, help="--only tp: tokens per sequence at most")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="instead of the covering grid, N random configurations per kernel")
    p.add_argument("--seed", type=int, default=0, help="seed of --random")
    p.add_argument("--json", type=pathlib.Path, help="write every record to this file")
    p.add_argument("--markdown", type=pathlib.Path, nargs="+", metavar="JSON",
                   help="print a markdown table of these JSON reports and exit (no compiling)")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown([json.loads(f.read_text()) for f in args.markdown]), end="")
        return 0
    if args.target is None:
        p.error(f"--target is required ({', '.join(sorted(TARGETS))})")
    try:
        compiler = deviceless.Compiler(args.target, *((args.tp, args.hosts) if args.only in ("tp", "moe-layer")
                                                      else (1, 1)))
    except Exception as e:
        print(f"gpu_compile_check: cannot get a compile-only {args.target} device ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}). Install the compile-only GPU packages: "
              f"pip install -e '.[gpu]'", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    # Mosaic GPU: the WGMMA kernels on Hopper (9.x), the mma.sync decode on Ampere/Ada (8.x,
    # cp.async) and Blackwell (10.x, TMA).
    impls = ("triton", "mosaic") if TARGETS[args.target]["cc"][0] in (8, 9, 10, 12) else ("triton",)
    records = []
    if args.only in ("kernels", "all"):
        records += check_kernels(compiler, impls, args.subset, random=args.random, seed=args.seed)
    if args.only in ("kernels", "stacked", "all") and not args.random:
        records += check_stacked_kernels(compiler, impls, args.subset, records)
    if args.only in ("ragged", "all"):
        records += check_ragged(compiler, impls, subset=args.subset)
    if args.only in ("ragged", "stacked", "all"):
        records += check_stacked_ragged(compiler, impls, args.subset, records)
    if args.only == "auto":
        records += check_auto(compiler)
    if args.only in ("engine", "all"):
        records += check_engine(compiler, which=tuple(args.engine_steps.split(",")))
    if args.only == "ladder":   # the step-shape ladder `jpa serve` compiles (EngineConfig.step_shapes="ladder")
        from jpa.engine.shapes import step_ladder
        rungs = step_ladder("ladder", args.max_seqs, args.budget)
        records += check_engine(compiler, which=("plain",), max_seqs=args.max_seqs, budget=args.budget, rungs=rungs)
    if args.only == "tp":
        config = with_layers(MODEL_SHAPES[args.model], args.layers)
        records += check_tp(compiler, config=config, embeddings=args.embeddings, pool_gib_per_device=args.pool_gib,
                            max_seqs=args.max_seqs, max_model_len=args.max_model_len, experts=args.expert_layout)
    if args.only == "moe-layer":
        records += check_moe_layer(compiler, MODEL_SHAPES[args.model], experts=args.expert_layout)
    failed = [r for r in records if not r["ok"]]
    compiled = [r for r in records if "refused" not in r]
    summary = dict(target=args.target, device_kind=TARGETS[args.target]["kind"],
                   subset=f"random {args.random} (seed {args.seed})" if args.random else args.subset,
                   jax=jax.__version__, ptxas=compiler.ptxas, topology=compiler.topology,
                   records=len(records), compiled=len(compiled),
                   refused=len(records) - len(compiled), failed=len(failed),
                   seconds=round(time.perf_counter() - t0, 1))
    print(f"\n{args.target}: {summary['compiled']} compiled, {summary['refused']} refused by "
          f"unsupported_reason, {summary['failed']} failed ({summary['seconds']} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(summary=summary, records=records), indent=1) + "\n")
    return 1 if failed else 0

