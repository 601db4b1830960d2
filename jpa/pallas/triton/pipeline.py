"""The key step both Pallas Triton kernels (decode, ragged) run: gather a tile of keys and values
through the block table out of the WHOLE page pools, score it, fold it into the online softmax.

Einsum letters: G rows of the program's q operand, S key tokens of one step, H head_dim (padded).

One step of `block_k` key tokens at positions `pos`:

1. `load_kv`: the physical page of each token (`page`, read from the block table by the kernel,
   clamped here) and its row in the page give one index array per pool dimension; K and V are
   loaded with masked gathers, so tokens outside the visible range cost no memory traffic and read
   as 0 (garbage, even NaN, in unused slots cannot reach the result).
2. `scores`: s = q @ K^T "GH,SH->GS" in the compute dtype with f32 accumulation, times the
   per-token K scales of a quantized cache, the softmax scale and the soft cap.
3. The kernel adds its bias (ALiBi) and says which (row, key) pairs are visible.
4. `softmax_step`: running max m, running sum l, f32 accumulator acc += p @ V "GS,SH->GH", with the
   per-token V scales applied to the columns of p.

Triton blocks need power-of-two shapes (`next_pow2`), and `tl.dot` needs every dimension >= 16
(MIN_BLOCK_K, MIN_ROWS).
"""

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jpa.core.quant import is_quantized
from jpa.pallas.common import MASK_VALUE

MIN_BLOCK_K = 16          # tl.dot needs every dim >= 16
MIN_ROWS = 16             # ditto for the q rows (q_per_kv padded up to this)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def compute_dtype(q_dtype, cache_dtype):
    """dtype of the dot operands: q's 16-bit dtype when the cache converts to it exactly
    (same dtype, or int8/float8 whose values bf16 and f16 both hold exactly), else f32."""
    q_dtype, cache_dtype = np.dtype(q_dtype), np.dtype(cache_dtype)
    if q_dtype != np.dtype(jnp.float32) and (cache_dtype == q_dtype or is_quantized(cache_dtype)):
        return q_dtype
    return np.dtype(jnp.float32)


def pool_specs(num_layers, num_pages: int, page_size: int, head_dim_pad: int):
    """BlockSpecs of the page pools and of their scales for a grid whose axis 1 is the kv head:
    the whole pool of kv head h, [P, S_p, H_pad] (per-layer pool, num_layers None) or every layer of
    it, [L, P, S_p, H_pad] (stacked; the kernel indexes the layer). Returns (pool_spec, scale_spec)."""
    if num_layers is None:
        return (pl.BlockSpec((None, num_pages, page_size, head_dim_pad), lambda *g: (g[1], 0, 0, 0)),
                pl.BlockSpec((None, num_pages, page_size), lambda *g: (g[1], 0, 0)))
    return (pl.BlockSpec((num_layers, None, num_pages, page_size, head_dim_pad),
                         lambda *g: (0, g[1], 0, 0, 0)),
            pl.BlockSpec((num_layers, None, num_pages, page_size), lambda *g: (0, g[1], 0, 0)))


