"""The memory traffic of one decode step of the engine, compiled for an H100 or A100 that is not here.

Compiles the engine's unified step (`jpa.tools.engine_checks.engine_steps`, Llama-3-8B's shapes in
bfloat16 by default, an 8 GiB pool) deviceless and prints, for one iteration of its decode loop,
the bytes read and written by purpose (weights, KV read, KV write, logits / sampling, page work,
other) against the ideal (every weight once, the live KV once, the new KV once), and the kernels
that move the most (`jpa.tools.traffic`). "spec" is the step with n-gram speculation (k = 4): a
verify pass of 5 rows per sequence. The program is compiled as the engine compiles it on a GPU,
with its XLA options (`jpa.core.xla_options.WEIGHTS_IN_PLACE`); --xla-default leaves them out.

    jpa tools traffic --target h100 --max-seqs 1 64 --which plain spec
    jpa tools traffic --xla-default --json out.json  # without the engine's XLA options
    jpa tools traffic --option xla_gpu_enable_triton_gemm=false   # any XLA option
    jpa tools traffic --model llama-small --layers 80 --max-seqs 64   # compile time vs depth
    jpa tools traffic --max-seqs 1 8 64 --context 8192 --project 1024 8192   # projected tok/s
    jpa tools traffic --quantization int8 Q4_1 awq --max-seqs 1 64   # quantized weights (issue 35)
    jpa tools traffic --tied --quantization Q8_0 --max-seqs 1   # a tied head (SmolLM2's form)
    jpa tools traffic --tied rows --quantization Q8_0 --max-seqs 1   # ... its table kept in rows (before)
    jpa tools traffic --model smollm2 --tied --quantization Q4_1:Q8_0 --max-seqs 1   # SmolLM2's GGUF form
    jpa tools traffic --tp 2 --quantization Q4_0 --max-seqs 1   # 2-way tensor parallel: one device's program

A deviceless-compile figure: bytes the compiled program moves, not a measured time.
"""

import argparse
import json
import os

from jpa.tools import deviceless
from jpa.tools.engine_checks import MODEL_SHAPES
from jpa.tools.traffic import engine_traffic, passes, projection, table


