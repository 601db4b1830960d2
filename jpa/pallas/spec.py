"""The static description of one paged-decode or ragged call, shared by dispatch and kernels."""

from typing import NamedTuple

import numpy as np

from jpa.core.quant import is_quantized

# Derived sizes shared by both specs (NamedTuples cannot share a base class with methods).
_Q_PER_KV = property(lambda self: self.num_q_heads // self.num_kv_heads, doc="num_q_heads // num_kv_heads")
_POOL_ELEMENTS = property(
    lambda self: self.num_layers * self.num_kv_heads * self.num_pages * self.page_size * self.head_dim,
    doc="Elements of one page pool operand (K or V): num_layers * num_kv_heads * num_pages * page_size "
        "* head_dim (num_layers is 1 for a per-layer pool, L for a stacked [L, K, P, S_p, H] pool).")


class DecodeSpec(NamedTuple):
    """Everything about a paged_decode call that is fixed at trace time (hashable)."""
    q_dtype: str          # numpy dtype name of q, e.g. "bfloat16"
    cache_dtype: str      # numpy dtype name of k_pages / v_pages, e.g. "int8"
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    soft_cap: bool
    alibi: bool
    sliding_window: bool
    quantized: bool
    # The remaining shapes of the call: kernels plan their grid from num_seqs, and pool size
    # limits (32-bit offsets) depend on num_pages. Defaults describe a small call.
    num_seqs: int = 1
    num_pages: int = 1
    # Layers of a stacked pool [num_layers, K, P, S_p, H] read at a layer index; 1 = a per-layer pool.
    num_layers: int = 1
    # Attention sinks (gpt-oss): a learned per-q-head logit f32[num_q_heads] in every softmax.
    sinks: bool = False

    q_per_kv = _Q_PER_KV
    pool_elements = _POOL_ELEMENTS


class RaggedSpec(NamedTuple):
    """Everything about a ragged_paged_attention call that is fixed at trace time (hashable)."""
    q_dtype: str          # numpy dtype name of q
    cache_dtype: str      # numpy dtype name of k_pages / v_pages
    num_tokens: int       # T, the static token budget (q.shape[0])
    max_num_seqs: int     # rows of block_tables / entries of seq_lens
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    num_pages: int
    soft_cap: bool
    alibi: bool
    sliding_window: bool
    quantized: bool
    # Layers of a stacked pool [num_layers, K, P, S_p, H] read at a layer index; 1 = a per-layer pool.
    num_layers: int = 1
    # Attention sinks (gpt-oss): a learned per-q-head logit f32[num_q_heads] in every softmax.
    sinks: bool = False

    q_per_kv = _Q_PER_KV
    pool_elements = _POOL_ELEMENTS


def decode_spec(q, k_pages, block_tables, *, soft_cap, alibi_slopes, sliding_window,
                sinks=None) -> DecodeSpec:
    """The static configuration of a (validated) paged_decode call: shapes, dtypes, options."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape[-4:]
    num_seqs, pages_per_seq = block_tables.shape
    return DecodeSpec(
        q_dtype=np.dtype(q.dtype).name, cache_dtype=np.dtype(k_pages.dtype).name,
        num_q_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, pages_per_seq=pages_per_seq, soft_cap=soft_cap is not None,
        alibi=alibi_slopes is not None, sliding_window=sliding_window is not None,
        quantized=is_quantized(k_pages.dtype), num_seqs=num_seqs, num_pages=num_pages,
        num_layers=k_pages.shape[0] if k_pages.ndim == 5 else 1, sinks=sinks is not None)


def ragged_spec(q, k_pages, block_tables, *, soft_cap, alibi_slopes, sliding_window,
                sinks=None) -> RaggedSpec:
    """The static configuration of a (validated) ragged_paged_attention call."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape[-4:]
    return RaggedSpec(
        q_dtype=np.dtype(q.dtype).name, cache_dtype=np.dtype(k_pages.dtype).name,
        num_tokens=q.shape[0], max_num_seqs=block_tables.shape[0], num_q_heads=q.shape[1],
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        pages_per_seq=block_tables.shape[1], num_pages=num_pages, soft_cap=soft_cap is not None,
        alibi=alibi_slopes is not None, sliding_window=sliding_window is not None,
        quantized=is_quantized(k_pages.dtype), num_layers=k_pages.shape[0] if k_pages.ndim == 5 else 1,
        sinks=sinks is not None)
