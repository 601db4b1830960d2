"""`jpa.paged_prefill`: causal attention of prompt chunks over a paged KV cache, in plain JAX.

Einsum letters: B num_seqs, T query tokens of the chunk, S key tokens of one loop chunk,
K num_kv_heads, G q_per_kv, H head_dim.

A prefill step hands in, for each sequence, a chunk of up to T new tokens whose K/V have already
been written into the cache (`jpa.write_kv`). Query token t of sequence b sits at position
`start[b] + t` and attends to the cached positions [0, start[b] + t] of its own sequence, so a
prompt may be fed in several chunks (chunked prefill) or continue after a cached prefix.

The keys are visited a chunk of pages at a time with the same online softmax as
`jpa.reference.paged_decode_xla` (running max m, running sum l, f32 accumulator), and only the
chunks some sequence occupies are visited.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa.quant import FLOAT_DTYPES
from jpa.reference import MASK_VALUE, _dequant, chunk_pages
from jpa.validate import (check_cache_pair, check_dtype, check_layer, check_ndim, check_options,
                          check_tables, check_used_pages, is_concrete)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def _paged_prefill_xla(q, k_pages, v_pages, block_tables, start, chunk_lens, *, scale,
                       soft_cap=None, alibi_slopes=None, sliding_window=None, k_scales=None,
                       v_scales=None, layer=None):
    """Plain-JAX prefill (arguments validated). soft_cap, alibi_slopes and sliding_window are as
    in `jpa.paged_decode`, for a query at position p: ALiBi adds slope * (k_pos - p) and the
    window keeps keys in (p - sliding_window, p]. Returns [B, T, N, H] in q's dtype."""
    num_seqs, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape[-4:]  # layer: i32[] of a stacked pool, or None
    pages_per_seq = block_tables.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    ppc = chunk_pages(page_size, pages_per_seq)
    num_chunks = -(-pages_per_seq // ppc)
    chunk_tokens = ppc * page_size
    if num_chunks * ppc != pages_per_seq:
        # Padding entries are never visible: their positions are past every query position.
        pad = num_chunks * ppc - pages_per_seq
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))  # [B, num_chunks * ppc]

    qg = q.astype(jnp.float32).reshape(num_seqs, num_tokens, num_kv_heads, q_per_kv, head_dim)
    qg = jnp.transpose(qg, (0, 2, 3, 1, 4)) * scale  # [B, K, G, T, H]
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # i32[T]
    q_pos = start[:, None] + t[None, :]  # i32[B, T]
    q_live = t[None, :] < chunk_lens[:, None]  # [B, T]; padding queries see nothing
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)  # [K, G]
    # Keys some query of the sequence may see: [lo, start + chunk_lens).
    lo = jnp.maximum(start - sliding_window + 1, 0) if sliding_window is not None else 0 * start

    def body(c, carry):
        m, l, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, H]
        tbl = lax.dynamic_slice_in_dim(block_tables, c * ppc, ppc, axis=1)  # i32[B, ppc]
        k = _dequant(k_pages, k_scales, tbl, layer)  # [K, B, S, H]
        v = _dequant(v_pages, v_scales, tbl, layer)  # [K, B, S, H]
        k_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)  # i32[S]
        valid = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_live[:, :, None]  # [B, T, S]
        if sliding_window is not None:
            valid &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        s = jnp.einsum("BKGTH,KBSH->BKGTS", qg, k, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if alibi_slopes is not None:
            rel = (k_pos[None, None, :] - q_pos[:, :, None]).astype(jnp.float32)  # [B, T, S]
            s = s + slopes[None, :, :, None, None] * rel[:, None, None, :, :]
        vmask = valid[:, None, None, :, :]  # [B, 1, 1, T, S]
        s = jnp.where(vmask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rescale what was accumulated under the old max before adding this chunk.
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vmask, jnp.exp(s - m_new[..., None]), 0.0)
        # Keys no query of the sequence may see can hold garbage (even NaN): 0 * NaN = NaN.
        seen = ((k_pos[None, :] < (start + chunk_lens)[:, None])
                & (k_pos[None, :] >= lo[:, None]))  # [B, S]
        v = jnp.where(seen[None, :, :, None], v, 0.0)
        l_new = l * alpha + jnp.sum(p, axis=-1)
        acc_new = acc * alpha[..., None] + jnp.einsum(
            "BKGTS,KBSH->BKGTH", p, v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_new

    init = (
        jnp.full((num_seqs, num_kv_heads, q_per_kv, num_tokens), MASK_VALUE, jnp.float32),
        jnp.zeros((num_seqs, num_kv_heads, q_per_kv, num_tokens), jnp.float32),
        jnp.zeros((num_seqs, num_kv_heads, q_per_kv, num_tokens, head_dim), jnp.float32),
    )
    if num_chunks == 1:
        m, l, acc = body(0, init)
    else:
        # Lengths are data, so the number of chunks visited is a while loop bound.
        live = chunk_lens > 0
        last = -(-jnp.max(jnp.where(live, start + chunk_lens, 0), initial=0) // chunk_tokens)
        big = jnp.iinfo(jnp.int32).max
        first = jnp.min(jnp.where(live, lo, big), initial=big) // chunk_tokens
        m, l, acc = lax.fori_loop(jnp.minimum(first, last), last, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, T, K, G, H]
    return out.reshape(num_seqs, num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _check_prefill_args(q, k_pages, v_pages, block_tables, start, chunk_lens, scale, soft_cap,
                        sliding_window, k_scales, v_scales, layer=None):
    check_ndim("q", q, 4, "[num_seqs, num_tokens, num_q_heads, head_dim]")
    check_dtype("q", q, FLOAT_DTYPES)
    num_kv_heads, num_pages, page_size, head_dim = check_cache_pair(k_pages, v_pages, k_scales, v_scales,
                                                                    layer)
    num_seqs, num_tokens, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q's head_dim (q.shape[3] = {q_head_dim}) must equal the cache's "
                         f"head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads (q.shape[2] = {num_q_heads}) must be a multiple of "
                         f"num_kv_heads (k_pages.shape[-4] = {num_kv_heads})")
    pages_per_seq = check_tables(block_tables, num_seqs)
    for name, x in (("start", start), ("chunk_lens", chunk_lens)):
        check_ndim(name, x, 1, "i32[num_seqs]")
        check_dtype(name, x, (np.int32,))
        if x.shape[0] != num_seqs:
            raise ValueError(f"{name} must have num_seqs = {num_seqs} entries; got {x.shape[0]}")
    check_options(num_q_heads, scale=scale, soft_cap=soft_cap, alibi_slopes=None,
                  sliding_window=sliding_window, impl="xla", interpret=False)
    if not (is_concrete(start) and is_concrete(chunk_lens)):
        return
    st, cl = np.asarray(start), np.asarray(chunk_lens)
    if num_seqs == 0:
        return
    if st.min() < 0:
        raise ValueError(f"start must be >= 0 (tokens already cached); got {st.min()}")
    if cl.min() < 0 or cl.max() > num_tokens:
        raise ValueError(f"chunk_lens must be in [0, num_tokens = {num_tokens}]; "
                         f"got values in [{cl.min()}, {cl.max()}]")
    max_len = pages_per_seq * page_size
    ends = st + cl
    if ends.max() > max_len:
        raise ValueError(f"start + chunk_lens must be <= pages_per_seq * page_size = {max_len}; "
                         f"got {ends.max()}")
    check_used_pages(block_tables, ends, page_size, num_pages)


def paged_prefill(q, k_pages, v_pages, block_tables, start, chunk_lens, *, scale=None,
                  soft_cap=None, sliding_window=None, k_scales=None, v_scales=None, layer=None):
    """Causal attention of a chunk of new tokens per sequence over a paged KV cache.

    Write the chunk's K/V into the cache with `jpa.write_kv` first. Query token t of sequence b
    is at position `start[b] + t` and attends to cached positions [0, start[b] + t]; token p
    lives in physical page `block_tables[b, p // page_size]` at offset `p % page_size`.

    Args:
      q: [num_seqs, num_tokens, num_q_heads, head_dim] float32, bfloat16 or float16; each row is
        a right-padded chunk.
      k_pages: [num_kv_heads, num_pages, page_size, head_dim]; float32/bfloat16/float16, or
        int8/float8_e4m3fn/float8_e5m2 with scales.
      v_pages: same shape and dtype as k_pages.
      block_tables: i32[num_seqs, pages_per_seq].
      start: i32[num_seqs], tokens of each sequence cached before this chunk (0 for a fresh prompt).
      chunk_lens: i32[num_seqs], valid tokens of each row, in [0, num_tokens]; start + chunk_lens
        must be <= pages_per_seq * page_size. A row with 0 is empty.
      scale: softmax scale; default head_dim ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (after scaling), as in
        `jpa.paged_decode`.
      sliding_window: query position p attends only to positions (p - sliding_window, p], the last
        `sliding_window` tokens including itself (as `jpa.paged_decode`).
      k_scales, v_scales: f32[num_kv_heads, num_pages, page_size], required for quantized caches.
      layer: with stacked pools `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` (scales
        `f32[num_layers, num_kv_heads, num_pages, page_size]`), the layer to attend over: an int or
        an i32[] (traced, e.g. a scan's layer index: clamped to [0, num_layers)). None with
        per-layer pools.

    Returns:
      [num_seqs, num_tokens, num_q_heads, head_dim] in q's dtype; zeros at padding positions
      (t >= chunk_lens[b]).
    """
    _check_prefill_args(q, k_pages, v_pages, block_tables, start, chunk_lens, scale, soft_cap,
                        sliding_window, k_scales, v_scales, layer)
    if layer is not None:
        layer = check_layer(layer, k_pages.shape[0])
    scale = float(scale) if scale is not None else float(q.shape[-1]) ** -0.5
    soft_cap = float(soft_cap) if soft_cap is not None else None
    sliding_window = int(sliding_window) if sliding_window is not None else None
    return _paged_prefill_xla(q, k_pages, v_pages, block_tables, start, chunk_lens, scale=scale,
                              soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
                              v_scales=v_scales, layer=layer)
