"""Paged decode attention as a Pallas kernel on the Triton backend (Ampere and later), with split-K.

Einsum letters: B num_seqs, K num_kv_heads, G q_per_kv, H head_dim, S key tokens of one step.

Grid: (num_seqs, num_kv_heads, num_partitions). One program owns every q head of one kv head
(the G rows of "BKGH"), so each K/V tile it loads from HBM is used by all G heads: a GQA step
reads the cache once, not G times. A program walks the key tokens of its partition in steps of
`block_k` tokens; for each step it looks the pages up in the block table, gathers the K/V rows
("slot = block_tables[b, t // page_size], t % page_size") straight out of the WHOLE page pools,
and folds them into an online softmax (running max m, running sum l, f32 accumulator acc).

Why the page pools are whole operands: a custom-call operand that is a slice of the cache is
materialized by XLA (a full copy per layer per step). The pools go in untouched; the block spec
only selects the kv head (an in-kernel pointer offset), and the page gather is in-kernel.

Two pool layouts (`paged_decode`'s `layer`):
- per layer, `[K, P, S_p, H]` (`layer=None`): one buffer per layer, the kernel reads all of it;
- stacked, `[L, K, P, S_p, H]` with a layer index (an i32 scalar, traced inside a scan over layers):
  the WHOLE stacked pool is the operand. The layer travels as an `i32[1]` operand; the block spec
  spans the layer axis (block `(L, None, P, S_p, H_pad)`, kv head h selected as before) and the
  kernel adds the layer to its gather index (`k_ref.at[layer, page, offset, column]`), so a layer
  costs a scalar offset, never a copy. Pallas Triton forms offsets in 32 bits unless the whole
  operand is above 2**32 bytes, so a stacked pool over 4 GiB gets 64-bit offsets (see
  `unsupported_reason` for the one size it refuses).

Why the loop bounds are dynamic: lengths are data. A program whose partition lies past its
sequence's end (or wholly before a sliding window) runs zero iterations and loads no page.

Split-K (flash-decoding): long contexts are cut into partitions that run as separate programs;
each writes its unnormalized (acc, m, l), merged by `jpa.pallas.common.merge_partitions`.

Triton blocks need power-of-two shapes: head_dim is padded to `head_dim_pad` (80 -> 128) and
q_per_kv to `rows` (>= 16 so `tl.dot` can use tensor cores); padded columns/rows are masked on
every load and store, so neither the cache nor the outputs are ever padded in memory.

The key step (gather, scores, online softmax) is `pipeline`'s, shared with the ragged kernel; the
tiling (`tuning.DecodeTuning`: tile size, split-K partitions, warps, stages) is an argument whose
default comes from `tuning.DECODE_TABLE`.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jpa.pallas.common import layer_index, layer_operand, merge_partitions, pool_layout
from jpa.pallas.spec import DecodeSpec
from jpa.pallas.triton import tuning as tuning_table
from jpa.pallas.triton.pipeline import (MIN_BLOCK_K, MIN_ROWS, compute_dtype, load_kv, next_pow2, pool_specs,
                                        scores, softmax_init, softmax_step)
from jpa.pallas.triton.tuning import DecodeTuning

MAX_HEAD_DIM = 256


class Plan(NamedTuple):
    """Static launch parameters chosen by `plan`."""
    block_k: int           # key tokens per inner step (a power of two >= 16)
    partition_tokens: int  # key tokens per split-K partition (a multiple of block_k)
    num_partitions: int    # grid extent along the partition axis
    rows: int              # q_per_kv padded to a power of two >= 16
    head_dim_pad: int      # head_dim padded to a power of two >= 16


def plan(num_seqs: int, num_kv_heads: int, q_per_kv: int, head_dim: int, page_size: int,
         pages_per_seq: int, partition_tokens: int | None = None, *,
         tuning: DecodeTuning | None = None) -> Plan:
    """Chooses tile and split-K sizes from static shapes (lengths are data, so the worst case).

    - block_k (key tokens per inner step) = tuning.tile_elements / head_dim_pad, at least 16, at
      most the longest context rounded up to a power of two. A step spans block_k / page_size pages
      (or part of one page when pages are larger than a step: the gather is per token).
    - One partition (no split-K) when the longest context fits in tuning.partition_tokens, or when
      num_seqs * num_kv_heads already fills the GPU (tuning.full_grid_programs) and contexts are at
      most tuning.no_split_max_tokens. Otherwise partitions of tuning.partition_tokens tokens (a
      multiple of block_k and of page_size).
    - tuning None: `tuning.decode_tuning(None, head_dim)`.
    """
    tuning = tuning or tuning_table.decode_tuning(None, head_dim)
    head_dim_pad = max(16, next_pow2(head_dim))
    rows = max(MIN_ROWS, next_pow2(q_per_kv))
    max_tokens = pages_per_seq * page_size
    block_k = max(MIN_BLOCK_K, min(tuning.tile_elements // head_dim_pad, next_pow2(max_tokens)))
    if partition_tokens is not None:  # an explicit size (tests, tuning) also bounds the step
        block_k = max(MIN_BLOCK_K, min(block_k, next_pow2(partition_tokens)))
    else:
        one_pass = max_tokens <= tuning.partition_tokens or (
            num_seqs * num_kv_heads >= tuning.full_grid_programs
            and max_tokens <= tuning.no_split_max_tokens)
        partition_tokens = max_tokens if one_pass else tuning.partition_tokens
    # A partition is a whole number of steps.
    partition_tokens = -(-partition_tokens // block_k) * block_k
    num_partitions = -(-max_tokens // partition_tokens)
    return Plan(block_k, partition_tokens, num_partitions, rows, head_dim_pad)


def _kernel(seq_lens_ref, tables_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, slopes_ref, layer_ref,
            acc_ref, m_ref, l_ref, *, scale, soft_cap, sliding_window, page_size,
            pages_per_seq, q_per_kv, head_dim, block_k, partition_tokens, compute_dtype):
    """One (sequence b, kv head, partition) program.

    Refs (block views):
      seq_lens_ref: i32[num_seqs] (whole); tables_ref: i32[pages_per_seq] (row b)
      q_ref: [rows, head_dim_pad] view of q [B, K, G, H] (masked to G x H)
      k_ref, v_ref: [num_pages, page_size, head_dim_pad] view of this kv head's whole pool, or
        [num_layers, num_pages, page_size, head_dim_pad] for a stacked pool (layer_ref given)
      ks_ref, vs_ref: f32[(num_layers,) num_pages, page_size] or None; slopes_ref: f32[rows] view or None
      layer_ref: i32[1], the layer of a stacked pool, or None (per-layer pool)
      acc_ref: f32[rows, head_dim_pad]; m_ref, l_ref: f32[rows] (views of [B, K, parts, G(, H)])
    """
    b = pl.program_id(0)
    part = pl.program_id(2)
    rows, head_dim_pad = q_ref.shape
    row_ok = lax.broadcasted_iota(jnp.int32, (rows,), 0) < q_per_kv  # [rows]
    cols = lax.broadcasted_iota(jnp.int32, (head_dim_pad,), 0)  # i32[head_dim_pad]
    col_ok = cols < head_dim  # [head_dim_pad]
    q = plgpu.load(q_ref, mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [rows, head_dim_pad]
    q = q.astype(compute_dtype)
    if slopes_ref is not None:
        slopes = plgpu.load(slopes_ref, mask=row_ok, other=0.0).astype(jnp.float32)  # [rows]
    # Clamped like a page: a layer outside the pool must never form a wild pointer.
    layer = layer_index(layer_ref, k_ref.shape[0]) if layer_ref is not None else None

    seq_len = seq_lens_ref[b]
    # First visible token: the sliding window hides everything before it.
    start = jnp.maximum(seq_len - sliding_window, 0) if sliding_window is not None else 0
    part_lo = part * partition_tokens
    # Steps [first, last) of this partition hold visible tokens; none when it lies past the end
    # of the sequence or wholly before the window, so such a program loads no page at all.
    last = jnp.maximum(jnp.minimum(seq_len - part_lo, partition_tokens), 0)
    last = (last + block_k - 1) // block_k
    first = jnp.minimum(jnp.maximum(start - part_lo, 0) // block_k, last)

    def body(step, carry):
        pos = part_lo + step * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # i32[S]
        valid = (pos < seq_len) & (pos >= start)  # [S]
        logical = jnp.minimum(pos // page_size, pages_per_seq - 1)  # i32[S]
        page = tables_ref[logical]  # i32[S] physical page of each token
        k, v, scale_ix = load_kv(k_ref, v_ref, page, pos, valid, cols, col_ok, layer,
                                 page_size=page_size)  # [S, head_dim_pad] each
        s = scores(q, k, ks_ref, scale_ix, valid, scale=scale, soft_cap=soft_cap,
                   compute_dtype=compute_dtype)  # [rows, S] "GH,SH->GS"
        if slopes_ref is not None:
            rel = (pos - seq_len + 1).astype(jnp.float32)  # [S]
            s = s + slopes[:, None] * rel[None, :]
        # Every row is the query at seq_len - 1: all rows see the same keys.
        return softmax_step(carry, s, valid[None, :], v, vs_ref, scale_ix, valid,
                            compute_dtype=compute_dtype)

    m, l, acc = lax.fori_loop(first, last, body, softmax_init(rows, head_dim_pad))
    plgpu.store(acc_ref, acc, mask=row_ok[:, None] & col_ok[None, :])
    plgpu.store(m_ref, m, mask=row_ok)
    plgpu.store(l_ref, l, mask=row_ok)


def _partials(q, k_pages, v_pages, block_tables, seq_lens, alibi_slopes, k_scales, v_scales, layer, *,
              scale, soft_cap, sliding_window, interpret, partition_tokens, tuning):
    """Runs the kernel. Returns (acc f32[B, K, parts, G, H], m f32[B, K, parts, G], l likewise)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = pool_layout(k_pages, layer)
    pages_per_seq = block_tables.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    cdt = compute_dtype(q.dtype, k_pages.dtype)
    tuning = tuning or tuning_table.decode_tuning(None, head_dim, cdt.name)
    p = plan(num_seqs, num_kv_heads, q_per_kv, head_dim, page_size, pages_per_seq, partition_tokens,
             tuning=tuning)
    rows, hp, parts = p.rows, p.head_dim_pad, p.num_partitions

    qg = q.reshape(num_seqs, num_kv_heads, q_per_kv, head_dim)  # [B, K, G, H] (free reshape)
    quantized = k_scales is not None
    kernel = functools.partial(
        _kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        page_size=page_size, pages_per_seq=pages_per_seq, q_per_kv=q_per_kv,
        head_dim=head_dim, block_k=p.block_k, partition_tokens=p.partition_tokens,
        compute_dtype=cdt)
    pool_spec, scale_spec = pool_specs(num_layers, num_pages, page_size, hp)
    in_specs = [
        pl.BlockSpec((num_seqs,), lambda b, h, j: (0,)),  # seq_lens, whole
        pl.BlockSpec((None, pages_per_seq), lambda b, h, j: (b, 0)),  # block_tables row b
        pl.BlockSpec((None, None, rows, hp), lambda b, h, j: (b, h, 0, 0)),  # q
        pool_spec, pool_spec,  # k_pages, v_pages: whole pools, kv head h selected in-kernel
        scale_spec if quantized else None, scale_spec if quantized else None,
        pl.BlockSpec((None, rows), lambda b, h, j: (h, 0)) if alibi_slopes is not None else None,
        pl.BlockSpec((1,), lambda b, h, j: (0,)) if num_layers is not None else None,  # layer
    ]
    slopes = (alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)  # [K, G]
              if alibi_slopes is not None else None)
    layer_arr = layer_operand(layer) if num_layers is not None else None  # i32[1]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, hp), lambda b, h, j: (b, h, j, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, q_per_kv, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, q_per_kv), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, q_per_kv), jnp.float32),
    ]
    return pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, parts),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        name=f"jpa_paged_decode_bk{p.block_k}_parts{parts}",
    )(seq_lens, block_tables, qg, k_pages, v_pages, k_scales, v_scales, slopes, layer_arr)


def unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None) -> str | None:
    """Why this kernel cannot serve `spec` on a GPU of `compute_capability`, or None when it can.

    compute_capability None (interpret mode, or an unknown device) skips device-specific limits.
    """
    if spec.head_dim > MAX_HEAD_DIM:
        return f"head_dim {spec.head_dim} > {MAX_HEAD_DIM} (K/V tiles would spill registers)"
    # Triton has no float8_e4m3fn (fp8e4nv) type before sm_89; e5m2 and int8 work on sm_80.
    if spec.cache_dtype == "float8_e4m3fn" and compute_capability is not None and compute_capability < 8.9:
        return (f"float8_e4m3fn caches need compute capability >= 8.9 in Triton; the target has "
                f"{compute_capability}")
    # Pallas Triton addresses a ref with 32-bit element offsets unless the whole operand is larger
    # than 2**32 bytes. The operand is the whole pool: with a stacked pool, all num_layers layers
    # (offsets count from layer 0, so `spec.pool_elements` includes num_layers). A 1-byte pool of
    # 2**31 .. 2**32 elements would be read through offsets that wrap negative, so it is refused
    # (16-bit and wider pools of that many elements exceed 2**32 bytes and get 64-bit offsets).
    # The f32 scales of such a pool have the same element count and 4 bytes each: 64-bit offsets.
    itemsize = np.dtype(jnp.dtype(spec.cache_dtype)).itemsize
    elements = spec.pool_elements
    if elements > 2 ** 31 and elements * itemsize <= 2 ** 32:
        layers = f"{spec.num_layers} layers x " if spec.num_layers > 1 else ""
        return (f"a {spec.cache_dtype} page pool of {elements} elements ({layers}num_kv_heads x "
                f"num_pages x page_size x head_dim) needs 64-bit offsets, which Pallas Triton uses "
                f"only above 2**32 bytes: use at most 2**31 elements per pool operand (fewer pages) "
                f"or a 16-bit cache")
    return None


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret",
                                             "partition_tokens", "tuning"))
