"""Ragged paged attention as Pallas Mosaic GPU kernels: WGMMA + TMA on Hopper (sm_90, this file's
tile kernel), mma.sync on Ampere/Ada (sm_80/86/89, cp.async) and Blackwell (sm_100, TMA) through
`ragged_ampere`'s tile kernel; `ragged_paged_attention(..., compute_capability=)` picks the path.

The same split as `jpa.pallas.triton.ragged`, in one jitted program over the whole page pools:

1. Every sequence's LAST query row (every decode token) goes through the Mosaic decode kernel
   (`jpa.pallas.mosaic.decode`, with its split-K partitions).
2. The other rows go through this file's kernel, grid (num_tiles, num_kv_heads). A tile is up to
   BLOCK_Q // q_per_kv consecutive query tokens of ONE sequence (`query_tiles`, plain JAX in the
   wrapper). GQA is packed into WGMMA's 64 rows: q is laid out [kv head, token, q_per_kv, H] by
   the wrapper (a copy of q, which is small next to the cache), so a tile's rows
   (token r // q_per_kv, head r % q_per_kv) are 64 consecutive rows: one TMA.

Program (w, h) walks its sequence's keys a block (>= 64 tokens, whole pages, each copied GMEM ->
SMEM by its own TMA through the block table) at a time from the first key any row may see (sliding
window) to its last query position, through the decode kernel's pipeline (`pipeline.attend`:
`slots` blocks buffered, slots - 1 in flight, dtype widening for 8-bit caches, online softmax and
in-place P @ V accumulation; GPU interpret mode: the same math through SMEM). This file says which
keys each row sees: causal and by the window, on the WGMMA-layout registers; as some rows may see no
key of a block, masked p are zeroed explicitly. V rows outside the tile's key range are zeroed in
SMEM (0 * NaN is NaN). The tiling (`MosaicTuning`) is the decode kernel's, from the same table.

Each live program writes its 64 output rows (normalized, q's dtype) to its own slot of a
[num_tiles, K, 64, H] buffer (a TMA store needs a static row count, and tiles of different
sequences are adjacent in q's rows); the wrapper gathers the live rows back into [T, N, H].
Tile slots past the live count skip their loads and their store.

Attention sinks (`sinks`, f32[num_q_heads]): the decode kernel folds them in at its split-K combine;
this kernel merges the state (m = sink, l = 1, acc = 0) into each row's final one before normalizing
(its 64 sinks, laid out like the rows, come in through SMEM after the main loop).

Pool layouts: per layer `[K, P, S_p, H]` (`layer=None`) or stacked `[L, K, P, S_p, H]` with a
layer index (an i32 scalar, traced in a scan over layers), as in the decode kernel: both kernels get
the whole pools and the layer as an `i32[1]` operand, and TMA from `k_ref.at[layer, kv_head, page,
rows]`.

Rejected: everything `mosaic_decode.unsupported_reason` rejects (the same WGMMA, TMA and SMEM
limits apply to both kernels); on 8.x and 10.x, what `ragged_ampere.unsupported_reason` rejects.

A caller that promises at most `max_q_len` rows a sequence (the engine's speculative verify pass,
`jpa.ops.ragged.query_rows_at_most`) gets, on Hopper when max_q_len x q_per_kv <= 64, ONE call of
the decode kernel with several query tokens (`decode.paged_decode_rows`): the KV read once, not by
both kernels.

The wrapper below (tile map, q layout `tile_q_rows`, the decode kernel for the last rows, the
gather of the tiled rows) serves both paths; the tile kernels share `pipeline`'s key range
(`tile_key_range`), masks (`ragged_logits`), softmax step and sink merge.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import (decode_last_rows, layer_index, layer_operand, max_query_tiles, pool_layout,
                               query_tiles)
from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import ragged_ampere
from jpa.pallas.mosaic import tuning as tuning_table
from jpa.pallas.mosaic.pipeline import (BLOCK_Q, ROW_ALIGN, KVBlocks, attend, barriers, launch, main_loop_scratch,
                                        merge_sink, num_slots, operand_transforms, prologue,
                                        ragged_logits, tile_key_range, tmas_per_block, uses_tma)
from jpa.pallas.mosaic.tuning import MosaicTuning
from jpa.pallas.spec import RaggedSpec, ragged_spec

# Placeholder operand for absent optional inputs (Mosaic GPU kernels take a fixed operand list).
_PLACEHOLDER_ROWS = 8


def unsupported_reason(spec: RaggedSpec, compute_capability: float | None = None, *,
                       tuning: MosaicTuning | None = None) -> str | None:
    """Why these kernels cannot serve `spec` on a GPU of `compute_capability` (None: skip the
    device check), or None when they can. Where `runs_mma` (8.x, 10.x, 12.x; on Hopper the shapes
    the WGMMA kernels refuse): the mma.sync kernels' limits (`ragged_ampere.unsupported_reason`).
    Else (Hopper; None too) the WGMMA decode kernel's limits, which cover the tile kernel; on Hopper
    a refusal gives both paths' reasons."""
    if runs_mma(spec, compute_capability):
        return ragged_ampere.unsupported_reason(spec, compute_capability, tuning=tuning)
    if compute_capability is not None and not 9.0 <= compute_capability < 10.0:
        return (f"compute capability {compute_capability} is served by none of the Mosaic GPU ragged "
                f"kernels: WGMMA + TMA on Hopper (9.x), mma.sync + cp.async on Ampere/Ada (8.x), "
                f"mma.sync + TMA on Hopper and Blackwell (9.x, 10.x, 12.x)")
    return mosaic_decode.hopper_reasons(
        mosaic_decode.wgmma_reason(spec, compute_capability, tuning=tuning), spec, compute_capability,
        ragged_ampere.unsupported_reason)