def load_kv(k_ref, v_ref, page, pos, valid, cols, col_ok, layer, *, page_size):
    """Gathers the K and V rows of one step's key tokens.

    Args:
      k_ref, v_ref: [num_pages, page_size, head_dim_pad] views of one kv head's whole pool, or
        [num_layers, num_pages, page_size, head_dim_pad] for a stacked pool (layer given).
      page: i32[S], each token's physical page as read from the block table (clamped here: a
        table entry past the sequence's pages may be anything; never form a wild pointer).
      pos: i32[S] token positions; valid: bool[S], tokens to load (the others read as 0).
      cols: i32[head_dim_pad] column indices; col_ok: bool[head_dim_pad], columns < head_dim.
      layer: i32[], the layer of a stacked pool, or None.
      page_size: tokens per page (static).

    Returns:
      (k, v, scale_ix): k, v [S, head_dim_pad] in the cache dtype; scale_ix the index arrays of
      the tokens' per-token scales (for `scores` and `softmax_step`).
    """
    block_k, head_dim_pad = pos.shape[0], cols.shape[0]
    num_pages = k_ref.shape[-3]
    page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)
    off = pos % page_size  # i32[S]
    tile = (block_k, head_dim_pad)
    tile_ok = valid[:, None] & col_ok[None, :]  # [S, head_dim_pad]
    # Pure integer-array indexing (one index array per dim, all [S, head_dim_pad]): a gather
    # that Triton lowers to one pointer tensor and interpret mode to one jnp gather.
    page_ix = jnp.broadcast_to(page[:, None], tile)
    off_ix = jnp.broadcast_to(off[:, None], tile)
    col_ix = jnp.broadcast_to(cols[None, :], tile)
    kv_ix = (page_ix, off_ix, col_ix)
    scale_ix = (page, off)
    if layer is not None:  # stacked pool: the layer is one more (uniform) index
        kv_ix = (jnp.full(tile, layer, jnp.int32),) + kv_ix
        scale_ix = (jnp.full_like(page, layer),) + scale_ix
    zero = 0 if jnp.issubdtype(k_ref.dtype, jnp.integer) else 0.0
    k = plgpu.load(k_ref.at[kv_ix], mask=tile_ok, other=zero)  # [S, head_dim_pad]
    v = plgpu.load(v_ref.at[kv_ix], mask=tile_ok, other=zero)  # [S, head_dim_pad]
    return k, v, scale_ix


def scores(q, k, ks_ref, scale_ix, valid, *, scale, soft_cap, compute_dtype):
    """s = q @ k^T [rows, S] "GH,SH->GS" in f32, times the K scales (ks_ref f32 pool view or None),
    the softmax scale and the soft cap (None: off)."""
    s = lax.dot_general(q, k.astype(compute_dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)  # [rows, S] "GH,SH->GS"
    if ks_ref is not None:
        # One scale per key token: it scales a column of the scores.
        s = s * plgpu.load(ks_ref.at[scale_ix], mask=valid, other=0.0)[None, :]
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def softmax_init(rows: int, head_dim_pad: int):
    """The online softmax's empty state: (m f32[rows] at MASK_VALUE, l f32[rows], acc f32[rows, H])."""
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim_pad), jnp.float32))


def softmax_step(carry, s, vis, v, vs_ref, scale_ix, valid, *, compute_dtype):
    """Folds one step into the online softmax state.

    Args:
      carry: (m f32[rows], l f32[rows], acc f32[rows, head_dim_pad]).
      s: f32[rows, S] scores with the kernel's biases; vis: bool[rows, S] (or [1, S]), the pairs
        that count; s is masked and p zeroed elsewhere.
      v: [S, head_dim_pad] (`load_kv`); vs_ref, scale_ix, valid: the V scales (None unless
        quantized), as `scores`.

    Returns:
      The new (m, l, acc).
    """
    m, l, acc = carry
    s = jnp.where(vis, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [rows]
    # Rescale what was accumulated under the old max before adding this step. MASK_VALUE is
    # finite, so a row with no visible key yet gives exp(0) = 1 here rather than NaN.
    alpha = jnp.exp(m - m_new)  # [rows]
    p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)  # [rows, S]
    l_new = l * alpha + jnp.sum(p, axis=1)
    if vs_ref is not None:
        # One scale per value token: it scales a column of p (the contraction index).
        p = p * plgpu.load(vs_ref.at[scale_ix], mask=valid, other=0.0)[None, :]
    pv = lax.dot_general(p.astype(compute_dtype), v.astype(compute_dtype),
                         (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)  # [rows, head_dim_pad] "GS,SH->GH"
    return m_new, l_new, acc * alpha[:, None] + pv
