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


# ---------------------------------------------------------------------------------------------
# GGUF block formats kept packed (issue 35): llama.cpp's Q8_0, Q4_0 and Q4_1 quantize a row in
# blocks of 32 values along the matmul's contraction axis, each block with an f16 scale d (and, for
# Q4_1, an f16 minimum m):  Q8_0: w = q * d (q int8);  Q4_0: w = (q - 8) * d;  Q4_1: w = q * d + m
# (q a 4-bit code, two per byte: byte j of a block holds value j in its low nibble and value j + 16
# in its high one, GGML's order). jpa keeps the codes as they are stored (int8, or uint8 bytes of
# two nibbles) with the block axis where the matmul contracts, and dequantizes inside the matmul.

GGUF_BLOCK = 32
# format -> (bytes per block of 32 values, stored code dtype, has a minimum)
PACKED_FORMATS = {"Q8_0": (34, np.dtype(np.int8), False), "Q4_0": (18, np.dtype(np.uint8), False),
                  "Q4_1": (20, np.dtype(np.uint8), True)}


def packed_format(codes, minimum) -> str:
    """The block format of stored codes: int8 -> Q8_0, uint8 with a minimum -> Q4_1, else Q4_0."""
    if np.dtype(codes.dtype) == np.int8:
        return "Q8_0"
    return "Q4_1" if minimum is not None else "Q4_0"


def unpack_gguf_rows(data: np.ndarray, fmt: str, rows: int, cols: int, name: str = "tensor"):
    """Splits GGUF block bytes into codes and per-block scales, blocks along the last axis.

    Args:
      data: uint8 [rows, cols / 32 * bytes_per_block] as gguf.GGUFReader gives a tensor's data.
      fmt: "Q8_0", "Q4_0" or "Q4_1".
      rows, cols: the tensor's shape in NumPy order (GGUF's ne reversed): cols is the contiguous axis.
      name: the tensor's name for errors.

    Returns:
      (codes: int8 [rows, cols] (Q8_0) or uint8 [rows, cols / 2] (Q4: block b's byte j at b * 16 + j),
       d: f16 [rows, cols / 32], m: f16 [rows, cols / 32] or None).

    Raises:
      ValueError: an unsupported format, or data whose size does not match (a corrupt tensor).
    """
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"tensor {name} has type {fmt}; jpa keeps {sorted(PACKED_FORMATS)} packed (other types "
                         f"are dequantized at load)")
    nbytes, _, has_min = PACKED_FORMATS[fmt]
    if cols % GGUF_BLOCK:
        raise ValueError(f"tensor {name} ({fmt}) has {cols} columns, not a multiple of {GGUF_BLOCK}: corrupt")
    nb = cols // GGUF_BLOCK
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.size != rows * nb * nbytes:
        raise ValueError(f"tensor {name} ({fmt}) holds {data.size} bytes of {data.dtype}; a [{rows}, {cols}] "
                         f"{fmt} tensor has {rows * nb * nbytes} uint8: truncated or corrupt")
    blocks = data.reshape(rows, nb, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [rows, nb]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if has_min else None
    start = 4 if has_min else 2
    if fmt == "Q8_0":
        codes = blocks[..., start:].copy().view(np.int8).reshape(rows, cols)
    else:
        codes = blocks[..., start:].reshape(rows, cols // 2).copy()
    if not (np.isfinite(d).all() and (m is None or np.isfinite(m).all())):
        raise ValueError(f"tensor {name} ({fmt}) has non-finite block scales: corrupt")
    return codes, d, m


def dequantize_blocks(codes, d, m=None, axis: int = -2, dtype=jnp.float32):
    """The float weight of packed GGUF blocks, blocks of 32 along `axis` (jnp; fused into the matmul
    that consumes it).

    Args:
      codes: int8 [..., K, ...] (Q8_0) or uint8 [..., K / 2, ...] (Q4), K on `axis`.
      d: f16/f32 [..., K / 32, ...] block scales; m: the same shape (Q4_1) or None.
      axis: the block axis (-2: the `in` axis of an [in, out] weight; -1: an embedding row).
      dtype: the result's dtype.

    Returns:
      dtype [..., K, ...].
    """
    fmt = packed_format(codes, m)
    axis = axis % codes.ndim
    shape = codes.shape
    nb = d.shape[axis]
    if fmt == "Q8_0":
        v = codes.reshape(shape[:axis] + (nb, GGUF_BLOCK) + shape[axis + 1:]).astype(dtype)
    else:
        p = codes.reshape(shape[:axis] + (nb, GGUF_BLOCK // 2) + shape[axis + 1:])
        v = jnp.concatenate([p & 15, p >> 4], axis=axis + 1).astype(dtype)  # values j and j + 16
        if fmt == "Q4_0":
            v = v - 8
    w = v * jnp.expand_dims(d, axis + 1).astype(dtype)
    if m is not None:
        w = w + jnp.expand_dims(m, axis + 1).astype(dtype)
    return w.reshape(shape[:axis] + (nb * GGUF_BLOCK,) + shape[axis + 1:])
