"""The memory traffic of a hybrid model's decode step (Qwen3.5-27B's shapes by default), compiled for a GPU that
is not here: bytes read and written by purpose (weights, KV of the attention layers, the Gated DeltaNet states,
...) against the ideal (every weight once, the live KV once, the new KV once, each state read and written once),
and the kernels that move the most (`jpa.tools.traffic.hybrid_traffic`). The step is
`models.hybrid.HybridModel.decode` called directly (not yet inside the engine's unified step).

    jpa tools traffic-hybrid --target h100 --max-seqs 1 64 --context 4096
    jpa tools traffic-hybrid --layers 8 48 --max-seqs 1   # compile time against depth

A deviceless-compile figure: bytes the compiled program moves, not a measured time.
"""

import argparse
import dataclasses
import time

from jpa.models.hybrid import FULL, LINEAR, QWEN35_27B_SHAPED
from jpa.tools.traffic import hybrid_traffic, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--max-seqs", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=6, help="kernels to list per step")
    ap.add_argument("--layers", type=int, nargs="+", default=[64],
                    help="model depths (multiples of 4: GDN x 3, attention), Qwen3.5-27B's widths")
    args = ap.parse_args(argv)
    for layers in args.layers:
        config = dataclasses.replace(QWEN35_27B_SHAPED, num_layers=layers,
                                     layer_types=tuple(LINEAR if (i + 1) % 4 else FULL for i in range(layers)))
        for b in args.max_seqs:
            step(args, config, layers, b)
    return 0


def step(args, config, layers, b):
    t0 = time.perf_counter()
    out = hybrid_traffic(args.target, config, num_seqs=b, context=args.context, page_size=args.page_size)
    print(f"\n## Qwen3.5-27B-shaped decode step, {layers} layers, {b} sequences x {args.context} tokens, "
          f"{args.target} (XLA compile {out['seconds']} s, {time.perf_counter() - t0:.0f} s in all)\n")
    print(table(out["summary"]))
    print("\nkernels moving the most (GB per step over all executions: read, written; executions):")
    for r in out["top"][:args.top]:
        rd, wr = sum(r["read"].values()), sum(r["written"].values())
        print(f"  {r['name'][:60]:60s} {rd / 1e9:8.3f} {wr / 1e9:8.3f}  x{r['executions']}")
