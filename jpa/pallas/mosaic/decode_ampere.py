"""Paged decode attention as a Pallas Mosaic GPU kernel on mma.sync: Ampere and Ada (sm_80, sm_86,
sm_89; cp.async copies) and Blackwell (sm_100, sm_120; the same kernel with TMA copies, `tma=True`).

Einsum letters: G rows of the q tile, S key tokens of one block, H head_dim.

The Hopper kernel (`decode`) is built on TMA copies with mbarriers and on WGMMA; none of them
exists below sm_90. This one keeps its contract (inputs, GQA packing, online softmax, split-K,
the stacked pool with a layer index, soft cap, sliding window, ALiBi; `decode.paged_decode`
routes here for compute capability 8.x, 10.x and 12.x) and changes the three hardware pieces:

- copies: `cp.async` (Mosaic GPU's `copy_gmem_to_smem` without a barrier below sm_90), one
  commit group per page (or page slice) of K and of V, awaited with `wait_gmem_to_smem(n)` (which
  also synchronises the warpgroup). A slot is refilled only after that wait, so every warp has
  finished reading it; `slots` blocks are buffered (`tuning.max_slots` at most, as SMEM allows).
  From sm_90 Mosaic GPU copies only by TMA: there (Blackwell, which has no WGMMA for the Hopper
  kernel) each slot has an mbarrier that its K/V TMAs arrive on (`pipeline.MmaOps.tma`); Mosaic synchronises
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
  (`pipeline.acc_to_lhs`, through `plgpu.inline_mgpu`).
- the head_dim is walked in column chunks of at most 64 (`pipeline.mma_chunks`): the q . K contraction
  accumulates over chunks and the output is one accumulator per chunk, so no [64, H] operand
  tile beyond the accumulator is live at once.

GPU interpret mode models neither `cp.async` without a barrier nor `mma` nor the inline relayout;
there (`interpret=True`) the same kernel body copies with plain ref reads/writes (TMA path: real
TMAs and barriers, which the interpreter models) and multiplies with `jnp.dot` (`MmaOps`): block
walk, masking, softmax, split-K and the layer index are the code that runs on the GPU; the
stand-in primitives are proven by the deviceless compile for sm_80/86/89, sm_100 and sm_120.

8-bit caches (int8, float8 e4m3fn / e5m2, per-token f32 scales `k_scales` / `v_scales`): the 8-bit
blocks are copied as stored and widened to q's dtype into an SMEM block per K and V (float8 by bit
manipulation where the GPU has no float8 convert, sm_80/86: `fp8_cvt=False`); the scales are read
from GMEM into the scores' column layout (`pipeline.MmaOps.key_vector`) and scale the logits (K) and
p (V), as the Hopper kernel and the reference. Head dims 80 / 112, and pages whose tiled cp.async
copy has no swizzle: untiled page copies, V restaged through a tiled block
(`pipeline.kv_untiled`, `staged`), outputs padded to a multiple of 32 columns (`out_width`).

Rejected (see `unsupported_reason`): compute capabilities outside 8.x, 10.x and 12.x; float32 q
(mma.sync has no exact float32 path); 16-bit caches whose dtype differs from q's; q_per_kv > 64;
head_dim not a multiple of 16, below 64 or above 256; page sizes that neither divide nor are
multiples of the block up to 256; on cp.async (8.x), pages neither a tiled nor an untiled copy can
move (8/16-token pages of head_dim 80 / 96 rows); shapes whose two K/V blocks do not fit the
target's SMEM (tuning's smem_budget); on the TMA path, pools of 2**31 pages or more (TMA
coordinates are 32-bit).

The block walk, the online softmax and the copies are `pipeline`'s mma path (`MmaBlocks`,
`mma_prologue`, `attend_mma`), shared with the ragged tile kernel (`ragged_ampere`); which keys a
row sees (`decode_key_range`, `decode_logits`) is shared with the Hopper decode kernel.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import layer_index, layer_operand, merge_partitions, pool_layout
from jpa.pallas.mosaic import tuning as tuning_table
from jpa.pallas.mosaic.pipeline import (BLOCK_Q, F32_ROW, ROW_ALIGN, MmaBlocks, MmaOps, attend_mma,
                                        decode_key_range, decode_logits, kv_transforms, kv_untiled,
                                        launch, mma_chunks, mma_copies_per_block, mma_prologue,
                                        out_width, partition_outputs, partitions, q_transforms, staged,
                                        staging_scratch, untiled_copy_ok, uses_tma)
from jpa.pallas.mosaic.tuning import MosaicTuning
from jpa.pallas.spec import DecodeSpec

SUPPORTED_DTYPES = ("bfloat16", "float16")
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
MAX_PAGE_SIZE = 256


def unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None, *,
                       tuning: MosaicTuning | None = None) -> str | None:
    """Why this kernel cannot serve `spec` on a GPU of `compute_capability`, or None when it can
    (None: interpret mode, device limits from the sm_80 row)."""
    if compute_capability is not None and not compiles_for(compute_capability):
        return (f"compute capability {compute_capability} is served by neither of this kernel's "
                f"paths: cp.async + mma.sync on Ampere/Ada (8.x), TMA + mma.sync on Hopper and "
                f"Blackwell (9.x, 10.x, 12.x)")
    if tuning is None:
        tuning = tuning_table.lookup_ampere(compute_capability, spec.head_dim, spec.quantized)
    if spec.q_dtype not in SUPPORTED_DTYPES:
        return (f"q dtype {spec.q_dtype} is not supported: mma.sync has no exact float32 path "
                f"(only tf32); use bfloat16 or float16")
    if spec.quantized and spec.cache_dtype not in QUANTIZED_DTYPES:
        return (f"8-bit cache dtype {spec.cache_dtype} is not supported: use one of "
                f"{', '.join(QUANTIZED_DTYPES)}")
    if not spec.quantized and spec.cache_dtype != spec.q_dtype:
        return (f"the cache dtype ({spec.cache_dtype}) must equal q's dtype ({spec.q_dtype}): "
                f"mma operands share one dtype")
    if spec.q_per_kv > BLOCK_Q:
        return f"q_per_kv = {spec.q_per_kv} exceeds the {BLOCK_Q}-row mma q tile"
    if spec.head_dim % 16 or not 64 <= spec.head_dim <= 256:
        return (f"head_dim = {spec.head_dim} is not supported by the mma.sync Mosaic kernel: it "
                f"must be a multiple of 16 (the mma's k) from 64 to 256")
    ps, bt = spec.page_size, tuning.block_tokens
    if ps < 8 or (ps < bt and bt % ps) or (ps >= bt and ps % bt) or ps > MAX_PAGE_SIZE:
        return (f"page_size = {ps} is not supported: it must divide {bt} (>= 8) or be a multiple "
                f"of {bt} up to {MAX_PAGE_SIZE} (the kernel reads keys in {bt}-token blocks)")
    rows = min(ps, bt)
    cache_itemsize = 1 if spec.quantized else 2
    # (TMA copies, sm_100 / sm_120, move any page of 16-byte-multiple rows.)
    if (not uses_tma(compute_capability) and kv_untiled(spec.head_dim, rows, cache_itemsize)
            and not untiled_copy_ok(rows, spec.head_dim, cache_itemsize)):
        return (f"page_size = {ps} with head_dim = {spec.head_dim} and a {cache_itemsize}-byte "
                f"cache is not supported: a page ({rows} rows of {spec.head_dim * cache_itemsize} "
                f"bytes) is neither a multiple of 4 SMEM tiles of 8 rows x 32/64/128 bytes (a "
                f"tiled cp.async copy, one tile per warp) nor a whole number of >= 4-byte pieces "
                f"per thread (an untiled copy); use larger pages")
    if uses_tma(compute_capability):
        # A TMA's coordinates are signed 32-bit: Mosaic folds the (layer, kv head, page) index of
        # a page into one.
        pages = spec.num_layers * spec.num_kv_heads * spec.num_pages
        if pages >= 2 ** 31:
            return (f"num_layers x num_kv_heads x num_pages = {pages} pages: a TMA coordinate "
                    f"(32-bit) cannot address them; use fewer pages")
    if num_slots(spec.head_dim, cache_itemsize=cache_itemsize, tuning=tuning, page_size=ps) == 0:
        return (f"head_dim = {spec.head_dim} needs more than {tuning.smem_budget // 1024} KiB of "
                f"SMEM for two K/V blocks of {bt} tokens on this GPU")
    return None


def serves(compute_capability: float | None) -> bool:
    """Whether a GPU of this compute capability runs the mma.sync kernels (this one and
    `ragged_ampere`): Ampere/Ada (8.x, cp.async) and Blackwell (10.x data center, 12.x RTX PRO /
    RTX 50xx: TMA copies; sm_120 has no WGMMA and no tcgen05 for jpa's other kernels)."""
    return compute_capability is not None and (8.0 <= compute_capability < 9.0
                                               or 10.0 <= compute_capability < 11.0
                                               or 12.0 <= compute_capability < 13.0)


def compiles_for(compute_capability: float | None) -> bool:
    """Whether this kernel (and `ragged_ampere`) builds for a GPU of this compute capability: the
    generations it `serves`, and Hopper (9.x, TMA copies), where it takes what the WGMMA kernels
    refuse (`decode.runs_mma`)."""
    return serves(compute_capability) or (compute_capability is not None
                                           and 9.0 <= compute_capability < 10.0)


def converts_fp8(compute_capability: float | None) -> bool:
    """Whether the GPU converts float8 to 16-bit in hardware (sm_89 and later; interpret mode
    too): else the kernels widen float8 by bit manipulation (`pipeline.widen_fp8_bits`)."""
    return compute_capability is None or compute_capability >= 8.9


def smem_plan(head_dim: int, itemsize: int = 2, *, tuning: MosaicTuning, f32_rows: int = 1,
              cache_itemsize: int | None = None, page_size: int | None = None) -> tuple:
    """(slots, bytes) of one program's SMEM: the q tile, `f32_rows` f32 rows (ALiBi slopes; the
    ragged tile kernel's sinks) and as many K/V slots (cache_itemsize bytes an element; None:
    itemsize, q's) as fit tuning.smem_budget, at most tuning.max_slots (0: two do not fit).
    The blocks restaged in q's dtype (`pipeline.staged`: K and V of an 8-bit cache, V of head dims
    80 / 112) come on top."""
    per_slot = 2 * tuning.block_tokens * head_dim * (cache_itemsize or itemsize)
    fixed = BLOCK_Q * head_dim * itemsize + f32_rows * F32_ROW * 4
    rows = min(page_size or tuning.block_tokens, tuning.block_tokens)
    fixed += (sum(staged(head_dim, rows, cache_itemsize == 1)) * tuning.block_tokens
              * out_width(head_dim) * itemsize)
    fit = (tuning.smem_budget - fixed) // per_slot
    slots = int(min(tuning.max_slots, fit)) if fit >= 2 else 0
    return slots, fixed + slots * per_slot


def num_slots(head_dim: int, itemsize: int = 2, *, tuning: MosaicTuning, f32_rows: int = 1,
              cache_itemsize: int | None = None, page_size: int | None = None) -> int:
    return smem_plan(head_dim, itemsize, tuning=tuning, f32_rows=f32_rows,
                     cache_itemsize=cache_itemsize, page_size=page_size)[0]


def _kernel(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, layer_ref, scale_refs,  # GMEM
            acc_out, m_out, l_out, bars, *, ops, scale, soft_cap, sliding_window, q_per_kv, page_size,
            block_tokens, blocks_per_part, slots):
    # q_ref [num_seqs * num_q_heads + q_pad, H]; k_ref, v_ref [K, P, S_p, H] or [L, K, P, S_p, H];
    # tables_ref i32[B, pages_per_seq]; lens_ref i32[B]; slopes_ref f32[N + pad] or None.
    # acc_out f32[B, K, parts, BLOCK_Q, H]; m_out, l_out f32[B, K, parts, BLOCK_Q].
    # scale_refs: 8-bit caches' (ks_ref, vs_ref) f32[K, P, S_p] or [L, K, P, S_p], else None.
    # bars: the TMA path's (q-tile barriers, slot barriers), else ().
    b = lax.axis_index("seq")
    kh = lax.axis_index("kv_head")
    part = lax.axis_index("part")
    num_kv_heads, _, _, head_dim = k_ref.shape[-4:]
    head = (kh,) if layer_ref is None else (layer_index(layer_ref, k_ref.shape[0]), kh)
    dtype = q_ref.dtype
    seq_len = lens_ref[b]
    start, lo, num_steps = decode_key_range(seq_len, part, blocks_per_part, block_tokens,
                                            sliding_window)

    def main_loop(q_smem, k_smem, v_smem, slopes_smem, *wide):
        blocks = MmaBlocks(ops, tables_ref, b, lo, num_steps, head, (k_ref, v_ref),
                           (k_smem, v_smem), bars[1] if ops.tma else None, page_size,
                           block_tokens, slots, scale_refs, wide)
        q_row0 = (b * num_kv_heads + kh) * q_per_kv
        rows = ([] if slopes_smem is None
                else [(slopes_ref.at[pl.ds(kh * q_per_kv, F32_ROW)], slopes_smem)])
        slopes = mma_prologue(blocks, q_ref.at[pl.ds(q_row0, BLOCK_Q)], q_smem, rows,
                              bars[0] if ops.tma else None)
        return attend_mma(blocks, q_smem, scale=scale, soft_cap=soft_cap,
                          logits=decode_logits(slopes[0] if slopes else None, seq_len, start),
                          key_range=(start, seq_len), zero_masked_p=False)

    accs, m, l = pl.run_scoped(
        main_loop,
        plgpu.SMEM((BLOCK_Q, head_dim), dtype, transforms=q_transforms(dtype, head_dim)),
        *[plgpu.SMEM((slots, block_tokens, head_dim), k_ref.dtype,
                     transforms=kv_transforms(k_ref.dtype, head_dim, min(page_size, block_tokens)))] * 2,
        plgpu.SMEM((F32_ROW,), jnp.float32) if slopes_ref is not None else None,
        *staging_scratch(dtype, head_dim, block_tokens, min(page_size, block_tokens), scale_refs is not None))
    for (c0, w), acc in zip(mma_chunks(out_width(head_dim)), accs):
        acc_out.at[b, kh, part, :, pl.ds(c0, w)][...] = acc
    m_out.at[b, kh, part][...] = m
    l_out.at[b, kh, part][...] = l


def _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap, alibi_slopes,
                  sliding_window, interpret, blocks_per_part=None, layer=None, tuning=None,
                  tma=False, sinks=None, k_scales=None, v_scales=None, fp8_cvt=True):
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, _, page_size, _ = pool_layout(k_pages, layer)
    stacked = num_layers is not None
    q_per_kv = num_q_heads // num_kv_heads
    tuning = tuning or tuning_table.lookup_ampere(None, head_dim, k_scales is not None)
    bt = tuning.block_tokens
    blocks_per_part, parts = partitions(num_seqs, num_kv_heads, block_tables.shape[1], page_size,
                                        tuning, blocks_per_part)
    dtype = q.dtype
    quantized = k_scales is not None
    slots = num_slots(head_dim, dtype.itemsize, tuning=tuning, cache_itemsize=k_pages.dtype.itemsize,
                      page_size=page_size)

    # q flattened (free) and padded so the 64-row q tile of the last kv head stays in bounds.
    q_pad = BLOCK_Q + (-(num_seqs * num_q_heads)) % ROW_ALIGN
    q_rows = jnp.pad(q.reshape(num_seqs * num_q_heads, head_dim), ((0, q_pad), (0, 0)))
    if alibi_slopes is not None:
        slopes = jnp.pad(alibi_slopes.astype(jnp.float32), (0, F32_ROW))
    else:
        slopes = jnp.zeros((F32_ROW,), jnp.float32)  # unused placeholder operand
    ops = MmaOps(interpret, tma, fp8_cvt)

    kernel = functools.partial(
        _kernel, ops=ops, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, q_per_kv=q_per_kv, page_size=page_size, block_tokens=bt,
        blocks_per_part=blocks_per_part, slots=slots)

    # The body's name is the kernel's name (ptxas reports and MOSAIC_GPU_DUMP_TO files).
    def jpa_mosaic_decode_ampere(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, *rest):
        scale_refs, rest = (rest[:2], rest[2:]) if quantized else (None, rest)
        layer_ref, outs = (rest[0], rest[1:]) if stacked else (None, rest)
        run = functools.partial(kernel, q_ref, k_ref, v_ref, tables_ref, lens_ref,
                                slopes_ref if alibi_slopes is not None else None, layer_ref,
                                scale_refs, *outs)
        # TMA path: the q tile's and slopes' barriers, and one per slot for its K and V pieces.
        pl.run_scoped(lambda *bars: run(bars),
                      *ops.barriers(1, mma_copies_per_block(page_size, bt), slots))

    acc, m, l = launch(
        jpa_mosaic_decode_ampere,
        partition_outputs(num_seqs, num_kv_heads, parts, BLOCK_Q, out_width(head_dim)),
        (num_seqs, num_kv_heads, parts), ("seq", "kv_head", "part"), interpret,
    )(q_rows, k_pages, v_pages, block_tables, seq_lens.astype(jnp.int32), slopes,
      *([k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)] if quantized else []),
      *([layer_operand(layer)] if stacked else []))
    # Attention sinks join at the split-K combine (exact for any partitioning).
    out = merge_partitions(acc[..., :q_per_kv, :head_dim], m[..., :q_per_kv], l[..., :q_per_kv], dtype,
                           None if sinks is None else sinks.reshape(num_kv_heads, q_per_kv))
    return out.reshape(num_seqs, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret",
                                             "tuning", "blocks_per_part", "tma", "fp8_cvt"))
def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, interpret=False, layer=None, tuning=None,
                 blocks_per_part=None, tma=False, sinks=None, k_scales=None, v_scales=None,
                 fp8_cvt=True):
    """Paged decode attention with the mma.sync Mosaic GPU kernel. Arguments as
    `decode.paged_decode` (validated; `unsupported_reason` is None for their DecodeSpec);
    k_scales / v_scales f32[K, P, S_p] (stacked: [L, K, P, S_p]) with an int8 / float8 cache.
    tuning None: `tuning.lookup_ampere(None, H)`. tma: TMA copies with mbarriers (Blackwell,
    sm_100) instead of cp.async (Ampere/Ada). fp8_cvt: the GPU converts float8 in hardware
    (sm_89+); False widens float8 by bit manipulation (sm_80/86; `pipeline.widen_fp8_bits`).

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    return _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, scale=scale,
                         soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                         sliding_window=sliding_window, interpret=interpret, layer=layer,
                         tuning=tuning, blocks_per_part=blocks_per_part, tma=tma, sinks=sinks,
                         k_scales=k_scales, v_scales=v_scales, fp8_cvt=fp8_cvt)
