"""Backend selection for `jpa.paged_decode`: which implementation serves a call, for which device.

Three rules make `impl="auto"` safe where it is used, i.e. inside `jax.jit`:

1. The backend is chosen for the device the computation is *compiled for* (`current_target`):
   the abstract device of an AOT compile (`jax.sharding.use_abstract_mesh`) when one is set,
   else the default device. Never `jax.devices()[0]` alone: an AOT compile for an H100 on a CPU
   host must pick the H100's kernel.
2. On a device that can execute, a kernel is trusted only after a one-time self-check per
   configuration (`self_check`): it is compiled for the EXACT shapes that will run (a kernel that
   asks for too many registers or too much shared memory fails here, not in the caller's
   compile) and run on a small random case with the same static configuration, compared with the
   reference. The check runs concretely even while the caller's jit is tracing
   (`jax.ensure_compile_time_eval`), so jitted and eager calls choose alike. It never raises.
   When the preferred kernel refuses the configuration (its `unsupported_reason`) or fails its
   self-check, `auto` tries the next kernel of AUTO_ORDER that serves the device, and only then
   the reference path; it warns once per configuration, saying which kernel was passed over, why,
   and what runs instead.
3. Under an AOT compile for a device that is not here nothing can run, so `auto` picks the first
   kernel whose `unsupported_reason` accepts the configuration for that device (and whose module's
   `aot_unsupported_reason`, when it has one, accepts compiling for it from here: Mosaic GPU
   lowers for sm_90 unless told the target, `jpa.tools.deviceless.mosaic_arch`), and says so once.

The engine passes impl="auto" through: the kernel is chosen while its jitted step is traced,
with the step's exact shapes, and the engine reads which one ran off the compiled program
(`jpa.engine.runner`). `resolve_decode_impl` gives a caller the same choice before tracing.
"""

import functools
import importlib
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpa.pallas.spec import DecodeSpec

KERNEL_MODULES = {"triton": "jpa.pallas.triton.decode", "mosaic": "jpa.pallas.mosaic.decode"}
# impl="auto" preference order, each entry with the compute capabilities it serves: [min, max).
# Mosaic GPU has WGMMA kernels for Hopper (9.x) and mma.sync kernels (`jpa.pallas.mosaic.decode_ampere`,
# `ragged_ampere`) with cp.async copies on Ampere/Ada (8.x) and TMA copies on Blackwell (10.x data
# center, 12.x RTX), for both ops; each kernel module's unsupported_reason says per op and
# configuration what it serves. Triton (deprecated by JAX; JAX warns when a Pallas Triton kernel is
# lowered, so only when it is asked for or chosen) is in the ladder only where Mosaic leaves gaps
# that it fills: Hopper, and GPUs no Mosaic kernel serves (11.x, 13.0 on). Measured over the
# deviceless tier's covering grids (90 decode and 30 ragged configurations,
# `jpa.tools.kernel_checks`; BENCHMARKS.md "Mosaic GPU on Ampere, Ada and Blackwell"): Mosaic
# serves 83 and 22 of them on A100 / A6000 / L4, 89 and 23 on B200 / RTX PRO 6000 (before 8-bit
# caches and head dims 80 / 112: 42 and 8). The rest, which Triton serves, fall to plain JAX with
# one warning: float32 q (1 decode, 7 ragged; mma.sync cannot compute it exactly) and, on 8.x only,
# 6 decode / 1 ragged page shapes cp.async cannot copy (8- or 16-token pages of head_dim 80 / 96
# rows of 8-bit, or 8-token ones of head_dim 80 at 16 bits). On H100 the WGMMA kernels refuse 24
# decode (one, an int8 pool of 2**32 elements, too large for Triton too) and 8 ragged ones beside
# float32 q (8-bit caches with pages < 32, head_dim 80 / 256 with 8-bit caches); the mma.sync kernels with TMA copies take all of them (`decode.runs_mma`), so
# Mosaic serves 89 and 23 there too, and Triton stays in Hopper's ladder for float32 q only.
AUTO_ORDER = (("mosaic", 8.0, 11.0), ("mosaic", 12.0, 13.0), ("triton", 9.0, 10.0),
              ("triton", 11.0, 12.0), ("triton", 13.0, float("inf")))
# Self-check tolerance per q dtype (max abs error vs the reference on O(1) values).
SELF_CHECK_TOL = {"float32": 2e-3, "bfloat16": 4e-2, "float16": 1e-2}
# Distinct sequences (each with its own pages) in the self-check's small pool; further sequences
# reuse their tables. The pool the real call uses (GiBs) is only ever compiled for, not allocated.
SELF_CHECK_SEQS = 3

# Compute capability by NVIDIA device kind, for abstract (AOT) targets that carry only a name.
# Word boundaries keep "A10" from matching "A100" and "L4" from matching "L40".
_KIND_CC = ((r"\bGH200\b|\bH100\b|\bH200\b|\bH800\b|\bH20\b", 9.0), (r"\bA100\b|\bA800\b|\bA30\b", 8.0),
            (r"\bA10G?\b|\bA40\b|\bRTX A\d+|\bRTX 30\d0", 8.6), (r"\bL40S?\b|\bL4\b|\bRTX 40\d0", 8.9),
            (r"\bGB200\b|\bB200\b", 10.0), (r"\bGB300\b|\bB300\b", 10.3),
            (r"\bRTX PRO \d+ Blackwell\b|\bRTX 50\d0\b", 12.0), (r"\bT4\b", 7.5),
            (r"\bV100\b", 7.0))


class Op(NamedTuple):
    """One attention operation with Pallas kernels behind it (hashable: keys the caches).

    Attributes:
      name: for messages, e.g. "paged-decode".
      modules: ((impl, module path), ...): each module has `unsupported_reason(spec,
        compute_capability)` and the kernel entry point `entry`, with the public argument order.
      entry: the kernel modules' function name.
      reference: module path and function name of the plain-JAX path ("jpa.ops.reference:paged_decode_xla").
      small_case: "module:function" mapping a spec to (args, opts), a small random case of it.
      exact_shapes: "module:function" mapping (spec, opts) to (args, array kwargs) as ShapeDtypeStructs
        of the call's real shapes.
    """
    name: str
    modules: tuple
    entry: str
    reference: str
    small_case: str
    exact_shapes: str


def _resolve(path: str):
    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


class KernelUnavailable(ValueError):
    """Raised when an explicitly requested kernel cannot serve a call."""


class Target(NamedTuple):
    """The device a computation is compiled for (hashable: it keys the self-check cache)."""
    platform: str                     # "gpu" for NVIDIA/AMD GPUs, else "cpu", "tpu", ...
    device_kind: str                  # e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: float | None  # NVIDIA GPUs only (None when unknown)
    executable: bool                  # a local device: a self-check can run on it

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.platform == "gpu" and self.device_kind.upper().startswith("NVIDIA")


def compute_capability_of(device_kind: str) -> float | None:
    """The compute capability of an NVIDIA device kind, or None when it is not known."""
    for pattern, cc in _KIND_CC:
        if re.search(pattern, device_kind, re.IGNORECASE):
            return cc
    return None


def _platform(name: str) -> str:
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def _default_device():
    dev = jax.config.jax_default_device
    if dev is None or isinstance(dev, str):
        dev = jax.devices(dev)[0] if isinstance(dev, str) else jax.devices()[0]
    return dev


def current_target() -> Target:
    """The device that the computation being traced (or run eagerly) is compiled for.

    An abstract device set by `jax.sharding.use_abstract_mesh` that differs from the local
    default device is an AOT target (it cannot run anything here); otherwise the target is the
    default device.
    """
    dev = _default_device()
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and (abstract.device_kind != dev.device_kind
                                 or _platform(abstract.platform) != _platform(dev.platform)):
        return Target(_platform(abstract.platform), abstract.device_kind,
                      compute_capability_of(abstract.device_kind), executable=False)
    cc = None
    if _platform(dev.platform) == "gpu":
        try:
            cc = float(getattr(dev, "compute_capability", None))
        except (TypeError, ValueError):
            cc = compute_capability_of(dev.device_kind)
    return Target(_platform(dev.platform), dev.device_kind, cc, executable=True)


