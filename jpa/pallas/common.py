"""Math shared by the Pallas kernels of both backends (plain jnp; all but `layer_index` runs outside
the kernels).

Split-K (flash-decoding / vLLM v2): each partition of a sequence's keys produces an
unnormalized accumulator acc_p, its running max m_p and running sum l_p. The partitions are
combined with a log-sum-exp merge:

    M = max_p m_p,  w_p = exp(m_p - M),  out = sum_p w_p acc_p / sum_p w_p l_p

An empty partition has m_p = MASK_VALUE, l_p = 0 and acc_p = 0, so it contributes nothing; a
sequence with no keys at all gets l = 0 and a zero output (never NaN).

Pool layouts (every kernel takes both): a per-layer pool `[K, P, S_p, H]` with `layer=None`, or a
stacked pool `[L, K, P, S_p, H]` (all layers in one buffer, carried through a scan over layers)
with a layer index, passed to the kernel whole next to the index (`pool_layout`, `layer_operand`).
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from jpa.core.numerics import MASK_VALUE  # noqa: F401  (re-exported: kernels use the same mask)


def pool_layout(k_pages, layer):
    """(num_layers or None, num_kv_heads, num_pages, page_size, head_dim) of a page pool, checking
    that its rank matches `layer`: 4-D [K, P, S_p, H] with layer None, 5-D [L, K, P, S_p, H] with
    a layer index. num_layers is None for a per-layer pool."""
    if layer is None:
        if k_pages.ndim != 4:
            raise ValueError(f"with layer=None the page pools are [num_kv_heads, num_pages, page_size, "
                             f"head_dim]; got shape {k_pages.shape} (a stacked 5-D pool needs `layer`)")
        return (None, *k_pages.shape)
    if k_pages.ndim != 5:
        raise ValueError(f"with a layer index the page pools are stacked [num_layers, num_kv_heads, "
                         f"num_pages, page_size, head_dim]; got shape {k_pages.shape}")
    if jnp.shape(layer) not in ((), (1,)) or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar; got {layer!r}")
    return tuple(k_pages.shape)


def layer_operand(layer):
    """The layer index as the kernels' i32[1] operand (a free reshape of an i32 scalar)."""
    return jnp.asarray(layer, jnp.int32).reshape(1)


def layer_index(layer_ref, num_layers):
    """The layer of a stacked pool, read inside a kernel from its i32[1] operand and clamped into
    [0, num_layers) (like a page: an out-of-range layer must never address outside the pool)."""
    return jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)


def merge_partitions(acc, m, l, out_dtype, sinks=None):
    """Merges per-partition online-softmax states along axis `-3` of acc / `-2` of m and l.

    Args:
      acc: f32[..., num_partitions, rows, head_dim] unnormalized accumulators.
      m: f32[..., num_partitions, rows] running maxima.
      l: f32[..., num_partitions, rows] running sums.
      out_dtype: dtype of the result.
      sinks: None, or f32 logits broadcastable to [..., rows] (attention sinks): each joins its
        row's softmax as one more column with a zero value. Folded in here, at the split-K
        combine, as a partition of its own (m = sink, l = 1, acc = 0): exact for any number of
        partitions, and an empty sequence (every l 0) gives 0.

    Returns:
      [..., rows, head_dim] in out_dtype.
    """
    m_max = jnp.max(m, axis=-2, keepdims=True)  # [..., 1, rows]
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks.astype(jnp.float32), m_max.shape[:-2] + m_max.shape[-1:])
        m_max = jnp.maximum(m_max, sinks[..., None, :])
    w = jnp.exp(m - m_max)  # [..., num_partitions, rows]
    l_tot = jnp.sum(w * l, axis=-2)  # [..., rows]
    if sinks is not None:
        l_tot = l_tot + jnp.exp(sinks - m_max[..., 0, :])
    acc_tot = jnp.sum(w[..., None] * acc, axis=-3)  # [..., rows, head_dim]
    out = jnp.where(l_tot[..., None] > 0, acc_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)
    return out.astype(out_dtype)


