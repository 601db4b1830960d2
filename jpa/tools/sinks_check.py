"""Deviceless compile of the decode kernels with attention sinks, next to their no-sink twins (the covering
grid's sinks configurations), and of the ragged op with sinks next to its twin. Prints each record's kernels
(registers, spills); exits 1 if any fails. One target per process (each compile configures XLA for it):

    jpa tools compile-sinks h100 mosaic
    jpa tools compile-sinks a100 triton
"""

import argparse
import dataclasses

from jpa.tools import deviceless, kernel_checks
from jpa.tools.kernel_checks import check_kernels, covering_grid


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=sorted(deviceless.TARGETS))
    p.add_argument("impl", choices=("mosaic", "triton"))
    args = p.parse_args(argv)
    grid = [c for c in covering_grid(args.impl) if c.sinks]
    grid = [dataclasses.replace(c, sinks=False) for c in grid] + grid  # twins first: registers of each
    sink_cfgs = [c for c in kernel_checks.RAGGED_CONFIGS if c[5:] and c[5]]
    saved = kernel_checks.covering_grid, kernel_checks.ragged_grid
    kernel_checks.covering_grid = lambda impl, subset="full": grid
    kernel_checks.ragged_grid = lambda subset="full": [c[:5] for c in sink_cfgs] + sink_cfgs
    try:
        comp = deviceless.Compiler(args.target)
        recs = check_kernels(comp, [args.impl], "full")
        for r in recs:
            print(r["name"], {k: v for k, v in r.items() if k in ("kernels", "spills", "problems", "ok")})
        print("DECODE", "FAILED" if any(not r["ok"] for r in recs) else "ALL OK", len(recs))
        rrecs = kernel_checks.check_ragged(comp, [args.impl])
        for r in rrecs:
            print(r["name"], {k: v for k, v in r.items() if k in ("kernels", "refused", "problems", "ok")})
        print("RAGGED", "FAILED" if any(not r["ok"] for r in rrecs) else "ALL OK", len(rrecs))
    finally:
        kernel_checks.covering_grid, kernel_checks.ragged_grid = saved
    return 1 if any(not r["ok"] for r in recs + rrecs) else 0
