"""Paged decode attention as a Pallas Mosaic GPU kernel (Hopper, sm_90+).

Einsum letters: B num_seqs, K num_kv_heads, G q_per_kv, H head_dim, S key tokens of one block.

One program per (sequence, kv head, partition). A program owns the G query heads that share
its kv head and walks its partition of the sequence's keys a *block* (64 tokens) at a time: a
block is 64 / page_size consecutive logical pages, each copied GMEM -> SMEM by its own TMA, or a
64-token slice of one larger page (one TMA); the source page is picked from the block table. `slots` blocks are buffered
(`num_slots`: up to 4, as SMEM allows): while block j is computed, blocks j+1 .. j+slots-1 are
already in flight.

Matmuls use WGMMA (Mosaic GPU has no other dot): the q tile is 64 rows (WGMMA's minimum M)
of which the first G are this kv head's query heads. The remaining rows are other heads' q
rows (finite values) whose results are computed and discarded: decode is bound by HBM
bandwidth, and the idle tensor-core rows cost nothing that matters next to the page loads.

    s   = q_tile @ K_block^T        "GH,SH->GS" (WGMMA, f32 accumulator in registers)
    acc = acc * alpha + p @ V_block "GS,SH->GH" (WGMMA, p rounded to q's dtype)

Masking, soft cap, ALiBi and the online softmax run on the f32 WGMMA-layout registers. Blocks
that straddle the end of the sequence (or the start of a sliding window) have the invisible
rows of their V tile zeroed in SMEM before P @ V: p is 0 there, but 0 * NaN is not.

Quantized caches (int8, float8_e4m3fn, float8_e5m2) move as 8-bit pages (half the HBM bytes),
are widened in SMEM to q's dtype for the WGMMA (exact), and their per-token scales are applied
to the logits (K) and to the columns of p (V) instead of to the values.

Split-K: each partition writes its unnormalized (acc, m, l); `merge_partitions` combines them.

Pool layouts (`paged_decode`'s `layer`): per layer `[K, P, S_p, H]` (`layer=None`), or stacked
`[L, K, P, S_p, H]` with a layer index (an i32 scalar, traced in a scan over layers). Either way
the pools are whole GMEM operands (a custom-call operand that is a slice of the cache would be
materialized: a copy per layer per step); the layer travels as an `i32[1]` operand, read like the
block table, and each TMA copies `k_ref.at[layer, kv_head, page, rows]`. Mosaic folds the squeezed
(layer, kv head, page) indices of a TMA source into one coordinate of at most L * K * P, which TMA
holds in 32 bits (`unsupported_reason`).
Rejected (see `unsupported_reason`): targets other than Hopper (9.x), float32 q (WGMMA is
tf32-only for f32), a 16-bit cache whose dtype differs from q's, q_per_kv > 64, head_dim not a
multiple of 16 (32 for 8-bit caches: Mosaic GPU swizzles SMEM rows in 32/64/128-byte units) or
> 256, 8-bit caches above head_dim 192 (they spill registers), page sizes that neither divide
nor are multiples of 64 or exceed 256, quantized pages under 32 tokens, and shapes whose two K/V
blocks do not fit SMEM. Every accepted configuration compiles for an H100 without register
spills (scripts/gpu_compile_check.py reads ptxas's report).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import MASK_VALUE, layer_operand, merge_partitions, pool_layout
from jpa.pallas.spec import DecodeSpec

# WGMMA's M: rows of the q tile.
BLOCK_Q = 64
# Key tokens per block (`block_tokens`): the N of the Q @ K^T WGMMA and the K of P @ V. The
# f32 scores of a block live in registers next to the [64, head_dim] f32 accumulator (head_dim / 2
# registers per thread), so blocks stay small: ptxas (read by scripts/gpu_compile_check.py) spills
# with 128- and 256-token blocks (pages of 128/256 tokens are now read a 64-token slice at a time).
BLOCK_TOKENS = 64
# Pages may be smaller than a block (a block is several pages, one TMA each) or larger (a block is
# a slice of a page); both must tile a block or be tiled by it. Larger pages are not tested.
MAX_PAGE_SIZE = 256
# Blocks buffered in SMEM per program (slots - 1 in flight during each block's compute): as many
# as fit SMEM_BUDGET, up to MAX_SLOTS. H100: 227 KiB of SMEM per block at most.
MAX_SLOTS = 4
SMEM_BUDGET = 200 * 1024
# Programs to aim for when choosing the number of partitions: two waves over an H100's 132 SMs
# (with 4 slots a program takes ~150 KiB of SMEM, so one is resident per SM; the second wave
# evens out partitions that finish early because their sequence is short).
TARGET_PROGRAMS = 2 * 132
SUPPORTED_DTYPES = ("bfloat16", "float16")
# Mosaic GPU copies a multiple of 128 bytes per TMA: one page of f32 scales is page_size * 4.
QUANT_MIN_PAGE_SIZE = 32
# Rows of the per-partition outputs: G rounded up to 8 (TMA rows must be >= 16 bytes for m, l).
ROW_ALIGN = 8


def unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None) -> str | None:
    """Why this kernel cannot serve `spec` on a GPU of `compute_capability`, or None when it can.

    compute_capability None (interpret mode, or an unknown device) skips the device check.
    """
    if compute_capability is not None and not 9.0 <= compute_capability < 10.0:
        return (f"compute capability {compute_capability} has no WGMMA: this kernel needs Hopper "
                f"(9.x)")
    if spec.q_dtype not in SUPPORTED_DTYPES:
        return (f"q dtype {spec.q_dtype} is not supported: WGMMA has no exact float32 path "
                f"(only tf32); use bfloat16 or float16")
    if spec.cache_dtype != spec.q_dtype and not spec.quantized:
        return (f"the cache dtype ({spec.cache_dtype}) must equal q's dtype ({spec.q_dtype}): "
                f"WGMMA operands share one dtype")
    if spec.q_per_kv > BLOCK_Q:
        return f"q_per_kv = {spec.q_per_kv} exceeds the {BLOCK_Q}-row WGMMA q tile"
    if spec.head_dim % 16 or spec.head_dim > 256:
        return (f"head_dim = {spec.head_dim} is not supported: it must be a multiple of 16 (rows "
                f"of a 16-bit WGMMA operand are swizzled in >= 32-byte units) and at most 256")
    if spec.quantized and spec.head_dim > MAX_QUANT_HEAD_DIM:
        return (f"head_dim = {spec.head_dim} with an 8-bit cache is not supported: above "
                f"{MAX_QUANT_HEAD_DIM} the widened K/V tiles next to the f32 accumulator keep this "
                f"kernel at ptxas's 255-register cap, and it spills (head_dim 256, int8, soft cap: "
                f"8 bytes); the Triton kernel serves it")
    if spec.quantized and spec.head_dim % 32:
        return (f"head_dim = {spec.head_dim} is not supported with an 8-bit cache: it must be a "
                f"multiple of 32 (8-bit SMEM pages are swizzled in >= 32-byte units)")
    ps = spec.page_size
    if spec.quantized and ps < QUANT_MIN_PAGE_SIZE:
        return (f"page_size = {ps} is too small for a quantized cache: a page's f32 scales "
                f"({ps * 4} bytes) must be a TMA of >= 128 bytes, so page_size >= "
                f"{QUANT_MIN_PAGE_SIZE}")
    bt = block_tokens(spec.head_dim, ps)
    if ps < 8 or (ps < bt and bt % ps) or (ps >= bt and ps % bt) or ps > MAX_PAGE_SIZE:
        return (f"page_size = {ps} is not supported: it must divide {bt} (>= 8) or be a multiple "
                f"of {bt} up to {MAX_PAGE_SIZE} (the kernel reads keys in {bt}-token blocks)")
    if num_slots(spec.head_dim, ps, 2, 1 if spec.quantized else 2) == 0:
        return (f"head_dim = {spec.head_dim} with page_size = {ps} needs more than "
                f"{SMEM_BUDGET // 1024} KiB of SMEM for two K/V blocks")
    # A TMA's coordinates are signed 32-bit: the (layer, kv head, page) index of a page, which
    # Mosaic folds into one coordinate, must stay below 2**31.
    pages = spec.num_layers * spec.num_kv_heads * spec.num_pages
    if pages >= MAX_TMA_COORD:
        return (f"num_layers x num_kv_heads x num_pages = {pages} pages: a TMA coordinate (32-bit) "
                f"cannot address them (at most {MAX_TMA_COORD - 1}); use fewer pages")
    return None


# TMA coordinates are signed 32-bit integers.
MAX_TMA_COORD = 2 ** 31


# Register tiles wider than this many columns are processed a column slice at a time where
# a whole [block_tokens, head_dim] tile would be live next to the accumulator (zeroing invisible V
# rows, widening 8-bit K/V): at head_dim 192/256 the whole tile made ptxas spill.
MAX_TILE_COLS = 128
# Largest head_dim with an 8-bit cache (measured: head_dim 256 spills with a soft cap).
MAX_QUANT_HEAD_DIM = 192


def block_tokens(head_dim: int, page_size: int) -> int:
    """Key tokens per block (see BLOCK_TOKENS): `block_tokens // page_size` whole pages, or a
    slice of one page when pages are larger."""
    del head_dim, page_size  # one size serves every shape accepted (measured: no spills)
    return BLOCK_TOKENS


def _tile_cols(dtype, minor: int) -> int:
    """Columns of one SMEM tile (`_operand_transforms`) of a row of `minor` elements."""
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


def _widen_tile(src, dst, dtype, head_dim):
    """dst[...] = src widened to dtype (8-bit cache block -> q's dtype), a column slice at a time."""
    for c0, width in col_chunks(head_dim, src.dtype, dtype):
        _cols(dst, c0, width, head_dim)[...] = _widen(_cols(src, c0, width, head_dim)[...], dtype)


def _mask_rows(src, dst, visible, block_start, block_tokens, dtype, head_dim):
    """dst[t] = src[t] (widened to dtype) where visible(position of key t), else 0; src may be
    dst. Column slice by column slice, so only a slice is in registers at once."""
    for c0, width in col_chunks(head_dim, src.dtype, dtype):
        tok = block_start + plgpu.broadcasted_iota(
            jnp.int32, (block_tokens, width), 0, layout=plgpu.Layout.WGMMA)
        vals = _cols(src, c0, width, head_dim)[...]
        _cols(dst, c0, width, head_dim)[...] = jnp.where(
            visible(tok), _widen(vals, dtype) if vals.dtype != dtype else vals, jnp.zeros((), dtype))


def _block_source(tables_ref, seq, blk, *, page_size, block_tokens, pages_per_seq, num_pages):
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


def _copy_block(src, slot, head, refs, smem, bars, *, page_size, block_tokens):
    """Starts the TMA copies of one block (`_block_source`'s src) into `slot`: K, V and, for a
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


def num_blocks(pages_per_seq: int, page_size: int, block_tokens: int) -> int:
    """Blocks that cover a sequence of pages_per_seq pages."""
    return -(-(pages_per_seq * page_size) // block_tokens)


def num_partitions(num_seqs: int, num_kv_heads: int, num_blocks: int) -> int:
    """Partitions per sequence: enough programs to fill the GPU, each at least one block."""
    want = -(-TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    return max(1, min(num_blocks, want))


def num_slots(head_dim: int, page_size: int, itemsize: int = 2, cache_itemsize: int = 2) -> int:
    """Blocks buffered per program: as many as fit SMEM_BUDGET, at most MAX_SLOTS (0: none fit).

    itemsize is q's, cache_itemsize the cache's (1 for int8/float8: quantized).
    """
    return _smem_plan(head_dim, page_size, itemsize, cache_itemsize)[0]


def smem_bytes(head_dim: int, page_size: int, itemsize: int = 2, cache_itemsize: int = 2, *,
               register_acc: bool = True) -> int:
    """Peak SMEM of one program, from the buffer shapes (barriers and Mosaic scratch excluded).

    The main loop holds the q tile, the ALiBi slopes, `num_slots` K and V blocks (quantized: + the
    widened K and V blocks and per-token scales) and, in interpret mode only (register_acc
    False), the p tile; the f32 output tile is allocated after the loop, in the space they free.
    Slots are planned as if p were in SMEM on both paths, so both run the same pipeline depth.
    """
    slots, peak = _smem_plan(head_dim, page_size, itemsize, cache_itemsize)
    if not register_acc:
        return peak
    bt = block_tokens(head_dim, page_size)
    epilogue = BLOCK_Q * head_dim * 4 + 2 * BLOCK_Q * 4
    return max(peak - BLOCK_Q * bt * itemsize, epilogue)


def _smem_plan(head_dim, page_size, itemsize, cache_itemsize):
    bt = block_tokens(head_dim, page_size)
    per_slot = 2 * bt * head_dim * cache_itemsize  # K and V
    fixed = (BLOCK_Q * head_dim + BLOCK_Q * bt) * itemsize + BLOCK_Q * 4  # q, p, slopes
    if cache_itemsize == 1:
        per_slot += 2 * bt * 4  # K and V scales
        fixed += 2 * bt * head_dim * itemsize  # widened K and V
    fit = (SMEM_BUDGET - fixed) // per_slot
    slots = int(min(MAX_SLOTS, fit)) if fit >= 2 else 0
    epilogue = BLOCK_Q * head_dim * 4 + 2 * BLOCK_Q * 4
    return slots, max(fixed + slots * per_slot, epilogue)


def _kernel(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, ks_ref, vs_ref, layer_ref,  # GMEM
            acc_out, m_out, l_out,  # outputs (GMEM)
            bars, *, scale, soft_cap, sliding_window, q_per_kv, page_size, block_tokens,
            blocks_per_part, slots, rows_out, register_acc):
    # q_ref [num_seqs * num_q_heads + BLOCK_Q, head_dim]; k_ref, v_ref [K, P, S_p, H], or
    # [L, K, P, S_p, H] for a stacked pool (layer_ref i32[1] then holds the layer, else None);
    # tables_ref i32[num_seqs, pages_per_seq]; lens_ref i32[num_seqs];
    # slopes_ref f32[num_q_heads + BLOCK_Q] or None; ks_ref, vs_ref f32[(L,) K, P, S_p] or None.
    # acc_out f32[B, K, parts, rows_out, H]; m_out, l_out f32[B, K, parts, rows_out].
    # register_acc: the hardware path. P @ V accumulates into `acc` in place (`pl.run_state` on
    # a WGMMA accumulator initialised from it) with p as a register operand. GPU interpret mode
    # models neither, so there (register_acc=False) p goes through SMEM (p_smem) and each block
    # gets a fresh accumulator that is added to acc: the same math, twice the accumulator
    # registers and a fence per block, which on hardware would spill at head_dim 256.
    q_bar, k_bars, v_bars = bars
    b = lax.axis_index("seq")
    kh = lax.axis_index("kv_head")
    part = lax.axis_index("part")
    num_kv_heads, num_pages, _, head_dim = k_ref.shape[-4:]
    head = (kh,) if layer_ref is None else (_layer(layer_ref, k_ref.shape[0]), kh)
    pages_per_seq = tables_ref.shape[1]
    dtype = q_ref.dtype
    quantized = ks_ref is not None
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    seq_len = lens_ref[b]
    if sliding_window is not None:
        start = jnp.maximum(seq_len - sliding_window, 0)
    else:
        start = jnp.int32(0)
    # Blocks [lo, hi) of this partition that hold visible tokens; every one of them holds >= 1.
    lo = jnp.maximum(part * blocks_per_part, lax.div(start, block_tokens))
    hi = jnp.minimum((part + 1) * blocks_per_part,
                     lax.div(seq_len + block_tokens - 1, block_tokens))
    num_steps = jnp.maximum(hi - lo, 0)

    def main_loop(q_smem, k_smem, v_smem, p_smem, slopes_smem, kd_smem, vd_smem, ks_smem,
                  vs_smem):
        # q_smem [BLOCK_Q, H]; k_smem, v_smem [slots, S, H] in the cache dtype; p_smem [BLOCK_Q, S];
        # slopes_smem f32[BLOCK_Q] or None; quantized only: kd_smem, vd_smem [S, H] in q's dtype,
        # ks_smem, vs_smem f32[slots, S]. S = block_tokens.
        q_row0 = (b * num_kv_heads + kh) * q_per_kv
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row0, BLOCK_Q)], q_smem, q_bar.at[0])
        if slopes_smem is not None:
            plgpu.copy_gmem_to_smem(slopes_ref.at[pl.ds(kh * q_per_kv, BLOCK_Q)], slopes_smem,
                                    q_bar.at[1])

        def lookup(step):
            """Where block lo + step is: i32 scalars read from the block table."""
            return _block_source(tables_ref, b, lo + step, page_size=page_size, block_tokens=block_tokens,
                                 pages_per_seq=pages_per_seq, num_pages=num_pages)

        def issue(src, slot):
            """Starts the TMA copies of one block into slot."""
            _copy_block(src, slot, head, (k_ref, v_ref, ks_ref, vs_ref), (k_smem, v_smem, ks_smem, vs_smem),
                        (k_bars, v_bars), page_size=page_size, block_tokens=block_tokens)

        for s in range(slots - 1):
            pl.when(s < num_steps)(functools.partial(issue, lookup(s), s))

        plgpu.barrier_wait(q_bar.at[0])
        if slopes_smem is not None:
            plgpu.barrier_wait(q_bar.at[1])
            slopes = plgpu.load(slopes_smem, layout=row_layout)  # f32[BLOCK_Q]

        def body(step, carry):
            acc, m, l, nxt_pages = carry  # f32[BLOCK_Q, H], f32[BLOCK_Q], f32[BLOCK_Q], i32s
            slot = lax.rem(step, slots)
            # Keep slots - 1 blocks in flight: the slot refilled here was freed by step - 1
            # (its WGMMAs completed before their results were read).
            nxt = step + slots - 1
            pl.when(nxt < num_steps)(lambda: issue(nxt_pages, lax.rem(nxt, slots)))
            # The block-table reads for the next step's copies start now and are first used
            # one step later, so their GMEM latency hides behind this block's compute.
            nxt_pages = lookup(nxt + 1)

            block_start = (lo + step) * block_tokens
            plgpu.barrier_wait(k_bars.at[slot])
            if quantized:
                # WGMMA operands share one dtype: widen the 8-bit block into q's dtype (exact
                # for int8 and both float8 formats); the per-token scale multiplies the logits.
                _widen_tile(k_smem.at[slot], kd_smem, dtype, head_dim)
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
            if slopes_smem is not None:
                rel = (pos - seq_len + 1).astype(jnp.float32)
                s = s + lax.broadcast_in_dim(slopes, s.shape, [0]) * rel
            valid = (pos < seq_len) & (pos >= start)
            s = jnp.where(valid, s, MASK_VALUE)
            # Every block holds a visible token, so m_new is a real logit and masked p are 0.
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)  # rescales what was accumulated under the old max
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bars.at[slot])
            if quantized:
                # acc += (p * v_scale) @ v: the scale is per key token, a column of p. Masked
                # columns may carry NaN scales (unwritten slots), so they are zeroed after.
                v_scale = plgpu.load(vs_smem.at[slot], layout=col_layout)  # f32[S]
                p = jnp.where(valid, p * lax.broadcast_in_dim(v_scale, p.shape, [1]), 0.0)
            if not register_acc:
                p_smem[...] = p.astype(dtype)  # interpret mode: SMEM operands only
            if quantized:
                # The widened copy is written whole, invisible tokens as 0 (see below).
                _mask_rows(v_smem.at[slot], vd_smem, lambda tok: (tok < seq_len) & (tok >= start),
                           block_start, block_tokens, dtype, head_dim)
                v_op = vd_smem
            else:
                v_op = v_smem.at[slot]
                partial_block = (block_start < start) | (block_start + block_tokens > seq_len)

                @pl.when(partial_block)
                def _zero_invisible_v():
                    # p = 0 there, but 0 * (garbage NaN/inf in a recycled page) would be NaN.
                    _mask_rows(v_smem.at[slot], v_smem.at[slot],
                               lambda tok: (tok < seq_len) & (tok >= start), block_start,
                               block_tokens, dtype, head_dim)
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
            lookup(slots - 1),
        )
        acc, m, l, _ = lax.fori_loop(0, num_steps, body, init)
        return acc, m, l

    transforms = _operand_transforms(dtype, head_dim)
    cache_dtype = k_ref.dtype
    cache_transforms = _operand_transforms(cache_dtype, head_dim)
    acc, m, l = pl.run_scoped(
        main_loop,
        plgpu.SMEM((BLOCK_Q, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((slots, block_tokens, head_dim), cache_dtype, transforms=cache_transforms),
        plgpu.SMEM((slots, block_tokens, head_dim), cache_dtype, transforms=cache_transforms),
        # Interpret mode: p in SMEM (the lhs of P @ V, minor dimension block_tokens).
        None if register_acc else plgpu.SMEM((BLOCK_Q, block_tokens), dtype,
                                             transforms=_operand_transforms(dtype, block_tokens)),
        plgpu.SMEM((BLOCK_Q,), jnp.float32) if slopes_ref is not None else None,
        # Quantized caches: the widened K and V blocks and the per-token scales.
        plgpu.SMEM((block_tokens, head_dim), dtype, transforms=transforms) if quantized else None,
        plgpu.SMEM((block_tokens, head_dim), dtype, transforms=transforms) if quantized else None,
        plgpu.SMEM((slots, block_tokens), jnp.float32) if quantized else None,
        plgpu.SMEM((slots, block_tokens), jnp.float32) if quantized else None,
    )

    def epilogue(o_smem, ml_smem):
        # The f32 tile is written whole (WGMMA layout) and only its first rows_out rows leave.
        o_smem[...] = acc
        ml_smem.at[0][...] = m
        ml_smem.at[1][...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out.at[b, kh, part])
        plgpu.copy_smem_to_gmem(ml_smem.at[0, pl.ds(0, rows_out)], m_out.at[b, kh, part])
        plgpu.copy_smem_to_gmem(ml_smem.at[1, pl.ds(0, rows_out)], l_out.at[b, kh, part])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        epilogue,
        plgpu.SMEM((BLOCK_Q, head_dim), jnp.float32,
                   transforms=_operand_transforms(jnp.float32, head_dim)),
        plgpu.SMEM((2, BLOCK_Q), jnp.float32),
    )


def _layer(layer_ref, num_layers):
    """The layer of a stacked pool, read from its i32[1] GMEM operand and clamped into
    [0, num_layers) (like a page: an out-of-range layer must never address outside the pool)."""
    return jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)


def _widen(x, dtype):
    """8-bit cache values -> q's dtype. float8 goes through f32: sm_90 converts float8 only to
    f16 directly, and f32 -> bf16/f16 of a float8 value is exact."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def _operand_transforms(dtype, minor):
    """Tiling + swizzle of a 2-D SMEM tile whose minor dimension has `minor` elements."""
    bits = np.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits, "a WGMMA operand tile")
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap, alibi_slopes,
                  sliding_window, k_scales=None, v_scales=None, interpret,
                  blocks_per_part=None, detect_races=False, layer=None):
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, page_size, _ = pool_layout(k_pages, layer)
    stacked = num_layers is not None
    pages_per_seq = block_tables.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    bt = block_tokens(head_dim, page_size)
    blocks = num_blocks(pages_per_seq, page_size, bt)
    if blocks_per_part is None:
        blocks_per_part = -(-blocks // num_partitions(num_seqs, num_kv_heads, blocks))
    parts = -(-blocks // blocks_per_part)
    rows_out = -(-q_per_kv // ROW_ALIGN) * ROW_ALIGN
    dtype = q.dtype
    quantized = k_scales is not None
    slots = num_slots(head_dim, page_size, dtype.itemsize, k_pages.dtype.itemsize)

    # q is tiny next to the cache: flatten it (free) and pad BLOCK_Q rows so the 64-row q tile
    # of the last kv head stays in bounds. The page pools go in whole, never sliced.
    # Row counts are padded to a multiple of 8 as well: Mosaic GPU's TMA tiles a GMEM operand's
    # rows by 8 (found by the compile tier: 4 sequences x 1 head = 68 rows did not lower).
    q_pad = BLOCK_Q + (-(num_seqs * num_q_heads)) % ROW_ALIGN
    q_rows = jnp.pad(q.reshape(num_seqs * num_q_heads, head_dim),
                     ((0, q_pad), (0, 0)))  # [num_seqs * num_q_heads + q_pad, head_dim]
    if alibi_slopes is not None:
        slopes = jnp.pad(alibi_slopes.astype(jnp.float32),
                         (0, BLOCK_Q + (-num_q_heads) % ROW_ALIGN))  # f32[N + BLOCK_Q, rounded up to 8]
    else:
        slopes = jnp.zeros((ROW_ALIGN,), jnp.float32)  # unused placeholder operand

    kernel = functools.partial(
        _kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        q_per_kv=q_per_kv, page_size=page_size, block_tokens=bt,
        blocks_per_part=blocks_per_part, slots=slots, rows_out=rows_out, register_acc=not interpret)
    # One barrier arrival per TMA: a page (or page slice) of K (V), and of its scales when quantized.
    arrivals = tmas_per_block(page_size, bt, quantized)

    # The body's name is the kernel's name (ptxas reports and MOSAIC_GPU_DUMP_TO files).
    # A stacked pool adds one operand, the layer (i32[1]), after the others.
    def jpa_mosaic_decode(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, ks_ref, vs_ref,
                          *rest):
        layer_ref, (acc_out, m_out, l_out) = (rest[0], rest[1:]) if stacked else (None, rest)
        pl.run_scoped(
            lambda *bars: kernel(q_ref, k_ref, v_ref, tables_ref, lens_ref,
                                 slopes_ref if alibi_slopes is not None else None,
                                 ks_ref if quantized else None, vs_ref if quantized else None,
                                 layer_ref, acc_out, m_out, l_out, bars),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),
        )

    out_type = (
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, rows_out, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, rows_out), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, rows_out), jnp.float32),
    )
    acc, m, l = plgpu.kernel(
        jpa_mosaic_decode, out_type=out_type, grid=(num_seqs, num_kv_heads, parts),
        grid_names=("seq", "kv_head", "part"),
        # Lane semantics: layouts are explicit (WGMMA layout for every register tile).
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams(detect_races=detect_races) if interpret else None,
    )(q_rows, k_pages, v_pages, block_tables, seq_lens.astype(jnp.int32), slopes,
      k_scales if quantized else slopes, v_scales if quantized else slopes,
      *([layer_operand(layer)] if stacked else []))
    acc = acc[..., :q_per_kv, :]  # [B, K, parts, G, H]
    out = merge_partitions(acc, m[..., :q_per_kv], l[..., :q_per_kv], dtype)  # [B, K, G, H]
    return out.reshape(num_seqs, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None,
                 interpret=False, layer=None):
    """Paged decode attention with the Mosaic GPU kernel. Arguments as `jpa.paged_decode`
    (already validated, and `unsupported_reason` is None for their DecodeSpec).

    k_pages, v_pages are [K, P, S_p, H] with layer None, or a stacked pool [L, K, P, S_p, H]
    (scales f32[L, K, P, S_p]) with `layer`, the layer to attend over: a Python int or a traced
    i32[] (one compiled kernel serves every layer), expected in [0, L) and clamped into it.
    The pools go to the kernel whole either way.

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    return _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, scale=scale,
                         soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                         sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales,
                         interpret=interpret, layer=layer)
