"""x @ W for one layer of a stacked quantized weight (issue 35): the Mosaic GPU dequantizing matmul
(`jpa.pallas.mosaic.qmatmul`) where it serves the device the step is compiled for, else plain JAX
(the layer's blocks dequantized, or its 8-bit values widened, where the dot reads them). Packed
weights (`packed_matmul`: the 4-bit Q4_0 / Q4_1 forms and GGUF Q4_K with its super-block scales; 8-bit
codes with group scales: GGUF Q8_0, Q5_K, Q6_K, block-wise FP8) and int8 / fp8 ones with per-channel
scales (`scaled_matmul`).

`kernel_serves(...)` says, before tracing a layer scan, whether the kernel takes such a weight
here; `models.gpt` then keeps those weights stacked through the scan (no per-layer slice copy) and
calls `packed_matmul` with the layer index. The environment variable JPA_QMATMUL=0 turns the
kernel off (every packed weight then takes the plain-JAX path, which writes a dense copy of each
weight per step on a GPU: the "before" of BENCHMARKS.md's issue-35 table). JPA_QMATMUL=interpret runs
the kernel in GPU interpret mode wherever its shape rules take a weight, whatever the device (on this
CPU: what the tests use to run a whole model through the kernel's code path, tensor-parallel included);
the rules are an H100's (float8 codes served).

`unsupported_reason(...)` / `scaled_unsupported_reason(...)` say why the kernel does not take a weight
(None: it does); `kernel_serves` / `scaled_kernel_serves` are those being None.

On a CPU, a few rows of a Q4_1 weight (`jpa.ops.cpu_qmatmul.MAX_ROWS`) take a C++ loop over the blocks
instead (an XLA FFI custom call, the layer read from the stack in place): `unsupported_reason` is None
there too, and `packed_matmul` calls it; everything else keeps XLA's dequantize-then-dot.
"""

import os

import jax.numpy as jnp
import numpy as np

from jpa.core.quant import dequantize_blocks
from jpa.ops.dispatch import current_target


INTERPRET_CC = 9.0  # the compute capability whose rules JPA_QMATMUL=interpret applies (an H100's)


def _interpret() -> bool:
    """Whether JPA_QMATMUL=interpret asks for the kernel in GPU interpret mode (module docstring)."""
    return os.environ.get("JPA_QMATMUL", "1") == "interpret"


def _target_why():
    """(compute capability, None) of the NVIDIA GPU being compiled for when the Mosaic kernels serve it
    (8.x-10.x, Mosaic lowering for it), else (None, why not); under JPA_QMATMUL=interpret
    (INTERPRET_CC, None); under JPA_QMATMUL=0 (None, why)."""
    from jpa.pallas.mosaic import decode as mosaic_decode

    if os.environ.get("JPA_QMATMUL", "1") == "0":
        return None, "JPA_QMATMUL=0 turns the Mosaic dequantizing matmul off"
    if _interpret():
        return INTERPRET_CC, None
    target = current_target()
    cc = target.compute_capability
    if not target.is_nvidia_gpu or cc is None or not 8.0 <= cc < 11.0:
        return None, (f"the target ({target.platform}: {target.device_kind}) is not an NVIDIA GPU of compute "
                      f"capability 8.x-10.x, which the Mosaic dequantizing matmul serves")
    if not target.executable:
        why = mosaic_decode.aot_unsupported_reason(cc)
        if why is not None:
            return None, why
    return cc, None


def _target_cc():
    """The compute capability of `_target_why` (None where the kernels do not serve)."""
    return _target_why()[0]


def _call_options() -> dict:
    """The kernel's static options for the target: interpret mode (cp.async stand-ins) or its copies."""
    from jpa.pallas.mosaic import qmatmul as kernel

    if _interpret():
        return dict(interpret=True, tma=False)
    return dict(tma=kernel.uses_tma(_target_cc()))


def _fp8_why(codes_dtype, cc) -> str | None:
    # float8 -> bf16 needs sm_89's cvt; on sm_100 ptxas rejected the kernel's float8 conversion in the
    # deviceless compile (int8 and 4-bit compile there), so float8 stays on XLA's path off Ada / Hopper.
    if np.dtype(codes_dtype) not in (np.dtype(np.int8), np.dtype(np.uint8)) and not 8.9 <= cc < 10.0:
        return f"{np.dtype(codes_dtype)} codes: the kernel converts float8 on sm_89 / sm_90 only (target {cc})"
    return None


