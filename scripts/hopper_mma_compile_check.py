"""Deviceless H100 compile of the configurations `impl="auto"` routes to the mma.sync kernels on
Hopper (`decode.runs_mma` / `ragged.runs_mma`: the covering grids' shapes the WGMMA kernels refuse):
python scripts/hopper_mma_compile_check.py [h100|h200] [--json PATH] [--max N]. Each record: the
kernels' registers, spills, PTX target (sm_90a checked by the Compiler); exits 1 if any fails."""
import os, sys, json
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import argparse
import jpa.tools.kernel_checks as kc
from jpa.pallas.mosaic import decode as mosaic_decode, ragged as mosaic_ragged

p = argparse.ArgumentParser()
p.add_argument("target", nargs="?", default="h100")
p.add_argument("--json")
p.add_argument("--max", type=int, default=0, help="at most N configurations per op (0: all)")
p.add_argument("--ops", default="decode,ragged")
args = p.parse_args()
cc = deviceless.compute_capability(args.target)
cap = (lambda xs: xs[:args.max]) if args.max else (lambda xs: xs)
grid = cap([c for c in kc.covering_grid("mosaic", "full")
            if cc is not None and not mosaic_decode.decode_ampere.serves(cc) and mosaic_decode.runs_mma(c.spec(), cc)])
rgrid = cap([c for c in kc.ragged_grid("full") if mosaic_ragged.runs_mma(kc.ragged_call("mosaic", *c)[0], cc)])
comp = deviceless.Compiler(args.target)
recs = []
if "decode" in args.ops:
    kc.covering_grid = lambda impl, subset="full": grid
    recs += kc.check_kernels(comp, ["mosaic"], "full")
if "ragged" in args.ops:
    kc.ragged_grid = lambda subset="full": rgrid
    recs += kc.check_ragged(comp, ["mosaic"])
bad = [r for r in recs if not r["ok"] or r.get("refused")]
for r in recs:
    ks = {k: (v.get("registers"), v.get("spill_stores"), v.get("ptx_targets")) for k, v in (r.get("kernels") or {}).items()}
    print(r["name"], "OK" if r in recs and r not in bad else "FAILED", ks, r.get("problems") or r.get("refused") or "")
print(f"{len(recs)} compiled ({len(grid)} decode, {len(rgrid)} ragged), {len(bad)} failed")
if args.json:
    json.dump(recs, open(args.json, "w"), indent=1, default=str)
sys.exit(1 if bad else 0)
