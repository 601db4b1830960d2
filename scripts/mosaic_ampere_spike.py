"""Spike: can Mosaic GPU kernels compile deviceless for an A100 (sm_80)? (BENCHMARKS.md has the answer.)

    python scripts/mosaic_ampere_spike.py {inferred|jpa|mma}

Run each mode in its own process: "inferred" can kill it. Mosaic infers the GPU arch from the
local device, or from the abstract device of an AOT compile, and an abstract device carries no
compute capability, so with no GPU it lowers for sm_90:

- inferred: jpa's Mosaic decode kernel for the A100 target as Mosaic infers it (sm_90 lowering,
  sm_80 LLVM target): LLVM aborts the process ("Cannot select: intrinsic %llvm.nvvm.elect.sync").
- jpa: the same with the inferred arch forced to (8, 0): Mosaic's Ampere path refuses jpa's first
  TMA copy ("copy_gmem_to_smem with a barrier is only supported Hopper and newer GPUs").
- mma: a minimal kernel written for the Ampere path (cp.async copies without a barrier,
  `wait_gmem_to_smem`, `plgpu.mma` with the MMA_LHS/RHS/ACC layouts), arch forced to (8, 0):
  compiles, with ptxas's report for sm_80.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jpa.tools import deviceless  # noqa: E402

deviceless.configure_environment()  # XLA's logging, before XLA starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402


def jpa_spike_mma(a_ref, b_ref, o_ref):
    """o = a @ b for one [64, 64] bf16 tile pair: cp.async to SMEM, Ampere MMA from registers."""
    def scoped(a_smem, b_smem):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.copy_gmem_to_smem(b_ref, b_smem, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.wait_gmem_to_smem(0)
        a = plgpu.load(a_smem, layout=plgpu.Layout.MMA_LHS(jnp.bfloat16))
        b = plgpu.load(b_smem, layout=plgpu.Layout.MMA_RHS(jnp.bfloat16))
        acc = plgpu.layout_cast(jnp.zeros((64, 64), jnp.float32), plgpu.Layout.MMA_ACC(jnp.bfloat16))
        o_ref[...] = plgpu.mma(acc, a, b)
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(scoped, plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiles),
                  plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tiles))


def main(mode: str) -> int:
    if mode not in ("inferred", "jpa", "mma"):
        print(f"mode must be inferred, jpa or mma; got {mode!r}", file=sys.stderr)
        return 2
    if mode != "inferred":
        mgpu_utils._infer_arch = lambda: (8, 0)  # private: the only override there is (JAX 0.12)
    compiler = deviceless.Compiler("a100")
    sds = jax.ShapeDtypeStruct
    if mode == "mma":
        fn = lambda a, b: plgpu.kernel(  # noqa: E731
            jpa_spike_mma, out_type=sds((64, 64), jnp.float32),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))(a, b)
        rec = compiler.compile("mosaic mma sm_80", fn, (sds((64, 64), jnp.bfloat16),) * 2)
    else:
        from jpa.pallas.mosaic import decode as mosaic_decode
        from jpa.tools.kernel_checks import KernelConfig, kernel_call
        cfg = KernelConfig("mosaic", head_dim=64, num_kv_heads=3, q_per_kv=3)
        _, args, kwargs, pools = kernel_call(cfg)
        fn = lambda *a, **k: mosaic_decode.paged_decode(*a, scale=0.125, **k)  # noqa: E731
        rec = compiler.compile(f"jpa mosaic decode sm_80 ({mode})", fn, args, kwargs=kwargs, pool_shapes=pools)
    print(deviceless.record_line(rec))
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mma"))
