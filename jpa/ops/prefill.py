"""`jpa.paged_prefill`: causal attention of prompt chunks over a paged KV cache, in plain JAX.

Einsum letters: B num_seqs, T query tokens of the chunk, S key tokens of one loop chunk,
K num_kv_heads, G q_per_kv, H head_dim.

A prefill step hands in, for each sequence, a chunk of up to T new tokens whose K/V have already
been written into the cache (`jpa.write_kv`). Query token t of sequence b sits at position
`start[b] + t` and attends to the cached positions [0, start[b] + t] of its own sequence, so a
prompt may be fed in several chunks (chunked prefill) or continue after a cached prefix.

The keys are visited a chunk of pages at a time with the same online softmax as
`jpa.ops.reference.paged_decode_xla` (running max m, running sum l, f32 accumulator), and only the
chunks some sequence occupies are visited.
"""

import numpy as np

from jpa.core.quant import FLOAT_DTYPES
from jpa.ops.reference import paged_prefill_xla
from jpa.ops.validate import (check_cache_pair, check_dtype, check_layer, check_ndim, check_options,
                              check_tables, check_used_pages, is_concrete)


def _check_prefill_args(q, k_pages, v_pages, block_tables, start, chunk_lens, scale, soft_cap,
                        sliding_window, k_scales, v_scales, layer=None, sinks=None):
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
                  sliding_window=sliding_window, impl="xla", interpret=False, sinks=sinks)
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
                  soft_cap=None, sliding_window=None, k_scales=None, v_scales=None, layer=None, sinks=None):
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
      sinks: f32[num_q_heads] attention sinks (gpt-oss) or None, as `jpa.paged_decode`: head h's
        softmax gets one more logit sinks[h] with a zero value.

    Returns:
      [num_seqs, num_tokens, num_q_heads, head_dim] in q's dtype; zeros at padding positions
      (t >= chunk_lens[b]).
    """
    _check_prefill_args(q, k_pages, v_pages, block_tables, start, chunk_lens, scale, soft_cap,
                        sliding_window, k_scales, v_scales, layer, sinks)
    if layer is not None:
        layer = check_layer(layer, k_pages.shape[0])
    scale = float(scale) if scale is not None else float(q.shape[-1]) ** -0.5
    soft_cap = float(soft_cap) if soft_cap is not None else None
    sliding_window = int(sliding_window) if sliding_window is not None else None
    return paged_prefill_xla(q, k_pages, v_pages, block_tables, start, chunk_lens, scale=scale,
                             soft_cap=soft_cap, sliding_window=sliding_window, k_scales=k_scales,
                             v_scales=v_scales, layer=layer, sinks=sinks)
