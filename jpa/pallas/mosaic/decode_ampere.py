"""Paged decode attention as a Pallas Mosaic GPU kernel on mma.sync: Ampere and Ada (sm_80, sm_86,
sm_89; cp.async copies) and Blackwell (sm_100; the same kernel with TMA copies, `tma=True`).

Einsum letters: G rows of the q tile, S key tokens of one block, H head_dim.

The Hopper kernel (`decode`) is built on TMA copies with mbarriers and on WGMMA; none of them
exists below sm_90. This one keeps its contract (inputs, GQA packing, online softmax, split-K,
the stacked pool with a layer index, soft cap, sliding window, ALiBi; `decode.paged_decode`
routes here for compute capability 8.x) and changes the three hardware pieces:

- copies: `cp.async` (Mosaic GPU's `copy_gmem_to_smem` without a barrier below sm_90), one
  commit group per page (or page slice) of K and of V, awaited with `wait_gmem_to_smem(n)` (which
  also synchronises the warpgroup). A slot is refilled only after that wait, so every warp has
  finished reading it; `slots` blocks are buffered (`tuning.max_slots` at most, as SMEM allows).
  From sm_90 Mosaic GPU copies only by TMA: there (Blackwell, which has no WGMMA for the Hopper
  kernel) each slot has an mbarrier that its K/V TMAs arrive on (`_Ops.tma`); Mosaic synchronises
  the warpgroup before issuing a TMA, so a slot is not refilled while a warp still reads it.
- matmuls: Ampere `mma.sync` (`plgpu.mma`, m16n8k16) on register operands loaded from SMEM in
  the MMA_LHS / MMA_RHS layouts, the f32 accumulator in MMA_ACC. The q tile is 64 rows (4 warps x
  16) of which the first G are this kv head's query heads, as in the Hopper kernel: every row of
  the softmax then stays inside one warp, and decode is bound by the page loads.

      s   = q_tile @ K_block^T        "GH,SH->GS" (K^T loaded from K's SMEM block transposed)
      acc = acc * alpha + p @ V_block "GS,SH->GH" (p rounded to q's dtype, as the Hopper kernel)

  p goes from the accumulator layout to the lhs layout in registers: for m16n8k16 the threads
  hold the same elements in both (two n8 accumulator tiles are one k16 lhs tile), only the
  register order of the fragment differs, which a reshape of the register array gives
  (`_acc_to_lhs`, through `plgpu.inline_mgpu`).
- the head_dim is walked in column chunks of at most 64 (`_chunks`): the q . K contraction
  accumulates over chunks and the output is one accumulator per chunk, so no [64, H] operand
  tile beyond the accumulator is live at once.

GPU interpret mode models neither `cp.async` without a barrier nor `mma` nor the inline relayout;
there (`interpret=True`) the same kernel body copies with plain ref reads/writes (TMA path: real
TMAs and barriers, which the interpreter models) and multiplies with `jnp.dot` (`_Ops`): block
walk, masking, softmax, split-K and the layer index are the code that runs on the GPU; the
stand-in primitives are proven by the deviceless compile for sm_80/86/89 and sm_100.

Rejected (see `unsupported_reason`): compute capabilities outside 8.x and 10.x (sm_120 is not
compiled yet); float32 q; caches whose dtype differs from q's (8-bit caches with scales: not yet on
this kernel); q_per_kv > 64; head_dim not a multiple of 64 (a cp.async row must be whole 128-byte
lines) or above 256; page sizes that neither divide nor are multiples of the block up to 256;
shapes whose two K/V blocks do not fit the target's SMEM (tuning's smem_budget); on the TMA path,
pools of 2**31 pages or more (TMA coordinates are 32-bit).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import MASK_VALUE, layer_index, layer_operand, merge_partitions, pool_layout
from jpa.pallas.mosaic import tuning as tuning_table
from jpa.pallas.mosaic.pipeline import BLOCK_Q, ROW_ALIGN, block_source, operand_transforms
from jpa.pallas.mosaic.tuning import MosaicTuning
from jpa.pallas.spec import DecodeSpec

SUPPORTED_DTYPES = ("bfloat16", "float16")
MAX_PAGE_SIZE = 256
# Columns of q / K / V handled per mma sweep (one [64, 64] f32 accumulator each).
CHUNK = 64
# Slopes are copied as a 128-element f32 row: an untiled cp.async moves a multiple of 128 elements.
SLOPES_ROW = 128


def unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None, *,
                       tuning: MosaicTuning | None = None) -> str | None:
    """Why this kernel cannot serve `spec` on a GPU of `compute_capability`, or None when it can
    (None: interpret mode, device limits from the sm_80 row)."""
    if compute_capability is not None and not (8.0 <= compute_capability < 9.0
                                               or 10.0 <= compute_capability < 11.0):
        return (f"compute capability {compute_capability} is served by neither of this kernel's "
                f"paths: cp.async + mma.sync on Ampere/Ada (8.x), TMA + mma.sync on Blackwell "
                f"(10.x)")
    if tuning is None:
        tuning = tuning_table.lookup_ampere(compute_capability, spec.head_dim)
    if spec.q_dtype not in SUPPORTED_DTYPES:
        return (f"q dtype {spec.q_dtype} is not supported: mma.sync has no exact float32 path "
                f"(only tf32); use bfloat16 or float16")
    if spec.quantized:
        return (f"8-bit caches ({spec.cache_dtype}) are not supported by the mma.sync Mosaic "
                f"kernel (Ampere/Ada/Blackwell) yet: copying the per-token scales and widening "
                f"K/V for mma.sync are not written")
    if spec.cache_dtype != spec.q_dtype:
        return (f"the cache dtype ({spec.cache_dtype}) must equal q's dtype ({spec.q_dtype}): "
                f"mma operands share one dtype")
    if spec.q_per_kv > BLOCK_Q:
        return f"q_per_kv = {spec.q_per_kv} exceeds the {BLOCK_Q}-row mma q tile"
    if spec.head_dim % 64 or spec.head_dim > 256:
        return (f"head_dim = {spec.head_dim} is not supported by the mma.sync Mosaic kernel: it "
                f"must be 64, 128, 192 or 256 (a cp.async row copy moves whole 128-byte GMEM "
                f"lines; the TMA path keeps the same rule)")
    ps, bt = spec.page_size, tuning.block_tokens
    if ps < 8 or (ps < bt and bt % ps) or (ps >= bt and ps % bt) or ps > MAX_PAGE_SIZE:
        return (f"page_size = {ps} is not supported: it must divide {bt} (>= 8) or be a multiple "
                f"of {bt} up to {MAX_PAGE_SIZE} (the kernel reads keys in {bt}-token blocks)")
    rows = min(ps, bt)
    if kv_swizzle(spec.head_dim, rows) is None:
        return (f"page_size = {ps} with head_dim = {spec.head_dim} is not supported: a cp.async "
                f"copy of one page ({rows} rows of {spec.head_dim * 2} bytes) must be a multiple "
                f"of 4 SMEM tiles of 8 rows x 32/64/128 bytes (one per warp); use pages of >= 32 "
                f"tokens or a head_dim that is a multiple of {64 if rows == 8 else 32}")
    if uses_tma(compute_capability):
        # A TMA's coordinates are signed 32-bit: Mosaic folds the (layer, kv head, page) index of
        # a page into one.
        pages = spec.num_layers * spec.num_kv_heads * spec.num_pages
        if pages >= 2 ** 31:
            return (f"num_layers x num_kv_heads x num_pages = {pages} pages: a TMA coordinate "
                    f"(32-bit) cannot address them; use fewer pages")
    if num_slots(spec.head_dim, tuning=tuning) == 0:
        return (f"head_dim = {spec.head_dim} needs more than {tuning.smem_budget // 1024} KiB of "
                f"SMEM for two K/V blocks of {bt} tokens on this GPU")
    return None


def uses_tma(compute_capability: float | None) -> bool:
    """Whether the kernel copies with TMA + mbarriers on this GPU (Mosaic GPU has cp.async only
    below sm_90): Blackwell; Ampere/Ada and interpret mode (None) use cp.async."""
    return compute_capability is not None and compute_capability >= 9.0


def smem_plan(head_dim: int, itemsize: int = 2, *, tuning: MosaicTuning) -> tuple:
    """(slots, bytes) of one program's SMEM: the q tile, the ALiBi slopes row and as many K/V
    slots as fit tuning.smem_budget, at most tuning.max_slots (0: two do not fit)."""
    per_slot = 2 * tuning.block_tokens * head_dim * itemsize
    fixed = BLOCK_Q * head_dim * itemsize + SLOPES_ROW * 4
    fit = (tuning.smem_budget - fixed) // per_slot
    slots = int(min(tuning.max_slots, fit)) if fit >= 2 else 0
    return slots, fixed + slots * per_slot


def num_slots(head_dim: int, itemsize: int = 2, *, tuning: MosaicTuning) -> int:
    return smem_plan(head_dim, itemsize, tuning=tuning)[0]


def kv_swizzle(head_dim: int, rows: int, itemsize: int = 2) -> int | None:
    """SMEM swizzle (bytes) of the K/V blocks, or None when none works.

    A cp.async copy of a tiled SMEM buffer is spread over the 4 warps a tile at a time (tiles of
    8 rows x swizzle bytes), so a page copy of `rows` rows must be a multiple of 4 tiles: the
    widest swizzle (fewest bank conflicts) that divides a row and gives such a count."""
    row_bytes = head_dim * itemsize
    for swizzle in (128, 64, 32):
        if row_bytes % swizzle == 0 and (rows // 8) * (row_bytes // swizzle) % 4 == 0:
            return swizzle
    return None


def _tiled(dtype, swizzle: int):
    bits = jnp.dtype(dtype).itemsize * 8
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _chunks(head_dim: int) -> list:
    """[(first column, width)] of head_dim in slices of at most CHUNK (each a multiple of 16)."""
    return [(c, min(CHUNK, head_dim - c)) for c in range(0, head_dim, CHUNK)]


def _acc_to_lhs(x):
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


class _Ops(NamedTuple):
    """The hardware primitives of the kernel, or their interpret-mode stand-ins (module doc).

    tma: copies are TMAs tracked by mbarriers (sm_90+: Mosaic GPU has no cp.async path there),
    else cp.async commit groups (sm_8x). GPU interpret mode models TMAs and barriers, so with tma
    only `mma` and the relayout have stand-ins there."""
    interpret: bool
    tma: bool = False

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

    def lhs(self, ref):
        return ref[...] if self.interpret else plgpu.load(ref, layout=plgpu.Layout.MMA_LHS(ref.dtype))

    def rhs(self, ref):
        return ref[...] if self.interpret else plgpu.load(ref, layout=plgpu.Layout.MMA_RHS(ref.dtype))

    def rhs_t(self, ref):
        """ref [S, W] -> its transpose [W, S] as an mma rhs."""
        if self.interpret:
            return ref[...].T
        return plgpu.load(ref.T, layout=plgpu.Layout.MMA_RHS(ref.dtype))

    def mma(self, acc, a, b):
        if self.interpret:
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)
        return plgpu.mma(acc, a, b)

    def to_lhs(self, p):
        return p if self.interpret else _acc_to_lhs(p)

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


def _kernel(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, layer_ref,  # GMEM
            acc_out, m_out, l_out, bars, *, ops, scale, soft_cap, sliding_window, q_per_kv, page_size,
            block_tokens, blocks_per_part, slots):
    # q_ref [num_seqs * num_q_heads + q_pad, H]; k_ref, v_ref [K, P, S_p, H] or [L, K, P, S_p, H];
    # tables_ref i32[B, pages_per_seq]; lens_ref i32[B]; slopes_ref f32[N + pad] or None.
    # acc_out f32[B, K, parts, BLOCK_Q, H]; m_out, l_out f32[B, K, parts, BLOCK_Q].
    b = lax.axis_index("seq")
    kh = lax.axis_index("kv_head")
    part = lax.axis_index("part")
    num_kv_heads, num_pages, _, head_dim = k_ref.shape[-4:]
    head = (kh,) if layer_ref is None else (layer_index(layer_ref, k_ref.shape[0]), kh)
    dtype = q_ref.dtype
    pages_per_seq = tables_ref.shape[1]
    chunks = _chunks(head_dim)

    seq_len = lens_ref[b]
    start = (jnp.maximum(seq_len - sliding_window, 0) if sliding_window is not None
             else jnp.int32(0))
    lo = jnp.maximum(part * blocks_per_part, lax.div(start, block_tokens))
    hi = jnp.minimum((part + 1) * blocks_per_part, lax.div(seq_len + block_tokens - 1, block_tokens))
    num_steps = jnp.maximum(hi - lo, 0)
    # cp.async commit groups per block: one per page (or page slice) of K and of V.
    pieces = max(1, block_tokens // page_size)
    groups = 2 * pieces

    def issue(step, slot, k_smem, v_smem):
        src = block_source(tables_ref, b, lo + step, page_size=page_size, block_tokens=block_tokens,
                           pages_per_seq=pages_per_seq, num_pages=num_pages)
        if page_size <= block_tokens:
            parts_ = [(page, pl.ds(0, page_size), pl.ds(i * page_size, page_size))
                      for i, page in enumerate(src)]
        else:
            page, row = src
            parts_ = [(page, pl.ds(row, block_tokens), pl.ds(0, block_tokens))]
        kv_bar = bars[1].at[slot] if ops.tma else None
        for page, src_rows, rows in parts_:
            ops.copy(k_ref.at[(*head, page, src_rows)], k_smem.at[slot, rows], kv_bar)
            ops.copy(v_ref.at[(*head, page, src_rows)], v_smem.at[slot, rows], kv_bar)

    def wait_block(step, slot):
        if ops.tma:  # one barrier per slot, `groups` TMA arrivals
            plgpu.barrier_wait(bars[1].at[slot])
            return
        # Groups still allowed in flight: those of the blocks issued after `step` (at most
        # slots - 2 when the wait comes before the refill).
        later = jnp.minimum(num_steps - 1 - step, slots - 2)
        for k in range(slots - 1):
            pl.when(later == k)(functools.partial(ops.wait, k * groups))

    def main_loop(q_smem, k_smem, v_smem, slopes_smem):
        q_row0 = (b * num_kv_heads + kh) * q_per_kv
        q_bar = bars[0] if ops.tma else None
        ops.copy(q_ref.at[pl.ds(q_row0, BLOCK_Q)], q_smem, q_bar.at[0] if ops.tma else None)
        if slopes_smem is not None:
            ops.copy(slopes_ref.at[pl.ds(kh * q_per_kv, SLOPES_ROW)], slopes_smem,
                     q_bar.at[1] if ops.tma else None)
        for s in range(slots - 1):
            pl.when(s < num_steps)(functools.partial(issue, s, s, k_smem, v_smem))
        ops.wait((slots - 1) * groups)  # q (and the slopes) have landed
        if ops.tma:
            plgpu.barrier_wait(q_bar.at[0])
            if slopes_smem is not None:
                plgpu.barrier_wait(q_bar.at[1])
        row_layout = plgpu.Layout.MMA_ACC(dtype).reduce(1)
        slopes = None
        if slopes_smem is not None:
            slopes = plgpu.load(slopes_smem.at[pl.ds(0, BLOCK_Q)], layout=row_layout)

        def body(step, carry):
            accs, m, l = carry
            slot = lax.rem(step, slots)
            wait_block(step, slot)
            # cp.async: every warp has passed the wait (it syncs the warpgroup), so the slot read
            # at step - 1 is free to refill. TMA: Mosaic syncs the warpgroup before issuing it.
            nxt = step + slots - 1
            pl.when(nxt < num_steps)(
                lambda: issue(nxt, lax.rem(nxt, slots), k_smem, v_smem))
            k_blk, v_blk = k_smem.at[slot], v_smem.at[slot]
            s = ops.zeros((BLOCK_Q, block_tokens), dtype)
            for c0, w in chunks:
                s = ops.mma(s, ops.lhs(q_smem.at[:, pl.ds(c0, w)]),
                            ops.rhs_t(k_blk.at[:, pl.ds(c0, w)]))
            s = s * scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
            block_start = (lo + step) * block_tokens
            pos = block_start + ops.iota((BLOCK_Q, block_tokens), 1, plgpu.Layout.MMA_ACC(dtype))
            if slopes is not None:
                rel = (pos - seq_len + 1).astype(jnp.float32)
                s = s + lax.broadcast_in_dim(slopes, s.shape, [0]) * rel
            vis = (pos < seq_len) & (pos >= start)
            s = jnp.where(vis, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            # Every block of [lo, hi) holds a visible key of every row (all rows are the query at
            # seq_len - 1), so a row's max is a real logit and masked p are exactly 0.
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p_op = ops.to_lhs(p.astype(dtype))
            alpha_b = lax.broadcast_in_dim(alpha, (BLOCK_Q, CHUNK), [0])
            new = []
            for (c0, w), acc in zip(chunks, accs):
                a = acc * (alpha_b if w == CHUNK else lax.broadcast_in_dim(alpha, acc.shape, [0]))
                v = ops.rhs(v_blk.at[:, pl.ds(c0, w)])
                # p = 0 on keys outside [start, seq_len), but their V rows may hold anything (a
                # recycled page): 0 * NaN is NaN, so those rows are zeroed in registers.
                tok = block_start + ops.iota((block_tokens, w), 0, plgpu.Layout.MMA_RHS(dtype))
                v = jnp.where((tok < seq_len) & (tok >= start), v, jnp.zeros((), dtype))
                new.append(ops.mma(a, p_op, v))
            return tuple(new), m_new, l

        init = (tuple(ops.zeros((BLOCK_Q, w), dtype) for _, w in chunks),
                ops.full_rows(MASK_VALUE, dtype), ops.full_rows(0.0, dtype))
        return lax.fori_loop(0, num_steps, body, init)

    kv_transforms = _tiled(dtype, kv_swizzle(head_dim, min(page_size, block_tokens),
                                             jnp.dtype(dtype).itemsize))
    accs, m, l = pl.run_scoped(
        main_loop,
        plgpu.SMEM((BLOCK_Q, head_dim), dtype, transforms=operand_transforms(dtype, head_dim)),
        plgpu.SMEM((slots, block_tokens, head_dim), dtype, transforms=kv_transforms),
        plgpu.SMEM((slots, block_tokens, head_dim), dtype, transforms=kv_transforms),
        plgpu.SMEM((SLOPES_ROW,), jnp.float32) if slopes_ref is not None else None)
    for (c0, w), acc in zip(chunks, accs):
        acc_out.at[b, kh, part, :, pl.ds(c0, w)][...] = acc
    m_out.at[b, kh, part][...] = m
    l_out.at[b, kh, part][...] = l


def _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap, alibi_slopes,
                  sliding_window, interpret, blocks_per_part=None, layer=None, tuning=None,
                  tma=False, sinks=None):
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, page_size, _ = pool_layout(k_pages, layer)
    stacked = num_layers is not None
    pages_per_seq = block_tables.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    tuning = tuning or tuning_table.lookup_ampere(None, head_dim)
    bt = tuning.block_tokens
    blocks = -(-(pages_per_seq * page_size) // bt)
    if blocks_per_part is None:
        want = -(-tuning.target_programs // max(1, num_seqs * num_kv_heads))
        blocks_per_part = -(-blocks // max(1, min(blocks, want)))
    parts = -(-blocks // blocks_per_part)
    dtype = q.dtype
    slots = num_slots(head_dim, dtype.itemsize, tuning=tuning)

    # q flattened (free) and padded so the 64-row q tile of the last kv head stays in bounds.
    q_pad = BLOCK_Q + (-(num_seqs * num_q_heads)) % ROW_ALIGN
    q_rows = jnp.pad(q.reshape(num_seqs * num_q_heads, head_dim), ((0, q_pad), (0, 0)))
    if alibi_slopes is not None:
        slopes = jnp.pad(alibi_slopes.astype(jnp.float32), (0, SLOPES_ROW))
    else:
        slopes = jnp.zeros((SLOPES_ROW,), jnp.float32)  # unused placeholder operand

    kernel = functools.partial(
        _kernel, ops=_Ops(interpret, tma), scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, q_per_kv=q_per_kv, page_size=page_size, block_tokens=bt,
        blocks_per_part=blocks_per_part, slots=slots)

    # The body's name is the kernel's name (ptxas reports and MOSAIC_GPU_DUMP_TO files).
    def jpa_mosaic_decode_ampere(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, *rest):
        layer_ref, outs = (rest[0], rest[1:]) if stacked else (None, rest)
        run = functools.partial(kernel, q_ref, k_ref, v_ref, tables_ref, lens_ref,
                                slopes_ref if alibi_slopes is not None else None, layer_ref, *outs)
        if not tma:
            run(None)
            return
        # TMA path: the q tile's and slopes' barriers, and one per slot for its K and V pieces.
        pl.run_scoped(lambda *bars: run(bars), plgpu.Barrier(num_barriers=2),
                      plgpu.Barrier(num_arrivals=2 * max(1, bt // page_size), num_barriers=slots))

    out_type = (
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, BLOCK_Q, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, BLOCK_Q), jnp.float32),
        jax.ShapeDtypeStruct((num_seqs, num_kv_heads, parts, BLOCK_Q), jnp.float32),
    )
    acc, m, l = plgpu.kernel(
        jpa_mosaic_decode_ampere, out_type=out_type, grid=(num_seqs, num_kv_heads, parts),
        grid_names=("seq", "kv_head", "part"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_rows, k_pages, v_pages, block_tables, seq_lens.astype(jnp.int32), slopes,
      *([layer_operand(layer)] if stacked else []))
    # Attention sinks join at the split-K combine (exact for any partitioning).
    out = merge_partitions(acc[..., :q_per_kv, :], m[..., :q_per_kv], l[..., :q_per_kv], dtype,
                           None if sinks is None else sinks.reshape(num_kv_heads, q_per_kv))
    return out.reshape(num_seqs, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret",
                                             "tuning", "blocks_per_part", "tma"))
def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, interpret=False, layer=None, tuning=None,
                 blocks_per_part=None, tma=False, sinks=None):
    """Paged decode attention with the mma.sync Mosaic GPU kernel. Arguments as
    `decode.paged_decode` (validated; `unsupported_reason` is None for their DecodeSpec); no
    k_scales / v_scales (8-bit caches are refused). tuning None: `tuning.lookup_ampere(None, H)`.
    tma: TMA copies with mbarriers (Blackwell, sm_100) instead of cp.async (Ampere/Ada).

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    return _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, scale=scale,
                         soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                         sliding_window=sliding_window, interpret=interpret, layer=layer,
                         tuning=tuning, blocks_per_part=blocks_per_part, tma=tma, sinks=sinks)
