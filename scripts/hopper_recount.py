"""Recount of the covering grids (90 decode + 30 ragged configurations) for one compute capability,
no compile: which `dispatch.unsupported_reason` says Mosaic serves (and how many on the mma.sync route),
which only Triton serves. python scripts/hopper_recount.py [cc, default 9.0]"""
import sys, json
from jpa.tools import kernel_checks as kc
from jpa.ops import dispatch, ragged
from jpa.pallas.mosaic import decode as md, ragged as mr
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)
cc = float(sys.argv[1]) if len(sys.argv) > 1 else 9.0
dec = kc.covering_grid("mosaic", "full")
out = {"decode": {}, "ragged": {}}
def row(kind, name, mosaic, triton, mma):
    out[kind][name] = dict(mosaic=mosaic is None, triton=triton is None, mma=mma, reason=mosaic)
for cfg in dec:
    s = cfg.spec()
    row("decode", cfg.name, dispatch.unsupported_reason("mosaic", s, cc), dispatch.unsupported_reason("triton", s, cc),
        md.runs_mma(s, cc))
for cfg in kc.ragged_grid("full"):
    spec = kc.ragged_call("mosaic", *cfg)[0]
    row("ragged", str(cfg), ragged.unsupported_reason("mosaic", spec, cc), ragged.unsupported_reason("triton", spec, cc),
        mr.runs_mma(spec, cc))
for k, d in out.items():
    n = len(d); m = sum(v["mosaic"] for v in d.values()); mma = sum(v["mma"] and v["mosaic"] for v in d.values())
    only_t = [name for name, v in d.items() if v["triton"] and not v["mosaic"]]
    neither = [name for name, v in d.items() if not v["triton"] and not v["mosaic"]]
    print(f"{k}: {n} configs, Mosaic serves {m} (mma path {mma}), only Triton {len(only_t)}, neither {len(neither)}")
    for name in only_t: print("   only triton:", name, "|", d[name]["reason"][:150])