def scaled_unsupported_reason(m: int, k: int, n: int, codes_dtype, compute_dtype) -> str | None:
    """Why `scaled_matmul` does not run the Mosaic kernel for an [m, k] x [k, n] product here, or None (int8 on
    sm_80-sm_10x, float8_e4m3fn on sm_89 / sm_90: Ampere has no float8 conversion)."""
    from jpa.pallas.mosaic import qmatmul as kernel

    cc, why = _target_why()
    if cc is None:
        return why
    return _fp8_why(codes_dtype, cc) or kernel.unsupported_reason_scaled(m, k, n, codes_dtype, compute_dtype)


def scaled_kernel_serves(m: int, k: int, n: int, codes_dtype, compute_dtype) -> bool:
    """Whether `scaled_matmul` runs the Mosaic kernel (int8 on sm_80-sm_10x, float8_e4m3fn on sm_89 /
    sm_90: Ampere has no float8 conversion) for an [m, k] x [k, n] product here."""
    return scaled_unsupported_reason(m, k, n, codes_dtype, compute_dtype) is None


def scaled_matmul(x, q, scale, *, layer=None, compute_dtype):
    """(x [M, K] @ q) * scale for an 8-bit weight with per-output-channel scales (q [L, K, N] with
    `layer`, or [K, N]; scale f32[L, N] / [N]) -> f32[M, N]: the Mosaic kernel when
    `scaled_kernel_serves`, else q widened to compute_dtype where the dot reads it, then the scale."""
    from jpa.pallas.mosaic import qmatmul as kernel

    mm, k = x.shape
    if scaled_kernel_serves(mm, k, q.shape[-1], q.dtype, compute_dtype):
        return kernel.qmatmul_scaled(x.astype(compute_dtype), q, scale, layer=0 if layer is None else layer,
                                     **_call_options())
    if layer is not None:
        q, scale = jnp.take(q, layer, axis=0), jnp.take(scale, layer, axis=0)
    y = jnp.dot(x.astype(compute_dtype), q.astype(compute_dtype), preferred_element_type=jnp.float32)
    return y * scale


def unsupported_reason(m: int, k: int, n: int, group: int, codes_dtype, compute_dtype, *, d2=None,
                       sub_dtypes=None) -> str | None:
    """Why `packed_matmul` does not run the Mosaic GPU kernel for an [m, k] x [k, n] product of a packed weight
    with groups of `group` values on the device being compiled for, or None (`kernel_serves`)."""
    from jpa.pallas.mosaic import qmatmul as kernel

    cc, why = _target_why()
    if cc is None:
        return None if _cpu_why(m, k, group, codes_dtype, compute_dtype, d2, sub_dtypes) is True else why
    if np.dtype(codes_dtype) != np.uint8:  # 8-bit codes with group scales
        sub = sub_dtypes if d2 is not None else None
        return _fp8_why(codes_dtype, cc) or kernel.unsupported_reason_grouped(m, k, n, group, codes_dtype,
                                                                               compute_dtype, sub)
    if d2 is not None:
        if sub_dtypes is None or sub_dtypes[1] is None:
            return "a 4-bit K-quant without sub-block minimums: the kernel takes Q4_K's form"
        why = kernel.sub_scales_unsupported(*sub_dtypes)
        if why is not None:
            return why
    return kernel.unsupported_reason(m, k, n, group, codes_dtype, compute_dtype)


def _cpu_why(m, k, group, codes_dtype, compute_dtype, d2, sub_dtypes):
    """On a CPU (not under JPA_QMATMUL=0): True where the C++ block loop serves (`jpa.ops.cpu_qmatmul`),
    else why not; None off a CPU."""
    from jpa.ops import cpu_qmatmul

    target = current_target()
    if target.platform != "cpu" or not target.executable or os.environ.get("JPA_QMATMUL", "1") == "0":
        return None
    d_dtype, m_dtype = sub_dtypes if sub_dtypes is not None else (None, None)
    why = cpu_qmatmul.unsupported_reason(m, k, group, codes_dtype, d_dtype, m_dtype is not None, compute_dtype,
                                         k_quant=d2 is not None)
    return True if why is None else why


def _on_cpu() -> bool:
    """Whether the product is compiled for this CPU (where `unsupported_reason` None means the C++ loop)."""
    return current_target().platform == "cpu" and _target_why()[0] is None


