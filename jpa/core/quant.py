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


# llama.cpp's K-quants: super-blocks of 256 values with an f16 scale d (and minimum dmin) and a 6-bit
# (Q4_K / Q5_K: eight sub-blocks of 32, scale and minimum each) or int8 (Q6_K: sixteen sub-blocks of
# 16) scale per sub-block: Q4_K / Q5_K w = d * sc_j * q - dmin * m_j (q 4 / 5 bits), Q6_K
# w = d * sc_j * (q - 32) (q 6 bits). jpa folds each sub-block's two scales into one f32 (d * sc_j and
# -dmin * m_j: exact, an f16 times an integer below 2^8) inside the matmul, as gguf does, and keeps
# the codes: Q4_K as 4-bit nibbles in the Q4 order above (groups of 32 with a minimum, the Q4_1 form),
# Q5_K as int8 0..31 and Q6_K as int8 -32..31 (the Q8_0 form, with Q5_K's minimums), beside the
# integer sub-block scales / minimums (one byte each) and the f16 super-block d / -dmin. So a weight
# costs 4.62 bits (Q4_K; the file: 4.5), 8.62 (Q5_K; 5.5) or 8.56 (Q6_K; 6.56), against 16 for bf16;
# the dequantized values equal gguf.quants.dequantize's bit for bit. Layouts: ggml/src/ggml-common.h
# (block_q4_K, block_q5_K, block_q6_K), gguf-py's gguf/quants.py.
QK_K = 256
# format -> bytes per super-block of 256 values
K_FORMATS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
KEPT_FORMATS = (*PACKED_FORMATS, *K_FORMATS)


def _k_scale_min(scales):
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums -> (sc, m) uint8 [..., 8]."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=-1)
    return sc, mn


def _gguf_blocks(data, fmt: str, rows: int, cols: int, name: str, block: int, nbytes: int) -> np.ndarray:
    """A GGUF tensor's bytes as [rows, cols / block, nbytes] blocks; ValueError naming the tensor when its
    size does not fit (truncated or corrupt)."""
    if cols % block:
        raise ValueError(f"tensor {name} ({fmt}) has {cols} columns, not a multiple of {block}: corrupt")
    nb = cols // block
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.size != rows * nb * nbytes:
        raise ValueError(f"tensor {name} ({fmt}) holds {data.size} bytes of {data.dtype}; a [{rows}, {cols}] "
                         f"{fmt} tensor has {rows * nb * nbytes} uint8: truncated or corrupt")
    return data.reshape(rows, nb, nbytes)


def _unpack_k_rows(data, fmt, rows, cols, name):
    """unpack_gguf_rows for the K-quants: (codes, d f32 [rows, cols / G], m f32 or None), G 32 or 16."""
    codes, d, m, d2, m2 = unpack_k_blocks(data, fmt, rows, cols, name)
    return codes, super_scaled(d, d2, -1), None if m is None else super_scaled(m, m2, -1)


