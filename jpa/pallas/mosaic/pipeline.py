"""The K/V block pipeline that both Mosaic GPU kernels (decode, ragged) run, and its SMEM plan.

Einsum letters: G rows of the q tile, S key tokens of one block, H head_dim.

A program walks its keys a *block* (`block_tokens` tokens) at a time. A block is
block_tokens / page_size consecutive logical pages, each copied GMEM -> SMEM by its own TMA, or a
block_tokens slice of one larger page (one TMA); the source page is read from the block table
(`block_source`, `copy_block`). `slots` blocks are buffered (`num_slots`): while block j is
computed, blocks j+1 .. j+slots-1 are in flight (`prologue`, which prefetches them, then `attend`).

`attend` is the online softmax over those blocks on WGMMA-layout registers:

    s   = q_tile @ K_block^T        "GH,SH->GS" (WGMMA, f32 accumulator in registers)
    acc = acc * alpha + p @ V_block "GS,SH->GH" (WGMMA, p rounded to q's dtype)

The kernel says which (row, key) pairs are visible and adds its biases (`logits`); the rest is
shared: scale, per-token K/V scales of 8-bit caches (widened in SMEM to q's dtype for the WGMMA,
exact), soft cap, the running max / sum, zeroing V rows outside the keys any row sees (p is 0
there, but 0 * NaN is not), and P @ V accumulated in place (`register_acc`, the hardware path) or
through SMEM (GPU interpret mode).
"""

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import MASK_VALUE
from jpa.pallas.mosaic import tuning as tuning_table
from jpa.pallas.mosaic.tuning import MosaicTuning

# WGMMA's M: rows of the q tile.
BLOCK_Q = 64
# Rows of the per-partition outputs and of padded GMEM operands are multiples of 8: Mosaic GPU's
# TMA tiles a GMEM operand's rows by 8 (and TMA rows must be >= 16 bytes for f32 m, l).
ROW_ALIGN = 8
# Register tiles wider than this many columns are processed a column slice at a time where
# a whole [block_tokens, head_dim] tile would be live next to the accumulator (zeroing invisible V
# rows, widening 8-bit K/V): at head_dim 192/256 the whole tile made ptxas spill.
MAX_TILE_COLS = 128


def operand_transforms(dtype, minor):
    """Tiling + swizzle of a 2-D SMEM tile whose minor dimension has `minor` elements."""
    bits = np.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits, "a WGMMA operand tile")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _tile_cols(dtype, minor: int) -> int:
    """Columns of one SMEM tile (`operand_transforms`) of a row of `minor` elements."""
    bits = np.dtype(dtype).itemsize * 8
    return plgpu.find_swizzle(minor * bits, "a WGMMA operand tile") * 8 // bits


def col_chunks(head_dim: int, *dtypes) -> list:
    """[(first column, width)] slices covering head_dim for register tiles of SMEM buffers of
    `dtypes`: one slice up to MAX_TILE_COLS, else the widest slice <= 64 (128 with an 8-bit
    dtype) that is whole SMEM tiles of every dtype and divides head_dim."""
    if head_dim <= MAX_TILE_COLS:
        return [(0, head_dim)]
    unit = int(np.lcm.reduce([_tile_cols(d, head_dim) for d in dtypes]))
    cap = 128 if any(np.dtype(d).itemsize == 1 for d in dtypes) else 64
    width = max(w for w in range(unit, max(unit, cap) + 1, unit) if head_dim % w == 0)
    return [(c, width) for c in range(0, head_dim, width)]


def _cols(ref, c0, width, head_dim):
    """ref[..., c0:c0 + width] (ref itself when that is every column)."""
    return ref if width == head_dim else ref.at[:, pl.ds(c0, width)]


