#!/usr/bin/env python3
"""Peak host memory of models.load(PATH) for a Hugging Face checkpoint of N bytes.

Each measurement runs in a fresh process that imports jax and the loader, starts the XLA CPU
client (one tiny array), then resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`,
Linux) and records the resident set as the baseline. The child runs JAX on the CPU so that the
parameters stay in host memory: the worst case for host memory. It then loads the checkpoint, waits for every
parameter to be on the device, and reads VmHWM (peak resident set) from /proc/self/status. The
figure is (VmHWM - baseline) / N, where N is the total size of the checkpoint's *.safetensors
files. The loaded parameters alone are N bytes when the requested dtype is the stored one (on a
CPU backend they live in host memory too), so 1.0 is the floor.

    # a ~300 MB float32 llama checkpoint (needs the separate transformers env, see make_hf_golden.py)
    HF_HUB_OFFLINE=1 /tmp/hfenv/bin/python scripts/make_hf_golden.py --big 300 --out /tmp/big_llama
    .venv/bin/python benchmarks/bench_hf_load.py /tmp/big_llama --json benchmarks/hf_load.json
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

CHILD = r"""
import json, pathlib, sys, time
import jax, jax.numpy as jnp
from flax import nnx
from jpa import models
import jpa.models.hf  # noqa: F401  (imports are part of the baseline)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

jnp.zeros(8).block_until_ready()  # the XLA client is part of the baseline too
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
base = status("VmRSS")
t0 = time.perf_counter()
model, tok = models.load(sys.argv[1], dtype=jnp.dtype(sys.argv[2]))
jax.block_until_ready(nnx.state(model, nnx.Param))
seconds = time.perf_counter() - t0
params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
print(json.dumps({"baseline_rss": base, "peak_rss": status("VmHWM"), "final_rss": status("VmRSS"),
                  "param_bytes": params, "seconds": seconds}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=pathlib.Path)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = ap.parse_args(argv)
    size = sum(f.stat().st_size for f in args.checkpoint.glob("*.safetensors"))
    runs = []
    for _ in range(args.repeats):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.checkpoint), args.dtype],
                              capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if proc.returncode:
            sys.exit(f"the loading process failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    mib = 2 ** 20
    for r in runs:
        r["peak_over_baseline"] = r["peak_rss"] - r["baseline_rss"]
        r["ratio"] = r["peak_over_baseline"] / size
        print(f"N = {size / mib:.1f} MiB of safetensors; params {r['param_bytes'] / mib:.1f} MiB ({args.dtype}); "
              f"peak RSS over baseline {r['peak_over_baseline'] / mib:.1f} MiB = {r['ratio']:.3f} N; "
              f"final {(r['final_rss'] - r['baseline_rss']) / mib:.1f} MiB; {r['seconds']:.2f} s")
    worst = max(r["ratio"] for r in runs)
    print(f"worst of {len(runs)}: peak host memory {worst:.3f} x N")
    if args.json:
        from jpa.tools.bench import machine, write_json

        write_json(args.json, {"checkpoint": str(args.checkpoint), "safetensors_bytes": size,
                               "dtype": args.dtype, "runs": runs, "worst_ratio": worst, "machine": machine()})


if __name__ == "__main__":
    main()