def mosaic_serves_target() -> bool:
    """Whether the Mosaic GPU kernels serve the device being compiled for (or JPA_QMATMUL=interpret): a None of
    `unsupported_reason` there means the Mosaic matmul, not the CPU loop."""
    return _target_why()[0] is not None


def kernel_serves(m: int, k: int, n: int, group: int, codes_dtype, compute_dtype, *, d2=None,
                  sub_dtypes=None) -> bool:
    """Whether `packed_matmul` runs the Mosaic GPU kernel for an [m, k] x [k, n] product of a
    packed weight with groups of `group` values on the device being compiled for: an NVIDIA GPU of
    compute capability 8.x-10.x whose Mosaic lowering targets it (`jpa.pallas.mosaic.decode.
    aot_unsupported_reason`). d2: a K-quant's super-block scales (or anything not None for one), with
    sub_dtypes (sub-block scale dtype, minimum dtype or None) its sub-block scales' and minimums' dtypes:
    4-bit codes (uint8) take Q4_K's form (uint8 scales and minimums); 8-bit codes (int8: GGUF Q8_0 and,
    as jpa keeps them, Q5_K / Q6_K; float8_e4m3fn: block-wise FP8, on sm_89 / sm_90 only, as
    `scaled_kernel_serves`) take group scales, and a K-quant's int8 / uint8 sub-block scales. On a CPU: whether
    the C++ loop over Q4_1 blocks serves instead (`jpa.ops.cpu_qmatmul.unsupported_reason`)."""
    return unsupported_reason(m, k, n, group, codes_dtype, compute_dtype, d2=d2, sub_dtypes=sub_dtypes) is None


def packed_matmul(x, codes, d, m=None, d2=None, m2=None, *, layer, compute_dtype):
    """x [M, K] @ W (layer `layer` of codes u8[L, K / 2, N], d / m [L, K / G, N]: jpa.core.quant's
    Q4_0 / Q4_1 forms; with d2 / m2 [L, K / 256, N], the Q4_K form: d / m the integer sub-block scales
    and minimums, d2 / m2 the f16 super-block ones; or 8-bit codes int8 / float8_e4m3fn [L, K, N], the
    Q8_0 form: GGUF Q8_0, Q5_K and Q6_K (d2 / m2 as Q4_K's; Q6_K without minimums), block-wise FP8)
    -> f32[M, N]. layer None: codes [K(/ 2), N] and its scales are one weight (a model's head). The
    Mosaic GPU kernel when `kernel_serves`, else W dequantized in compute_dtype (one layer's slice,
    read inside the dequantizing fusion) and a dot."""
    from jpa.pallas.mosaic import qmatmul as kernel

    mm, k = x.shape
    n = codes.shape[-1]
    group = k // d.shape[-2]
    sub = (d.dtype, None if m is None else m.dtype)
    if kernel_serves(mm, k, n, group, codes.dtype, compute_dtype, d2=d2, sub_dtypes=sub):
        if _on_cpu():   # the C++ loop over the blocks (jpa.ops.cpu_qmatmul), layer `layer` read in place
            from jpa.ops.cpu_qmatmul import q4_1_matmul

            return q4_1_matmul(x, codes, d, m, layer)
        call = kernel.qmatmul if codes.dtype == jnp.uint8 else kernel.qmatmul_grouped
        return call(x.astype(compute_dtype), codes, d, m, d2, m2, layer=0 if layer is None else layer,
                    **_call_options())
    take = lambda a: a if a is None or layer is None else jnp.take(a, layer, axis=0)
    w = dequantize_blocks(take(codes), take(d), take(m), -2, compute_dtype, take(d2), take(m2))
    return jnp.dot(x.astype(compute_dtype), w, preferred_element_type=jnp.float32)


def reference(x, codes, d, m=None, layer=0, d2=None, m2=None):
    """NumPy: x @ W with W dequantized in f32 (`dequantize_blocks`), f32[M, N]."""
    codes, d = np.asarray(codes), np.asarray(d)
    m, d2, m2 = (None if a is None else np.asarray(a) for a in (m, d2, m2))
    if codes.ndim == 3:
        codes, d = codes[layer], d[layer]
        m, d2, m2 = (None if a is None else a[layer] for a in (m, d2, m2))
    w = dequantize_blocks(codes, d, m, -2, np.float32, d2, m2)
    return np.asarray(x, np.float32) @ w