def runs_mma(spec: RaggedSpec, compute_capability: float | None) -> bool:
    """Whether the ragged op for `spec` runs the mma.sync kernels (`ragged_ampere`'s tile kernel,
    `decode_ampere` for the last rows): `decode.runs_mma` judged with `ragged_ampere`'s limits."""
    return mosaic_decode.runs_mma(spec, compute_capability, ragged_ampere.unsupported_reason)


def aot_unsupported_reason(compute_capability: float | None) -> str | None:
    """Why an ahead-of-time compile for an absent GPU of `compute_capability` would get Mosaic code
    for another GPU, or None: as `decode.aot_unsupported_reason` (both kernels lower alike)."""
    return mosaic_decode.aot_unsupported_reason(compute_capability)


def is_mma_path(compute_capability: float | None) -> bool:
    """Whether a GPU of this compute capability runs the mma.sync kernels (`decode_ampere`,
    `ragged_ampere`) for every shape: Ampere/Ada (8.x, cp.async) and Blackwell (10.x, 12.x; TMA).
    On Hopper only some shapes do (`runs_mma`)."""
    return ragged_ampere.decode_ampere.serves(compute_capability)


def tile_tokens(q_per_kv: int) -> int:
    """Query tokens per tile: as many as fill BLOCK_Q rows with their q_per_kv heads."""
    return BLOCK_Q // q_per_kv