def max_query_tiles(num_tokens: int, max_num_seqs: int, tile_tokens: int) -> int:
    """Tile slots that hold any batch: sequences with q_len_i summing to at most num_tokens,
    at most max_num_seqs of them, cut into tiles of tile_tokens, make at most
    sum_i ceil(q_len_i / tile_tokens) <= (num_tokens + max_num_seqs * (tile_tokens - 1)) / tile_tokens
    tiles, and never more than num_tokens (every tile holds a token)."""
    return max(1, min(num_tokens, (num_tokens + max_num_seqs * (tile_tokens - 1)) // tile_tokens))


def query_tiles(cu_q_lens, seq_lens, num_seqs, *, num_tokens, tile_tokens, num_tiles,
                skip_last=False):
    """Cuts each live sequence's query rows into tiles of at most `tile_tokens` tokens.

    A tile never spans two sequences, so a tile's keys are one sequence's pages. The map is a
    few vector ops on i32[max_num_seqs] (a cumsum and a search), run as plain JAX before the
    kernel; rows past cu_q_lens[num_seqs] (padding) get no tile.

    Args:
      cu_q_lens: i32[max_num_seqs + 1]; sequence i owns rows cu_q_lens[i]:cu_q_lens[i + 1].
      seq_lens: i32[max_num_seqs], tokens cached per sequence (its query rows are the last ones).
      num_seqs: i32[], live sequences; entries past it are ignored.
      num_tokens: T, rows of q (static). Tiles are clamped into [0, T) whatever the data.
      tile_tokens: query tokens per tile (static).
      num_tiles: tile slots (static), e.g. `max_query_tiles(...)`.
      skip_last: leave out each sequence's last query row.

    Returns:
      (seq, row0, ntok, pos0), each i32[num_tiles]: tile w holds query rows
      row0[w] + [0, ntok[w]) of sequence seq[w], at positions pos0[w] + [0, ntok[w]) of that
      sequence. Live tiles come first, in row order; the other slots have ntok = 0 and seq,
      row0, pos0 = 0.
    """
    max_num_seqs = seq_lens.shape[0]
    live = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs  # [max_num_seqs]
    q_lens = jnp.where(live, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)  # i32[max_num_seqs]
    rows = jnp.maximum(q_lens - 1, 0) if skip_last else q_lens  # i32[max_num_seqs]
    n = (rows + tile_tokens - 1) // tile_tokens  # i32[max_num_seqs], tiles per sequence
    ends = jnp.cumsum(n)  # i32[max_num_seqs], inclusive
    w = jnp.arange(num_tiles, dtype=jnp.int32)  # i32[num_tiles]
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), max_num_seqs - 1).astype(jnp.int32)
    local = w - (ends - n)[seq]  # i32[num_tiles], tile index within its sequence
    ntok = jnp.clip(rows[seq] - local * tile_tokens, 0, tile_tokens)
    ntok = jnp.where(w < ends[-1], ntok, 0)  # i32[num_tiles]
    live_tile = ntok > 0
    row0 = jnp.clip(cu_q_lens[seq] + local * tile_tokens, 0, num_tokens - ntok)
    pos0 = jnp.maximum(seq_lens[seq] - q_lens[seq] + local * tile_tokens, 0)
    zero = jnp.zeros_like(w)
    return (jnp.where(live_tile, seq, zero), jnp.where(live_tile, row0, zero), ntok,
            jnp.where(live_tile, pos0, zero))


def last_rows(cu_q_lens, num_seqs, *, num_tokens):
    """Each sequence's last query row: a decode query at position seq_len - 1.

    Returns:
      (row i32[max_num_seqs], has_rows bool[max_num_seqs]): row clamped into [0, num_tokens);
      has_rows false for sequences past num_seqs or with q_len 0.
    """
    max_num_seqs = cu_q_lens.shape[0] - 1
    live = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs  # [max_num_seqs]
    has_rows = live & (cu_q_lens[1:] > cu_q_lens[:-1])  # [max_num_seqs]
    return jnp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1), has_rows


def decode_last_rows(decode_fn, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs,
                     **opts):
    """Runs `decode_fn` (a paged_decode implementation) on every sequence's last query row.

    Returns [num_tokens, num_q_heads, head_dim] in q's dtype: those rows filled, all others zero.
    """
    num_tokens = q.shape[0]
    row, has_rows = last_rows(cu_q_lens, num_seqs, num_tokens=num_tokens)
    q_last = jnp.where(has_rows[:, None, None], q[row], 0)  # [max_num_seqs, N, H]; padding may be NaN
    out_last = decode_fn(q_last, k_pages, v_pages, block_tables, jnp.where(has_rows, seq_lens, 0),
                         **opts)  # [max_num_seqs, N, H]
    out = jnp.zeros(q.shape, q.dtype)  # [T, N, H]
    return out.at[jnp.where(has_rows, row, num_tokens)].set(out_last, mode="drop")


@dataclasses.dataclass(frozen=True)
class TuningRow:
    """One entry of a kernel family's tuning table (`jpa/pallas/<backend>/tuning.py`).

    The row serves GPUs of compute capability in [min, max) (`compute_capability` None: any GPU,
    an unknown one and interpret mode: a fallback row, last in its table), head_dim in
    head_dims[0] .. head_dims[1] (inclusive) and, when `compute_dtypes` is given, only those dot
    operand dtypes (numpy names). `measured` says what was measured for this row and where; an
    empty string marks an unmeasured default."""
    gpus: str
    compute_capability: tuple | None
    tuning: Any
    measured: str = ""
    head_dims: tuple = (1, 1 << 30)
    compute_dtypes: tuple | None = None

    def matches(self, compute_capability, head_dim: int, compute_dtype: str | None = None) -> bool:
        if self.compute_capability is not None:
            lo, hi = self.compute_capability
            if compute_capability is None or not lo <= compute_capability < hi:
                return False
        if not self.head_dims[0] <= head_dim <= self.head_dims[1]:
            return False
        return self.compute_dtypes is None or compute_dtype in self.compute_dtypes


def lookup_tuning(table, compute_capability, head_dim: int, compute_dtype: str | None = None) -> TuningRow:
    """The first row of `table` that serves (compute capability, head_dim, compute dtype)."""
    for row in table:
        if row.matches(compute_capability, head_dim, compute_dtype):
            return row
    raise LookupError(f"no tuning row for compute capability {compute_capability}, head_dim "
                      f"{head_dim}, compute dtype {compute_dtype}: a table must end with fallback rows")