def kernel_module(impl: str, op: Op | None = None):
    """Imports the kernel module for impl ("triton" or "mosaic") of op (default: paged decode)."""
    return importlib.import_module(dict(op.modules)[impl] if op else KERNEL_MODULES[impl])


def kernel_options(impl: str, compute_capability: float | None, op: Op | None = None) -> dict:
    """Static options a kernel entry point needs from the target: the Mosaic decode and ragged
    entries take the compute capability (they run their mma.sync kernels on 8.x, 10.x and 12.x,
    the WGMMA ones otherwise)."""
    if impl == "mosaic" and compute_capability is not None:
        return {"compute_capability": float(compute_capability)}
    return {}


def target_kernel_options(impl: str, op: Op | None = None) -> dict:
    """`kernel_options` for the device being compiled for (`current_target`)."""
    target = current_target()
    return kernel_options(impl, target.compute_capability if target.is_nvidia_gpu else None, op)


def unsupported_reason(impl: str, spec, compute_capability: float | None = None, op: Op | None = None) -> str | None:
    """Why kernel `impl` of op (default: paged decode) cannot serve `spec` on a GPU of that compute
    capability (None: it can).

    compute_capability None means "not a known GPU" (interpret mode on CPU): device-specific
    limits are then not applied.
    """
    modules = dict(op.modules) if op else KERNEL_MODULES
    if impl not in modules:
        return f"there is no {impl} kernel for this operation (only {sorted(modules)})"
    try:
        mod = kernel_module(impl, op)
    except ImportError as e:  # e.g. a JAX without the Pallas GPU backend
        return f"cannot import {modules[impl]}: {e}"
    return mod.unsupported_reason(spec, compute_capability)