def _kernel(q_ref, k_ref, v_ref, tables_ref, seq_ref, row0_ref, ntok_ref, pos0_ref, slopes_ref,
            ks_ref, vs_ref, layer_ref, sinks_ref, out_ref, bars, *, scale, soft_cap, sliding_window, q_per_kv,
            page_size, block_tokens, slots, rows_per_head, register_acc):
    # q_ref [K * rows_per_head, H]: kv head h's rows start at h * rows_per_head, token t's
    #   q_per_kv heads at + t * q_per_kv (rows_per_head = T * q_per_kv + BLOCK_Q, padded).
    # k_ref, v_ref [K, P, S_p, H], or [L, K, P, S_p, H] for a stacked pool (layer_ref i32[1] then
    # holds the layer, else None); tables_ref i32[max_num_seqs, pages_per_seq];
    # seq_ref, row0_ref, ntok_ref, pos0_ref i32[num_tiles]; slopes_ref f32[K, BLOCK_Q] or None;
    # ks_ref, vs_ref f32[(L,) K, P, S_p] or None; sinks_ref f32[K, BLOCK_Q] (attention sinks, laid out
    # like the slopes) or None; out_ref [num_tiles, K, BLOCK_Q, H] in q's dtype.
    # register_acc: as in the decode kernel (`pipeline.attend`); False in GPU interpret mode.
    q_bar, k_bars, v_bars = bars
    w = lax.axis_index("tile")
    kh = lax.axis_index("kv_head")
    head_dim = k_ref.shape[-1]
    head = (kh,) if layer_ref is None else (layer_index(layer_ref, k_ref.shape[0]), kh)
    dtype = q_ref.dtype
    quantized = ks_ref is not None

    seq, row0, ntok, pos0 = seq_ref[w], row0_ref[w], ntok_ref[w], pos0_ref[w]
    # Keys some row of the tile sees: [kv_lo, kv_end); kv_end - 1 is the last query position.
    kv_lo, kv_end, lo, num_steps = tile_key_range(pos0, ntok, block_tokens, sliding_window)

    def main_loop(q_smem, k_smem, v_smem, p_smem, slopes_smem, kd_smem, vd_smem, ks_smem,
                  vs_smem):
        # As `pipeline.main_loop_scratch` lists them.
        blocks = KVBlocks(tables_ref, seq, lo, num_steps, head, (k_ref, v_ref, ks_ref, vs_ref),
                          (k_smem, v_smem, ks_smem, vs_smem), (k_bars, v_bars), page_size,
                          block_tokens, slots)
        q_src = q_ref.at[pl.ds(kh * rows_per_head + row0 * q_per_kv, BLOCK_Q)]
        slopes = prologue(blocks, q_src, q_smem,
                          slopes_ref.at[kh] if slopes_ref is not None else None, slopes_smem,
                          q_bar)  # f32[BLOCK_Q] or None
        # Position of each row's query: pos0 + token of the row.
        q_pos = pos0 + lax.div(plgpu.broadcasted_iota(
            jnp.int32, (BLOCK_Q, block_tokens), 0, layout=plgpu.Layout.WGMMA), q_per_kv)

        return attend(blocks, q_smem, p_smem, kd_smem, vd_smem, scale=scale,
                      soft_cap=soft_cap,
                      logits=ragged_logits(slopes, lambda _: q_pos, (kv_lo, kv_end), sliding_window),
                      key_range=(kv_lo, kv_end),
                      zero_masked_p=True, register_acc=register_acc)

    acc, m, l = pl.run_scoped(
        main_loop,
        *main_loop_scratch(dtype, k_ref.dtype, head_dim, block_tokens, slots,
                           alibi=slopes_ref is not None, quantized=quantized,
                           register_acc=register_acc))  # f32[BLOCK_Q, H] (WGMMA layout), 2 x f32[BLOCK_Q]
    if sinks_ref is not None:
        # The sink joins each row's softmax as a column of value 0: the state (m = sink, l = 1,
        # acc = 0) merged into the final one (a program holds all of its rows' keys: exact). Its
        # 64 logits come in through SMEM after the main loop has freed its buffers.
        def load_sinks(sinks_smem, bar):
            plgpu.copy_gmem_to_smem(sinks_ref.at[kh], sinks_smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            return plgpu.load(sinks_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # f32[BLOCK_Q]

        sink = pl.run_scoped(load_sinks, plgpu.SMEM((BLOCK_Q,), jnp.float32),
                             plgpu.Barrier(num_barriers=1))
        alpha, l = merge_sink(m, l, sink)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    # Live rows see at least their own key (l > 0); the guard keeps the other rows finite.
    l = jnp.where(l > 0, l, 1.0)
    out = acc / lax.broadcast_in_dim(l, acc.shape, [0])  # f32[BLOCK_Q, H], WGMMA layout

    def epilogue(o_smem):
        o_smem[...] = out.astype(dtype)
        plgpu.commit_smem()

        @pl.when(ntok > 0)
        def _store():
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[w, kh])
            plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((BLOCK_Q, head_dim), dtype,
                                       transforms=operand_transforms(dtype, head_dim)))


def tile_q_rows(q, num_kv_heads):
    """q [T, N, H] -> (q_rows [K * rows_per_head, H], rows_per_head): both tile kernels' q layout,
    [kv head, token, q_per_kv, H], so a tile's 64 rows for one kv head are consecutive (one copy).
    Each head's rows are padded by BLOCK_Q (the last tile's copy stays in bounds) and to a multiple
    of 8 (Mosaic GPU's TMA tiles GMEM rows by 8; see the decode kernel)."""
    num_tokens, num_q_heads, head_dim = q.shape
    q_per_kv = num_q_heads // num_kv_heads
    rows_per_head = num_tokens * q_per_kv + BLOCK_Q + (-(num_tokens * q_per_kv)) % ROW_ALIGN
    q_rows = jnp.swapaxes(q.reshape(num_tokens, num_kv_heads, q_per_kv, head_dim), 0, 1)
    q_rows = jnp.pad(q_rows.reshape(num_kv_heads, num_tokens * q_per_kv, head_dim),
                     ((0, 0), (0, rows_per_head - num_tokens * q_per_kv), (0, 0)))
    return q_rows.reshape(num_kv_heads * rows_per_head, head_dim), rows_per_head


def _tile_rows(q, k_pages, v_pages, block_tables, tiles, alibi_slopes, k_scales, v_scales, *,
               scale, soft_cap, sliding_window, interpret, layer=None, tuning, sinks=None):
    """Runs the tile kernel. Returns out_tiles [num_tiles, K, BLOCK_Q, H] in q's dtype (rows
    of dead tiles, and rows past a tile's tokens, are unspecified)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, page_size, _ = pool_layout(k_pages, layer)
    stacked = num_layers is not None
    q_per_kv = num_q_heads // num_kv_heads
    num_tiles = tiles[0].shape[0]
    bt = tuning.block_tokens
    quantized = k_scales is not None
    # Planned as if p were in SMEM on both paths (the decode kernel's rule): same pipeline depth.
    slots = num_slots(head_dim, page_size, q.dtype.itemsize, k_pages.dtype.itemsize, tuning=tuning)
    q_rows, rows_per_head = tile_q_rows(q, num_kv_heads)
    placeholder = jnp.zeros((_PLACEHOLDER_ROWS,), jnp.float32)
    if alibi_slopes is not None:
        # Row r of a tile is q head kh * q_per_kv + r % q_per_kv.
        r = jnp.arange(BLOCK_Q) % q_per_kv  # i32[BLOCK_Q]
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)[:, r]  # [K, BLOCK_Q]
    if sinks is not None:
        r = jnp.arange(BLOCK_Q) % q_per_kv  # i32[BLOCK_Q]
        sink_rows = sinks.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)[:, r]  # [K, BLOCK_Q]
    kernel = functools.partial(
        _kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        q_per_kv=q_per_kv, page_size=page_size, block_tokens=bt, slots=slots,
        rows_per_head=rows_per_head, register_acc=not interpret)
    arrivals = tmas_per_block(page_size, bt, quantized)

    # The body's name is the kernel's name (ptxas reports and MOSAIC_GPU_DUMP_TO files).
    # A stacked pool adds one operand, the layer (i32[1]), after the others; sinks one after that.
    def jpa_mosaic_ragged(q_ref, k_ref, v_ref, tables_ref, seq_ref, row0_ref, ntok_ref, pos0_ref,
                          slopes_ref, ks_ref, vs_ref, *rest):
        rest = list(rest)
        layer_ref = rest.pop(0) if stacked else None
        sinks_ref = rest.pop(0) if sinks is not None else None
        (out_ref,) = rest
        pl.run_scoped(
            lambda *bars: kernel(q_ref, k_ref, v_ref, tables_ref, seq_ref, row0_ref, ntok_ref,
                                 pos0_ref, slopes_ref if alibi_slopes is not None else None,
                                 ks_ref if quantized else None, vs_ref if quantized else None,
                                 layer_ref, sinks_ref, out_ref, bars),
            *barriers(arrivals, slots))

    return launch(
        jpa_mosaic_ragged, jax.ShapeDtypeStruct((num_tiles, num_kv_heads, BLOCK_Q, head_dim), q.dtype),
        (num_tiles, num_kv_heads), ("tile", "kv_head"), interpret,
    )(q_rows, k_pages, v_pages, block_tables, *tiles,
      slopes if alibi_slopes is not None else placeholder,
      k_scales if quantized else placeholder, v_scales if quantized else placeholder,
      *([layer_operand(layer)] if stacked else []), *([sink_rows] if sinks is not None else []))


def short_rows(q_per_kv: int, max_q_len: int | None, compute_capability: float | None) -> bool:
    """Whether a call whose sequences hold at most max_q_len query rows runs as ONE multi-row decode
    kernel call (`decode.paged_decode_rows`, Hopper): every row of a sequence fits its 64-row q tile."""
    return (max_q_len is not None and not is_mma_path(compute_capability)
            and max_q_len <= mosaic_decode.max_rows_tokens(q_per_kv))


def _short_rows(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, max_q_len, *,
                interpret, layer, tuning, **opts):
    """Every sequence's rows (at most max_q_len) through one `paged_decode_rows` call: each
    program reads its partition of the sequence's KV once for all of them. [T, N, H] in q's dtype."""
    num_tokens = q.shape[0]
    max_num_seqs = seq_lens.shape[0]
    live = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, jnp.clip(cu_q_lens[1:] - cu_q_lens[:-1], 0, max_q_len), 0)  # i32[B]
    t = jnp.arange(max_q_len, dtype=jnp.int32)
    # Row of sequence b's token t, its last q_lens[b] rows (num_tokens: none; a zero q row, its
    # output dropped).
    rows = jnp.where(t[None, :] < q_lens[:, None], cu_q_lens[1:, None] - q_lens[:, None] + t[None, :],
                     num_tokens)  # [B, max_q_len]
    q_seq = jnp.pad(q, ((0, 1), (0, 0), (0, 0)))[rows]  # [B, max_q_len, N, H]
    out = mosaic_decode.paged_decode_rows(q_seq, k_pages, v_pages, block_tables, jnp.where(q_lens > 0, seq_lens, 0),
                                          q_lens, interpret=interpret, layer=layer, tuning=tuning, **opts)
    return jnp.zeros(q.shape, q.dtype).at[rows].set(out, mode="drop")


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret",
                                             "tuning", "compute_capability", "max_q_len"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *,
                           scale, soft_cap=None, alibi_slopes=None, sliding_window=None,
                           k_scales=None, v_scales=None, interpret=False, layer=None, tuning=None,
                           sinks=None, compute_capability=None, max_q_len=None):
    """Ragged paged attention with the Mosaic GPU kernels. Arguments as
    `jpa.ragged_paged_attention` (already validated; `unsupported_reason` is None for them).

    k_pages, v_pages are [K, P, S_p, H] with layer None, or a stacked pool [L, K, P, S_p, H]
    (scales f32[L, K, P, S_p]) with `layer`, the layer to attend over: a Python int or a traced
    i32[] (one compiled program serves every layer), expected in [0, L) and clamped into it.
    Both kernels get the pools whole either way.

    tuning: a `MosaicTuning` (static) for both kernels; None takes `tuning.lookup(None,
    head_dim)`, the table's fallback row (the same values as its H100 row).
    sinks: f32[num_q_heads] attention sinks or None: the decode kernel folds them in at its split-K
    combine, the tile kernel into each row's final softmax state.
    compute_capability: the GPU compiled for (static; the dispatch passes its target's). Where
    `runs_mma` (8.x, 10.x, 12.x; on 9.x the shapes the WGMMA kernels refuse) the mma.sync kernels
    run (`ragged_ampere`'s tile kernel, `decode_ampere` for the last rows; cp.async copies on 8.x,
    TMA from 9.x on; tiling `tuning.lookup_ampere(compute_capability,
    head_dim)` unless `tuning` is given); anything else (None included) the WGMMA kernels.
    max_q_len: None, or the caller's promise (static) that no live sequence has more query rows
      (a speculative verify pass: k + 1). On Hopper, when that many tokens' heads fit the 64-row q
      tile (`short_rows`), every row runs in ONE multi-row decode kernel call that reads each
      sequence's KV once (`decode.paged_decode_rows`), instead of the decode kernel for the last
      rows and the tile kernel for the others (which read it twice). A sequence that breaks the
      promise gets its last max_q_len rows; the rows before them are left zero.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype; zeros at padding rows.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = pool_layout(k_pages, layer)[1]
    q_per_kv = num_q_heads // num_kv_heads
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    mma = runs_mma(ragged_spec(q, k_pages, block_tables, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                               sliding_window=sliding_window, sinks=sinks), compute_capability)
    tuning = tuning or (tuning_table.lookup_ampere(compute_capability, head_dim, k_scales is not None) if mma
                        else tuning_table.lookup(None, head_dim))
    opts = dict(scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales, sinks=sinks)
    if not mma and short_rows(q_per_kv, max_q_len, compute_capability):
        return _short_rows(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, max_q_len,
                           interpret=interpret, layer=layer, tuning=tuning, **opts)
    # 1. Last rows (all decode tokens) through the split-K decode kernel of the same path.
    decode = functools.partial(mosaic_decode.paged_decode, interpret=interpret, layer=layer,
                               tuning=tuning, compute_capability=compute_capability if mma else None)
    out = decode_last_rows(decode, q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                           num_seqs, **opts)  # [T, N, H]
    # 2. The other rows through the tile kernel.
    tt = tile_tokens(q_per_kv)
    tiles = query_tiles(cu_q_lens, seq_lens, num_seqs, num_tokens=num_tokens, tile_tokens=tt,
                        num_tiles=max_query_tiles(num_tokens, block_tables.shape[0], tt),
                        skip_last=True)  # 4 x i32[num_tiles]
    if mma:
        q_rows, rows_per_head = tile_q_rows(q, num_kv_heads)
        out_tiles = ragged_ampere.tile_rows(
            q_rows, k_pages, v_pages, block_tables, tiles, alibi_slopes, sinks, scale=scale,
            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret, layer=layer,
            tuning=tuning, tma=uses_tma(compute_capability), q_per_kv=q_per_kv,
            rows_per_head=rows_per_head, k_scales=k_scales, v_scales=v_scales,
            fp8_cvt=ragged_ampere.decode_ampere.converts_fp8(compute_capability))  # [W, K, BLOCK_Q, H]
    else:
        out_tiles = _tile_rows(q, k_pages, v_pages, block_tables, tiles, alibi_slopes, k_scales,
                               v_scales, scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, interpret=interpret, layer=layer,
                               tuning=tuning, sinks=sinks)  # [W, K, BLOCK_Q, H]
    # Gather each tiled row back: row t is token t - row0[w] of its tile w.
    _, row0, ntok, _ = tiles
    j = jnp.arange(tt, dtype=jnp.int32)  # i32[tt]
    rows = jnp.where(j[None, :] < ntok[:, None], row0[:, None] + j[None, :], num_tokens)  # [W, tt]
    w_ids = jnp.broadcast_to(jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None], rows.shape)
    tile_of_row = jnp.full((num_tokens,), -1, jnp.int32).at[rows].set(w_ids, mode="drop")  # i32[T]
    w_row = jnp.maximum(tile_of_row, 0)  # i32[T]
    local = jnp.arange(num_tokens, dtype=jnp.int32) - row0[w_row]  # i32[T], token in its tile
    k_ix = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    g_ix = jnp.arange(q_per_kv, dtype=jnp.int32)[None, None, :]
    tiled = out_tiles[w_row[:, None, None], k_ix,
                      jnp.clip(local, 0, tt - 1)[:, None, None] * q_per_kv + g_ix]  # [T, K, G, H]
    tiled = tiled.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
    return jnp.where((tile_of_row >= 0)[:, None, None], tiled, out)
