"""Deviceless H100 compile of the configurations `impl="auto"` routes to the mma.sync kernels on Hopper
(`decode.runs_mma` / `ragged.runs_mma`: the covering grids' shapes the WGMMA kernels refuse). Each record:
the kernels' registers, spills, PTX target (sm_90a checked by the Compiler); exits 1 if any fails.

    jpa tools compile-hopper-mma [h100|h200] [--json PATH] [--max N] [--ops decode,ragged]
"""

import argparse
import json

from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import ragged as mosaic_ragged
from jpa.tools import deviceless, kernel_checks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", default="h100")
    p.add_argument("--json")
    p.add_argument("--max", type=int, default=0, help="at most N configurations per op (0: all)")
    p.add_argument("--ops", default="decode,ragged")
    args = p.parse_args(argv)
    cc = deviceless.compute_capability(args.target)
    cap = (lambda xs: xs[:args.max]) if args.max else (lambda xs: xs)
    grid = cap([c for c in kernel_checks.covering_grid("mosaic", "full")
                if cc is not None and not mosaic_decode.decode_ampere.serves(cc)
                and mosaic_decode.runs_mma(c.spec(), cc)])
    rgrid = cap([c for c in kernel_checks.ragged_grid("full")
                 if mosaic_ragged.runs_mma(kernel_checks.ragged_call("mosaic", *c)[0], cc)])
    comp = deviceless.Compiler(args.target)
    recs = []
    saved = kernel_checks.covering_grid, kernel_checks.ragged_grid
    try:
        if "decode" in args.ops:
            kernel_checks.covering_grid = lambda impl, subset="full": grid
            recs += kernel_checks.check_kernels(comp, ["mosaic"], "full")
        if "ragged" in args.ops:
            kernel_checks.ragged_grid = lambda subset="full": rgrid
            recs += kernel_checks.check_ragged(comp, ["mosaic"])
    finally:
        kernel_checks.covering_grid, kernel_checks.ragged_grid = saved
    bad = [r for r in recs if not r["ok"] or r.get("refused")]
    for r in recs:
        ks = {k: (v.get("registers"), v.get("spill_stores"), v.get("ptx_targets"))
              for k, v in (r.get("kernels") or {}).items()}
        print(r["name"], "FAILED" if r in bad else "OK", ks, r.get("problems") or r.get("refused") or "")
    print(f"{len(recs)} compiled ({len(grid)} decode, {len(rgrid)} ragged), {len(bad)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1, default=str)
    return 1 if bad else 0
