"""Plain-JAX paged attention (decode and prefill): the CPU/TPU path and the oracle for every kernel.

Einsum letters: B num_seqs, K num_kv_heads, G q_per_kv, H head_dim, S key tokens of one chunk
("KBGH,KBSH->KBGS": the kernel-friendly [K, B, ...] order in which pages are gathered).

The keys of each sequence are visited a chunk of pages at a time with an online softmax
(running max m, running sum l, f32 accumulator acc), the same recurrence the GPU kernels
use. Attention sinks (gpt-oss: a learned logit per q head that joins every softmax as a column
with no value) are folded into the final state (`fold_sinks`). The loop runs only over the chunks that some sequence actually occupies, so a step
whose sequences are short costs little even when `pages_per_seq` is large.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jpa.core.numerics import MASK_VALUE

# Key tokens gathered per loop iteration: small enough that a gathered chunk stays in cache and
# short contexts do not pay for the whole table; large enough that the loop overhead is small.
# 128 measured best of 16-256 on a 2-core Xeon (benchmarks/bench_attention.py).
CHUNK_TOKENS = 128


def chunk_pages(page_size: int, pages_per_seq: int) -> int:
    """Pages visited per loop iteration of the reference path."""
    return max(1, min(pages_per_seq, CHUNK_TOKENS // page_size))


def gather_pages(pages, tbl, layer=None):
    """pages [K, P, ...] (or a stacked [L, K, P, ...] read at i32[] `layer`) gathered through
    tbl i32[B, C] -> [K, B, C, ...]. The stacked pool is indexed in one gather, never sliced to a
    per-layer copy first (the pool is the carry of a scan over layers)."""
    if layer is None:
        return jnp.take(pages, tbl, axis=1, mode="clip")  # [K, B, C, ...]
    # One XLA gather of (layer, page) pairs on the whole stacked pool: never a per-layer slice.
    idx = jnp.stack([jnp.broadcast_to(layer, tbl.shape), tbl], axis=-1)  # i32[B, C, 2]
    dnums = lax.GatherDimensionNumbers(offset_dims=(0,) + tuple(range(3, pages.ndim)),
                                       collapsed_slice_dims=(0, 2), start_index_map=(0, 2))
    return lax.gather(pages, idx, dnums, (1, pages.shape[1], 1) + pages.shape[3:],
                      mode=lax.GatherScatterMode.CLIP)  # [K, B, C, ...]


def _dequant(pages, scales, tbl, layer=None):
    """Gathers pages [K, P, S_p, H] (or [L, K, P, S_p, H] at `layer`) through tbl i32[B, C]
    -> f32[K, B, C * S_p, H]."""
    num_kv_heads, _, page_size, head_dim = pages.shape[-4:]
    num_seqs, num_chunk_pages = tbl.shape
    x = gather_pages(pages, tbl, layer)  # [K, B, C, S_p, H]
    x = x.astype(jnp.float32)
    if scales is not None:
        s = gather_pages(scales, tbl, layer)  # [K, B, C, S_p]
        x = x * s[..., None]
    return x.reshape(num_kv_heads, num_seqs, num_chunk_pages * page_size, head_dim)


def fold_sinks(m, l, acc, sinks):
    """Adds an attention sink to online-softmax states: one more column of logit `sinks` (broadcast
    like m) and value 0, as the state (m = sink, l = 1, acc = 0) merged into (m, l, acc). Exact in
    any order, so it can follow the loop; a sequence with no visible key gets l = 1, acc = 0."""
    sinks = jnp.broadcast_to(sinks, m.shape)
    m_new = jnp.maximum(m, sinks)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + jnp.exp(sinks - m_new), acc * alpha[..., None]


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "pages_per_chunk"))
def paged_decode_xla(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
                     alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None,
                     pages_per_chunk=None, layer=None, sinks=None):
    """Paged decode attention in plain JAX. Arguments as `jpa.paged_decode` (already validated;
    `layer` an i32[] with stacked [L, K, P, S_p, H] pools, None with per-layer pools; `sinks`
    f32[num_q_heads] or None).

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape[-4:]
    pages_per_seq = block_tables.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    ppc = pages_per_chunk or chunk_pages(page_size, pages_per_seq)
    num_chunks = -(-pages_per_seq // ppc)
    chunk_tokens = ppc * page_size
    if num_chunks * ppc != pages_per_seq:
        # Padding entries are never visible: their positions are >= every seq_len.
        pad = num_chunks * ppc - pages_per_seq
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))  # [B, num_chunks * ppc]

    seq_lens = seq_lens.astype(jnp.int32)  # i32[num_seqs]
    # Work in [K, B, ...] order, the order pages are gathered in ([K, B, S, H]): the gathered
    # chunk then feeds both dots without a transposing copy.
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, q_per_kv, head_dim)
    qg = jnp.swapaxes(qg, 0, 1) * scale  # [K, B, G, H]
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)  # [K, G]
    # First visible position of each sequence.
    if sliding_window is not None:
        start = jnp.maximum(seq_lens - sliding_window, 0)  # i32[num_seqs]
    else:
        start = jnp.zeros_like(seq_lens)

    def body(c, carry):
        m, l, acc = carry  # [K, B, G], [K, B, G], [K, B, G, H]
        tbl = lax.dynamic_slice_in_dim(block_tables, c * ppc, ppc, axis=1)  # i32[B, ppc]
        k = _dequant(k_pages, k_scales, tbl, layer)  # [K, B, S, H]
        v = _dequant(v_pages, v_scales, tbl, layer)  # [K, B, S, H]
        pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)  # i32[S]
        valid = (pos[None, :] < seq_lens[:, None]) & (pos[None, :] >= start[:, None])  # [B, S]
        s = jnp.einsum("KBGH,KBSH->KBGS", qg, k, preferred_element_type=jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if alibi_slopes is not None:
            rel = (pos[None, :] - seq_lens[:, None] + 1).astype(jnp.float32)  # [B, S]
            s = s + slopes[:, None, :, None] * rel[None, :, None, :]
        vmask = valid[None, :, None, :]  # [1, B, 1, S]
        s = jnp.where(vmask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rescale what was accumulated under the old max before adding this chunk.
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vmask, jnp.exp(s - m_new[..., None]), 0.0)
        # Garbage (even NaN) in slots a sequence cannot see must not reach the result
        # (0 * NaN = NaN); chunks where every slot is visible skip the masking pass.
        v = lax.cond(jnp.all(valid), lambda v: v, lambda v: jnp.where(valid[None, :, :, None], v, 0.0), v)
        l_new = l * alpha + jnp.sum(p, axis=-1)
        acc_new = acc * alpha[..., None] + jnp.einsum(
            "KBGS,KBSH->KBGH", p, v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_new

    init = (
        jnp.full((num_kv_heads, num_seqs, q_per_kv), MASK_VALUE, jnp.float32),
        jnp.zeros((num_kv_heads, num_seqs, q_per_kv), jnp.float32),
        jnp.zeros((num_kv_heads, num_seqs, q_per_kv, head_dim), jnp.float32),
    )
    if num_chunks == 1:
        m, l, acc = body(0, init)
    else:
        # Visit only chunks some sequence occupies: lengths are data, so this is a while loop.
        live = seq_lens > 0
        first = jnp.min(jnp.where(live, start, jnp.iinfo(jnp.int32).max)) // chunk_tokens
        last = -(-jnp.max(seq_lens) // chunk_tokens)
        m, l, acc = lax.fori_loop(jnp.minimum(first, last), last, body, init)
    if sinks is not None:
        m, l, acc = fold_sinks(m, l, acc, sinks.astype(jnp.float32).reshape(num_kv_heads, 1, q_per_kv))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.swapaxes(out, 0, 1)  # [B, K, G, H]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
def paged_prefill_xla(q, k_pages, v_pages, block_tables, start, chunk_lens, *, scale,
                      soft_cap=None, alibi_slopes=None, sliding_window=None, k_scales=None,
                      v_scales=None, layer=None, sinks=None):
    """Plain-JAX prefill (arguments validated). soft_cap, alibi_slopes, sliding_window and sinks are
    as in `jpa.paged_decode`, for a query at position p: ALiBi adds slope * (k_pos - p) and the
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
    if sinks is not None:
        m, l, acc = fold_sinks(m, l, acc, sinks.astype(jnp.float32).reshape(1, num_kv_heads, q_per_kv, 1))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, T, K, G, H]
    return out.reshape(num_seqs, num_tokens, num_q_heads, head_dim).astype(q.dtype)