def unpack_k_blocks(data, fmt, rows, cols, name: str = "tensor"):
    """A K-quant tensor's blocks as jpa keeps them: (codes, d, m, d2, m2) with d (m) the integer
    sub-block scales (minimums) [rows, cols / G] (int8 for Q6_K, uint8 for Q4_K / Q5_K; m None for
    Q6_K) and d2 (m2) the f16 super-block scales (negated minimums) [rows, cols / 256]:
    dequantize_blocks(codes, d, m, d2=d2, m2=m2). Raises ValueError naming the tensor when its size is
    wrong or its scales are not finite."""
    b = _gguf_blocks(data, fmt, rows, cols, name, QK_K, K_FORMATS[fmt])
    nb = b.shape[1]
    f16 = lambda lo: b[..., lo:lo + 2].copy().view(np.float16)[..., 0]  # [rows, nb]
    if fmt == "Q6_K":
        ql, qh, sc = b[..., :128], b[..., 128:192], b[..., 192:208].copy().view(np.int8)
        d, d2, m2 = sc, f16(208), None
        # value 128 h + 64 s + j: nibble s of ql[64 h + j]; value 128 h + 32 s + j: bits 2s, 2s+1 of qh[32 h + j]
        ql, qh = ql.reshape(rows, nb, 2, 64), qh.reshape(rows, nb, 2, 32)
        lo = np.stack([ql & 15, ql >> 4], axis=-2).reshape(rows, nb, 8, 32)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2).reshape(rows, nb, 8, 32)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        codes, d, m = q.reshape(rows, cols), d.reshape(rows, cols // 16), None
    else:
        d, m = _k_scale_min(b[..., 4:16])  # uint8 [rows, nb, 8]
        d2, m2 = f16(0), -f16(2)
        qs = b[..., 16:144] if fmt == "Q4_K" else b[..., 48:176]
        q = np.stack([qs.reshape(rows, nb, 4, 32) & 15, qs.reshape(rows, nb, 4, 32) >> 4], axis=-2)
        q = q.reshape(rows, nb, 8, 32)
        if fmt == "Q5_K":
            qh = b[..., 16:48]
            q = q | (np.stack([(qh >> s) & 1 for s in range(8)], axis=-2) << 4)
            codes = q.astype(np.int8).reshape(rows, cols)
        else:
            codes = pack_nibbles(q.reshape(rows, cols), axis=-1)
        d, m = d.reshape(rows, cols // 32), m.reshape(rows, cols // 32)
    if not (np.isfinite(d2).all() and (m2 is None or np.isfinite(m2).all())):
        raise ValueError(f"tensor {name} ({fmt}) has non-finite block scales: corrupt")
    return codes, d, m, d2, m2


def packed_format(codes, minimum) -> str:
    """The block format of stored codes: int8 (or float8_e4m3fn: block-wise FP8, `fp8_block`, w = q * d
    the same way) -> Q8_0, uint8 with a minimum -> Q4_1, else Q4_0."""
    if np.dtype(codes.dtype) in (np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn)):
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
    if fmt in K_FORMATS:
        return _unpack_k_rows(data, fmt, rows, cols, name)
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"tensor {name} has type {fmt}; jpa keeps {sorted(KEPT_FORMATS)} packed (other types "
                         f"are dequantized at load)")
    nbytes, _, has_min = PACKED_FORMATS[fmt]
    blocks = _gguf_blocks(data, fmt, rows, cols, name, GGUF_BLOCK, nbytes)
    nb = blocks.shape[1]
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


def super_scaled(sub, sup, axis: int = -2):
    """A K-quant's effective f32 group scales (or minimums): integer sub-block values sub [..., G', ...]
    times their f16 super-block scale sup [..., G' / r, ...] repeated r times along `axis`, computed as
    gguf does (f32(sup) * f32(sub): exact)."""
    xp = np if isinstance(sub, np.ndarray) else jnp
    r = sub.shape[axis] // sup.shape[axis]
    return sub.astype(np.float32) * xp.repeat(sup.astype(np.float32), r, axis=axis)


