"""The ragged tile kernel on mma.sync: Ampere / Ada (sm_80, sm_86, sm_89; cp.async copies) and
Blackwell (sm_100, sm_120; TMA copies), the twin of `ragged`'s WGMMA tile kernel (Hopper). 8-bit
caches, head dims 80 / 112 and the column padding as `decode_ampere` (the pipeline's mma path).

Einsum letters: G rows of the q tile, S key tokens of one block, H head_dim.

`ragged.ragged_paged_attention` runs it for compute capability 8.x, 10.x and 12.x, next to the mma.sync
decode kernel (`decode_ampere`) that serves every sequence's last row. Same contract as the Hopper
tile kernel: grid (num_tiles, num_kv_heads), a tile is up to BLOCK_Q // q_per_kv query tokens of
one sequence with their q_per_kv heads packed into the 64 rows ([kv head, token, q_per_kv, H] q
layout from the wrapper), keys walked a block at a time from the first key any row may see
(sliding window) to the tile's last query position, causal and window masks per row
(`pipeline.ragged_logits`), ALiBi, soft cap, attention sinks merged into each row's final state,
the stacked pool with a layer index. Each live program writes its 64 normalized rows to its own
slot of a [num_tiles, K, 64, H] buffer; the wrapper gathers the live rows.

The hardware pieces are `pipeline`'s mma path: `MmaBlocks` (cp.async commit groups, or TMA +
a barrier per slot on sm_100), `mma_prologue` (q tile, slopes and sinks rows), `attend_mma`
(m16n8k16 mma.sync, head_dim in 64-column chunks, masked p zeroed since a row may see no key of a
block, V rows outside the tile's key range zeroed in registers). The output leaves from registers
by plain stores (no TMA store: the same on both copy paths) in f32: an MMA_ACC fragment of a 16-bit
dtype stores 16 bytes per 8-column row segment, not whole 32-byte GMEM sectors, which Mosaic GPU
refuses (found by the sm_80 compile); f32 rows are 32 bytes. The wrapper rounds the gathered rows to
q's dtype (the tile buffer's bytes double: 64 x H x 4 per live tile and kv head).

GPU interpret mode: `MmaOps(interpret=True)` stands in for cp.async without a barrier, `mma` and
the accumulator -> lhs relayout (TMA path: real TMAs and barriers); the deviceless compile for
sm_80/86/89 and sm_100 covers them.

Rejected: everything `decode_ampere.unsupported_reason` rejects (the same mma, copy and SMEM
limits), and shapes whose K/V blocks do not fit next to the sinks row.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import layer_index, layer_operand, pool_layout
from jpa.pallas.mosaic import decode_ampere
from jpa.pallas.mosaic.pipeline import (BLOCK_Q, F32_ROW, MmaBlocks, MmaOps, attend_mma, kv_transforms, launch,
                                        merge_sink, mma_chunks, mma_copies_per_block, mma_prologue,
                                        out_width, q_transforms, ragged_logits, staging_scratch,
                                        tile_key_range)
from jpa.pallas.mosaic.tuning import MosaicTuning
from jpa.pallas.spec import RaggedSpec

# f32 rows copied per tile: ALiBi slopes and sinks (planned whether used or not).
_F32_ROWS = 2


def unsupported_reason(spec: RaggedSpec, compute_capability: float | None = None, *,
                       tuning: MosaicTuning | None = None) -> str | None:
    """Why the mma.sync ragged kernels (this tile kernel and `decode_ampere` for the last rows)
    cannot serve `spec` on a GPU of `compute_capability` (None: interpret mode), or None."""
    reason = decode_ampere.unsupported_reason(spec, compute_capability, tuning=tuning)
    if reason is not None:
        return reason
    from jpa.pallas.mosaic import tuning as tuning_table
    tuning = tuning or tuning_table.lookup_ampere(compute_capability, spec.head_dim, spec.quantized)
    if decode_ampere.num_slots(spec.head_dim, tuning=tuning, f32_rows=_F32_ROWS,
                               cache_itemsize=1 if spec.quantized else 2,
                               page_size=spec.page_size) == 0:
        return (f"head_dim = {spec.head_dim} needs more than {tuning.smem_budget // 1024} KiB of "
                f"SMEM for two K/V blocks of {tuning.block_tokens} tokens next to the tile's rows")
    return None


def _kernel(q_ref, k_ref, v_ref, tables_ref, seq_ref, row0_ref, ntok_ref, pos0_ref, slopes_ref,
            sinks_ref, layer_ref, scale_refs, out_ref, bars, *, ops, scale, soft_cap, sliding_window, q_per_kv,
            page_size, block_tokens, slots, rows_per_head):
    # q_ref [K * rows_per_head, H] (the Hopper tile kernel's layout); k_ref, v_ref [K, P, S_p, H]
    # or [L, K, P, S_p, H] (layer_ref i32[1], else None); tables_ref i32[max_num_seqs,
    # pages_per_seq]; seq_ref, row0_ref, ntok_ref, pos0_ref i32[num_tiles]; slopes_ref, sinks_ref
    # f32[K, F32_ROW] (row r < BLOCK_Q: q head kh * q_per_kv + r % q_per_kv) or None;
    # scale_refs: 8-bit caches' (ks_ref, vs_ref) f32[K, P, S_p] or [L, K, P, S_p], else None.
    # out_ref f32[num_tiles, K, BLOCK_Q, H]. bars: the TMA path's, else ().
    w = lax.axis_index("tile")
    kh = lax.axis_index("kv_head")
    head_dim = k_ref.shape[-1]
    head = (kh,) if layer_ref is None else (layer_index(layer_ref, k_ref.shape[0]), kh)
    dtype = q_ref.dtype
    seq, row0, ntok, pos0 = seq_ref[w], row0_ref[w], ntok_ref[w], pos0_ref[w]
    kv_lo, kv_end, lo, num_steps = tile_key_range(pos0, ntok, block_tokens, sliding_window)
    acc_layout = plgpu.Layout.MMA_ACC(dtype)

    def main_loop(q_smem, k_smem, v_smem, slopes_smem, sinks_smem, *wide):
        blocks = MmaBlocks(ops, tables_ref, seq, lo, num_steps, head, (k_ref, v_ref),
                           (k_smem, v_smem), bars[1] if ops.tma else None, page_size,
                           block_tokens, slots, scale_refs, wide)
        rows = [(ref.at[kh], smem) for ref, smem in ((slopes_ref, slopes_smem), (sinks_ref, sinks_smem))
                if ref is not None]
        loaded = mma_prologue(blocks, q_ref.at[pl.ds(kh * rows_per_head + row0 * q_per_kv, BLOCK_Q)],
                              q_smem, rows, bars[0] if ops.tma else None)
        slopes = loaded[0] if slopes_ref is not None else None
        sink = loaded[-1] if sinks_ref is not None else None

        def q_pos(shape):
            # Recomputed per block (a few integer ops) rather than held: an i32 [64, S] tile kept
            # across the loop would cost 32 registers a thread.
            return pos0 + lax.div(ops.iota(shape, 0, acc_layout), q_per_kv)

        accs, m, l = attend_mma(blocks, q_smem, scale=scale, soft_cap=soft_cap,
                                logits=ragged_logits(slopes, q_pos, (kv_lo, kv_end), sliding_window),
                                key_range=(kv_lo, kv_end), zero_masked_p=True)
        return accs, m, l, sink

    cache_dtype = k_ref.dtype
    transforms = kv_transforms(cache_dtype, head_dim, min(page_size, block_tokens))
    accs, m, l, sink = pl.run_scoped(
        main_loop,
        plgpu.SMEM((BLOCK_Q, head_dim), dtype, transforms=q_transforms(dtype, head_dim)),
        plgpu.SMEM((slots, block_tokens, head_dim), cache_dtype, transforms=transforms),
        plgpu.SMEM((slots, block_tokens, head_dim), cache_dtype, transforms=transforms),
        plgpu.SMEM((F32_ROW,), jnp.float32) if slopes_ref is not None else None,
        plgpu.SMEM((F32_ROW,), jnp.float32) if sinks_ref is not None else None,
        # Restaged K / V blocks in q's dtype (8-bit caches; V of head dims 80 / 112).
        *staging_scratch(dtype, head_dim, block_tokens, min(page_size, block_tokens), scale_refs is not None))
    alpha = None
    if sink is not None:
        alpha, l = merge_sink(m, l, sink)
    # Live rows see at least their own key (l > 0); the guard keeps the other rows finite.
    inv = 1.0 / jnp.where(l > 0, l, 1.0)
    scale_rows = inv if alpha is None else inv * alpha

    @pl.when(ntok > 0)
    def _store():
        for (c0, width), acc in zip(mma_chunks(out_width(head_dim)), accs):
            out = acc * lax.broadcast_in_dim(scale_rows, acc.shape, [0])
            out_ref.at[w, kh, :, pl.ds(c0, width)][...] = out


def tile_rows(q_rows, k_pages, v_pages, block_tables, tiles, alibi_slopes, sinks, *, scale,
              soft_cap, sliding_window, interpret, layer, tuning, tma, q_per_kv, rows_per_head,
              k_scales=None, v_scales=None, fp8_cvt=True):
    """Runs the tile kernel over `ragged`'s q layout (q_rows [K * rows_per_head, H]) and tile map
    (`query_tiles`' 4 x i32[num_tiles]). Returns out_tiles f32[num_tiles, K, BLOCK_Q, H]
    (normalized; rows of dead tiles, and rows past a tile's tokens, are unspecified).
    k_scales / v_scales: f32 per-token scales of an int8 / float8 pool (as `decode_ampere`);
    fp8_cvt: as `decode_ampere.paged_decode`."""
    num_layers, num_kv_heads, _, page_size, head_dim = pool_layout(k_pages, layer)
    stacked = num_layers is not None
    num_tiles = tiles[0].shape[0]
    dtype = q_rows.dtype
    bt = tuning.block_tokens
    quantized = k_scales is not None
    slots = decode_ampere.num_slots(head_dim, dtype.itemsize, tuning=tuning, f32_rows=_F32_ROWS,
                                    cache_itemsize=k_pages.dtype.itemsize, page_size=page_size)
    ops = MmaOps(interpret, tma, fp8_cvt)
    r = jnp.arange(BLOCK_Q) % q_per_kv  # row r of a tile is q head kh * q_per_kv + r % q_per_kv

    def per_row(x):  # f32[num_q_heads] -> f32[K, F32_ROW], laid out like the tile's rows
        x = x.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)[:, r]
        return jnp.pad(x, ((0, 0), (0, F32_ROW - BLOCK_Q)))
    placeholder = jnp.zeros((F32_ROW,), jnp.float32)
    kernel = functools.partial(
        _kernel, ops=ops, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        q_per_kv=q_per_kv, page_size=page_size, block_tokens=bt, slots=slots,
        rows_per_head=rows_per_head)
    f32_rows = int(alibi_slopes is not None) + int(sinks is not None)

    # The body's name is the kernel's name (ptxas reports and MOSAIC_GPU_DUMP_TO files).
    def jpa_mosaic_ragged_ampere(q_ref, k_ref, v_ref, tables_ref, seq_ref, row0_ref, ntok_ref,
                                 pos0_ref, slopes_ref, sinks_ref, *rest):
        scale_refs, rest = (rest[:2], rest[2:]) if quantized else (None, rest)
        layer_ref, (out_ref,) = (rest[0], rest[1:]) if stacked else (None, rest)
        run = functools.partial(kernel, q_ref, k_ref, v_ref, tables_ref, seq_ref, row0_ref, ntok_ref,
                                pos0_ref, slopes_ref if alibi_slopes is not None else None,
                                sinks_ref if sinks is not None else None, layer_ref, scale_refs,
                                out_ref)
        pl.run_scoped(lambda *bars: run(bars),
                      *ops.barriers(f32_rows, mma_copies_per_block(page_size, bt), slots))

    out = launch(
        jpa_mosaic_ragged_ampere,
        jax.ShapeDtypeStruct((num_tiles, num_kv_heads, BLOCK_Q, out_width(head_dim)), jnp.float32),
        (num_tiles, num_kv_heads), ("tile", "kv_head"), interpret,
    )(q_rows, k_pages, v_pages, block_tables, *tiles,
      per_row(alibi_slopes) if alibi_slopes is not None else placeholder,
      per_row(sinks) if sinks is not None else placeholder,
      *([k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)] if quantized else []),
      *([layer_operand(layer)] if stacked else []))
    return out[..., :head_dim]  # the padding columns of `out_width`
