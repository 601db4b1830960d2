"""Paged decode attention as a Pallas Mosaic GPU kernel (Hopper, sm_90); on Ampere/Ada (8.x) and
Blackwell (10.x) `paged_decode` and `unsupported_reason` hand over to `decode_ampere` (mma.sync,
with cp.async copies on 8.x and TMA copies on 10.x).

Einsum letters: B num_seqs, K num_kv_heads, G q_per_kv, H head_dim, S key tokens of one block.

One program per (sequence, kv head, partition). A program owns the G query heads that share
its kv head and walks its partition of the sequence's keys a *block* (`MosaicTuning.block_tokens`,
64 tokens) at a time through `pipeline`'s K/V block pipeline: a block is block_tokens / page_size
consecutive logical pages, each copied GMEM -> SMEM by its own TMA, or a slice of one larger page;
`slots` blocks are buffered (`num_slots`: up to `max_slots`, as SMEM allows).

Matmuls use WGMMA (Mosaic GPU has no other dot): the q tile is 64 rows (WGMMA's minimum M)
of which the first G are this kv head's query heads. The remaining rows are other heads' q
rows (finite values) whose results are computed and discarded: decode is bound by HBM
bandwidth, and the idle tensor-core rows cost nothing that matters next to the page loads.

    s   = q_tile @ K_block^T        "GH,SH->GS" (WGMMA, f32 accumulator in registers)
    acc = acc * alpha + p @ V_block "GS,SH->GH" (WGMMA, p rounded to q's dtype)

Masking, soft cap, ALiBi and the online softmax run on the f32 WGMMA-layout registers
(`pipeline.attend`; this file adds the ALiBi bias and the visible range [seq_len - window, seq_len)).
Blocks that straddle the end of the sequence (or the start of a sliding window) have the invisible
rows of their V tile zeroed in SMEM before P @ V: p is 0 there, but 0 * NaN is not.

Quantized caches (int8, float8_e4m3fn, float8_e5m2) move as 8-bit pages (half the HBM bytes),
are widened in SMEM to q's dtype for the WGMMA (exact), and their per-token scales are applied
to the logits (K) and to the columns of p (V) instead of to the values.

Several query tokens a sequence (`paged_decode_rows`, a speculative verify pass's k + 1 rows): the
q tile holds [token, q head] rows of the kv head (tokens x q_per_kv <= 64), each row causal at its
own position (`pipeline.ragged_logits`), so one program reads its partition of the KV once for all
of them; a row that sees no key of a partition leaves it (m, l, acc) = (MASK_VALUE, 0, 0).

Split-K: each partition writes its unnormalized (acc, m, l); `merge_partitions` combines them. With
one partition and no sinks the program normalizes its rows and writes q's dtype itself.
Attention sinks (`sinks`, f32[num_q_heads]) join there, as one more partition (m = sink, l = 1,
acc = 0): exact for any split, and the kernel body is the same with or without them.

Pool layouts (`paged_decode`'s `layer`): per layer `[K, P, S_p, H]` (`layer=None`), or stacked
`[L, K, P, S_p, H]` with a layer index (an i32 scalar, traced in a scan over layers). Either way
the pools are whole GMEM operands (a custom-call operand that is a slice of the cache would be
materialized: a copy per layer per step); the layer travels as an `i32[1]` operand, read like the
block table, and each TMA copies `k_ref.at[layer, kv_head, page, rows]`. Mosaic folds the squeezed
(layer, kv head, page) indices of a TMA source into one coordinate of at most L * K * P, which TMA
holds in 32 bits (`unsupported_reason`).
Rejected (see `unsupported_reason`; on 8.x and 10.x `decode_ampere.unsupported_reason` decides):
targets other than Ampere/Ada (8.x), Hopper (9.x) and Blackwell (10.x), float32 q (WGMMA is
tf32-only for f32), a 16-bit cache whose dtype differs from q's, q_per_kv > 64, head_dim not a
multiple of 16 (32 for 8-bit caches: Mosaic GPU swizzles SMEM rows in 32/64/128-byte units) or
> 256, 8-bit caches above head_dim 192 (they spill registers), page sizes that neither divide
nor are multiples of 64 or exceed 256, quantized pages under 32 tokens, and shapes whose two K/V
blocks do not fit SMEM (`MosaicTuning.smem_budget`). Every accepted configuration compiles for an
H100 without register spills (`jpa tools compile` reads ptxas's report).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import layer_index, layer_operand, merge_partitions, pool_layout
from jpa.pallas.mosaic import decode_ampere
from jpa.pallas.mosaic import tuning as tuning_table
from jpa.pallas.mosaic.pipeline import (BLOCK_Q, ROW_ALIGN, KVBlocks, attend, barriers, decode_key_range,  # noqa: F401
                                        decode_logits, launch, main_loop_scratch, num_blocks, num_partitions,
                                        num_slots, operand_transforms, partition_outputs, partitions, prologue,
                                        ragged_logits, smem_plan, tmas_per_block, uses_tma)
from jpa.pallas.mosaic.tuning import MosaicTuning
from jpa.pallas.spec import DecodeSpec, decode_spec

# Pages may be smaller than a block (a block is several pages, one TMA each) or larger (a block is
# a slice of a page); both must tile a block or be tiled by it. Larger pages are not tested.
MAX_PAGE_SIZE = 256
SUPPORTED_DTYPES = ("bfloat16", "float16")
# Mosaic GPU copies a multiple of 128 bytes per TMA: one page of f32 scales is page_size * 4.
QUANT_MIN_PAGE_SIZE = 32
# TMA coordinates are signed 32-bit integers.
MAX_TMA_COORD = 2 ** 31
# Largest head_dim with an 8-bit cache (measured: head_dim 256 spills with a soft cap).
MAX_QUANT_HEAD_DIM = 192


def runs_mma(spec, compute_capability: float | None, mma_reason=decode_ampere.unsupported_reason) -> bool:
    """Whether jpa's Mosaic kernels for `spec` on a GPU of `compute_capability` are the mma.sync
    ones (`decode_ampere`, `ragged_ampere`) rather than the WGMMA ones: always on 8.x, 10.x and
    12.x (`decode_ampere.serves`); on Hopper (9.x) when the WGMMA kernel refuses `spec` and the
    mma.sync kernel with TMA copies takes it; never in interpret mode (None). The one routing rule
    of `paged_decode`, `unsupported_reason` and the ragged op.
    mma_reason: the mma.sync kernels' check (the ragged op passes `ragged_ampere`'s)."""
    if decode_ampere.serves(compute_capability):
        return True
    return (compute_capability is not None and 9.0 <= compute_capability < 10.0
            and wgmma_reason(spec, compute_capability) is not None
            and mma_reason(spec, compute_capability) is None)


def unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None, *,
                       tuning: MosaicTuning | None = None) -> str | None:
    """Why jpa's Mosaic GPU decode kernels cannot serve `spec` on a GPU of `compute_capability`,
    or None when one can: the mma.sync kernel (`decode_ampere`) where `runs_mma`, else the WGMMA
    one (`wgmma_reason`). On Hopper a refusal gives both kernels' reasons.
    compute_capability None (interpret mode, or an unknown device) skips the device check.
    tuning: the WGMMA tiling to check (None: `tuning.lookup(compute_capability, spec.head_dim)`).
    """
    if runs_mma(spec, compute_capability):
        return decode_ampere.unsupported_reason(spec, compute_capability)
    return hopper_reasons(wgmma_reason(spec, compute_capability, tuning=tuning), spec,
                          compute_capability, decode_ampere.unsupported_reason)


def hopper_reasons(wgmma: str | None, spec, compute_capability: float | None, mma_reason) -> str | None:
    """The WGMMA kernel's refusal `wgmma`, with the mma.sync kernel's (`mma_reason`) added on
    Hopper, where both were tried."""
    if wgmma is None or compute_capability is None or not 9.0 <= compute_capability < 10.0:
        return wgmma
    return f"{wgmma}; the mma.sync kernel (TMA copies) neither: {mma_reason(spec, compute_capability)}"


def wgmma_reason(spec: DecodeSpec, compute_capability: float | None = None, *,
                 tuning: MosaicTuning | None = None) -> str | None:
    """Why the WGMMA (Hopper) decode kernel cannot serve `spec`, or None when it can."""
    if tuning is None:
        tuning = tuning_table.lookup(compute_capability, spec.head_dim)
    if compute_capability is not None and not 9.0 <= compute_capability < 10.0:
        return (f"compute capability {compute_capability} is not served by jpa's Mosaic GPU decode "
                f"kernels: the WGMMA kernel needs Hopper (9.x), the mma.sync one Ampere/Ada (8.x, "
                f"cp.async) or Blackwell (10.x, TMA)")
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
                f"8 bytes); on Hopper the mma.sync kernel (TMA copies) serves it")
    if spec.quantized and spec.head_dim % 32:
        return (f"head_dim = {spec.head_dim} is not supported with an 8-bit cache: it must be a "
                f"multiple of 32 (8-bit SMEM pages are swizzled in >= 32-byte units)")
    ps = spec.page_size
    if spec.quantized and ps < QUANT_MIN_PAGE_SIZE:
        return (f"page_size = {ps} is too small for a quantized cache: a page's f32 scales "
                f"({ps * 4} bytes) must be a TMA of >= 128 bytes, so page_size >= "
                f"{QUANT_MIN_PAGE_SIZE}")
    bt = tuning.block_tokens
    if ps < 8 or (ps < bt and bt % ps) or (ps >= bt and ps % bt) or ps > MAX_PAGE_SIZE:
        return (f"page_size = {ps} is not supported: it must divide {bt} (>= 8) or be a multiple "
                f"of {bt} up to {MAX_PAGE_SIZE} (the kernel reads keys in {bt}-token blocks)")
    if num_slots(spec.head_dim, ps, 2, 1 if spec.quantized else 2, tuning=tuning) == 0:
        return (f"head_dim = {spec.head_dim} with page_size = {ps} needs more than "
                f"{tuning.smem_budget // 1024} KiB of SMEM for two K/V blocks")
    # A TMA's coordinates are signed 32-bit: the (layer, kv head, page) index of a page, which
    # Mosaic folds into one coordinate, must stay below 2**31.
    pages = spec.num_layers * spec.num_kv_heads * spec.num_pages
    if pages >= MAX_TMA_COORD:
        return (f"num_layers x num_kv_heads x num_pages = {pages} pages: a TMA coordinate (32-bit) "
                f"cannot address them (at most {MAX_TMA_COORD - 1}); use fewer pages")
    return None


def aot_unsupported_reason(compute_capability: float | None) -> str | None:
    """Why an ahead-of-time compile for an absent GPU of `compute_capability` would get Mosaic code
    for another GPU, or None. Mosaic GPU lowers for the arch it infers from the local device or,
    under an abstract device (which carries no compute capability), assumes sm_90: an AOT compile
    for an A100 or a B200 from a CPU host would hold sm_90 code (for the A100 the kernel's cp.async
    copies fail to lower; a B200 cannot load sm_90a code). `jpa.tools.deviceless` compiles under `mosaic_arch`, which sets the arch."""
    if compute_capability is None:
        return None
    from jax.experimental.mosaic.gpu import utils as mgpu_utils  # private: no public arch query
    try:
        major, minor = mgpu_utils._infer_arch()
    except Exception as e:  # noqa: BLE001 (an unknown device: say so, do not crash the dispatch)
        return f"cannot tell which GPU Mosaic GPU lowers for ({type(e).__name__}: {e})"
    want = (int(compute_capability), int(round(compute_capability * 10)) % 10)
    if major != want[0] or minor > want[1]:
        return (f"Mosaic GPU would lower for sm_{major}{minor}, not the target's "
                f"sm_{want[0]}{want[1]}: with no such GPU attached it cannot infer the target "
                f"(compile under jpa.tools.deviceless.mosaic_arch, as jpa's deviceless tier does)")
    return None


def smem_bytes(head_dim: int, page_size: int, itemsize: int = 2, cache_itemsize: int = 2, *,
               register_acc: bool = True, tuning: MosaicTuning | None = None) -> int:
    """Peak SMEM of one program, from the buffer shapes (barriers and Mosaic scratch excluded).

    The main loop holds the q tile, the ALiBi slopes, `num_slots` K and V blocks (quantized: + the
    widened K and V blocks and per-token scales) and, in interpret mode only (register_acc
    False), the p tile; the f32 output tile is allocated after the loop, in the space they free.
    Slots are planned as if p were in SMEM on both paths, so both run the same pipeline depth.
    """
    tuning = tuning or tuning_table.lookup(None, head_dim)
    slots, peak = smem_plan(head_dim, page_size, itemsize, cache_itemsize, tuning=tuning)
    if not register_acc:
        return peak
    epilogue = BLOCK_Q * head_dim * 4 + 2 * BLOCK_Q * 4
    return max(peak - BLOCK_Q * tuning.block_tokens * itemsize, epilogue)


def multi_row_key_range(first, seq_len, part, blocks_per_part, block_tokens, sliding_window):
    """A multi-row decode program's keys: (start, lo, num_steps). Query rows at positions first ..
    seq_len - 1 see [start, seq_len) between them (start: the first row's window); the program walks
    blocks lo .. lo + num_steps - 1 of its partition `part` (each holds a key some row sees)."""
    start = (jnp.maximum(first + 1 - sliding_window, 0) if sliding_window is not None
             else jnp.int32(0))
    lo = jnp.maximum(part * blocks_per_part, lax.div(start, block_tokens))
    hi = jnp.minimum((part + 1) * blocks_per_part, lax.div(seq_len + block_tokens - 1, block_tokens))
    return start, lo, jnp.maximum(hi - lo, 0)


def _kernel(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, ks_ref, vs_ref, layer_ref, qlens_ref,  # GMEM
            acc_out, m_out, l_out,  # outputs (GMEM)
            bars, *, scale, soft_cap, sliding_window, q_per_kv, page_size, block_tokens,
            blocks_per_part, slots, rows_out, register_acc, q_tokens=1):
    # q_ref [num_seqs * num_q_heads * q_tokens + BLOCK_Q, head_dim] (rows: seq, kv head, token,
    # q_per_kv); k_ref, v_ref [K, P, S_p, H], or [L, K, P, S_p, H] for a stacked pool (layer_ref
    # i32[1] then holds the layer, else None); tables_ref i32[num_seqs, pages_per_seq]; lens_ref
    # i32[num_seqs]; slopes_ref f32[num_q_heads + BLOCK_Q] (q_tokens 1) or f32[K * BLOCK_Q] (per
    # row) or None; ks_ref, vs_ref f32[(L,) K, P, S_p] or None; qlens_ref i32[num_seqs] (query
    # tokens of each sequence, the last of its seq_len positions) with q_tokens > 1, else None.
    # acc_out f32[B, K, parts, rows_out, H]; m_out, l_out f32[B, K, parts, rows_out]; or, with one
    # partition and no sinks (m_out, l_out None), acc_out [B, K, rows_out, H] in q's dtype, normalized.
    # register_acc: the hardware path (see `pipeline.attend`); False in GPU interpret mode.
    q_bar, k_bars, v_bars = bars
    b = lax.axis_index("seq")
    kh = lax.axis_index("kv_head")
    part = lax.axis_index("part")
    num_kv_heads, _, _, head_dim = k_ref.shape[-4:]
    head = (kh,) if layer_ref is None else (layer_index(layer_ref, k_ref.shape[0]), kh)
    dtype = q_ref.dtype
    quantized = ks_ref is not None

    seq_len = lens_ref[b]
    if q_tokens == 1:
        # Blocks [lo, lo + num_steps) of this partition that hold visible tokens; every one holds >= 1.
        start, lo, num_steps = decode_key_range(seq_len, part, blocks_per_part, block_tokens,
                                                sliding_window)
    else:
        # Several query tokens at positions first .. seq_len - 1: the keys of the first one's window
        # on; a row may see no key of a block (or of a whole partition).
        first = seq_len - qlens_ref[b]
        start, lo, num_steps = multi_row_key_range(first, seq_len, part, blocks_per_part, block_tokens,
                                                   sliding_window)

    def main_loop(q_smem, k_smem, v_smem, p_smem, slopes_smem, kd_smem, vd_smem, ks_smem,
                  vs_smem):
        # As `pipeline.main_loop_scratch` lists them.
        q_row0 = (b * num_kv_heads + kh) * q_per_kv * q_tokens
        blocks = KVBlocks(tables_ref, b, lo, num_steps, head, (k_ref, v_ref, ks_ref, vs_ref),
                          (k_smem, v_smem, ks_smem, vs_smem), (k_bars, v_bars), page_size,
                          block_tokens, slots)
        slope0 = kh * q_per_kv if q_tokens == 1 else kh * BLOCK_Q
        slopes = prologue(blocks, q_ref.at[pl.ds(q_row0, BLOCK_Q)], q_smem,
                          slopes_ref.at[pl.ds(slope0, BLOCK_Q)] if slopes_ref is not None else None,
                          slopes_smem, q_bar)  # f32[BLOCK_Q] or None
        if q_tokens == 1:
            logits = decode_logits(slopes, seq_len, start)
        else:
            # Row r is token r // q_per_kv, at position first + r // q_per_kv: causal per row.
            q_pos = first + lax.div(plgpu.broadcasted_iota(
                jnp.int32, (BLOCK_Q, block_tokens), 0, layout=plgpu.Layout.WGMMA), q_per_kv)
            logits = ragged_logits(slopes, lambda _: q_pos, (start, seq_len), sliding_window)

        return attend(blocks, q_smem, p_smem, kd_smem, vd_smem, scale=scale, soft_cap=soft_cap,
                      logits=logits, key_range=(start, seq_len), zero_masked_p=q_tokens > 1,
                      register_acc=register_acc)

    acc, m, l = pl.run_scoped(
        main_loop,
        *main_loop_scratch(dtype, k_ref.dtype, head_dim, block_tokens, slots,
                           alibi=slopes_ref is not None, quantized=quantized,
                           register_acc=register_acc))

    if m_out is None:
        # One partition and no sinks: the program holds every key of its rows, so it normalizes
        # and writes its rows in q's dtype (what `merge_partitions` would make of one partition,
        # without the f32 state's round trip through GMEM). A row that saw no key has l = 0, acc = 0.
        out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])

        def store(o_smem):
            o_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows_out)], acc_out.at[b, kh])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((BLOCK_Q, head_dim), dtype, transforms=operand_transforms(dtype, head_dim)))
        return

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
                   transforms=operand_transforms(jnp.float32, head_dim)),
        plgpu.SMEM((2, BLOCK_Q), jnp.float32),
    )


def _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap, alibi_slopes,
                  sliding_window, k_scales=None, v_scales=None, interpret,
                  blocks_per_part=None, detect_races=False, layer=None, tuning=None, sinks=None, q_lens=None):
    # q [B, N, H] (one query per sequence, q_lens None), or [B, q_tokens, N, H] with q_lens i32[B]:
    # sequence b's first q_lens[b] rows are its last q_lens[b] positions (`paged_decode_rows`).
    multi = q_lens is not None
    q_tokens = q.shape[1] if multi else 1
    num_seqs, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    num_layers, num_kv_heads, _, page_size, _ = pool_layout(k_pages, layer)
    stacked = num_layers is not None
    q_per_kv = num_q_heads // num_kv_heads
    tuning = tuning or tuning_table.lookup(None, head_dim)
    bt = tuning.block_tokens
    blocks_per_part, parts = partitions(num_seqs, num_kv_heads, block_tables.shape[1], page_size,
                                        tuning, blocks_per_part)
    rows = q_per_kv * q_tokens  # live rows of a program's q tile
    rows_out = -(-rows // ROW_ALIGN) * ROW_ALIGN
    dtype = q.dtype
    quantized = k_scales is not None
    slots = num_slots(head_dim, page_size, dtype.itemsize, k_pages.dtype.itemsize, tuning=tuning)

    # q is tiny next to the cache: laid out [seq, kv head, token, q_per_kv] (a free reshape for one
    # token) and padded by BLOCK_Q rows so the 64-row q tile of the last kv head stays in bounds.
    # The page pools go in whole, never sliced.
    # Row counts are padded to a multiple of 8 as well: Mosaic GPU's TMA tiles a GMEM operand's
    # rows by 8 (found by the compile tier: 4 sequences x 1 head = 68 rows did not lower).
    if multi:
        q = jnp.swapaxes(q.reshape(num_seqs, q_tokens, num_kv_heads, q_per_kv, head_dim), 1, 2)
    n_rows = num_seqs * num_q_heads * q_tokens
    q_rows = jnp.pad(q.reshape(n_rows, head_dim),
                     ((0, BLOCK_Q + (-n_rows) % ROW_ALIGN), (0, 0)))  # [n_rows + q_pad, head_dim]
    if alibi_slopes is not None and multi:
        # Row r of kv head kh's tile is q head kh * q_per_kv + r % q_per_kv.
        r = jnp.arange(BLOCK_Q) % q_per_kv  # i32[BLOCK_Q]
        slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, q_per_kv)[:, r].reshape(-1)
    elif alibi_slopes is not None:
        slopes = jnp.pad(alibi_slopes.astype(jnp.float32),
                         (0, BLOCK_Q + (-num_q_heads) % ROW_ALIGN))  # f32[N + BLOCK_Q, rounded up to 8]
    else:
        slopes = jnp.zeros((ROW_ALIGN,), jnp.float32)  # unused placeholder operand

    kernel = functools.partial(
        _kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        q_per_kv=q_per_kv, page_size=page_size, block_tokens=bt,
        blocks_per_part=blocks_per_part, slots=slots, rows_out=rows_out, register_acc=not interpret,
        q_tokens=q_tokens)
    # One barrier arrival per TMA: a page (or page slice) of K (V), and of its scales when quantized.
    arrivals = tmas_per_block(page_size, bt, quantized)

    # The body's name is the kernel's name (ptxas reports and MOSAIC_GPU_DUMP_TO files).
    # A stacked pool adds one operand, the layer (i32[1]), after the others; several query tokens
    # one after that, their counts (i32[B]).
    def jpa_mosaic_decode(q_ref, k_ref, v_ref, tables_ref, lens_ref, slopes_ref, ks_ref, vs_ref,
                          *rest):
        rest = list(rest)
        layer_ref = rest.pop(0) if stacked else None
        qlens_ref = rest.pop(0) if multi else None
        acc_out, m_out, l_out = rest if len(rest) == 3 else (rest[0], None, None)
        pl.run_scoped(
            lambda *bars: kernel(q_ref, k_ref, v_ref, tables_ref, lens_ref,
                                 slopes_ref if alibi_slopes is not None else None,
                                 ks_ref if quantized else None, vs_ref if quantized else None,
                                 layer_ref, qlens_ref, acc_out, m_out, l_out, bars),
            *barriers(arrivals, slots))

    # One partition and no sinks: the kernel writes its rows normalized, in q's dtype (no merge).
    normalized = parts == 1 and sinks is None
    out_type = (jax.ShapeDtypeStruct((num_seqs, num_kv_heads, rows_out, head_dim), dtype) if normalized
                else partition_outputs(num_seqs, num_kv_heads, parts, rows_out, head_dim))
    outs = launch(
        jpa_mosaic_decode, out_type,
        (num_seqs, num_kv_heads, parts), ("seq", "kv_head", "part"), interpret, detect_races,
    )(q_rows, k_pages, v_pages, block_tables, seq_lens.astype(jnp.int32), slopes,
      k_scales if quantized else slopes, v_scales if quantized else slopes,
      *([layer_operand(layer)] if stacked else []), *([q_lens.astype(jnp.int32)] if multi else []))
    if normalized:
        out = outs[..., :rows, :]  # [B, K, rows, H]
    else:
        acc, m, l = outs
        acc = acc[..., :rows, :]  # [B, K, parts, rows, H]
        # Attention sinks join at the split-K combine (exact for any partitioning), one per row's head.
        row_sinks = None if sinks is None else jnp.tile(sinks.reshape(num_kv_heads, q_per_kv), (1, q_tokens))
        out = merge_partitions(acc, m[..., :rows], l[..., :rows], dtype, row_sinks)  # [B, K, rows, H]
    if not multi:
        return out.reshape(num_seqs, num_q_heads, head_dim)
    out = out.reshape(num_seqs, num_kv_heads, q_tokens, q_per_kv, head_dim)
    return jnp.swapaxes(out, 1, 2).reshape(num_seqs, q_tokens, num_q_heads, head_dim)


def max_rows_tokens(q_per_kv: int) -> int:
    """Query tokens per sequence `paged_decode_rows` takes: as many as fill the BLOCK_Q-row q tile
    with their q_per_kv heads."""
    return BLOCK_Q // q_per_kv


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "tuning",
                                             "blocks_per_part"))
def paged_decode_rows(q, k_pages, v_pages, block_tables, seq_lens, q_lens, *, scale, soft_cap=None,
                      alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None, interpret=False,
                      layer=None, tuning=None, sinks=None, blocks_per_part=None):
    """Several query tokens per sequence in one Hopper decode-kernel call (a speculative verify pass:
    the pending token and its drafts): each program reads its partition of the sequence's KV once
    for all of its rows, causal per row.

    q [B, q_tokens, N, H] with q_tokens * q_per_kv <= BLOCK_Q (`max_rows_tokens`); q_lens i32[B]:
    sequence b's rows 0 .. q_lens[b] - 1 are its last q_lens[b] positions, seq_lens[b] - q_lens[b] + t
    (q_lens[b] <= min(q_tokens, seq_lens[b])), and attend to the keys [0, position] (or the window).
    Other arguments as `paged_decode` (validated; `unsupported_reason` None for them).

    Returns:
      [B, q_tokens, N, H] in q's dtype; rows t >= q_lens[b] are unspecified (finite).
    """
    return _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, scale=scale, soft_cap=soft_cap,
                         alibi_slopes=alibi_slopes, sliding_window=sliding_window, k_scales=k_scales,
                         v_scales=v_scales, interpret=interpret, layer=layer, tuning=tuning, sinks=sinks,
                         q_lens=q_lens, blocks_per_part=blocks_per_part)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret",
                                             "tuning", "compute_capability"))
def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None,
                 interpret=False, layer=None, tuning=None, compute_capability=None, sinks=None):
    """Paged decode attention with the Mosaic GPU kernel. Arguments as `jpa.paged_decode`
    (already validated, and `unsupported_reason` is None for their DecodeSpec).

    k_pages, v_pages are [K, P, S_p, H] with layer None, or a stacked pool [L, K, P, S_p, H]
    (scales f32[L, K, P, S_p]) with `layer`, the layer to attend over: a Python int or a traced
    i32[] (one compiled kernel serves every layer), expected in [0, L) and clamped into it.
    The pools go to the kernel whole either way.

    tuning: a `MosaicTuning` (static); None takes `tuning.lookup(None, head_dim)`, the table's
    fallback row (the same values as its H100 row).
    compute_capability: the GPU compiled for (static; the dispatch passes its target's). Where
    `runs_mma` (8.x, 10.x, 12.x; on 9.x the shapes the WGMMA kernel refuses) the mma.sync kernel
    runs (`decode_ampere.paged_decode`: cp.async on 8.x, TMA from 9.x on; its tiling from
    `tuning.lookup_ampere(compute_capability, head_dim)` unless `tuning` is given); anything else
    (None included) the Hopper WGMMA kernel.

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    if runs_mma(decode_spec(q, k_pages, block_tables, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                            sliding_window=sliding_window, sinks=sinks), compute_capability):
        return decode_ampere.paged_decode(
            q, k_pages, v_pages, block_tables, seq_lens, scale=scale, soft_cap=soft_cap,
            alibi_slopes=alibi_slopes, sliding_window=sliding_window, interpret=interpret,
            layer=layer, tma=uses_tma(compute_capability), sinks=sinks, k_scales=k_scales,
            v_scales=v_scales, fp8_cvt=decode_ampere.converts_fp8(compute_capability),
            tuning=tuning or tuning_table.lookup_ampere(compute_capability, q.shape[-1],
                                                        k_scales is not None))
    return _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, scale=scale,
                         soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                         sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales,
                         interpret=interpret, layer=layer, tuning=tuning, sinks=sinks)
