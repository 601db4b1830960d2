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

import jax
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


def num_blocks(pages_per_seq: int, page_size: int, block_tokens: int) -> int:
    """Blocks that cover a sequence of pages_per_seq pages."""
    return -(-(pages_per_seq * page_size) // block_tokens)


def num_partitions(num_seqs: int, num_kv_heads: int, num_blocks: int, *,
                   tuning: MosaicTuning | None = None) -> int:
    """Split-K partitions per sequence of the decode kernels: enough programs to fill the GPU
    (`tuning.target_programs`), each at least one block."""
    tuning = tuning or tuning_table.lookup()
    want = -(-tuning.target_programs // max(1, num_seqs * num_kv_heads))
    return max(1, min(num_blocks, want))


def partitions(num_seqs, num_kv_heads, pages_per_seq, page_size, tuning, blocks_per_part=None):
    """(blocks_per_part, parts) of a decode call: `blocks_per_part` when given, else as
    `num_partitions` chooses."""
    blocks = num_blocks(pages_per_seq, page_size, tuning.block_tokens)
    if blocks_per_part is None:
        blocks_per_part = -(-blocks // num_partitions(num_seqs, num_kv_heads, blocks, tuning=tuning))
    return blocks_per_part, -(-blocks // blocks_per_part)


def launch(body, out_type, grid: tuple, grid_names: tuple, interpret: bool, detect_races: bool = False):
    """`plgpu.kernel` as every jpa Mosaic kernel calls it: Lane semantics (layouts explicit on every
    register tile), GPU interpret mode when asked. The body's name is the kernel's name (ptxas
    reports and MOSAIC_GPU_DUMP_TO files)."""
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams(detect_races=detect_races) if interpret else None)


def partition_outputs(num_seqs: int, num_kv_heads: int, parts: int, rows: int, head_dim: int) -> tuple:
    """The decode kernels' outputs: f32 acc [B, K, parts, rows, H], m and l [B, K, parts, rows]
    (unnormalized per split-K partition; `merge_partitions` combines them)."""
    lead = (num_seqs, num_kv_heads, parts, rows)
    return (jax.ShapeDtypeStruct(lead + (head_dim,), jnp.float32),
            jax.ShapeDtypeStruct(lead, jnp.float32), jax.ShapeDtypeStruct(lead, jnp.float32))


# ---- Which keys a row sees, and the online-softmax step: both paths (WGMMA, mma.sync) ----

def decode_key_range(seq_len, part, blocks_per_part, block_tokens, sliding_window):
    """A decode program's keys: (start, lo, num_steps). Every query row is at position seq_len - 1
    and sees [start, seq_len); the program walks blocks lo .. lo + num_steps - 1 of its partition
    `part`, each of which holds a visible key."""
    start = (jnp.maximum(seq_len - sliding_window, 0) if sliding_window is not None
             else jnp.int32(0))
    lo = jnp.maximum(part * blocks_per_part, lax.div(start, block_tokens))
    hi = jnp.minimum((part + 1) * blocks_per_part, lax.div(seq_len + block_tokens - 1, block_tokens))
    return start, lo, jnp.maximum(hi - lo, 0)


def decode_logits(slopes, seq_len, start):
    """The decode kernels' `logits` (see `attend`): ALiBi (slopes f32[BLOCK_Q] in the row layout,
    or None) and the visible range [start, seq_len). Every block of the walk holds a visible key of
    every row, so a row's max is a real logit and masked p are exactly 0."""
    def logits(s, pos):
        if slopes is not None:
            rel = (pos - seq_len + 1).astype(jnp.float32)
            s = s + lax.broadcast_in_dim(slopes, s.shape, [0]) * rel
        return s, (pos < seq_len) & (pos >= start)
    return logits


def tile_key_range(pos0, ntok, block_tokens, sliding_window):
    """A ragged tile's keys (ntok query tokens at positions pos0 ..): (kv_lo, kv_end, lo,
    num_steps). Some row sees each key of [kv_lo, kv_end) (kv_end - 1 is the last query position);
    blocks lo .. lo + num_steps - 1 cover them (none for a dead tile, ntok 0)."""
    kv_end = pos0 + ntok
    kv_lo = jnp.maximum(pos0 - sliding_window + 1, 0) if sliding_window is not None else jnp.int32(0)
    lo = lax.div(kv_lo, block_tokens)
    hi = jnp.where(ntok > 0, lax.div(kv_end + block_tokens - 1, block_tokens), lo)
    return kv_lo, kv_end, lo, jnp.maximum(hi - lo, 0)


def ragged_logits(slopes, q_pos, key_range, sliding_window):
    """The ragged tile kernels' `logits`: ALiBi, the tile's key range, causal per row and the
    window per row. q_pos(shape) -> i32 position of each row's query (pos0 + row // q_per_kv) in
    the register layout of the scores."""
    kv_lo, kv_end = key_range

    def logits(s, pos):
        rel = pos - q_pos(s.shape)  # key position - query position
        if slopes is not None:
            s = s + lax.broadcast_in_dim(slopes, s.shape, [0]) * rel.astype(jnp.float32)
        vis = (pos < kv_end) & (pos >= kv_lo) & (rel <= 0)
        if sliding_window is not None:
            vis = vis & (rel > -sliding_window)
        return s, vis
    return logits


def apply_soft_cap(s, soft_cap):
    """soft_cap * tanh(s / soft_cap), or s when soft_cap is None."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s * (1.0 / soft_cap))


def softmax_step(s, vis, m, l, *, zero_masked_p):
    """One block of the online softmax: s f32[BLOCK_Q, S] logits, vis bool[BLOCK_Q, S], m, l
    f32[BLOCK_Q] the running max and sum. Returns (p, m_new, alpha, l_new); the caller rescales its
    accumulator by alpha and adds p @ V. zero_masked_p: as `attend`."""
    s = jnp.where(vis, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)  # rescales what was accumulated under the old max
    m_sub = m_new
    if zero_masked_p:
        # A row that has seen no key yet (causal, window) has m_new = MASK_VALUE, and its masked
        # p would be exp(0) = 1: it subtracts 0 instead, so they are exp(MASK_VALUE) = 0. A row
        # with a real max gets exp(MASK_VALUE - max) = 0 anyway. (A row-wide select: the per-key
        # `vis` need not stay live past the max, which kept the mma.sync tile kernel spilling.)
        m_sub = jnp.where(m_new > MASK_VALUE, m_new, 0.0)
    p = jnp.exp(s - lax.broadcast_in_dim(m_sub, s.shape, [0]))
    return p, m_new, alpha, l * alpha + p.sum(axis=1)


def merge_sink(m, l, sink):
    """An attention sink as one more softmax column of value 0: the state (m = sink, l = 1,
    acc = 0) merged into a row's final (m, l). Returns (alpha, l): the accumulator is scaled by
    alpha (exact: a program holds all of its rows' keys)."""
    m_new = jnp.maximum(m, sink)
    alpha = jnp.exp(m - m_new)
    return alpha, l * alpha + jnp.exp(sink - m_new)


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


def block_pieces(src, *, page_size, block_tokens):
    """The copies of one block (`block_source`'s src): [(page, rows of the page, rows of the
    block)], one per page, or one slice of a page larger than a block."""
    if page_size <= block_tokens:
        return [(page, pl.ds(0, page_size), pl.ds(i * page_size, page_size)) for i, page in enumerate(src)]
    page, row = src
    return [(page, pl.ds(row, block_tokens), pl.ds(0, block_tokens))]


def copy_block(src, slot, head, refs, smem, bars, *, page_size, block_tokens):
    """Starts the TMA copies of one block (`block_source`'s src) into `slot`: K, V and, for a
    quantized cache, their per-token scales. head: the leading pool indices, (kv head,) or
    (layer, kv head) for a stacked pool; refs: (k_ref, v_ref, ks_ref, vs_ref) in GMEM (scales
    None unless quantized); smem: the matching [slots, S, H] / [slots, S] buffers; bars: (k_bars,
    v_bars). Each barrier gets `tmas_per_block` arrivals."""
    k_ref, v_ref, ks_ref, vs_ref = refs
    k_smem, v_smem, ks_smem, vs_smem = smem
    k_bars, v_bars = bars
    for page, src_rows, rows in block_pieces(src, page_size=page_size, block_tokens=block_tokens):
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
    # p * v_scale is rounded to q's dtype for the WGMMA: times `p_shift` (exact) it stays out of
    # float16's subnormals (float8 e5m2: v_scale = amax / 57344); acc is shifted back at the end.
    shift = p_shift(k_smem.dtype) if quantized else 1.0

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
        s = apply_soft_cap(s, soft_cap)
        pos = block_start + plgpu.broadcasted_iota(
            jnp.int32, (BLOCK_Q, block_tokens), 1, layout=plgpu.Layout.WGMMA)
        s, vis = logits(s, pos)
        p, m_new, alpha, l = softmax_step(s, vis, m, l, zero_masked_p=zero_masked_p)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bars.at[slot])
        if quantized:
            # acc += (p * v_scale) @ v: the scale is per key token, a column of p. Masked
            # columns may carry NaN scales (unwritten slots), so they are zeroed after.
            v_scale = plgpu.load(vs_smem.at[slot], layout=col_layout) * shift  # f32[S]
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
    if quantized:
        acc = acc * (1.0 / shift)
    return acc, m, l


# ---- The mma.sync path: Ampere / Ada (sm_80/86/89, cp.async copies), Blackwell (sm_100, TMA) ----
#
# The same block walk and online softmax as above on the hardware below (and beside) Hopper's
# WGMMA: `plgpu.mma` (m16n8k16 mma.sync) on register operands loaded from SMEM, the f32
# accumulator in the MMA_ACC layout, one [64, <= CHUNK] accumulator per head_dim column chunk.
# Copies: cp.async commit groups below sm_90; TMA + one mbarrier per slot on sm_100 (Mosaic GPU
# copies only by TMA from sm_90 on; sm_120 the same). The per-generation difference is
# `MmaOps.tma`, `MmaOps.fp8_cvt` (float8 converted in hardware from sm_89, by bit manipulation
# below) and the tiling row (`tuning.lookup_ampere`); GPU interpret mode gets stand-ins for the
# primitives it does not model (`MmaOps.interpret`).

# Columns of q / K / V handled per mma sweep (one [64, 64] f32 accumulator each).
CHUNK = 64
# f32 rows per q tile (ALiBi slopes, attention sinks) are copied as 128 elements: an untiled
# cp.async moves a multiple of 128 elements.
F32_ROW = 128


def uses_tma(compute_capability: float | None) -> bool:
    """Whether the mma.sync kernels copy with TMA + mbarriers on this GPU (Mosaic GPU has cp.async
    only below sm_90): Blackwell; Ampere/Ada and interpret mode (None) use cp.async."""
    return compute_capability is not None and compute_capability >= 9.0


def kv_swizzle(head_dim: int, rows: int, itemsize: int = 2) -> int | None:
    """SMEM swizzle (bytes) of the K/V blocks, or None when none works.

    A cp.async copy of a tiled SMEM buffer is spread over the 4 warps a tile at a time (tiles of
    8 rows x swizzle bytes), so a page copy of `rows` rows must be a multiple of 4 tiles: the
    widest swizzle (fewest bank conflicts) that divides a row and gives such a count. A tile is
    at most CHUNK columns wide (128-byte tiles of an 8-bit block would be 128 columns, which the
    CHUNK-column operand slices cannot cut)."""
    row_bytes = head_dim * itemsize
    for swizzle in (128, 64, 32):
        if swizzle > CHUNK * itemsize:
            continue
        if row_bytes % swizzle == 0 and (rows // 8) * (row_bytes // swizzle) % 4 == 0:
            return swizzle
    return None


def untiled_rows(head_dim: int) -> bool:
    """Whether the mma path keeps its [rows, head_dim] SMEM tiles untiled (row-major, no swizzle):
    head dims that are not a multiple of 32 (80, 112). A tiled cp.async copy moves 8-row x
    swizzle-byte tiles a warp at a time and Mosaic GPU wants each warp's share to be whole 128-byte
    GMEM lines, which 160- / 224-byte rows are not; an untiled copy moves the contiguous page
    (or q rows) as one run of 16-byte pieces."""
    return head_dim % 32 != 0


def out_width(head_dim: int) -> int:
    """Columns of the mma path's accumulators and f32 outputs: head_dim, rounded up to a multiple
    of 32 for untiled rows (`untiled_rows`): an f32 output chunk is stored in whole 128-byte GMEM
    lines, which 16 columns (head_dim 80's last chunk) are not. The extra columns come from the
    restaged V block's unwritten columns and are sliced off by the wrappers."""
    return -(-head_dim // 32) * 32 if untiled_rows(head_dim) else head_dim


def untiled_copy_ok(rows: int, head_dim: int, itemsize: int) -> bool:
    """Whether an untiled cp.async copy of a [rows, head_dim] page piece works: a multiple of 128
    elements, each thread's share moved in pieces of 4, 8 or 16 bytes (the vector Mosaic's
    WGStridedFragLayout picks: the thread's share up to 8 bytes, halved until it divides; 5 or 6
    int8 elements of an 8-row page at head_dim 80 / 96 are no cp.async size)."""
    size = rows * head_dim
    if size % 128:
        return False
    vec = min(8 // itemsize, size // 128)
    while vec > 0 and size % (vec * 128):
        vec //= 2
    return vec * itemsize in (4, 8, 16)


def q_transforms(dtype, head_dim: int):
    """The mma path's q tile transforms: `operand_transforms`, or none (`untiled_rows`)."""
    return () if untiled_rows(head_dim) else operand_transforms(dtype, head_dim)


def kv_untiled(head_dim: int, rows: int, itemsize: int) -> bool:
    """Whether the K/V SMEM blocks are untiled: head dims 80 / 112 (`untiled_rows`), or pages
    whose tiled cp.async copy has no swizzle that works (`kv_swizzle`: small pages of narrow rows,
    e.g. 8 tokens x 64 int8). Untiled copies move the contiguous page (`untiled_copy_ok`)."""
    return untiled_rows(head_dim) or kv_swizzle(head_dim, rows, itemsize) is None


def staged(head_dim: int, rows: int, quantized: bool) -> tuple:
    """(K, V): which blocks the mma path restages through a tiled SMEM block in q's dtype before
    its operand loads (`MmaOps.widen_block`): both for an 8-bit cache (widened), V for untiled
    K/V blocks (`kv_untiled`; rows: a page copy's rows; V's operand pairs run along tokens, which
    Mosaic GPU loads only from tiled 16-bit SMEM; K^T's run along head_dim and load from untiled
    rows)."""
    return quantized, quantized or kv_untiled(head_dim, rows, 1 if quantized else 2)


def staging_scratch(dtype, head_dim: int, block_tokens: int, rows: int, quantized: bool) -> list:
    """The two restaging blocks of `staged` for `pl.run_scoped` ([S, H] in q's dtype, or None)."""
    k_on, v_on = staged(head_dim, rows, quantized)
    if untiled_rows(head_dim):
        # 32-byte swizzle: tiles of 16 columns, which head_dim 80's / 112's last mma chunks (16,
        # 48 columns) cut whole.
        bits = jnp.dtype(dtype).itemsize * 8
        transforms = (plgpu.TilingTransform((8, 32 * 8 // bits)), plgpu.SwizzleTransform(32))
        return [plgpu.SMEM((block_tokens, width), dtype, transforms=transforms) if on else None
                for on, width in ((k_on, head_dim), (v_on, out_width(head_dim)))]
    return [plgpu.SMEM((block_tokens, head_dim), dtype, transforms=operand_transforms(dtype, head_dim))
            if on else None for on in (k_on, v_on)]


def kv_transforms(dtype, head_dim: int, rows: int):
    """Tiling + swizzle of the mma path's K/V SMEM blocks (`kv_swizzle`; rows per copy), or none
    (`kv_untiled`)."""
    if kv_untiled(head_dim, rows, jnp.dtype(dtype).itemsize):
        return ()
    swizzle = kv_swizzle(head_dim, rows, jnp.dtype(dtype).itemsize)
    bits = jnp.dtype(dtype).itemsize * 8
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def mma_chunks(head_dim: int) -> list:
    """[(first column, width)] of head_dim in slices of at most CHUNK (each a multiple of 16)."""
    return [(c, min(CHUNK, head_dim - c)) for c in range(0, head_dim, CHUNK)]


def acc_to_lhs(x):
    """A [64, N] 16-bit array in the MMA_ACC layout -> the same values in the MMA_LHS layout.

    For m16n8k16 (4 warps along M) a thread owns the same elements in both layouts: acc registers
    are indexed [n8 tile, row half], lhs registers [k16 tile, k half, row half], and n8 tile
    2 * t + h is k16 tile t's half h. So the register array is the same, reshaped."""
    import jax.experimental.mosaic.gpu as mgpu  # the lowering's own library

    acc_layout = plgpu.Layout.MMA_ACC(x.dtype)
    lhs_layout = plgpu.Layout.MMA_LHS(x.dtype)

    @plgpu.inline_mgpu(arg_types=(acc_layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, lhs_layout))
    def relayout(_, a):
        lhs = mgpu.MMALayouts(a.mlir_dtype, m_warps=4).lhs
        regs = a.registers.reshape(lhs.registers_shape(a.shape))
        return mgpu.FragmentedArray(_registers=regs, _layout=lhs, _is_signed=a.is_signed)
    return relayout(x)


class MmaOps(NamedTuple):
    """The mma path's hardware primitives, or their interpret-mode stand-ins: the per-generation
    strategy of the mma.sync kernels.

    tma: copies are TMAs tracked by mbarriers (sm_100: Mosaic GPU has no cp.async path from sm_90
    on), else cp.async commit groups (sm_8x). interpret: GPU interpret mode, which models neither
    cp.async without a barrier nor `mma` nor the accumulator -> lhs relayout; there copies are
    plain ref reads/writes (TMA path: real TMAs and barriers, which the interpreter models) and
    matmuls `jnp.dot`. Block walk, masking, softmax, split-K and the layer index are the code that
    runs on the GPU. fp8_cvt: the GPU converts float8 in hardware (sm_89 and later: cvt from
    e4m3/e5m2); without it (sm_80/86) float8 widens by integer bit manipulation (`widen_fp8_bits`).

    8-bit caches: a K or V block is widened to q's dtype into an SMEM block (`widen_block`),
    which the operand loads then read as a 16-bit cache's. (V's operand pairs run along tokens,
    strided, which Mosaic GPU loads only from 16-bit tiles; widening K in registers next to the
    scores, the other choice for K, spilled on sm_80.)"""
    interpret: bool
    tma: bool = False
    fp8_cvt: bool = True

    def copy(self, src, dst, bar=None):
        if self.tma:
            plgpu.copy_gmem_to_smem(src, dst, bar)
        elif self.interpret:
            dst[...] = src[...]
        else:
            plgpu.copy_gmem_to_smem(src, dst, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    def wait(self, groups: int):
        """cp.async: wait until at most `groups` commit groups are in flight (and sync the
        warpgroup)."""
        if not self.interpret and not self.tma:
            plgpu.wait_gmem_to_smem(groups)

    # Operand loads pass optimized=False: from an untiled block (`kv_untiled`) Mosaic GPU may find
    # no bank-conflict-free pattern (192-byte rows) and would refuse rather than load slower.
    def lhs(self, ref):
        if self.interpret:
            return ref[...]
        return plgpu.load(ref, layout=plgpu.Layout.MMA_LHS(ref.dtype), optimized=False)

    def rhs(self, ref, dtype=None):
        """ref [S, W] as an mma rhs of `dtype` (None: ref's; an 8-bit ref is widened to it)."""
        dtype = dtype or ref.dtype
        x = ref[...] if self.interpret else plgpu.load(ref, layout=plgpu.Layout.MMA_RHS(dtype),
                                                        optimized=False)
        return self.widen_operand(x, dtype)

    def rhs_t(self, ref, dtype=None):
        """ref [S, W] -> its transpose [W, S] as an mma rhs of `dtype` (as `rhs`)."""
        dtype = dtype or ref.dtype
        if self.interpret:
            return self.widen_operand(ref[...].T, dtype)
        return self.widen_operand(
            plgpu.load(ref.T, layout=plgpu.Layout.MMA_RHS(dtype), optimized=False), dtype)

    def widen_operand(self, x, dtype):
        """An operand tile read from an 8-bit block -> q's dtype, exactly (int8 and both float8
        formats are exact in bfloat16 and float16); x itself when it already has that dtype."""
        if x.dtype == dtype:
            return x
        if jnp.issubdtype(x.dtype, jnp.floating) and not self.fp8_cvt:
            return widen_fp8_bits(x).astype(dtype)
        # Through f32 for int8 too: Mosaic's direct int8 -> bfloat16 uses sub.bf16x2 (sm_90+).
        return x.astype(jnp.float32).astype(dtype)

    def sync(self):
        """A warpgroup barrier (bar.sync): SMEM written by some warps is then visible to all."""
        if self.interpret:
            return
        import jax.experimental.mosaic.gpu as mgpu  # the lowering's own library

        @plgpu.inline_mgpu()
        def barrier(_):
            mgpu.utils.warpgroup_barrier()
        barrier()

    def widen_block(self, src, dst, dtype):
        """dst[...] = src[...] widened to dtype (an 8-bit K or V block [S, W] -> q's dtype in
        SMEM), through registers in the layout of a transposed operand load (pairs along W,
        contiguous in both)."""
        if self.interpret:
            dst[...] = self.widen_operand(src[...], dtype)
            return
        dst.T[...] = self.rhs_t(src, dtype)

    def mma(self, acc, a, b):
        if self.interpret:
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)
        return plgpu.mma(acc, a, b)

    def to_lhs(self, p):
        return p if self.interpret else acc_to_lhs(p)

    def iota(self, shape, dim, layout):
        """i32 indices along `dim` of a tile of `shape`, in `layout` (a register layout)."""
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

    def zeros(self, shape, dtype):
        return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.MMA_ACC(dtype))

    def full_rows(self, value, dtype):
        return plgpu.layout_cast(jnp.full((BLOCK_Q,), value, jnp.float32),
                                 plgpu.Layout.MMA_ACC(dtype).reduce(1))

    def key_vector(self, pieces, dtype):
        """f32[S] per-key values of a block (8-bit caches' scales) read straight from GMEM into
        the column layout of the [BLOCK_Q, S] scores: pieces, the block's slices of the scale
        pool in key order (one per page, or one slice of a page), are loaded and joined in
        registers. (A cp.async copy moves whole 128-element or 4-warp-tile pieces: a page's scales
        are fewer.)"""
        if self.interpret:
            return jnp.concatenate([ref[...] for ref in pieces]) if len(pieces) > 1 else pieces[0][...]
        layout = plgpu.Layout.MMA_ACC(dtype).reduce(0)
        parts = [plgpu.load(ref, layout=layout, optimized=False) for ref in pieces]
        return parts[0] if len(parts) == 1 else join_columns(parts, dtype)

    def barriers(self, rows: int, arrivals: int, slots: int) -> tuple:
        """The TMA path's barriers, for `pl.run_scoped`: one per q-tile copy (q, then `rows` f32
        rows) and one per slot with `arrivals` TMAs (K and V pieces); none on cp.async."""
        if not self.tma:
            return ()
        return (plgpu.Barrier(num_barriers=1 + rows),
                plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots))


def widen_fp8_bits(x):
    """float8 e4m3fn / e5m2 -> float16 by integer bit manipulation, for GPUs without a float8
    convert (sm_80/86). e5m2 is float16's top byte. e4m3fn's bits (sign, 4 exponent bits of bias
    7, 3 mantissa bits) placed at float16's (bias 15) give x * 2**-8 for normal and subnormal x
    alike, so one exact multiply by 256 restores x. (0x7f/0xff, e4m3fn's NaN, become +-480: the
    kernels mask every key outside a sequence, the only place a NaN may sit.)"""
    bits = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint16)
    if x.dtype == jnp.float8_e5m2:
        return lax.bitcast_convert_type(bits << 8, jnp.float16)
    h = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return lax.bitcast_convert_type(h, jnp.float16) * jnp.float16(256.0)


def join_columns(parts, dtype):
    """f32 vectors in the column layout of a [BLOCK_Q, n_i] MMA_ACC tile -> one vector of
    sum(n_i), in order. A column vector's registers are one group per 8 columns (the m16n8
    accumulator tile's width), so joining is concatenating the register groups."""
    import jax.experimental.mosaic.gpu as mgpu  # the lowering's own library

    layout = plgpu.Layout.MMA_ACC(dtype).reduce(0)
    total = sum(p.shape[0] for p in parts)

    @plgpu.inline_mgpu(arg_types=(layout,) * len(parts),
                       return_type=plgpu.ShapeDtypeStruct((total,), jnp.float32, layout))
    def join(_, *xs):
        regs = np.concatenate([x.registers for x in xs], axis=0)
        return mgpu.FragmentedArray(_registers=regs, _layout=xs[0].layout, _is_signed=None)
    return join(*parts)


def mma_copies_per_block(page_size: int, block_tokens: int) -> int:
    """Copies per block: one per page (or page slice) of K and of V (cp.async commit groups, or
    TMA arrivals on the slot's barrier)."""
    return 2 * max(1, block_tokens // page_size)


class MmaBlocks(NamedTuple):
    """One mma-path program's stream of K/V blocks (built inside a kernel), as `KVBlocks`: blocks
    lo .. lo + num_steps - 1 of sequence `seq` into `slots` SMEM slots, copied by `ops`."""
    ops: MmaOps
    tables_ref: Any
    seq: Any
    lo: Any
    num_steps: Any
    head: tuple       # (kv head,) or (layer, kv head)
    gmem: tuple       # (k_ref, v_ref)
    smem: tuple       # (k_smem, v_smem) [slots, S, H]
    bars: Any         # TMA path: the slots' barriers, else None
    page_size: int
    block_tokens: int
    slots: int
    scales: tuple | None = None  # 8-bit caches: (ks_ref, vs_ref) f32[..., P, S_p] in GMEM
    wide: tuple = (None, None)  # (k, v) restaging blocks [S, H] in q's dtype or None (`staged`)

    @property
    def groups(self) -> int:
        return mma_copies_per_block(self.page_size, self.block_tokens)

    def pieces(self, step):
        """block_pieces of block lo + step (its pages read from the block table)."""
        src = block_source(self.tables_ref, self.seq, self.lo + step, page_size=self.page_size,
                           block_tokens=self.block_tokens, pages_per_seq=self.tables_ref.shape[1],
                           num_pages=self.gmem[0].shape[-3])
        return block_pieces(src, page_size=self.page_size, block_tokens=self.block_tokens)

    def issue(self, step, slot):
        """Starts the copies of block lo + step into slot."""
        k_ref, v_ref = self.gmem
        k_smem, v_smem = self.smem
        bar = self.bars.at[slot] if self.ops.tma else None
        for page, src_rows, rows in self.pieces(step):
            self.ops.copy(k_ref.at[(*self.head, page, src_rows)], k_smem.at[slot, rows], bar)
            self.ops.copy(v_ref.at[(*self.head, page, src_rows)], v_smem.at[slot, rows], bar)

    def scale_vector(self, step, which, dtype):
        """8-bit caches: K's (which 0) or V's (1) scales f32[S] of block lo + step in the scores'
        column layout (`MmaOps.key_vector`), read from GMEM when the block is computed."""
        ref = self.scales[which]
        return self.ops.key_vector([ref.at[(*self.head, page, src_rows)]
                                    for page, src_rows, _ in self.pieces(step)], dtype)

    def prefetch(self):
        """Starts the copies of the first slots - 1 blocks (those that exist)."""
        for s in range(self.slots - 1):
            pl.when(s < self.num_steps)(functools.partial(self.issue, s, s))

    def wait_in_flight(self, later):
        """cp.async: waits until only the groups of `later` (an i32 in [0, slots - 1]) blocks are
        in flight; everything committed before them (earlier blocks, the q tile) has landed."""
        for k in range(self.slots):
            pl.when(later == k)(functools.partial(self.ops.wait, k * self.groups))

    def wait_block(self, step, slot):
        """Waits for block lo + step (in slot) to land."""
        if self.ops.tma:  # one barrier per slot, `groups` TMA arrivals
            plgpu.barrier_wait(self.bars.at[slot])
            return
        # Groups still allowed in flight: those of the blocks issued after `step` (at most
        # slots - 2 when the wait comes before the refill).
        self.wait_in_flight(jnp.minimum(self.num_steps - 1 - step, self.slots - 2))


def mma_prologue(blocks: MmaBlocks, q_src, q_smem, rows, q_bars):
    """A program's prologue on the mma path: starts the copies of its q tile (q_src [BLOCK_Q, H]
    in GMEM) and of its f32 rows (rows: [(src f32[F32_ROW] in GMEM, dst SMEM)]: ALiBi slopes,
    sinks), then of its first blocks, and waits for the q tile and the rows (not the blocks).
    Returns each row's first BLOCK_Q values as f32[BLOCK_Q] in the MMA_ACC row layout."""
    ops = blocks.ops
    ops.copy(q_src, q_smem, q_bars.at[0] if ops.tma else None)
    for i, (src, dst) in enumerate(rows):
        ops.copy(src, dst, q_bars.at[1 + i] if ops.tma else None)
    blocks.prefetch()
    if ops.tma:
        for i in range(1 + len(rows)):
            plgpu.barrier_wait(q_bars.at[i])
    else:
        # The prefetched blocks' groups may stay in flight; the q tile's and the rows' came first.
        blocks.wait_in_flight(jnp.minimum(blocks.num_steps, blocks.slots - 1))
    layout = plgpu.Layout.MMA_ACC(q_smem.dtype).reduce(1)
    return [plgpu.load(dst.at[pl.ds(0, BLOCK_Q)], layout=layout) for _, dst in rows]


def attend_mma(blocks: MmaBlocks, q_smem, *, scale, soft_cap, logits, key_range, zero_masked_p):
    """`attend` on the mma path (after `mma_prologue`): the online softmax of the q tile over
    `blocks`, with the same `logits`, `key_range` and `zero_masked_p` contract.

        s   = q_tile @ K_block^T        "GH,SH->GS" (K^T loaded from K's SMEM block transposed)
        acc = acc * alpha + p @ V_block "GS,SH->GH" (p rounded to q's dtype, as the WGMMA path)

    The head_dim is walked in column chunks of at most CHUNK (`mma_chunks`): the q . K
    contraction accumulates over chunks and the output is one accumulator per chunk, so no
    [64, H] operand tile beyond the accumulator is live at once. p goes from the accumulator
    layout to the lhs layout in registers (`acc_to_lhs`). V rows outside key_range are zeroed in
    registers (p is 0 there, but 0 * NaN from a recycled page is not).

    8-bit caches (blocks.scales set): K and V operand tiles are loaded from the 8-bit SMEM block
    in q's operand layout and widened in registers (exact); the per-token scales, read from GMEM
    per block, multiply the scores' columns (K) and p's columns before p is rounded (V), as the
    WGMMA path and the reference: s = (q . k_int) * scale * k_scale, acc += (p * v_scale) @ v_int.
    V scales outside key_range are zeroed (an unwritten slot's scale may be NaN). p * v_scale is
    taken times a power of two near the 8-bit format's largest value (`p_shift`), and the
    accumulators times its inverse at the end (both exact): p * v_scale alone falls into
    float16's subnormal range for float8 e5m2 (scale = amax / 57344) and loses bits there.

    Returns:
      (accs, m, l): a tuple of f32[BLOCK_Q, width] per chunk, f32[BLOCK_Q] twice; unnormalized,
      in the MMA_ACC layouts.
    """
    ops = blocks.ops
    k_smem, v_smem = blocks.smem
    slots, block_tokens = blocks.slots, blocks.block_tokens
    dtype = q_smem.dtype
    chunks = mma_chunks(q_smem.shape[-1])
    # P @ V's column chunks: the restaged V block's width (`out_width`) when there is one.
    v_wide = blocks.wide[1]
    pv_chunks = chunks if v_wide is None else mma_chunks(v_wide.shape[-1])
    key_lo, key_end = key_range
    quantized = blocks.scales is not None
    shift = p_shift(k_smem.dtype) if quantized else 1.0

    def body(step, carry):
        accs, m, l = carry
        slot = lax.rem(step, slots)
        blocks.wait_block(step, slot)
        # cp.async: every warp has passed the wait (it syncs the warpgroup), so the slot read at
        # step - 1 is free to refill. TMA: Mosaic syncs the warpgroup before issuing it.
        nxt = step + slots - 1
        pl.when(nxt < blocks.num_steps)(lambda: blocks.issue(nxt, lax.rem(nxt, slots)))
        k_blk, v_blk = k_smem.at[slot], v_smem.at[slot]
        if any(x is not None for x in blocks.wide):
            # Blocks restaged in SMEM (`staged`: 8-bit K and V widened, V of untiled rows). The
            # previous block's readers are done: on cp.async the wait above synced the warpgroup
            # after them; TMA waits do not sync.
            if ops.tma:
                ops.sync()
            for src, dst in zip((k_blk, v_blk), blocks.wide):
                if dst is not None:
                    for c0, w in chunks:
                        ops.widen_block(src.at[:, pl.ds(c0, w)], dst.at[:, pl.ds(c0, w)], dtype)
            ops.sync()
            k_blk, v_blk = (blk if dst is None else dst for blk, dst in zip((k_blk, v_blk), blocks.wide))
        s = ops.zeros((BLOCK_Q, block_tokens), dtype)
        for c0, w in chunks:
            s = ops.mma(s, ops.lhs(q_smem.at[:, pl.ds(c0, w)]), ops.rhs_t(k_blk.at[:, pl.ds(c0, w)]))
        s = s * scale
        block_start = (blocks.lo + step) * block_tokens
        if quantized:
            # Read where used, not before the wait: held across the widening (and V's across
            # the softmax) they made sm_80 spill.
            k_scale = blocks.scale_vector(step, 0, dtype)
            s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
        s = apply_soft_cap(s, soft_cap)
        pos = block_start + ops.iota((BLOCK_Q, block_tokens), 1, plgpu.Layout.MMA_ACC(dtype))
        s, vis = logits(s, pos)
        p, m_new, alpha, l = softmax_step(s, vis, m, l, zero_masked_p=zero_masked_p)
        if quantized:
            v_scale = blocks.scale_vector(step, 1, dtype)
            key = block_start + ops.iota((block_tokens,), 0, plgpu.Layout.MMA_ACC(dtype).reduce(0))
            v_scale = jnp.where((key < key_end) & (key >= key_lo), v_scale * shift, 0.0)
            p = p * lax.broadcast_in_dim(v_scale, p.shape, [1])
        p_op = ops.to_lhs(p.astype(dtype))
        alpha_b = lax.broadcast_in_dim(alpha, (BLOCK_Q, CHUNK), [0])
        new = []
        for (c0, w), acc in zip(pv_chunks, accs):
            a = acc * (alpha_b if w == CHUNK else lax.broadcast_in_dim(alpha, acc.shape, [0]))
            v = ops.rhs(v_blk.at[:, pl.ds(c0, w)])
            tok = block_start + ops.iota((block_tokens, w), 0, plgpu.Layout.MMA_RHS(dtype))
            v = jnp.where((tok < key_end) & (tok >= key_lo), v, jnp.zeros((), dtype))
            new.append(ops.mma(a, p_op, v))
        return tuple(new), m_new, l

    init = (tuple(ops.zeros((BLOCK_Q, w), dtype) for _, w in pv_chunks),
            ops.full_rows(MASK_VALUE, dtype), ops.full_rows(0.0, dtype))
    accs, m, l = lax.fori_loop(0, blocks.num_steps, body, init)
    if quantized:
        accs = tuple(acc * (1.0 / shift) for acc in accs)
    return accs, m, l


def p_shift(cache_dtype) -> float:
    """The power of two that p * v_scale is scaled by (`attend`, `attend_mma`): the largest
    one <= the 8-bit format's largest value (int8 64, e4m3fn 256, e5m2 32768), so p * v_scale *
    shift is about p * |V row| / 1-2, a normal float16 number."""
    dt = jnp.dtype(cache_dtype)
    top = float(jnp.iinfo(dt).max if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt).max)
    return float(2.0 ** np.floor(np.log2(top)))
