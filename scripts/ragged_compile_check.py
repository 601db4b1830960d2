"""Deviceless full compile of the ragged Triton kernel for H100 and A100 (design.md's recipe).

Needs the `gpu` extra (jax[cuda12] compile-only packages); no GPU. For each configuration, XLA's
whole GPU pipeline runs (Triton included: a kernel over the shared-memory limit fails here as on
the device) and the kernel's launch (grid, threads, shared memory) is read from the thunk dump.

    python scripts/ragged_compile_check.py [--gpu H100|A100|all]

The lead's scripts/gpu_compile_check.py is the project-wide tier; this script covers the ragged
kernel until it is plugged in there.
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# GpuTargetConfigProto fields from design.md ("Target configs").
GPUS = {
    "H100": ("NVIDIA H100 80GB HBM3", 9, 132, 232448, 233472, 128, 3352320000000, 52428800, 1.98,
             84929347584),
    "A100": ("NVIDIA A100-SXM4-80GB", 8, 108, 166912, 167936, 64, 2039040000000, 41943040, 1.41,
             85100068864),
}
# (q dtype, cache dtype, q_per_kv, head_dim, page_size): the serving-size shapes below with each.
CONFIGS = [("bfloat16", "bfloat16", 4, 128, 16), ("bfloat16", "bfloat16", 1, 256, 16),
           ("float16", "int8", 3, 64, 32), ("float32", "float32", 8, 128, 16),
           ("bfloat16", "float8_e5m2", 8, 80, 128)]
NUM_TOKENS, MAX_NUM_SEQS, NUM_KV_HEADS, NUM_PAGES, PAGES_PER_SEQ = 512, 64, 8, 4096, 256


def target_config(gpu):
    name, major, cores, optin, per_core, fpus, bw, l2, clock, mem = GPUS[gpu]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {per_core} threads_per_core_limit: 2048 core_count: {cores}
  fpus_per_core: {fpus} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bw} l2_cache_size: {l2} clock_rate_ghz: {clock}
  device_memory_size: {mem} shared_memory_per_block_optin: {optin}
  cuda_compute_capability {{ major: {major} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""


def compile_one(gpu, q_dtype, cache_dtype, q_per_kv, head_dim, page_size):
    """Runs in a child process (XLA_FLAGS, read once per process, names the dump folder)."""
    import warnings

    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, SingleDeviceSharding

    import jpa
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    dev = topologies.get_topology_desc("x", "cuda", target_config=target_config(gpu),
                                       topology="1x1x1").devices[0]
    sh = SingleDeviceSharding(dev)
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind=dev.device_kind, num_cores=GPUS[gpu][2], platform="cuda"))
    quantized = cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    k, n = NUM_KV_HEADS, NUM_KV_HEADS * q_per_kv
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    pool = s((k, NUM_PAGES, page_size, head_dim), cache_dtype)
    args = [s((NUM_TOKENS, n, head_dim), q_dtype), pool, pool,
            s((MAX_NUM_SEQS, PAGES_PER_SEQ), jnp.int32), s((MAX_NUM_SEQS,), jnp.int32),
            s((MAX_NUM_SEQS + 1,), jnp.int32), s((), jnp.int32)]
    if quantized:
        args += [s((k, NUM_PAGES, page_size), jnp.float32)] * 2

    def step(q, k_pages, v_pages, tables, lens, cu, num_seqs, *scales):
        return jpa.ragged_paged_attention(
            q, k_pages, v_pages, tables, lens, cu, num_seqs, soft_cap=30.0, sliding_window=1024,
            k_scales=scales[0] if quantized else None, v_scales=scales[1] if quantized else None,
            impl="triton")

    with jax.sharding.use_abstract_mesh(mesh):
        compiled = jax.jit(step).lower(*args).compile()
    print(f"temp_bytes={compiled.memory_analysis().temp_size_in_bytes}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="all", choices=["all", *GPUS])
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        gpu, qd, cd, g, h, ps = a.child
        compile_one(gpu, qd, cd, int(g), int(h), int(ps))
        return
    failed = 0
    for gpu in GPUS if a.gpu == "all" else [a.gpu]:
        for cfg in CONFIGS:
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={d}")
                r = subprocess.run([sys.executable, __file__, "--child", gpu, *map(str, cfg)],
                                   env=env, capture_output=True, text=True)
                launch = sorted({line.split("]", 1)[1].strip()
                                 for f in glob.glob(f"{d}/*thunk_sequence*") for line in open(f)
                                 if "jpa_ragged" in line or "jpa_paged_decode" in line})
            label = f"{gpu} q={cfg[0]} cache={cfg[1]} q_per_kv={cfg[2]} head_dim={cfg[3]} page={cfg[4]}"
            if r.returncode:
                failed += 1
                err = [x for x in r.stderr.splitlines() if "Error" in x or "error" in x]
                print(f"FAIL {label}: {(err or r.stderr.splitlines() or ['?'])[-1][:300]}")
            else:
                temp = r.stdout.strip().splitlines()[-1]
                print(f"ok   {label}: {'; '.join(launch)} ({temp})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
