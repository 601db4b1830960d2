"""Deviceless compile of the decode kernels with attention sinks, next to their no-sink twins (the
covering grid's sinks configurations): python scripts/sinks_compile_check.py {h100,a100} {mosaic,triton}
(one target per process). Prints each record's kernels: registers, spills."""
import os, sys, json
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import dataclasses
from jpa.tools.kernel_checks import KernelConfig, check_kernels, covering_grid
import jpa.tools.kernel_checks as kc
target, impl = sys.argv[1], sys.argv[2]
grid = [c for c in covering_grid(impl) if c.sinks]
grid = [dataclasses.replace(c, sinks=False) for c in grid] + grid  # twins first: registers of each
kc.covering_grid = lambda impl, subset="full": grid
comp = deviceless.Compiler(target)
cc = deviceless.compute_capability(target)
recs = check_kernels(comp, [impl], "full")
bad = [r for r in recs if not r["ok"]]
for r in recs:
    print(r["name"], {k: v for k, v in r.items() if k in ("kernels", "spills", "problems", "ok")})
print("DECODE", "FAILED" if bad else "ALL OK", len(recs))
# The ragged op with sinks (its tile kernel and the decode kernel of the last rows), next to its twin.
sink_cfgs = [c for c in kc.RAGGED_CONFIGS if c[5:] and c[5]]
kc.ragged_grid = lambda subset="full": [c[:5] for c in sink_cfgs] + sink_cfgs
rrecs = kc.check_ragged(comp, [impl])
for r in rrecs:
    print(r["name"], {k: v for k, v in r.items() if k in ("kernels", "refused", "problems", "ok")})
print("RAGGED", "FAILED" if any(not r["ok"] for r in rrecs) else "ALL OK", len(rrecs))
