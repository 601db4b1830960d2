"""The memory traffic of a hybrid model's decode step (Qwen3.5-27B's shapes by default), compiled for a GPU that
is not here: bytes read and written by purpose (weights, KV of the attention layers, the Gated DeltaNet states,
...) against the ideal (every weight once, the live KV once, the new KV once, each state read and written once),
and the kernels that move the most (`jpa.tools.traffic.hybrid_traffic`). The step is
`models.hybrid.HybridModel.decode` called directly (not yet inside the engine's unified step).

    python scripts/hybrid_traffic.py --target h100 --max-seqs 1 64 --context 4096

A deviceless-compile figure: bytes the compiled program moves, not a measured time.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jpa.tools import deviceless  # noqa: E402

deviceless.configure_environment()

import argparse  # noqa: E402
import time  # noqa: E402

from jpa.tools.traffic import hybrid_traffic, table  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--max-seqs", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--top", type=int, default=6, help="kernels to list per step")
    args = ap.parse_args()
    for b in args.max_seqs:
        t0 = time.perf_counter()
        out = hybrid_traffic(args.target, num_seqs=b, context=args.context, page_size=args.page_size)
        print(f"\n## Qwen3.5-27B-shaped decode step, {b} sequences x {args.context} tokens, {args.target} "
              f"(compiled in {time.perf_counter() - t0:.0f} s)\n")
        print(table(out["summary"]))
        print("\nkernels moving the most (GB per step over all executions: read, written; executions):")
        for r in out["top"][:args.top]:
            rd, wr = sum(r["read"].values()), sum(r["written"].values())
            print(f"  {r['name'][:60]:60s} {rd / 1e9:8.3f} {wr / 1e9:8.3f}  x{r['executions']}")


if __name__ == "__main__":
    main()
