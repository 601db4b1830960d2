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
