"""Quantized KV caches: int8, float8_e4m3fn and float8_e5m2 with one f32 scale per token and head.

A cache value x is stored as round(x / scale) (int8) or (x / scale) cast to float8, where
scale = max(|x| over head_dim) / dtype_max, so every stored value is in range and
dequantization is `stored.astype(f32) * scale`.
"""

import jax.numpy as jnp
import numpy as np

# Largest finite magnitude each storage dtype holds; the scale maps amax onto it.
QUANT_MAX = {
    np.dtype(jnp.int8): 127.0,
    np.dtype(jnp.float8_e4m3fn): 448.0,
    np.dtype(jnp.float8_e5m2): 57344.0,
}
FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def is_quantized(dtype) -> bool:
    """True for the cache dtypes that carry per-token scales."""
    return np.dtype(dtype) in QUANT_MAX


def quantize(x, dtype):
    """Quantizes along the last axis (head_dim).

    Args:
      x: float array [..., head_dim].
      dtype: int8, float8_e4m3fn or float8_e5m2.

    Returns:
      (values [..., head_dim] in dtype, scales f32[...]).
    """
    dtype = np.dtype(dtype)
    qmax = QUANT_MAX[dtype]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [...]
    # An all-zero vector gets scale 1 (not 0) so dequantization never divides by or multiplies 0/0.
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    y = x / scale[..., None]
    if dtype == np.dtype(jnp.int8):
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    else:
        y = jnp.clip(y, -qmax, qmax)
    return y.astype(dtype), scale


def dequantize(values, scales):
    """values [..., head_dim] (any cache dtype), scales f32[...] -> f32[..., head_dim]."""
    return values.astype(jnp.float32) * scales[..., None]


# ---------------------------------------------------------------------------------------------
# Weight-only quantization (issue 35): a linear weight W [..., in, out] is stored as
# q = round(W / scale) (int8) or W / scale cast to float8_e4m3fn, with one f32 scale per output
# channel (scale = max |W| over `in` / dtype_max), so W ~= q * scale. The matmul then reads q:
#     x @ W  ~=  (x @ q.astype(compute_dtype)) * scale            (scale: [out], after the dot)
# The scale factors out of the sum over `in`, so the dot reads the stored dtype and XLA may fuse the
# convert into the gemm's operand (no dense float copy of W). An embedding table [vocab, d_model]
# is quantized per row (reduce over d_model): a row lookup is q[t] * scale[t], and the tied head
# h @ E.T is (h @ q.T) * scale[vocab] (per output channel of the head).

WEIGHT_QUANTIZATIONS = {"int8": np.dtype(jnp.int8), "fp8": np.dtype(jnp.float8_e4m3fn)}


def check_weight_quantization(quantization):
    """None or a key of WEIGHT_QUANTIZATIONS; ValueError (one line, naming the choices) otherwise."""
    if quantization is not None and quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {sorted(WEIGHT_QUANTIZATIONS)} or None; got "
                         f"{quantization!r}")
    return quantization


def quantize_weight(w, quantization: str, axis: int = -2):
    """Quantizes a float weight with one scale per slice along every axis but `axis`.

    Works on NumPy arrays (host-side, at load: no float copy on the device) and on jax arrays
    (traced or not), returning the same kind.

    Args:
      w: float [..., in, out] (axis=-2: a scale per output channel) or [vocab, d_model]
        (axis=-1: a scale per row).
      quantization: "int8" or "fp8" (float8_e4m3fn).
      axis: the axis the scale is shared along (reduced by the amax).

    Returns:
      (q: w's shape in the storage dtype, scale: f32, w's shape without `axis`).
    """
    dtype = WEIGHT_QUANTIZATIONS[check_weight_quantization(quantization)]
    xp = np if isinstance(w, np.ndarray) else jnp
    qmax = QUANT_MAX[dtype]
    w = w.astype(np.float32)
    amax = xp.max(xp.abs(w), axis=axis)
    # An all-zero channel gets scale 1, so its dequantized values are exact zeros (never 0/0).
    scale = xp.where(amax > 0, amax / np.float32(qmax), np.float32(1.0)).astype(np.float32)
    y = w / xp.expand_dims(scale, axis)
    y = xp.clip(xp.round(y), -qmax, qmax) if dtype == np.dtype(jnp.int8) else xp.clip(y, -qmax, qmax)
    return y.astype(dtype), scale


def dequantize_weight(q, scale, axis: int = -2):
    """The float32 weight q * scale (scale broadcast along `axis`), as quantize_weight stored it."""
    xp = np if isinstance(q, np.ndarray) else jnp
    return q.astype(np.float32) * xp.expand_dims(scale, axis)