def random_pools_and_options(rng, spec, num_pages: int, max_len: int):
    """Random K and V pools of `num_pages` pages in spec's cache dtype (quantized with scales when
    spec.quantized) and every option spec turns on, at values that make it matter within max_len
    tokens. Returns (k_pages, v_pages, opts) with opts' scale, soft_cap, alibi_slopes,
    sliding_window, k_scales and v_scales. Shared by every op's self-check case.

    For a stacked-pool spec (num_layers > 1) the pools hold two layers (the check reads the second,
    so a kernel that ignores the layer index fails it) and opts has the i32[] `layer`."""
    shape = (spec.num_kv_heads, num_pages, spec.page_size, spec.head_dim)
    stacked = getattr(spec, "num_layers", 1) > 1
    if stacked:
        shape = (2,) + shape
    kv = []
    for _ in range(2):
        x = rng.standard_normal(shape).astype(np.float32)
        if spec.quantized:
            from jpa.core.quant import quantize
            kv.append(quantize(jnp.asarray(x), spec.cache_dtype))
        else:
            kv.append((jnp.asarray(x, spec.cache_dtype), None))
    opts = dict(
        scale=spec.head_dim ** -0.5,
        soft_cap=30.0 if spec.soft_cap else None,
        alibi_slopes=(jnp.asarray(2.0 ** -np.arange(1, spec.num_q_heads + 1), jnp.float32)
                      if spec.alibi else None),
        sliding_window=max(1, max_len // 3) if spec.sliding_window else None,
        k_scales=kv[0][1], v_scales=kv[1][1])
    if stacked:
        opts["layer"] = jnp.int32(1)
    if getattr(spec, "sinks", False):
        # Sinks near the logits' scale, so that they move the result.
        opts["sinks"] = jnp.asarray(rng.standard_normal(spec.num_q_heads) + 1.0, jnp.float32)
    return kv[0][0], kv[1][0], opts


def self_check_inputs(spec: DecodeSpec, seed: int = 0):
    """A small random case with `spec`'s static configuration (and its num_seqs, pages_per_seq).

    The pool is small (every table points at distinct pages of `num_seqs * pages_per_seq + 1`
    pages, capped by SELF_CHECK_SEQS distinct sequences' worth), so checking a configuration whose
    real pool is many GiB never allocates it.
    """
    rng = np.random.default_rng(seed)
    num_seqs, pages_per_seq, page_size = spec.num_seqs, spec.pages_per_seq, spec.page_size
    distinct = min(num_seqs, SELF_CHECK_SEQS)
    num_pages = distinct * pages_per_seq + 1
    max_len = pages_per_seq * page_size
    q = jnp.asarray(rng.standard_normal((num_seqs, spec.num_q_heads, spec.head_dim)), spec.q_dtype)
    k, v, opts = random_pools_and_options(rng, spec, num_pages, max_len)
    pages = rng.permutation(num_pages)[: distinct * pages_per_seq].reshape(distinct, pages_per_seq)
    tables = pages[np.arange(num_seqs) % distinct]  # i32[num_seqs, pages_per_seq]
    # Full, single-token, empty and random lengths: every sequence length class the kernel branches on.
    lens = rng.integers(0, max_len + 1, size=num_seqs)
    lens[: min(num_seqs, 3)] = [max_len, 1, 0][: min(num_seqs, 3)]
    return (q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(lens, jnp.int32)), opts


def decode_shapes(spec: DecodeSpec, opts: dict):
    """ShapeDtypeStructs of a call with `spec`'s EXACT shapes (num_pages included) and its options."""
    sds = jax.ShapeDtypeStruct
    pool = pool_shape(spec)
    args = (sds((spec.num_seqs, spec.num_q_heads, spec.head_dim), spec.q_dtype),
            sds(pool, spec.cache_dtype), sds(pool, spec.cache_dtype),
            sds((spec.num_seqs, spec.pages_per_seq), jnp.int32), sds((spec.num_seqs,), jnp.int32))
    return args, option_shapes(spec, opts)


def pool_shape(spec) -> tuple:
    """The exact page-pool shape of a spec: [K, P, S_p, H], or [L, K, P, S_p, H] when stacked."""
    pool = (spec.num_kv_heads, spec.num_pages, spec.page_size, spec.head_dim)
    return ((spec.num_layers,) + pool) if spec.num_layers > 1 else pool


def option_shapes(spec, opts: dict) -> dict:
    """ShapeDtypeStructs of the array options in `opts` (alibi_slopes, scales, layer, sinks) at spec's exact shapes."""
    sds = jax.ShapeDtypeStruct
    shapes = {"alibi_slopes": sds((spec.num_q_heads,), jnp.float32), "layer": sds((), jnp.int32),
              "k_scales": sds(pool_shape(spec)[:-1], jnp.float32),
              "v_scales": sds(pool_shape(spec)[:-1], jnp.float32),
              "sinks": sds((spec.num_q_heads,), jnp.float32)}
    return {k: v for k, v in shapes.items() if opts.get(k) is not None}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


@functools.lru_cache(maxsize=None)
def self_check(impl: str, spec, target: Target, op: Op | None = None) -> str | None:
    """Checks kernel `impl` of op (default: paged decode) for `spec` on the (executable) target
    device; None when it passes.

    First compiles it for the exact shapes of `spec` (nothing is allocated), then runs it on the
    op's small case of `spec` and compares with the reference. Runs concretely even inside a jit
    trace. On failure warns once (the result is memoized per (impl, spec, target, op)).
    """
    op_desc = op or DECODE
    try:
        mod = kernel_module(impl, op)  # op None: KERNEL_MODULES, the decode kernels
        op = op_desc
        with jax.ensure_compile_time_eval():
            args, opts = _resolve(op.small_case)(spec)
            static = {k: opts[k] for k in ("scale", "soft_cap", "sliding_window")}
            fn = functools.partial(getattr(mod, op.entry), interpret=False, **static,
                                   **kernel_options(impl, target.compute_capability, op))
            shapes, arrays = _resolve(op.exact_shapes)(spec, opts)
            jax.jit(fn).lower(*shapes, **arrays).compile()  # the real shapes: resource limits
            arr = {k: v for k, v in opts.items() if k not in static}
            got = np.asarray(jax.jit(fn)(*args, **arr), np.float32)
            want = np.asarray(_resolve(op.reference)(*args, **opts), np.float32)
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        tol = SELF_CHECK_TOL.get(spec.q_dtype, 4e-2)
        reason = None if np.isfinite(got).all() and err <= tol else (
            f"result differs from the reference by {err:.3g} (tolerance {tol})")
    except Exception as e:  # compile or runtime failure on this device: fall back, never crash
        reason = _first_line(e)
    return reason


@functools.lru_cache(maxsize=None)
def _announce_fallback(skipped: tuple, chosen: str, spec, target: Target, op_name: str) -> None:
    """Warns once per configuration that `auto` passed over preferred kernels: skipped is
    ((impl, "refuses this configuration" | "failed its self-check", reason), ...) in AUTO_ORDER."""
    why = "; ".join(f"the {impl} {op_name} kernel {how}: {reason}" for impl, how, reason in skipped)
    instead = "the reference path (plain JAX)" if chosen == "xla" else f"the {chosen} kernel"
    warnings.warn(f"jpa: impl='auto' on {target.device_kind}: {why}. Using {instead} "
                  f"for {spec}.", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _announce_aot(impl: str, spec, target: Target, op_name: str = "paged-decode", skipped: tuple = ()) -> None:
    passed = "".join(f" The {i} {op_name} kernel {how}: {reason}." for i, how, reason in skipped)
    warnings.warn(f"jpa: compiling for {target.device_kind} (compute capability "
                  f"{target.compute_capability}), which is not attached: impl='auto' uses the {impl} "
                  f"{op_name} kernel, accepted by its unsupported_reason for {spec}; it cannot be "
                  f"self-checked without the device.{passed}", UserWarning, stacklevel=2)


def choose_impl(impl: str, spec, target: Target | None = None, op: Op | None = None) -> str:
    """Resolves impl ("auto", "xla", "triton", "mosaic") of op (default: paged decode) to the
    implementation that will run.

    An explicit kernel is checked only against its `unsupported_reason` (KernelUnavailable when
    it refuses); "auto" follows the module docstring's rules and falls back to "xla".
    """
    if impl == "xla":
        return "xla"
    target = current_target() if target is None else target
    cc = target.compute_capability if target.is_nvidia_gpu else None
    if impl != "auto":
        reason = unsupported_reason(impl, spec, cc, op)
        if reason is not None:
            raise KernelUnavailable(f"impl={impl!r} cannot serve this call: {reason}")
        return impl
    if cc is None:
        return "xla"
    op_name = (op or DECODE).name
    skipped = []  # preferred kernels passed over on this device, with why
    chosen = "xla"
    for name, lo, hi in AUTO_ORDER:
        if not lo <= cc < hi:
            continue
        reason = unsupported_reason(name, spec, cc, op)
        if reason is not None:
            skipped.append((name, "refuses this configuration", reason))
            continue
        if not target.executable:
            aot = getattr(kernel_module(name, op), "aot_unsupported_reason", None)
            reason = aot(cc) if aot is not None else None
            if reason is not None:
                skipped.append((name, "cannot be compiled ahead of time here", reason))
                continue
            _announce_aot(name, spec, target, op_name, tuple(skipped))
            chosen = name
            break
        reason = self_check(name, spec, target, op)
        if reason is None:
            chosen = name
            break
        skipped.append((name, "failed its self-check", reason))
    if skipped and (target.executable or chosen == "xla"):
        # (Ahead of time a chosen kernel's notice lists what was passed over: `_announce_aot`.)
        _announce_fallback(tuple(skipped), chosen, spec, target, op_name)
    return chosen


# Paged decode's kernels are looked up in KERNEL_MODULES (op=None everywhere above); this
# describes the rest of the operation for self_check.
DECODE = Op("paged-decode", (), "paged_decode", "jpa.ops.reference:paged_decode_xla",
            "jpa.ops.dispatch:self_check_inputs", "jpa.ops.dispatch:decode_shapes")
