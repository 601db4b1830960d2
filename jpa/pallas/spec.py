"""The static description of one paged-decode or ragged call, shared by dispatch and kernels."""

from typing import NamedTuple


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

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads


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
    soft_cap: bool
    alibi: bool
    sliding_window: bool
    quantized: bool

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads
