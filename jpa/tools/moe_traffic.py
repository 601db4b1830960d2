"""The memory traffic of one decode step of a mixture-of-experts model, compiled for an H100 that is
not here (a deviceless compile; `jpa.tools.traffic.engine_traffic`, as `jpa tools traffic` does
for dense models).

Qwen3-30B-A3B's shapes (128 experts, top-8, expert width 768, bf16), or with `--model gpt-oss-20b`
gpt-oss-20b's (32 experts, top-4, width 2880, sinks, sliding window 128 on alternate layers, the
experts in MXFP4 as released), `--layers` of its layers (the layers are a scan: the per-layer traffic
does not depend on the depth). Prints the traffic table by purpose, the kernels that move the most,
and the expert matmuls' kernels in the HLO.

    jpa tools traffic-moe --max-seqs 1 64 --layers 4
    jpa tools traffic-moe --model gpt-oss-20b --max-seqs 1 --layers 2
    jpa tools traffic-moe --model gpt-oss-120b --max-seqs 1 --layers 36   # the whole model

A deviceless-compile figure: bytes the compiled program moves (by jpa.tools.traffic's model), not a
measured time.
"""

import argparse
import re

from jpa.tools import deviceless
from jpa.tools.engine_checks import GPT_OSS_20B, GPT_OSS_120B, QWEN3_30B_A3B, with_layers
from jpa.tools.traffic import engine_traffic, table

# The released configs' shapes (jpa.tools.engine_checks, shared with gpu_compile_check.py --only tp).
MODELS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(deviceless.TARGETS), default="h100")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-seqs", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--expert-matmul", choices=("ragged_dot", "blocked"), default=None,
                   help="models.moe.EXPERT_MATMUL for batches of M*k >= E pairs (default: the module's)")
    args = p.parse_args(argv)
    if args.expert_matmul:
        from jpa.models import moe
        moe.EXPERT_MATMUL = args.expert_matmul
    shapes = with_layers(MODELS[args.model], args.layers)  # gpt-oss: the even layers slide
    for seqs in args.max_seqs:
        r = engine_traffic(args.target, shapes, max_seqs=seqs, context=args.context, pool_gib=8.0,
                           label=f"{args.model} ({args.layers} layers)")
        print(f"\n{r['name']} on {args.target}, {seqs} x {args.context} tokens of context: compiled in "
              f"{r['seconds']} s, temporaries {r['temp_bytes'] / 2 ** 30:.2f} GiB")
        print(table(r["summary"]))
        for k in r["top"][:args.top]:
            parts = ", ".join([f"R {q} {b / 1e9:.3f}" for q, b in k["read"].items()]
                              + [f"W {q} {b / 1e9:.3f}" for q, b in k["written"].items()])
            print(f"  {k['bytes'] / 1e9:8.3f} GB  {k['name']} ({k['what'][:40]}) x{k['executions']}: {parts}")
        # The expert matmuls: the dots XLA made of ragged_dot (the ragged pass's and the decode
        # step's), or the gathers of expert weights of the gathered and blocked forms.
        dots = sorted(set(re.findall(r"= (f32\[[\d,]+\])\S* dot\([^\n]*ragged_dot_general", r["hlo"])))
        gathers = sorted(set(re.findall(r"= ((?:bf16|u8)\[\d+,1,\d+,\d+\]\S*) gather\(", r["hlo"])))
        print(f"  ragged_dot's dots (results; XLA's dense lowering over all experts): {dots or 'none'}")
        print(f"  expert-weight gathers (gathered: the chosen experts; blocked: one per tile): {gathers or 'none'}")
    return 0

