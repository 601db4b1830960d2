"""The static description of one paged-decode or ragged call, shared by dispatch and kernels."""

from typing import NamedTuple

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