def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None,
                 interpret=False, partition_tokens=None, layer=None, tuning=None, sinks=None):
    """Paged decode attention with the Triton-backend Pallas kernel. Arguments as
    `jpa.paged_decode` (already validated there).

    Args:
      q: [num_seqs, num_q_heads, head_dim].
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] with layer None, or a
        stacked pool [num_layers, num_kv_heads, num_pages, page_size, head_dim] with a layer
        index. Either way passed to the kernel whole (never sliced).
      block_tables: i32[num_seqs, pages_per_seq].
      seq_lens: i32[num_seqs].
      scale, soft_cap, alibi_slopes, sliding_window: as `jpa.paged_decode`.
      k_scales, v_scales: f32[(num_layers,) num_kv_heads, num_pages, page_size] for quantized
        caches (stacked like the pools), else None.
      interpret: run on CPU in Pallas interpret mode.
      partition_tokens: override the split-K partition size (tests, tuning); None = `plan`.
      layer: None (per-layer pools), or the layer of a stacked pool to attend over: an integer
        scalar, a Python int or a traced i32[] (e.g. a scan's loop index); one compiled kernel
        serves every layer. Expected in [0, num_layers) (the public API validates it); the
        kernel clamps it into range.
      sinks: f32[num_q_heads] attention sinks or None; folded in at the split-K combine
        (`merge_partitions`), exact for any partitioning.
      tuning: a `DecodeTuning` (static); None takes `tuning.decode_tuning(None, head_dim, ...)`,
        DECODE_TABLE's fallback row (the same values as its A100 and H100 rows).

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    if partition_tokens is not None and not (
            isinstance(partition_tokens, int) and not isinstance(partition_tokens, bool)
            and partition_tokens >= 1):
        raise ValueError(f"partition_tokens must be a positive int or None; got {partition_tokens!r}")
    acc, m, l = _partials(q, k_pages, v_pages, block_tables, seq_lens, alibi_slopes, k_scales,
                          v_scales, layer, scale=scale, soft_cap=soft_cap,
                          sliding_window=sliding_window, interpret=interpret,
                          partition_tokens=partition_tokens, tuning=tuning)
    num_kv_heads = k_pages.shape[-4]
    q_per_kv = num_q_heads // num_kv_heads
    out = merge_partitions(acc, m, l, q.dtype, None if sinks is None else
                           sinks.reshape(num_kv_heads, q_per_kv))  # [B, K, G, H]
    return out.reshape(num_seqs, num_q_heads, head_dim)