def widen(x, dtype):
    """8-bit cache values -> q's dtype. float8 goes through f32: sm_90 converts float8 only to
    f16 directly, and f32 -> bf16/f16 of a float8 value is exact."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def widen_tile(src, dst, dtype, head_dim):
    """dst[...] = src widened to dtype (8-bit cache block -> q's dtype), a column slice at a time."""
    for c0, width in col_chunks(head_dim, src.dtype, dtype):
        _cols(dst, c0, width, head_dim)[...] = widen(_cols(src, c0, width, head_dim)[...], dtype)


def mask_rows(src, dst, visible, block_start, block_tokens, dtype, head_dim):
    """dst[t] = src[t] (widened to dtype) where visible(position of key t), else 0; src may be
    dst. Column slice by column slice, so only a slice is in registers at once."""
    for c0, width in col_chunks(head_dim, src.dtype, dtype):
        tok = block_start + plgpu.broadcasted_iota(
            jnp.int32, (block_tokens, width), 0, layout=plgpu.Layout.WGMMA)
        vals = _cols(src, c0, width, head_dim)[...]
        _cols(dst, c0, width, head_dim)[...] = jnp.where(
            visible(tok), widen(vals, dtype) if vals.dtype != dtype else vals, jnp.zeros((), dtype))


def block_source(tables_ref, seq, blk, *, page_size, block_tokens, pages_per_seq, num_pages):
    """Where block `blk` (i32) of sequence `seq` is in the pool: a tuple of i32 scalars, the
    physical pages of its whole pages, or (page, first row) when a block is a slice of a page.

    Pages past the table or the sequence are still copied (a barrier's byte count is static)
    from a clamped in-range page; their tokens are masked by the caller."""
    if page_size <= block_tokens:
        n = block_tokens // page_size
        pages = []
        for i in range(n):
            page = tables_ref[seq, jnp.minimum(blk * n + i, pages_per_seq - 1)]
            pages.append(jnp.clip(page, 0, num_pages - 1))
        return tuple(pages)
    splits = page_size // block_tokens
    page = tables_ref[seq, jnp.minimum(lax.div(blk, splits), pages_per_seq - 1)]
    return jnp.clip(page, 0, num_pages - 1), lax.rem(blk, splits) * block_tokens


def copy_block(src, slot, head, refs, smem, bars, *, page_size, block_tokens):
    """Starts the TMA copies of one block (`block_source`'s src) into `slot`: K, V and, for a
    quantized cache, their per-token scales. head: the leading pool indices, (kv head,) or
    (layer, kv head) for a stacked pool; refs: (k_ref, v_ref, ks_ref, vs_ref) in GMEM (scales
    None unless quantized); smem: the matching [slots, S, H] / [slots, S] buffers; bars: (k_bars,
    v_bars). Each barrier gets `tmas_per_block` arrivals."""
    k_ref, v_ref, ks_ref, vs_ref = refs
    k_smem, v_smem, ks_smem, vs_smem = smem
    k_bars, v_bars = bars
    if page_size <= block_tokens:
        pieces = [(page, pl.ds(0, page_size), pl.ds(i * page_size, page_size)) for i, page in enumerate(src)]
    else:
        page, row = src
        pieces = [(page, pl.ds(row, block_tokens), pl.ds(0, block_tokens))]
    for page, src_rows, rows in pieces:
        plgpu.copy_gmem_to_smem(k_ref.at[(*head, page, src_rows)], k_smem.at[slot, rows], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[(*head, page, src_rows)], v_smem.at[slot, rows], v_bars.at[slot])
        if ks_ref is not None:
            plgpu.copy_gmem_to_smem(ks_ref.at[(*head, page, src_rows)], ks_smem.at[slot, rows],
                                    k_bars.at[slot])
            plgpu.copy_gmem_to_smem(vs_ref.at[(*head, page, src_rows)], vs_smem.at[slot, rows],
                                    v_bars.at[slot])


def tmas_per_block(page_size: int, block_tokens: int, quantized: bool) -> int:
    """TMA copies per block and per barrier (K's or V's): one per page (or page slice), twice
    for a quantized cache (values and scales)."""
    return max(1, block_tokens // page_size) * (2 if quantized else 1)


def barriers(arrivals: int, slots: int):
    """The barriers of a program, for `pl.run_scoped`: the q tile's (q, ALiBi slopes) and one
    per slot for K and for V, each expecting `arrivals` TMAs (`tmas_per_block`)."""
    return (plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots))


def num_slots(head_dim: int, page_size: int, itemsize: int = 2, cache_itemsize: int = 2, *,
              tuning: MosaicTuning | None = None) -> int:
    """Blocks buffered per program: as many as fit `tuning.smem_budget`, at most
    `tuning.max_slots` (0: two do not fit). Both kernels run this pipeline depth.

    itemsize is q's, cache_itemsize the cache's (1 for int8/float8: quantized); tuning None takes
    `tuning.lookup(None, head_dim)`.
    """
    return smem_plan(head_dim, page_size, itemsize, cache_itemsize, tuning=tuning)[0]


def smem_plan(head_dim, page_size, itemsize, cache_itemsize, *, tuning=None):
    """(slots, peak SMEM bytes of the main loop) of one program: as many K/V slots as fit
    tuning.smem_budget next to the fixed buffers, at most tuning.max_slots (0 slots: two do not fit).

    Fixed: the q tile, the ALiBi slopes and the p tile (planned on both paths, so both run the same
    pipeline depth); quantized caches add the widened K and V blocks and per-slot f32 scales. The
    peak is at least the decode kernel's f32 epilogue tile, allocated after the loop. Every page
    size accepted tiles a block, so the plan depends on the block only."""
    del page_size
    tuning = tuning or tuning_table.lookup(None, head_dim)
    bt = tuning.block_tokens
    per_slot = 2 * bt * head_dim * cache_itemsize  # K and V
    fixed = (BLOCK_Q * head_dim + BLOCK_Q * bt) * itemsize + BLOCK_Q * 4  # q, p, slopes
    if cache_itemsize == 1:
        per_slot += 2 * bt * 4  # K and V scales
        fixed += 2 * bt * head_dim * itemsize  # widened K and V
    fit = (tuning.smem_budget - fixed) // per_slot
    slots = int(min(tuning.max_slots, fit)) if fit >= 2 else 0
    epilogue = BLOCK_Q * head_dim * 4 + 2 * BLOCK_Q * 4
    return slots, max(fixed + slots * per_slot, epilogue)


def main_loop_scratch(dtype, cache_dtype, head_dim, block_tokens, slots, *, alibi, quantized,
                      register_acc):
    """The SMEM buffers of the main loop, in `attend`'s order, for `pl.run_scoped`: q_smem
    [BLOCK_Q, H]; k_smem, v_smem [slots, S, H] in the cache dtype; p_smem [BLOCK_Q, S] (interpret
    mode only, else None); slopes_smem f32[BLOCK_Q] or None; quantized only (else None): kd_smem,
    vd_smem [S, H] in q's dtype and ks_smem, vs_smem f32[slots, S]. S = block_tokens."""
    transforms = operand_transforms(dtype, head_dim)
    cache_transforms = operand_transforms(cache_dtype, head_dim)
    return (
        plgpu.SMEM((BLOCK_Q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((slots, block_tokens, head_dim), cache_dtype, transforms=cache_transforms),
        plgpu.SMEM((slots, block_tokens, head_dim), cache_dtype, transforms=cache_transforms),
        # Interpret mode: p in SMEM (the lhs of P @ V, minor dimension block_tokens).
        None if register_acc else plgpu.SMEM((BLOCK_Q, block_tokens), dtype,
                                             transforms=operand_transforms(dtype, block_tokens)),
        plgpu.SMEM((BLOCK_Q,), jnp.float32) if alibi else None,
        # Quantized caches: the widened K and V blocks and the per-token scales.
        plgpu.SMEM((block_tokens, head_dim), dtype, transforms=transforms) if quantized else None,
        plgpu.SMEM((block_tokens, head_dim), dtype, transforms=transforms) if quantized else None,
        plgpu.SMEM((slots, block_tokens), jnp.float32) if quantized else None,
        plgpu.SMEM((slots, block_tokens), jnp.float32) if quantized else None,
    )


class KVBlocks(NamedTuple):
    """One program's stream of K/V blocks (built inside a kernel): blocks lo .. lo + num_steps - 1
    of sequence `seq`, copied from the GMEM pools through the block table into `slots` SMEM slots."""
    tables_ref: Any   # i32[num_seqs, pages_per_seq] in GMEM
    seq: Any          # i32[], the sequence (row of tables_ref)
    lo: Any           # i32[], the first block
    num_steps: Any    # i32[], blocks to walk (0: no copy at all)
    head: tuple       # leading pool indices: (kv head,), or (layer, kv head) for a stacked pool
    gmem: tuple       # (k_ref, v_ref, ks_ref, vs_ref); scales None unless quantized
    smem: tuple       # (k_smem, v_smem, ks_smem, vs_smem): [slots, S, H] and f32[slots, S] or None
    bars: tuple       # (k_bars, v_bars), `slots` barriers each
    page_size: int
    block_tokens: int
    slots: int

    def lookup(self, step):
        """Where block lo + step is: i32 scalars read from the block table (`block_source`)."""
        num_pages = self.gmem[0].shape[-3]
        return block_source(self.tables_ref, self.seq, self.lo + step, page_size=self.page_size,
                            block_tokens=self.block_tokens, pages_per_seq=self.tables_ref.shape[1],
                            num_pages=num_pages)

    def issue(self, src, slot):
        """Starts the TMA copies of one block into slot."""
        copy_block(src, slot, self.head, self.gmem, self.smem, self.bars,
                   page_size=self.page_size, block_tokens=self.block_tokens)

    def prefetch(self):
        """Starts the copies of the first slots - 1 blocks (those that exist)."""
        for s in range(self.slots - 1):
            pl.when(s < self.num_steps)(functools.partial(self.issue, self.lookup(s), s))


def prologue(blocks: KVBlocks, q_src, q_smem, slopes_src, slopes_smem, q_bar):
    """A program's prologue: starts the copies of its q tile (q_src [BLOCK_Q, H] in GMEM) and ALiBi
    slopes (slopes_src f32[BLOCK_Q] in GMEM; both None without ALiBi) and of its first blocks, then
    waits for q (and the slopes). Returns the slopes f32[BLOCK_Q] in the WGMMA row layout, or None."""
    plgpu.copy_gmem_to_smem(q_src, q_smem, q_bar.at[0])
    if slopes_smem is not None:
        plgpu.copy_gmem_to_smem(slopes_src, slopes_smem, q_bar.at[1])
    blocks.prefetch()
    plgpu.barrier_wait(q_bar.at[0])
    if slopes_smem is None:
        return None
    plgpu.barrier_wait(q_bar.at[1])
    return plgpu.load(slopes_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # f32[BLOCK_Q]


def attend(blocks: KVBlocks, q_smem, p_smem, kd_smem, vd_smem, *, scale, soft_cap, logits,
           key_range, zero_masked_p, register_acc):
    """The online softmax of the q tile over `blocks` (after `prologue`).

    Args:
      blocks: the K/V stream; its slots and barriers are reused round-robin.
      q_smem: [BLOCK_Q, H] in q's dtype, loaded. p_smem, kd_smem, vd_smem: `main_loop_scratch`'s.
      scale, soft_cap: as the public functions (soft_cap None: off).
      logits: (s f32[BLOCK_Q, S], pos i32[BLOCK_Q, S] key positions) -> (s with the kernel's
        biases, vis bool[BLOCK_Q, S]): which keys each row sees; s is masked where not vis.
      key_range: (key_lo, key_end) i32[]: keys outside [key_lo, key_end) are seen by no row; their
        V rows are zeroed in SMEM before P @ V (p is 0 there, but 0 * NaN is not).
      zero_masked_p: set p = 0 where not vis explicitly; needed when a row may see no key of a
        block (its max is then MASK_VALUE and exp(s - m) = 1). False when every row sees every
        visible key of a block (decode), which every block holds.
      register_acc: the hardware path. P @ V accumulates into `acc` in place (`pl.run_state` on
        a WGMMA accumulator initialised from it) with p as a register operand. GPU interpret mode
        models neither, so there (False) p goes through SMEM (p_smem) and each block gets a fresh
        accumulator that is added to acc: the same math, twice the accumulator registers and a
        fence per block, which on hardware would spill at head_dim 256.

    Returns:
      (acc f32[BLOCK_Q, H], m f32[BLOCK_Q], l f32[BLOCK_Q]) unnormalized, in WGMMA layouts.
    """
    k_smem, v_smem, ks_smem, vs_smem = blocks.smem
    k_bars, v_bars = blocks.bars
    slots, block_tokens = blocks.slots, blocks.block_tokens
    dtype = q_smem.dtype
    head_dim = q_smem.shape[-1]
    quantized = ks_smem is not None
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    key_lo, key_end = key_range

    def body(step, carry):
        acc, m, l, nxt_pages = carry  # f32[BLOCK_Q, H], f32[BLOCK_Q], f32[BLOCK_Q], i32s
        slot = lax.rem(step, slots)
        # Keep slots - 1 blocks in flight: the slot refilled here was freed by step - 1
        # (its WGMMAs completed before their results were read).
        nxt = step + slots - 1
        pl.when(nxt < blocks.num_steps)(lambda: blocks.issue(nxt_pages, lax.rem(nxt, slots)))
        # The block-table reads for the next step's copies start now and are first used
        # one step later, so their GMEM latency hides behind this block's compute.
        nxt_pages = blocks.lookup(nxt + 1)

        block_start = (blocks.lo + step) * block_tokens
        plgpu.barrier_wait(k_bars.at[slot])
        if quantized:
            # WGMMA operands share one dtype: widen the 8-bit block into q's dtype (exact
            # for int8 and both float8 formats); the per-token scale multiplies the logits.
            widen_tile(k_smem.at[slot], kd_smem, dtype, head_dim)
            plgpu.commit_smem()
            k_op = kd_smem
        else:
            k_op = k_smem.at[slot]

        def qk(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_op.transpose((1, 0)))
            return s_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_tokens), jnp.float32))  # [BLOCK_Q, S]
        s = s * scale
        if quantized:
            k_scale = plgpu.load(ks_smem.at[slot], layout=col_layout)  # f32[S]
            s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
        pos = block_start + plgpu.broadcasted_iota(
            jnp.int32, (BLOCK_Q, block_tokens), 1, layout=plgpu.Layout.WGMMA)
        s, vis = logits(s, pos)
        s = jnp.where(vis, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)  # rescales what was accumulated under the old max
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        if zero_masked_p:
            # A row may see no key of this block (causal, window): its p must be 0, not exp(0).
            p = jnp.where(vis, p, 0.0)
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bars.at[slot])
        if quantized:
            # acc += (p * v_scale) @ v: the scale is per key token, a column of p. Masked
            # columns may carry NaN scales (unwritten slots), so they are zeroed after.
            v_scale = plgpu.load(vs_smem.at[slot], layout=col_layout)  # f32[S]
            p = jnp.where(vis, p * lax.broadcast_in_dim(v_scale, p.shape, [1]), 0.0)
        if not register_acc:
            p_smem[...] = p.astype(dtype)  # interpret mode: SMEM operands only

        def seen(tok):
            return (tok < key_end) & (tok >= key_lo)
        if quantized:
            # The widened copy is written whole, unseen tokens as 0 (see below).
            mask_rows(v_smem.at[slot], vd_smem, seen, block_start, block_tokens, dtype, head_dim)
            v_op = vd_smem
        else:
            v_op = v_smem.at[slot]
            partial_block = (block_start < key_lo) | (block_start + block_tokens > key_end)

            @pl.when(partial_block)
            def _zero_unseen_v():
                # p = 0 there, but 0 * (garbage NaN/inf in a recycled page) would be NaN.
                mask_rows(v_smem.at[slot], v_smem.at[slot], seen, block_start, block_tokens,
                          dtype, head_dim)
                if register_acc:
                    plgpu.commit_smem()  # only blocks that were rewritten need the fence

        if quantized or not register_acc:
            plgpu.commit_smem()  # register stores to SMEM -> visible to the WGMMA (async proxy)

        if register_acc:
            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_op)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        else:
            def pv(pv_ref):
                plgpu.wgmma(pv_ref, p_smem, v_op)
                return pv_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))
        return acc, m_new, l, nxt_pages

    init = (
        plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((BLOCK_Q,), MASK_VALUE, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout),
        blocks.lookup(slots - 1),
    )
    acc, m, l, _ = lax.fori_loop(0, blocks.num_steps, body, init)
    return acc, m, l
