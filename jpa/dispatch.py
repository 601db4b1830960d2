"""Backend selection for `jpa.paged_decode`, with a one-time on-device self-check per kernel config.

A Pallas GPU kernel cannot be executed on the machines jpa is developed on, so `impl="auto"`
never trusts one blindly: the first time a configuration (DecodeSpec) is used on a GPU, the
kernel is compiled and run on a small random case and compared with the reference path. If it
fails to compile, or disagrees, jpa warns once with the reason and uses the reference path.
"""

import functools
import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jpa.pallas.spec import DecodeSpec

KERNEL_MODULES = {"triton": "jpa.pallas.triton_decode", "mosaic": "jpa.pallas.mosaic_decode"}
# Minimum compute capability per kernel, in preference order for impl="auto".
AUTO_ORDER = (("mosaic", 9.0), ("triton", 8.0))
# Self-check tolerance per q dtype (max abs error vs the reference on O(1) values).
SELF_CHECK_TOL = {"float32": 2e-3, "bfloat16": 4e-2, "float16": 1e-2}


class KernelUnavailable(ValueError):
    """Raised when an explicitly requested kernel cannot serve a call."""


def kernel_module(impl: str):
    """Imports the kernel module for impl ("triton" or "mosaic")."""
    return importlib.import_module(KERNEL_MODULES[impl])


def gpu_compute_capability() -> float | None:
    """Compute capability of the default device when it is an NVIDIA GPU, else None."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return None
    cc = getattr(dev, "compute_capability", None)
    try:
        return float(cc)
    except (TypeError, ValueError):
        return None


def unsupported_reason(impl: str, spec: DecodeSpec) -> str | None:
    try:
        mod = kernel_module(impl)
    except ImportError as e:  # e.g. a JAX without the Pallas GPU backend
        return f"cannot import {KERNEL_MODULES[impl]}: {e}"
    return mod.unsupported_reason(spec)


def self_check_inputs(spec: DecodeSpec, seed: int = 0, num_seqs: int = 3):
    """A small random paged-decode case of the given configuration (host numpy -> device)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = spec.pages_per_seq
    num_pages = num_seqs * pages_per_seq + 1
    max_len = pages_per_seq * spec.page_size
    cache_shape = (spec.num_kv_heads, num_pages, spec.page_size, spec.head_dim)
    q = jnp.asarray(rng.standard_normal((num_seqs, spec.num_q_heads, spec.head_dim)), spec.q_dtype)
    kv = []
    for _ in range(2):
        x = rng.standard_normal(cache_shape).astype(np.float32)
        if spec.quantized:
            from jpa.quant import quantize
            vals, scales = quantize(jnp.asarray(x), spec.cache_dtype)
            kv.append((vals, scales))
        else:
            kv.append((jnp.asarray(x, spec.cache_dtype), None))
    tables = rng.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    lens = np.array([max_len, 1, rng.integers(1, max_len + 1)][:num_seqs], np.int32)
    opts = dict(
        scale=spec.head_dim ** -0.5,
        soft_cap=30.0 if spec.soft_cap else None,
        alibi_slopes=(jnp.asarray(2.0 ** -np.arange(1, spec.num_q_heads + 1), jnp.float32)
                      if spec.alibi else None),
        sliding_window=max(1, max_len // 3) if spec.sliding_window else None,
        k_scales=kv[0][1], v_scales=kv[1][1])
    return (q, kv[0][0], kv[1][0], jnp.asarray(tables, jnp.int32), jnp.asarray(lens)), opts


@functools.lru_cache(maxsize=None)
def self_check(impl: str, spec: DecodeSpec) -> str | None:
    """Runs kernel `impl` once on a random case of `spec` on the default device.

    Returns None when it compiles and agrees with the reference, else the reason (and warns once:
    the result is memoized per (impl, spec) for the life of the process).
    """
    from jpa.reference import paged_decode_xla
    args, opts = self_check_inputs(spec)
    try:
        got = np.asarray(jax.jit(functools.partial(kernel_module(impl).paged_decode, interpret=False,
                                                   **opts))(*args), np.float32)
        want = np.asarray(paged_decode_xla(*args, **opts), np.float32)
        err = float(np.max(np.abs(got - want)))
        tol = SELF_CHECK_TOL.get(spec.q_dtype, 4e-2)
        reason = None if np.isfinite(got).all() and err <= tol else (
            f"result differs from the reference by {err:.3g} (tolerance {tol})")
    except Exception as e:  # compile or runtime failure on this device: fall back, never crash
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if reason is not None:
        warnings.warn(f"jpa: the {impl} paged-decode kernel failed its self-check on "
                      f"{jax.devices()[0].device_kind} for {spec}; using the reference path. "
                      f"Reason: {reason}", RuntimeWarning, stacklevel=3)
    return reason


def choose_impl(impl: str, spec: DecodeSpec) -> str:
    """Resolves impl ("auto", "xla", "triton", "mosaic") to the implementation that will run."""
    if impl == "xla":
        return "xla"
    if impl != "auto":
        reason = unsupported_reason(impl, spec)
        if reason is not None:
            raise KernelUnavailable(f"impl={impl!r} cannot serve this call: {reason}")
        return impl
    cc = gpu_compute_capability()
    if cc is None:
        return "xla"
    for name, min_cc in AUTO_ORDER:
        if cc >= min_cc and unsupported_reason(name, spec) is None and self_check(name, spec) is None:
            return name
    return "xla"
