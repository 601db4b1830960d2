"""Ragged paged attention (prefill chunks and decode tokens in one call), Pallas Triton backend.

Two kernels in one jitted program, both over the whole page pools:

1. Every sequence's LAST query row is a decode query (position seq_len - 1). All of them go
   through the decode kernel (`jpa.pallas.triton.decode`, grid (max_num_seqs, kv heads,
   partitions)), which brings split-K for long contexts: a decode-heavy batch with few sequences
   still fills the GPU.
   Slots past num_seqs have length 0 and load nothing.
2. The other rows (the body of prefill chunks) go through this file's kernel, grid
   (num_tiles, num_kv_heads). A query tile is up to `tile_tokens` consecutive rows of ONE
   sequence; the tile -> (sequence, first row, row count, first position) map is computed in
   plain JAX in the wrapper (`jpa.pallas.common.query_tiles`: a cumsum and a search over
   i32[max_num_seqs]), so a program reads four scalars to find its work. The number of tile slots
   is static (`max_query_tiles`: enough for any mix under the token budget); slots past the live
   tiles load and store nothing, so a decode-only step costs this kernel only its launch.

GQA is packed into the MMA rows: the tile_tokens x q_per_kv query heads that share kv head h are
the `rows` rows of one operand (row r = token r // q_per_kv, q head h * q_per_kv + r % q_per_kv),
so K/V of a page are loaded once for all of them. Program (w, h) walks its sequence's keys
block_k tokens per step from the first key any of its rows may see (sliding window) to its last
query position (causal bound), gathering each key through the block table (pages are never
copied), with the decode kernel's key step (`pipeline`: gather, scores, online softmax with running
max m, sum l, f32 accumulator). Each row is masked causally (key pos <= its own query pos) and by
the window; masked loads make keys outside the tile's range cost no memory traffic, so NaN in
unused slots never reaches the result.

Pool layouts: per layer `[K, P, S_p, H]` (`layer=None`) or stacked `[L, K, P, S_p, H]` with a
layer index (an i32 scalar, traced in a scan over layers), as in the decode kernel: both kernels get
the whole pools (block `(L, None, P, S_p, H_pad)`: every layer of kv head h) and the layer as an
`i32[1]` operand, added to the in-kernel gather index (`k_ref.at[layer, page, offset, column]`).

The output buffer (zeros with the last rows scattered in) is aliased into and out of the kernel;
each program scatters its live rows into it, so padding rows stay zero.

Trade-offs (static, from shapes; lengths are data; the values are `tuning.RAGGED_TABLE`'s):
- rows = 64 MMA rows (16 for head_dim > 128): a prefill tile of 64 / q_per_kv tokens reads its
  sequence's K/V once for all of them.
- Prefill tiles have no split-K (their parallelism comes from the tiles themselves); a chunk's
  last row is read once more by the decode kernel (1 / num_tiles_of_the_chunk extra traffic).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jpa.pallas.common import (decode_last_rows, layer_index, layer_operand, max_query_tiles, pool_layout,
                               query_tiles)
from jpa.pallas.spec import RaggedSpec
from jpa.pallas.triton import decode as triton_decode
from jpa.pallas.triton import tuning as tuning_table
from jpa.pallas.triton.pipeline import (MIN_BLOCK_K, MIN_ROWS, compute_dtype, load_kv, next_pow2, pool_specs,
                                        scores, softmax_init, softmax_step)
from jpa.pallas.triton.tuning import DecodeTuning, RaggedTuning


class Plan(NamedTuple):
    """Static launch parameters chosen by `plan`."""
    rows: int            # MMA rows per program (a power of two >= 16)
    tile_tokens: int     # query tokens per tile: rows // q_per_kv
    block_k: int         # key tokens per inner step (a power of two >= 16)
    head_dim_pad: int    # head_dim padded to a power of two >= 16
    num_tiles: int       # grid extent along tiles


def plan(num_tokens: int, max_num_seqs: int, q_per_kv: int, head_dim: int, page_size: int,
         pages_per_seq: int, rows: int | None = None, f32: bool = False, *,
         tuning: RaggedTuning | None = None) -> Plan:
    """Chooses tile sizes from static shapes.

    - tuning None: `tuning.ragged_tuning(None, head_dim, "float32" if f32 else None)`, whose rows
      differ by head_dim (> 128: 16 rows) and by float32 compute (`f32`: half the key tile).
    - rows: tuning.rows, or `rows` when given, at least q_per_kv rounded up to a power of two
      (one token's heads always fit a tile).
    - block_k: tuning.tile_elements / head_dim_pad key tokens per step, at least 16, at most the
      longest context rounded up to a power of two.
    - num_tiles: `max_query_tiles(num_tokens, max_num_seqs, tile_tokens)`.
    """
    tuning = tuning or tuning_table.ragged_tuning(None, head_dim, "float32" if f32 else None)
    head_dim_pad = max(16, next_pow2(head_dim))
    if rows is None:
        rows = tuning.rows
    rows = max(MIN_ROWS, next_pow2(rows), next_pow2(q_per_kv))
    tile_tokens = rows // q_per_kv
    max_tokens = pages_per_seq * page_size
    block_k = max(MIN_BLOCK_K, min(tuning.tile_elements // head_dim_pad, next_pow2(max_tokens)))
    num_tiles = max_query_tiles(num_tokens, max_num_seqs, tile_tokens)
    return Plan(rows, tile_tokens, block_k, head_dim_pad, num_tiles)


def _kernel(seq_ref, row0_ref, ntok_ref, pos0_ref, tables_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref,
            slopes_ref, sinks_ref, layer_ref, _out_in_ref, out_ref, *, scale, soft_cap, sliding_window, page_size,
            pages_per_seq, q_per_kv, head_dim, rows, block_k, compute_dtype):
    """One (query tile w, kv head h) program.

    Refs (whole arrays unless noted):
      seq_ref, row0_ref, ntok_ref, pos0_ref: i32[num_tiles], the tile map (`query_tiles`).
      tables_ref: i32[max_num_seqs, pages_per_seq].
      q_ref: [num_tokens, num_q_heads, head_dim_pad] view of q (masked to head_dim).
      k_ref, v_ref: [num_pages, page_size, head_dim_pad] view of kv head h's whole pool, or
        [num_layers, num_pages, page_size, head_dim_pad] for a stacked pool (layer_ref given).
      ks_ref, vs_ref: f32[(num_layers,) num_pages, page_size] views (kv head h) or None.
      slopes_ref: f32[num_q_heads] or None.
      sinks_ref: f32[num_q_heads] (attention sinks) or None.
      layer_ref: i32[1], the layer of a stacked pool, or None (per-layer pool).
      _out_in_ref: the output buffer as an input (aliased to out_ref; unused).
      out_ref: [num_tokens, num_q_heads, head_dim_pad] view of the output.
    """
    w = pl.program_id(0)
    h = pl.program_id(1)
    seq, row0, ntok, pos0 = seq_ref[w], row0_ref[w], ntok_ref[w], pos0_ref[w]
    head_dim_pad = q_ref.shape[-1]
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)  # i32[rows]
    tok = r // q_per_kv  # i32[rows], token of the tile
    head = h * q_per_kv + r % q_per_kv  # i32[rows], q head
    row_ok = tok < ntok  # [rows]; rows past q_per_kv * tile_tokens have tok >= ntok
    cols = lax.broadcasted_iota(jnp.int32, (head_dim_pad,), 0)  # i32[head_dim_pad]
    col_ok = cols < head_dim  # [head_dim_pad]
    io_ok = row_ok[:, None] & col_ok[None, :]  # [rows, head_dim_pad]
    io = (rows, head_dim_pad)
    # Integer-array indexing (one index array per dim, all [rows, head_dim_pad]): one pointer
    # tensor in Triton, one gather/scatter in interpret mode.
    tok_ix = jnp.broadcast_to((row0 + tok)[:, None], io)
    head_ix = jnp.broadcast_to(head[:, None], io)
    col_ix = jnp.broadcast_to(cols[None, :], io)
    q = plgpu.load(q_ref.at[tok_ix, head_ix, col_ix], mask=io_ok, other=0.0)  # [rows, head_dim_pad]
    q = q.astype(compute_dtype)
    if slopes_ref is not None:
        slopes = plgpu.load(slopes_ref.at[head], mask=row_ok, other=0.0).astype(jnp.float32)  # [rows]
    # Clamped like a page: a layer outside the pool must never form a wild pointer.
    layer = layer_index(layer_ref, k_ref.shape[0]) if layer_ref is not None else None
    q_pos = pos0 + tok  # i32[rows], position of each row's query in its sequence
    # Keys any row of the tile may see: [kv_lo, kv_end). kv_end - 1 is the last query position.
    kv_end = pos0 + ntok
    kv_lo = jnp.maximum(pos0 - sliding_window + 1, 0) if sliding_window is not None else 0
    last = jnp.where(ntok > 0, (kv_end + block_k - 1) // block_k, 0)
    first = jnp.minimum(kv_lo // block_k, last)

    def body(step, carry):
        pos = step * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # i32[S]
        valid = (pos < kv_end) & (pos >= kv_lo)  # [S], keys some row of the tile sees
        logical = jnp.minimum(pos // page_size, pages_per_seq - 1)  # i32[S]
        page = plgpu.load(tables_ref.at[jnp.full_like(logical, seq), logical])  # i32[S]
        k, v, scale_ix = load_kv(k_ref, v_ref, page, pos, valid, cols, col_ok, layer,
                                 page_size=page_size)  # [S, head_dim_pad] each
        s = scores(q, k, ks_ref, scale_ix, valid, scale=scale, soft_cap=soft_cap,
                   compute_dtype=compute_dtype)  # [rows, S]
        rel = pos[None, :] - q_pos[:, None]  # i32[rows, S], key pos - query pos
        if slopes_ref is not None:
            s = s + slopes[:, None] * rel.astype(jnp.float32)
        # Causal within the chunk (rel <= 0), the window per row, and the tile's key range.
        vis = valid[None, :] & (rel <= 0)  # [rows, S]
        if sliding_window is not None:
            vis = vis & (rel > -sliding_window)
        return softmax_step(carry, s, vis, v, vs_ref, scale_ix, valid, compute_dtype=compute_dtype)

    m, l, acc = lax.fori_loop(first, last, body, softmax_init(rows, head_dim_pad))
    if sinks_ref is not None:
        # The sink joins each row's softmax as a column of value 0: (m = sink, l = 1, acc = 0)
        # merged into the final state (a program holds all of its rows' keys: exact).
        sink = plgpu.load(sinks_ref.at[head], mask=row_ok, other=0.0).astype(jnp.float32)  # [rows]
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.exp(sink - m_new)
        acc = acc * alpha[:, None]
    # Every live row sees at least its own key, so l > 0 there; the guard keeps dead rows finite.
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # [rows, head_dim_pad]
    plgpu.store(out_ref.at[tok_ix, head_ix, col_ix], out.astype(out_ref.dtype), mask=io_ok)


def unsupported_reason(spec: RaggedSpec, compute_capability: float | None = None) -> str | None:
    """Why this kernel cannot serve `spec` on a GPU of `compute_capability` (None: skip
    device-specific limits), or None when it can.

    The per-step work is the decode kernel's (same key tiles, dtypes and pool gathers), so the
    limits are the decode kernel's: head_dim <= 256, float8_e4m3fn only from compute capability
    8.9, and no 1-byte pool that needs 64-bit offsets."""
    return triton_decode.unsupported_reason(spec, compute_capability)


def _tile_rows(q, k_pages, v_pages, block_tables, tiles, alibi_slopes, k_scales, v_scales, layer, out, *,
               scale, soft_cap, sliding_window, interpret, tile_plan, cdt, tuning, sinks=None):
    """Runs the tile kernel with the launch `tile_plan` (`plan`) over `tiles` (`query_tiles`: 4 x
    i32[num_tiles]), writing into `out` [T, N, H] (aliased): the other rows keep their values.
    cdt: the dot operands' dtype. Returns the filled [T, N, H] in q's dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = pool_layout(k_pages, layer)
    max_num_seqs, pages_per_seq = block_tables.shape
    q_per_kv = num_q_heads // num_kv_heads
    p, hp = tile_plan, tile_plan.head_dim_pad
    quantized = k_scales is not None
    kernel = functools.partial(
        _kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        page_size=page_size, pages_per_seq=pages_per_seq, q_per_kv=q_per_kv,
        head_dim=head_dim, rows=p.rows, block_k=p.block_k, compute_dtype=cdt)
    whole = lambda shape: pl.BlockSpec(shape, lambda w, h: (0,) * len(shape))  # noqa: E731
    tile_spec = whole((p.num_tiles,))
    pool_spec, scale_spec = pool_specs(num_layers, num_pages, page_size, hp)
    io_spec = whole((num_tokens, num_q_heads, hp))
    in_specs = [
        tile_spec, tile_spec, tile_spec, tile_spec,
        whole((max_num_seqs, pages_per_seq)),  # block_tables
        io_spec,  # q
        pool_spec, pool_spec,  # k_pages, v_pages: whole pools, kv head h selected by the index map
        scale_spec if quantized else None, scale_spec if quantized else None,
        whole((num_q_heads,)) if alibi_slopes is not None else None,
        whole((num_q_heads,)) if sinks is not None else None,
        whole((1,)) if num_layers is not None else None,  # layer
        io_spec,  # the output buffer, last rows already filled
    ]
    slopes = alibi_slopes.astype(jnp.float32) if alibi_slopes is not None else None
    layer_arr = layer_operand(layer) if num_layers is not None else None  # i32[1]
    sinks = sinks.astype(jnp.float32) if sinks is not None else None
    operands = (*tiles, block_tables, q, k_pages, v_pages, k_scales, v_scales, slopes, sinks, layer_arr,
                out)
    out_index = sum(x is not None for x in operands) - 1  # None operands are dropped
    return pl.pallas_call(
        kernel,
        grid=(p.num_tiles, num_kv_heads),
        in_specs=in_specs,
        out_specs=io_spec,
        out_shape=jax.ShapeDtypeStruct(out.shape, q.dtype),
        input_output_aliases={out_index: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        name=f"jpa_ragged_rows{p.rows}_bk{p.block_k}",
    )(*operands)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret",
                                             "rows", "partition_tokens", "tuning", "decode_tuning"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *,
                           scale, soft_cap=None, alibi_slopes=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False, rows=None,
                           partition_tokens=None, layer=None, tuning: RaggedTuning | None = None,
                           decode_tuning: DecodeTuning | None = None, sinks=None):
    """Ragged paged attention with the Triton-backend Pallas kernel. Arguments as
    `jpa.ragged_paged_attention` (already validated there).

    Args:
      q: [num_tokens, num_q_heads, head_dim].
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] with layer None, or a
        stacked pool [num_layers, num_kv_heads, num_pages, page_size, head_dim] with a layer
        index. Either way passed to both kernels whole (never sliced).
      block_tables: i32[max_num_seqs, pages_per_seq].
      seq_lens: i32[max_num_seqs].
      cu_q_lens: i32[max_num_seqs + 1].
      num_seqs: i32[].
      scale, soft_cap, alibi_slopes, sliding_window: as the public function.
      k_scales, v_scales: f32[(num_layers,) num_kv_heads, num_pages, page_size] (stacked like the
        pools) for quantized caches, else None.
      interpret: run on CPU in Pallas interpret mode.
      rows: override the MMA rows per program (tests, tuning); None = `plan`.
      partition_tokens: override the decode kernel's split-K partition size; None = its plan.
      layer: None (per-layer pools), or the layer of a stacked pool: a Python int or a traced
        i32[] (one compiled program serves every layer), expected in [0, num_layers) and clamped
        into it by the kernels.
      tuning: a `RaggedTuning` (static) for the tile kernel; None takes
        `tuning.ragged_tuning(None, head_dim, compute dtype)` (RAGGED_TABLE's fallback rows).
      decode_tuning: a `DecodeTuning` for the last rows' decode kernel; None: its default.
      sinks: f32[num_q_heads] attention sinks or None: the decode kernel folds them in at its
        split-K combine, the tile kernel into each row's final softmax state.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype; zeros at padding rows.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = pool_layout(k_pages, layer)
    max_num_seqs, pages_per_seq = block_tables.shape
    q_per_kv = num_q_heads // num_kv_heads
    cdt = compute_dtype(q.dtype, k_pages.dtype)
    tuning = tuning or tuning_table.ragged_tuning(None, head_dim, cdt.name)
    p = plan(num_tokens, max_num_seqs, q_per_kv, head_dim, page_size, pages_per_seq, rows,
             f32=cdt == jnp.float32, tuning=tuning)
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    opts = dict(scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales, sinks=sinks)
    # 1. Each sequence's last row (every decode token) through the split-K decode kernel.
    decode = functools.partial(triton_decode.paged_decode, interpret=interpret,
                               partition_tokens=partition_tokens, layer=layer, tuning=decode_tuning)
    out = decode_last_rows(decode, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                           num_seqs, **opts)  # [T, N, H]
    # 2. The other rows through this file's kernel, written into the same buffer.
    tiles = query_tiles(cu_q_lens, seq_lens, num_seqs, num_tokens=num_tokens,
                        tile_tokens=p.tile_tokens, num_tiles=p.num_tiles,
                        skip_last=True)  # 4 x i32[num_tiles]
    return _tile_rows(q, k_pages, v_pages, block_tables, tiles, alibi_slopes, k_scales, v_scales,
                      layer, out, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                      interpret=interpret, tile_plan=p, cdt=cdt, tuning=tuning, sinks=sinks)