def dequantize_blocks(codes, d, m=None, axis: int = -2, dtype=jnp.float32, d2=None, m2=None):
    """The float weight of packed blocks, groups along `axis` (jnp, fused into the matmul that
    consumes it; NumPy arrays in give a NumPy result, for dequantizing on the host at load).

    The codes are unpacked in 32-value blocks (GGUF's nibble order, `pack_nibbles`); the scales
    apply per group of K / d.shape[axis] values (GGUF: 32; a Hugging Face AWQ / GPTQ checkpoint
    repacked by `awq_int4` / `gptq_int4`: its group size, a multiple of 32).

    Args:
      codes: int8 [..., K, ...] (Q8_0: w = q * d) or uint8 [..., K / 2, ...] (4-bit: w = (q - 8) * d
        without m (Q4_0), q * d + m with it (Q4_1)), K on `axis`.
      d: f16/f32 [..., K / G, ...] group scales; m: the same shape (Q4_1 form) or None.
      axis: the block axis (-2: the `in` axis of an [in, out] weight; -1: an embedding row).
      dtype: the result's dtype.
      d2, m2: a K-quant's f16 super-block scales (and negated minimums) when d (and m) hold its integer
        sub-block scales (minimums): the group scales are then `super_scaled(d, d2)`.

    Returns:
      dtype [..., K, ...].
    """
    xp = np if isinstance(codes, np.ndarray) else jnp
    if d2 is not None:
        d = super_scaled(d, d2, axis)
    if m2 is not None:
        m = super_scaled(m, m2, axis)
    fmt = packed_format(codes, m)
    axis = axis % codes.ndim
    shape = codes.shape
    k = shape[axis] * (1 if fmt == "Q8_0" else 2)
    nb = d.shape[axis]
    # In f32, rounded to `dtype` once at the end: q * d + m cancels (an AWQ / GPTQ minimum is -z * s), so
    # rounding d and m to bf16 first would cost far more than one rounding of w; elementwise, this stays
    # inside the fusion that produces w (what a bf16 model loaded dense-dequantized holds, bit for bit).
    f32 = np.float32
    if fmt == "Q8_0":
        v = codes.astype(f32)
    else:
        p = codes.reshape(shape[:axis] + (k // GGUF_BLOCK, GGUF_BLOCK // 2) + shape[axis + 1:])
        v = xp.concatenate([p & 15, p >> 4], axis=axis + 1).astype(f32)  # values j and j + 16
        if fmt == "Q4_0":
            v = v - 8
    v = v.reshape(shape[:axis] + (nb, k // nb) + shape[axis + 1:])
    w = v * xp.expand_dims(d, axis + 1).astype(f32)
    if m is not None:
        w = w + xp.expand_dims(m, axis + 1).astype(f32)
    return w.reshape(shape[:axis] + (k,) + shape[axis + 1:]).astype(dtype)


def pack_nibbles(q: np.ndarray, axis: int = -2) -> np.ndarray:
    """4-bit codes (integers 0..15, K of them on `axis`, K a multiple of 32) -> uint8 [..., K / 2, ...]
    in GGUF's Q4 order (`dequantize_blocks`): byte j of each 32-value block holds value j in its low
    nibble and value j + 16 in its high one. NumPy, on the host."""
    axis = axis % q.ndim
    shape = q.shape
    if shape[axis] % GGUF_BLOCK:
        raise ValueError(f"4-bit codes need a multiple of {GGUF_BLOCK} values on the packed axis; got {shape[axis]}")
    b = np.asarray(q, np.uint8).reshape(shape[:axis] + (shape[axis] // GGUF_BLOCK, 2, GGUF_BLOCK // 2)
                                        + shape[axis + 1:])
    lo, hi = np.take(b, 0, axis=axis + 1), np.take(b, 1, axis=axis + 1)
    return (lo | (hi << 4)).reshape(shape[:axis] + (shape[axis] // 2,) + shape[axis + 1:])


# ---------------------------------------------------------------------------------------------
# Hugging Face int4 checkpoints (issue 35): AWQ (AutoAWQ "gemm"), GPTQ (AutoGPTQ / GPTQModel / optimum
# "gptq" v1 and "gptq_v2") and compressed-tensors "pack-quantized". Each stores 4-bit codes eight to
# an int32, an f16 scale per group of G input features and output channel, and (asymmetric) a 4-bit
# zero point z per group: w = (q - z) * s. jpa unpacks the int32s on the host and repacks the codes
# two to a byte along the matmul's contraction axis (`pack_nibbles`), so the device holds 4 bits a
# weight, dequantized inside the matmul (`dequantize_blocks`): d = s, and m = -z * s (exact in f32:
# a <= 5-bit integer times an f16) unless every z is 8, which is the Q4_0 form (q - 8) * d (GPTQ and
# compressed-tensors symmetric checkpoints), with no m stored.

# AWQ's GEMM packing: an int32 holds output columns 8k + AWQ_ORDER[i] in nibble i (bits 4i..4i+3).
# vLLM: vllm/model_executor/layers/quantization/awq_triton.py (AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
# to undo it); AutoAWQ: awq/modules/linear/gemm.py (order_map = [0, 2, 4, 6, 1, 3, 5, 7] when packing).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 [..., n, ...] -> uint8 [..., 8n, ...]: nibble i of element k becomes value 8k + i on `axis`."""
    u = np.ascontiguousarray(packed).view(np.uint32)
    axis = axis % u.ndim
    shifts = np.arange(0, 32, 4, dtype=np.uint32).reshape((8,) + (1,) * (u.ndim - axis - 1))
    v = (np.expand_dims(u, axis + 1) >> shifts) & 15  # [..., n, 8, ...]
    return v.reshape(u.shape[:axis] + (u.shape[axis] * 8,) + u.shape[axis + 1:]).astype(np.uint8)


def _int4_blocks(q, z, s, name, fmt):
    """Codes q [in, out] (0..15), zero points z [in / G, out] (any integers), scales s [in / G, out] ->
    (codes uint8 [in / 2, out], d, m or None) for dequantize_blocks(axis=-2)."""
    s = np.asarray(s)
    if not np.isfinite(s.astype(np.float32)).all():
        raise ValueError(f"tensor {name} ({fmt}) has non-finite scales: corrupt")
    if s.dtype not in (np.float16, np.float32, np.dtype(jnp.bfloat16)):
        s = s.astype(np.float32)
    codes = pack_nibbles(q, axis=-2)
    if z is None or np.all(z == 8):
        return codes, s, None
    return codes, s, -(z.astype(np.float32) * s.astype(np.float32))


def _groups(name, fmt, k, n_groups):
    if n_groups <= 0 or k % n_groups or (k // n_groups) % GGUF_BLOCK:
        raise ValueError(f"tensor {name} ({fmt}): {k} input features in {n_groups} groups; jpa needs a group size "
                         f"that is a multiple of {GGUF_BLOCK}")
    return k // n_groups


def _check_shape(name, fmt, role, a, want):
    if tuple(a.shape) != tuple(want) or np.dtype(a.dtype) != np.int32 and role != "scales":
        raise ValueError(f"tensor {name}.{role} ({fmt}) has shape {list(a.shape)} of {a.dtype}; expected "
                         f"{list(want)}{'' if role == 'scales' else ' of int32'}: truncated or corrupt")


def awq_int4(qweight, qzeros, scales, name: str = "tensor"):
    """An AutoAWQ GEMM linear (qweight int32 [in, out / 8], qzeros int32 [in / G, out / 8], scales
    f16 [in / G, out]: w[i, o] = (q[i, o] - z[i // G, o]) * s[i // G, o], no offset on z) ->
    (codes, d, m) for dequantize_blocks(axis=-2). Raises ValueError naming the tensor on bad shapes."""
    fmt = "awq int4"
    scales = np.asarray(scales)
    if scales.ndim != 2:
        raise ValueError(f"tensor {name}.scales ({fmt}) has shape {list(scales.shape)}; expected [in / G, out]")
    n_groups, out = scales.shape
    k = np.asarray(qweight).shape[0]
    _check_shape(name, fmt, "qweight", np.asarray(qweight), (k, out // 8))
    _check_shape(name, fmt, "qzeros", np.asarray(qzeros), (n_groups, out // 8))
    if out % 8:
        raise ValueError(f"tensor {name} ({fmt}) has {out} output channels, not a multiple of 8: corrupt")
    _groups(name, fmt, k, n_groups)
    rev = np.argsort(AWQ_ORDER)  # column 8k + c sits in nibble rev[c]

    def unpack(a):
        v = _nibbles(a, -1).reshape(a.shape[0], -1, 8)
        return v[:, :, rev].reshape(a.shape[0], -1)

    return _int4_blocks(unpack(np.asarray(qweight)), unpack(np.asarray(qzeros)), scales, name, fmt)


def gptq_act_order(g_idx, k: int, g: int, name: str = "tensor"):
    """The input permutation of an act-order (desc_act) GPTQ linear, or None when g_idx is i // G.

    Act order quantizes the inputs in a permuted order, so input i belongs to group g_idx[i] and a
    group's inputs are scattered. With perm = argsort(g_idx) (stable) the permuted rows W[perm] have
    contiguous groups of G, and x @ W = x[..., perm] @ W[perm]: jpa keeps W[perm] packed and gathers the
    activations (vLLM's Marlin path sorts by g_idx the same way: gptq_marlin.py, marlin_sort_g_idx).
    Raises ValueError naming the tensor when g_idx is not G inputs per group."""
    g_idx = np.asarray(g_idx)
    if g_idx.shape != (k,) or g_idx.min(initial=0) < 0:
        raise ValueError(f"tensor {name}.g_idx has shape {list(g_idx.shape)}; expected [{k}] of groups >= 0")
    if np.array_equal(g_idx, np.arange(k) // g):
        return None
    if not np.array_equal(np.bincount(g_idx, minlength=k // g), np.full(k // g, g)):
        raise ValueError(f"tensor {name}.g_idx (gptq int4) does not put {g} inputs in each of {k // g} groups: corrupt")
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def gptq_int4(qweight, qzeros, scales, g_idx=None, v2: bool = False, name: str = "tensor", perm=None):
    """A GPTQ linear (qweight int32 [in / 8, out] packed along `in`, nibble j of row r holding input
    8r + j; qzeros int32 [in / G, out / 8] packed along `out`, sequentially; scales f16 [in / G, out];
    g_idx int32 [in] or None) -> (codes, d, m) for dequantize_blocks(axis=-2).

    The GPTQ v1 format (AutoGPTQ, checkpoint_format "gptq") stores each zero point minus one, so
    w = (q - (z_stored + 1)) * s; "gptq_v2" stores z itself (v2=True). vLLM:
    vllm/model_executor/layers/quantization/gptq.py (use_v2_format; its exllama kernel adds the 1).
    Act-order checkpoints (desc_act, a g_idx that is not i // G) are refused unless `perm`
    (`gptq_act_order`) is given: the codes are then returned for the rows W[perm]."""
    fmt = "gptq int4"
    scales, qweight = np.asarray(scales), np.asarray(qweight)
    if scales.ndim != 2 or qweight.ndim != 2:
        raise ValueError(f"tensor {name}.scales ({fmt}) has shape {list(scales.shape)}; expected [in / G, out]")
    n_groups, out = scales.shape
    k = qweight.shape[0] * 8
    _check_shape(name, fmt, "qweight", qweight, (k // 8, out))
    _check_shape(name, fmt, "qzeros", np.asarray(qzeros), (n_groups, out // 8))
    g = _groups(name, fmt, k, n_groups)
    if g_idx is not None and perm is None:
        g_idx = np.asarray(g_idx)
        if g_idx.shape != (k,) or not np.array_equal(g_idx, np.arange(k) // g):
            raise ValueError(f"tensor {name}.g_idx ({fmt}) is not i // {g}: an act-order (desc_act) checkpoint, "
                             f"which jpa does not load packed (load with quantization 'none' to dequantize it)"
                             if g_idx.shape == (k,) else
                             f"tensor {name}.g_idx ({fmt}) has shape {list(g_idx.shape)}; expected [{k}]")
    q = _nibbles(qweight, 0)  # [in, out]
    if perm is not None:  # act order: rows sorted by group, so group j is rows j * G .. (j + 1) * G - 1
        q = q[perm]
    z = _nibbles(np.asarray(qzeros), -1).astype(np.int32) + (0 if v2 else 1)
    return _int4_blocks(q, z, scales, name, fmt)


def pack_quantized_int4(weight_packed, weight_scale, weight_zero_point=None, name: str = "tensor"):
    """A compressed-tensors "pack-quantized" 4-bit linear (weight_packed int32 [out, in / 8], nibble j
    of element c holding input 8c + j; weight_scale [out, in / G]; asymmetric: weight_zero_point
    int32 [out / 8, in / G] packed along `out` the same way) -> (codes, d, m) for
    dequantize_blocks(axis=-2). Symmetric codes are stored offset by 8 (signed -8..7 as 0..15), so
    w = (q - 8) * s; asymmetric zero points are offset the same way (both signed in -8..7 before
    packing), so w = (q - z) * s with the stored z.
    compressed-tensors: compressors/pack_quantized/{base,helpers}.py (pack_to_int32: value + 8, element i at
    bits 4i; the zero point packed with packed_dim=0). A one-off check (BENCHMARKS.md, "One-off checks")
    compared this with compressed-tensors 0.20.0's own decompression: equal."""
    fmt = "pack-quantized int4"
    weight_packed, weight_scale = np.asarray(weight_packed), np.asarray(weight_scale)
    if weight_scale.ndim != 2 or weight_packed.ndim != 2:
        raise ValueError(f"tensor {name}.weight_scale ({fmt}) has shape {list(weight_scale.shape)}; expected "
                         f"[out, in / G]")
    out, n_groups = weight_scale.shape
    k = weight_packed.shape[1] * 8
    _check_shape(name, fmt, "weight_packed", weight_packed, (out, k // 8))
    _groups(name, fmt, k, n_groups)
    q = _nibbles(weight_packed, -1).T  # [in, out]
    z = None
    if weight_zero_point is not None:
        _check_shape(name, fmt, "weight_zero_point", np.asarray(weight_zero_point), (out // 8, n_groups))
        z = _nibbles(np.asarray(weight_zero_point), 0).astype(np.int32).T  # [in / G, out]
    return _int4_blocks(q, z, weight_scale.T, name, fmt)


# ---------------------------------------------------------------------------------------------
# Block-wise FP8 (issue 35): DeepSeek-V3 / Qwen3-*-FP8 (quant_method "fp8" with weight_block_size
# [bo, bi], scales P.weight_scale_inv) and compressed-tensors float-quantized strategy "block"
# (block_structure [bo, bi], scales P.weight_scale) store W [out, in] as float8_e4m3fn codes with one
# f32 scale per bo x bi block: W[o, i] = q[o, i] * s[o // bo, i // bi], s of shape
# [ceil(out / bo), ceil(in / bi)] (the last block of each axis may be ragged). vLLM:
# vllm/model_executor/layers/quantization/fp8.py (weight_block_size, weight_scale_inv) and
# utils/fp8_utils.py. jpa keeps the codes (1 byte a weight) in the Q8_0 form of `dequantize_blocks`
# (w = q * d, groups along `in`): d [in / g, out] f32 is the block scale repeated over each block's
# bo output channels, with g = gcd(in, bi) (= bi when in is a multiple of bi, as in the released
# checkpoints: 4 / bi bytes a weight, 0.03 at bi = 128; a ragged `in` edge repeats the scale over
# smaller groups).


def check_fp8_block(block, where: str = "weight_block_size"):
    """[bo, bi] -> (bo, bi), two positive ints; ValueError (one line naming `where`) otherwise."""
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{where} is {block!r}; block-wise FP8 needs two positive integers [out, in]")
    return int(block[0]), int(block[1])


def fp8_block(weight, scale, block, name: str = "tensor"):
    """A block-wise FP8 linear (weight float8_e4m3fn [out, in], scale [ceil(out / bo), ceil(in / bi)])
    -> (codes float8_e4m3fn [in, out], d f32 [in / g, out]) for dequantize_blocks(axis=-2), with
    g = gcd(in, bi). NumPy, on the host. Raises ValueError naming the tensor on a shape that does not
    match the block size, non-finite or non-positive scales, or NaN codes."""
    import math

    bo, bi = check_fp8_block(block)
    weight, scale = np.asarray(weight), np.asarray(scale)
    if weight.ndim != 2 or np.dtype(weight.dtype) != np.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"tensor {name}.weight is {weight.dtype} {list(weight.shape)}; block-wise FP8 needs "
                         f"float8_e4m3fn [out, in]")
    n, k = weight.shape
    want = (-(-n // bo), -(-k // bi))
    if scale.shape != want:
        raise ValueError(f"tensor {name} scales have shape {list(scale.shape)}; a [{n}, {k}] weight in "
                         f"[{bo}, {bi}] blocks has {list(want)}: wrong block size or truncated")
    s = scale.astype(np.float32)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"tensor {name} (block-wise fp8) has non-finite or non-positive scales: corrupt")
    if not np.isfinite(weight.astype(np.float32)).all():
        raise ValueError(f"tensor {name}.weight (float8_e4m3fn) holds NaN codes: corrupt")
    g = math.gcd(k, bi)
    d = np.repeat(s, bo, axis=0)[:n]  # [out, ceil(in / bi)]: each block's scale on its output channels
    d = np.repeat(d, bi // g, axis=1)[:, :k // g]  # [out, in / g]: groups of g inside each block
    return np.ascontiguousarray(weight.T), np.ascontiguousarray(d.T)