# benchmarks/bench_compile.py's Llama-shaped model with small widths (its compile-time-vs-depth model).
SHAPES = dict(MODEL_SHAPES, **{"llama-small": dict(
    family="llama", vocab_size=512, d_model=256, num_layers=8, num_q_heads=4, num_kv_heads=2, head_dim=64,
    ffn_dim=768, max_seq_len=2048, rope_base=500000.0, norm_eps=1e-5, tie_embeddings=False, bos_token_id=256,
    eos_token_id=257)}, **{"smollm2": dict(
    # SmolLM2-135M-Instruct's shapes (models.config PRESETS["smollm2-135m"]): d_model 576 = 4 x 128 + 64, tied head.
    family="llama", vocab_size=49152, d_model=576, num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64,
    ffn_dim=1536, max_seq_len=8192, rope_base=100000.0, norm_eps=1e-5, tie_embeddings=True, bos_token_id=1,
    eos_token_id=2)})


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(deviceless.TARGETS), default="h100")
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--layers", type=int, help="the model's shapes with this many layers")
    p.add_argument("--max-seqs", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024, help="tokens of context of every sequence")
    p.add_argument("--pool-gib", type=float, default=8.0)
    p.add_argument("--quantization", nargs="+", default=[None], metavar="FORMAT",
                   help="the weights stored quantized (jpa.tools.traffic.ABSTRACT_FORMATS: int8 fp8 Q4_0 Q4_1 Q4_K "
                        "Q8_0 Q5_K Q6_K fp8-block awq gptq; 'none': bfloat16; 'Q4_1:Q8_0': Q4_1 layers and a Q8_0 head or "
                        "tied table, SmolLM2's GGUF); several: one table each")
    p.add_argument("--tied", nargs="?", const="columns", choices=("columns", "rows"),
                   help="tie the head to the embedding table (quantized in the format's head form, as SmolLM2's "
                        "GGUF keeps it: jpa.tools.traffic.abstract_model); 'rows': keep the table [vocab, d_model] "
                        "instead of the [d_model, vocab] the engine keeps for the Mosaic matmul (the before)")
    p.add_argument("--which", nargs="+", choices=("plain", "spec"), default=["plain"])
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="compile the step tensor-parallel over N compile-only GPUs (models.sharding's layout; "
                        "--pool-gib per device) and model one device's program (plain step only)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA option for the compile (repeatable), e.g. xla_gpu_enable_triton_gemm=false")
    p.add_argument("--xla-default", action="store_true",
                   help="compile without the engine's XLA options (jpa.core.xla_options.WEIGHTS_IN_PLACE: "
                        "cuBLAS gemms, no dot merger), as XLA compiles by default")
    p.add_argument("--project", type=int, nargs="+", metavar="CONTEXT",
                   help="also model each compiled plain step at these contexts (the same program) and print a "
                        "projected decode rate at --efficiency x the target's HBM peak (a projection: no GPU)")
    p.add_argument("--efficiency", type=float, default=0.8, help="fraction of HBM peak for --project")
    p.add_argument("--top", type=int, default=8, help="kernels listed per table")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument("--hlo", help="a folder: write each compiled program's optimized HLO there")
    p.add_argument("--from-hlo", help="a folder written by --hlo: model the programs saved there, compiling nothing")
    args = p.parse_args(argv)
    options = {}
    for o in args.option:
        if "=" not in o:
            p.error(f"--option wants NAME=VALUE; got {o!r}")
        k, v = o.split("=", 1)
        options[k] = _value(v)
    shapes = dict(SHAPES[args.model], **({"num_layers": args.layers} if args.layers else {}),
                  **({"tie_embeddings": True} if args.tied else {}))
    out = []
    quants = [None if q in (None, "none") else q for q in args.quantization]
    for quant, which, seqs in [(q, w, n) for q in quants for w in args.which for n in args.max_seqs]:
        if True:
            tag = "_".join(f"{k}={v}" for k, v in options.items())
            fname = f"{args.target}_{(quant or 'bf16').replace(':', '+')}{'_tied-' + args.tied if args.tied else ''}{f'_tp{args.tp}' if args.tp > 1 else ''}_{which}_{seqs}_{'xla' if args.xla_default else 'engine'}_{tag or 'options'}.hlo"
            saved = None
            if args.from_hlo:
                with open(os.path.join(args.from_hlo, fname)) as f:
                    saved = f.read()
            r = engine_traffic(args.target, shapes, max_seqs=seqs, context=args.context, pool_gib=args.pool_gib,
                               which=which, compiler_options=options, label=args.model, hlo=saved,
                               engine_options=not args.xla_default, quantization=quant,
                               embeddings_columns=None if args.tied is None else args.tied == "columns",
                               tensor_parallel=args.tp)
            s = r["summary"]
            if args.hlo:
                os.makedirs(args.hlo, exist_ok=True)
                with open(os.path.join(args.hlo, fname), "w") as f:
                    f.write(r["hlo"])
            how = ("from saved HLO" if r["seconds"] is None
                   else f"compiled in {r['seconds']} s ({r['cpu_seconds']} CPU s)")
            print(f"\n{r['name']}, weights {quant or 'bf16'}{f', tensor-parallel over {args.tp} (one device)' if args.tp > 1 else ''}{', tied head (table in ' + args.tied + ')' if args.tied else ''}, on {args.target}, {seqs} x {args.context} tokens of context, "
                  f"XLA options {r['compiler_options']}: "
                  f"{how}; {len(s['weight_copies'])} materialized weight slices"
                  + "".join(f"\n  weight copy: {c['bytes'] / 1e9:.3f} GB {c['name']} -> {c['result'][:60]}"
                            for c in s["weight_copies"]))
            print(table(s))
            rows = seqs * (5 if which == "spec" else 1)
            logit_passes = passes(r["rows"], "logits", rows * shapes["vocab_size"] * 4)
            print(f"  logits / sampling: {logit_passes:.2f} reads of the step's [{rows}, {shapes['vocab_size']}] float32 "
                  f"logits (outside the sampler's whole-row search for the rows that need it)")
            for k in r["top"][:args.top]:
                parts = ", ".join([f"R {p} {b / 1e9:.3f}" for p, b in k["read"].items()]
                                  + [f"W {p} {b / 1e9:.3f}" for p, b in k["written"].items()])
                print(f"  {k['bytes'] / 1e9:8.3f} GB  {k['name']} ({k['what'][:40]}) x{k['executions']}: {parts}")
            if args.project and which == "plain":
                print(f"\nProjected decode rate (a projection from this model, not a measurement): "
                      f"{args.target} at {args.efficiency:.0%} of HBM peak, {seqs} sequences")
                print("| context | bytes a step (GB) | total / ideal | step (ms) | tokens/s | KV + weights fit |")
                print("|---:|---:|---:|---:|---:|---|")
                for ctx in args.project:
                    rc = engine_traffic(args.target, shapes, max_seqs=seqs, context=ctx, pool_gib=args.pool_gib,
                                        which=which, label=args.model, hlo=r["hlo"], quantization=quant)
                    sc = rc["summary"]
                    kv = seqs * ctx * 2 * shapes["num_layers"] * shapes["num_kv_heads"] * shapes["head_dim"] * 2
                    weights = sc["weights"]["ideal"] + shapes["vocab_size"] * shapes["d_model"] * 2  # + the table
                    pr = projection(sc, args.target, seqs, efficiency=args.efficiency, kv_bytes=kv,
                                    weight_bytes=weights)
                    print(f"| {ctx} | {sc['total']['total'] / 1e9:.2f} | "
                          f"{sc['total']['total'] / sc['total']['ideal']:.2f} | {pr['step_ms']:.2f} | "
                          f"{pr['tokens_per_s']:.0f} | {'yes' if pr['fits'] else 'no'} |")
                    out.append(dict(target=args.target, model=args.model, max_seqs=seqs, context=ctx, which=which,
                                    projected_from_context=args.context, summary=sc, projection=pr,
                                    efficiency=args.efficiency))
            out.append(dict(target=args.target, model=args.model, quantization=quant, tied=args.tied, tp=args.tp,
                            num_layers=shapes["num_layers"], max_seqs=seqs,
                            context=args.context, which=which, options=r["compiler_options"], seconds=r["seconds"],
                            cpu_seconds=r["cpu_seconds"], temp_bytes=r["temp_bytes"], summary=s, top=r["top"],
                            logit_passes=logit_passes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0

