"""A 4-bit dequantizing matmul as a Pallas Mosaic GPU kernel on mma.sync (issue 35): the decode
step's x @ W for a weight kept in jpa's packed 4-bit form, reading the codes and scales as stored
and never writing a float copy of W.

Einsum letters: M rows of x (the tokens of the step), K the weight's in, N its out, G a group.

The weight is one layer of a stacked [num_layers, ...] parameter (the kernel takes the stacked
arrays and the layer index, as the attention kernels take the stacked pool, so the scan over
layers passes it without slicing a copy):

    codes u8[L, K / 2, N]   two 4-bit codes a byte, GGUF's order (jpa.core.quant.pack_nibbles):
                            byte j of a 32-value block holds value j (low nibble) and j + 16 (high)
    d     [L, K / G, N]     group scales (f16 / bf16 / f32)
    m     [L, K / G, N]     group minimums (the Q4_1 form: w = q * d + m) or None (Q4_0 form:
                            w = (q - 8) * d)
    d2/m2 [L, K / G2, N]    GGUF Q4_K only: f16 super-block scales / negated minimums (G2 = 256);
                            d and m are then its uint8 sub-block scales / minimums (G = 32), and
                            the group's scale d2 * d and minimum m2 * m are formed in f32 in
                            registers from the stored values (exact, as `super_scaled`)

and the program computes, for a tile of TN output columns,

    y[M, TN] = sum over 32-value blocks b of  x[:, b] @ W[b, TN]        "MK,KN->MN"
    W[b]     = (q[b] * d[g(b)] + m[g(b)]) in f32, rounded to x's dtype  (as `dequantize_blocks`)

Its copies: each step copies a [KB / 2, TN] tile of codes and the rows [R, KB] of x into SMEM (KB = 128
values of K, or 64 where K is a multiple of 64 but not of 128: `k_step`, SmolLM2's d_model 576)
(cp.async below sm_90, TMA with mbarriers from sm_90: `pipeline.MmaOps`), double buffered, and
reads the step's scale rows from GMEM. Registers: the codes are loaded from SMEM in the MMA_RHS
layout of a 16-bit operand (two consecutive k per register) as 32-bit integers, split into their
nibbles, scaled (the scale and minimum rows broadcast along k) and rounded to bf16 in registers:
the mma's rhs; x is the lhs, loaded from SMEM in the MMA_LHS layout. R = 16, 32 or 64 rows of x
(m_warps 1, 2, 4 of `MMALayouts`: at R = 16 the four warps split the tile's columns).

Any number of rows: x is padded to a multiple of R (R = 64 above 64 rows) and the grid is
(N / TN column tiles, M / R row tiles), each program computing its [R, TN] output tile. The row-tile
axis is the grid's last (Mosaic GPU reverses the grid: CUDA's x, launched fastest), so the M / R
programs that read the same column tile of the weight are launched one after another and run in the
same wave: the tile comes from HBM once and M / R - 1 times from L2 (the note at ROW_TILE).

`qmatmul_scaled` is the same kernel for 8-bit weights with one scale per output channel (jpa.core.quant's
int8 / fp8 path: q int8 / float8_e4m3fn [L, K, N], scale f32[L, N]): the values are widened exactly,
two rows of a k16 slice joined per register (`permute_k8` orders x's K to match), and the scale
multiplies the f32 result: (x @ q) * scale. `qmatmul_grouped` is the same 8-bit kernel for codes with a
scale per group of K (jpa.core.quant's Q8_0 form: q int8 / float8_e4m3fn [L, K, N], d [L, K / G, N], G a
multiple of 16, optional minimums m; GGUF Q8_0, Q5_K / Q6_K as jpa keeps them with d2 / m2 as Q4_K's, and
block-wise FP8): each k16 slice's values become q * d + m in f32 in registers, rounded once, as the 4-bit
path does.

Interpret mode (`interpret=True`) runs the same body with `MmaOps`' stand-ins: plain ref copies
and `jnp.dot`; the real layouts, cp.async / TMA and `mma` are proven by the deviceless compile
(tests/test_quant_gpu.py, benchmarks/bench_quant.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas.common import layer_index, layer_operand
from jpa.pallas.mosaic.pipeline import MmaOps, launch, uses_tma

BLOCK = 32          # values of one nibble block (GGUF's Q4 order)
TN = 64             # output columns of one program
KB = 128            # values of K one step copies (4 blocks: 64 code bytes a column) where K is a multiple of it
KB_TAIL = 64        # the step where K is a multiple of 64 only (SmolLM2's d_model 576 = 9 x 64): 2 blocks
ROW_TILE = 64       # rows of x one program takes at most (4 warps x 16); more rows: more row tiles
MAX_COL_TILES = 65535  # the grid's second axis is CUDA's y (at most 65535 blocks): N <= 65535 * TN
# What the row tiles cost: every program reads its whole [K, TN] column tile of codes and scales,
# so a call of T row tiles moves T x the layer's weight bytes from L2 to the SMs, but from HBM once: the T
# programs of a column tile are consecutive in launch order (row tiles on CUDA's x axis), so they run in
# the same wave and all but the first find the tile in L2. A wave of an H100's 132 programs holds about 132 / T
# column tiles (at most 132 x K x TN bytes: 7.7 MB for a 4-bit K = 14336 at T = 8), far under its 50 MB L2.
# x [M, K] itself is read once per column tile (N / TN times) from L2, as it was with one row tile.
# Checked deviceless (H100, 200 rows, N = 512): Mosaic's gpu.launch has blocks (4, 8, 1), row tiles on x.
SLOTS = 2


def permute_k(x):
    """x [..., K] in the kernel's order of K: within each 32-value block, slot 16c + 2i + h holds value
    8c + i + 16h (c, h in {0, 1}, i < 8): byte 8c + i's low nibble (h = 0) and high nibble (h = 1)
    side by side, as `pair_rows` puts them in an mma's k16 slice."""
    *lead, k = x.shape
    x = x.reshape(*lead, k // BLOCK, 2, 2, 8)  # [..., block, h, c, i]
    return jnp.swapaxes(jnp.swapaxes(x, -3, -2), -2, -1).reshape(*lead, k)  # [..., block, c, i, h]


def k_step(k: int) -> int:
    """Values of K one step of the kernel copies for a K of k: KB (128) where k is a multiple of it, else
    KB_TAIL (64; k must then be a multiple of 64). A static of the call: the 128-value step, and so the
    programs compiled for such K, are those of a kernel that only had it."""
    return KB if k % KB == 0 else KB_TAIL


def rows_for(m: int) -> int:
    """Rows of the kernel's x tile (one program's) for m rows of x: 16, 32 or 64 (ROW_TILE; above 64 rows
    the call has several row tiles, `row_tiles`)."""
    return 16 if m <= 16 else 32 if m <= 32 else ROW_TILE


def row_tiles(m: int) -> int:
    """Row tiles of a call with m rows of x (at least one: an empty x still launches a tile)."""
    return max(1, -(-m // rows_for(m)))


def unsupported_reason(m: int, k: int, n: int, group: int, codes_dtype, x_dtype=jnp.bfloat16) -> str | None:
    """Why the kernel cannot compute an [m, k] x [k, n] product of this form, or None."""
    if np.dtype(codes_dtype) != np.uint8:
        return f"codes of {np.dtype(codes_dtype)}: the kernel reads 4-bit codes packed in uint8"
    if k % KB_TAIL or n % TN:
        return f"a [{k}, {n}] weight: K must be a multiple of {KB_TAIL} and N of {TN}"
    if n // TN > MAX_COL_TILES:
        return f"N = {n}: the grid takes at most {MAX_COL_TILES} column tiles of {TN} (N <= {MAX_COL_TILES * TN})"
    if group % BLOCK or k % group:
        return f"group size {group}: a multiple of {BLOCK} that divides K = {k}"
    if np.dtype(x_dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"compute dtype {np.dtype(x_dtype)}: the kernel multiplies in bfloat16 or float16"
    return None


def _kernel(x_ref, c_ref, d_ref, m_ref, d2_ref, m2_ref, layer_ref, o_ref, x_smem, c_smem, bars, *, ops, rows,
            group, m_warps, dtype, bits, kb):
    # 4 bits: x_ref [T * R, K] (permute_k); c_ref u8[L, K / 2, N]; d_ref, m_ref [L, K / G, N] (m_ref None:
    # Q4_0 form); c_smem u8[SLOTS, KB / 2, TN]. A K-quant (Q4_K): d_ref, m_ref the integer sub-block
    # scales / minimums u8[L, K / G, N] and d2_ref, m2_ref the f16 super-block ones [L, K / G2, N]
    # (else None): group g's scale is f32(d2[g2]) * f32(d[g]), as `super_scaled` computes it.
    # 8 bits: x_ref [T * R, K] (permute_k8); c_ref int8 / float8 [L, K, N]; d_ref f32[L, N] per-channel
    # scales, or group scales [L, K / G, N] with m_ref / d2_ref / m2_ref as above (`grouped`); c_smem
    # [SLOTS, KB, TN].
    # layer_ref i32[1]; o_ref f32[T * R, N] (T row tiles); x_ref [T * R, K]; x_smem [SLOTS, R, KB].
    # KB here is kb, the call's K step (`k_step`: 128, or 64 where K is not a multiple of 128).
    # This program: rows m0 .. m0 + R - 1 (row tile "m") and columns n0 .. n0 + TN - 1 (column tile "n").
    m0 = pl.multiple_of(lax.axis_index("m") * rows, rows)
    n0 = pl.multiple_of(lax.axis_index("n") * TN, TN)
    layer = layer_index(layer_ref, c_ref.shape[0])
    k = x_ref.shape[1]
    steps = k // kb
    lhs_l = plgpu.Layout.MMA_LHS(dtype, m_warps=m_warps)
    # The codes' byte rows in the MMA_RHS layout of a 32-bit operand (m16n8k8: thread t holds row
    # t % 4 (+ 4) of column t / 4), which is the 16-bit operand's layout (m16n8k16: rows 2 (t % 4)
    # and 2 (t % 4) + 1) with each byte standing for a pair of rows (`pair_rows`).
    byte_l = plgpu.Layout.MMA_RHS(jnp.float32, m_warps=m_warps)
    acc_l = plgpu.Layout.MMA_ACC(dtype, m_warps=m_warps)

    def issue(s, slot):
        bar = bars.at[slot] if ops.tma else None
        ops.copy(x_ref.at[pl.ds(m0, rows), pl.ds(s * kb, kb)], x_smem.at[slot], bar)
        rows_per_step = kb * bits // 8
        ops.copy(c_ref.at[layer, pl.ds(s * rows_per_step, rows_per_step), pl.ds(n0, TN)], c_smem.at[slot], bar)

    def wait(s, slot):
        if ops.tma:
            plgpu.barrier_wait(bars.at[slot])
        else:  # the next step is issued after this wait: nothing else is in flight
            ops.wait(0)

    def load_bytes(ref):  # [8, TN] 8-bit rows in byte_l
        return ref[...] if ops.interpret else plgpu.load(ref, layout=byte_l, optimized=False)

    def widen(v):  # int8 / float8 codes -> the mma dtype, exactly
        v = v.astype(jnp.int32 if jnp.issubdtype(v.dtype, jnp.integer) else jnp.float32)
        return v.astype(jnp.float32).astype(dtype)

    def row(ref, g):  # one group's f32[8, TN] scale (or minimum) row, broadcast along the 8 byte rows
        if ops.interpret:
            v = ref[layer, g, pl.ds(n0, TN)].astype(jnp.float32)
            return jnp.broadcast_to(v[None], (8, TN))
        v = plgpu.load(ref.at[layer, g, pl.ds(n0, TN)], layout=byte_l.reduce(0), optimized=False)
        return plgpu.layout_cast(lax.broadcast_in_dim(v.astype(jnp.float32), (8, TN), [1]), byte_l)

    # 8 bits with group scales d_ref [L, K / G, N] (`qmatmul_grouped`: GGUF Q8_0 / Q5_K / Q6_K, block-wise
    # FP8) rather than per-channel ones [L, N]: each group's w = q * d (+ m) in f32, rounded to the mma
    # dtype in registers, as `dequantize_blocks` rounds it.
    grouped = bits == 8 and len(d_ref.shape) == 3

    def group_rows(g):  # group g's f32 [8, TN] scale and minimum (or None) rows; K-quants: d2 * d, m2 * m
        d = row(d_ref, g)
        mn = row(m_ref, g) if m_ref is not None else None
        if d2_ref is not None:
            g2 = g // (d_ref.shape[1] // d2_ref.shape[1])
            d = row(d2_ref, g2) * d
            mn = None if mn is None else row(m2_ref, g2) * mn
        return d, mn

    def scale_rows(v, d, mn):  # [8, TN] 8-bit codes -> (q * d + m) in the mma dtype
        v = v.astype(jnp.int32 if jnp.issubdtype(v.dtype, jnp.integer) else jnp.float32).astype(jnp.float32)
        w = v * d
        return (w if mn is None else w + mn).astype(dtype)

    def body(s, acc):
        slot = lax.rem(s, SLOTS)
        wait(s, slot)
        pl.when(s + 1 < steps)(lambda: issue(s + 1, lax.rem(s + 1, SLOTS)))
        xs, cs = x_smem.at[slot], c_smem.at[slot]
        lhs = lambda a_ref: ops.lhs(a_ref) if ops.interpret else plgpu.load(a_ref, layout=lhs_l, optimized=False)
        if bits == 8:  # k16 slice j: rows 16j + i and 16j + 8 + i side by side (permute_k8)
            for j in range(kb // 16):
                lo, hi = (load_bytes(cs.at[pl.ds(16 * j + 8 * h, 8)]) for h in (0, 1))
                if grouped:  # a new group starts at this slice: its scale (and minimum) rows
                    if j == 0 or (16 * j) % group == 0:
                        d, mn = group_rows((s * kb + 16 * j) // group)
                    lo, hi = (scale_rows(v, d, mn) for v in (lo, hi))
                else:
                    lo, hi = (widen(v) for v in (lo, hi))
                acc = ops.mma(acc, lhs(xs.at[:, pl.ds(16 * j, 16)]), pair_rows(lo, hi, ops.interpret, m_warps))
            return acc
        for b in range(kb // BLOCK):
            g = (s * kb + b * BLOCK) // group
            d = row(d_ref, g)
            mn = row(m_ref, g) if m_ref is not None else None
            if d2_ref is not None:  # a K-quant: the super-block scales times the integer sub-block ones
                g2 = g // (d_ref.shape[1] // d2_ref.shape[1])
                d = row(d2_ref, g2) * d
                mn = row(m2_ref, g2) * mn
            if mn is None:
                mn = d * -8.0
            for c in range(2):  # bytes 8c .. 8c + 7 of the block: values 8c + i and 8c + i + 16
                q = load_bytes(cs.at[pl.ds(b * (BLOCK // 2) + c * 8, 8)]).astype(jnp.int32)  # [8, TN]
                lo = ((q & 15).astype(jnp.float32) * d + mn).astype(dtype)  # as dequantize_blocks rounds
                hi = ((q >> 4).astype(jnp.float32) * d + mn).astype(dtype)
                w = pair_rows(lo, hi, ops.interpret, m_warps)  # [16, TN]: rows 2i, 2i + 1 = lo[i], hi[i]
                acc = ops.mma(acc, lhs(xs.at[:, pl.ds(b * BLOCK + c * 16, 16)]), w)
        return acc

    issue(0, 0)
    acc = jnp.zeros((rows, TN), jnp.float32)
    if not ops.interpret:
        acc = plgpu.layout_cast(acc, acc_l)
    acc = lax.fori_loop(0, steps, body, acc)
    if bits == 8 and not grouped:  # the per-channel scale leaves the sum: (x @ q) * scale
        if ops.interpret:
            sc = d_ref[layer, pl.ds(n0, TN)][None]
        else:
            sc = plgpu.load(d_ref.at[layer, pl.ds(n0, TN)], layout=acc_l.reduce(0), optimized=False)
            sc = plgpu.layout_cast(lax.broadcast_in_dim(sc, (rows, TN), [1]), acc_l)
        acc = acc * sc
    o_ref.at[pl.ds(m0, rows), pl.ds(n0, TN)][...] = acc


def pair_rows(lo, hi, interpret: bool, m_warps: int):
    """[8, TN] lo and hi (16-bit, in the 32-bit MMA_RHS layout) -> [16, TN] with rows 2i = lo[i],
    2i + 1 = hi[i], in the 16-bit MMA_RHS layout.

    For m16n8k8 (32-bit) a thread holds B[t % 4 (+ 4), t / 4]; for m16n8k16 (16-bit) it holds
    B[2 (t % 4) + {0, 1} (+ 8), t / 4] as one register of two values. So the same thread owns
    both rows of each pair, and the register arrays have the same shape: each 16-bit register is
    the 32-bit layout's lo value and hi value, concatenated."""
    if interpret:
        return jnp.stack([lo, hi], axis=1).reshape(2 * lo.shape[0], lo.shape[1])
    import jax.experimental.mosaic.gpu as mgpu  # the lowering's own library
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    src = plgpu.Layout.MMA_RHS(jnp.float32, m_warps=m_warps)
    dst = plgpu.Layout.MMA_RHS(lo.dtype, m_warps=m_warps)
    shape = (2 * lo.shape[0], lo.shape[1])

    @plgpu.inline_mgpu(arg_types=(src, src), return_type=plgpu.ShapeDtypeStruct(shape, lo.dtype, dst))
    def pair(_, a, b):
        layout = mgpu.MMALayouts(a.mlir_dtype, m_warps=m_warps).rhs
        regs = np.empty(layout.registers_shape(shape), dtype=object)
        for i, (x, y) in enumerate(zip(a.registers.flat, b.registers.flat)):
            regs.flat[i] = mgpu_utils.vector_concat([x, y])
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
    return pair(lo, hi)


@functools.partial(jax.jit, static_argnames=("interpret", "tma"))
def qmatmul(x, codes, d, m=None, d2=None, m2=None, *, layer=0, interpret=False, tma=False):
    """x @ W for one layer of a stacked packed 4-bit weight, W never materialized.

    Args:
      x: [M, K] float (any M: row tiles of 64 above 64 rows), rounded to bfloat16 (f16 x stays f16) for the mma.
      codes: u8[L, K / 2, N] (jpa.core.quant's nibble order), or u8[K / 2, N] (one layer).
      d: [L, K / G, N] group scales; m: the same shape (w = q * d + m) or None (w = (q - 8) * d).
      d2, m2: a K-quant's (Q4_K's) f16 super-block scales and negated minimums [L, K / G2, N] (G2 a
        multiple of G: 256) when d and m hold its integer sub-block scales and minimums (uint8): the
        group scale is d2 * d and the minimum m2 * m, each in f32 (`jpa.core.quant.super_scaled`).
      layer: i32 scalar, the layer (clamped into [0, L)).
      interpret: GPU interpret mode (the stand-ins of `MmaOps`).
      tma: TMA copies with mbarriers (sm_90 and later) instead of cp.async (sm_8x).

    Returns:
      f32[M, N].
    """
    if codes.ndim == 2:
        codes, d = codes[None], d[None]
        m, d2, m2 = (None if a is None else a[None] for a in (m, d2, m2))
    mm, k = x.shape
    _, half_k, n = codes.shape
    if half_k * 2 != k or d.shape[:1] + d.shape[2:] != codes.shape[:1] + (n,) or (k // d.shape[1]) * d.shape[1] != k:
        raise ValueError(f"qmatmul: x [{mm}, {k}] does not fit codes {list(codes.shape)} and scales "
                         f"{list(d.shape)} (codes [L, K / 2, N], scales [L, K / G, N])")
    if m is not None and m.shape != d.shape:
        raise ValueError(f"qmatmul: minimums {list(m.shape)} differ from scales {list(d.shape)}")
    if (d2 is not None or m2 is not None) and (d2 is None or m2 is None or m is None):
        raise ValueError("qmatmul: a K-quant takes its super-block scales d2 and minimums m2 and its sub-block "
                         "minimums m together (the Q4_K form)")
    if d2 is not None and (m2.shape != d2.shape or d2.shape[:1] + d2.shape[2:] != d.shape[:1] + d.shape[2:]
                           or d2.shape[1] == 0 or d.shape[1] % d2.shape[1]):
        raise ValueError(f"qmatmul: super-block scales {list(d2.shape)} / minimums {list(m2.shape)} do not fit "
                         f"sub-block scales {list(d.shape)} ([L, K / G2, N], G2 a multiple of G)")
    group = k // d.shape[1]
    dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    why = unsupported_reason(mm, k, n, group, codes.dtype, dtype)
    if why is None and d2 is not None:
        why = sub_scales_unsupported(d.dtype, m.dtype)
    if why is not None:
        raise ValueError(f"qmatmul: {why}")
    rows = rows_for(mm)
    xp = jnp.pad(permute_k(x.astype(dtype)), ((0, row_tiles(mm) * rows - mm), (0, 0)))  # [T * R, K]
    return _call(xp, codes, d, m, layer, mm, n, rows, group, dtype, 4, interpret, tma, d2, m2)


def sub_scales_unsupported(d_dtype, m_dtype) -> str | None:
    """Why the kernel cannot read a K-quant's sub-block scales / minimums of these dtypes, or None: it
    reads them as stored, one byte each (Q4_K's 6-bit values in uint8)."""
    if np.dtype(d_dtype) != np.uint8 or np.dtype(m_dtype) != np.uint8:
        return (f"K-quant sub-block scales / minimums of {np.dtype(d_dtype)} / {np.dtype(m_dtype)}: the kernel "
                f"reads them as uint8 (Q4_K)")
    return None


def _call(xp, codes, d, m, layer, mm, n, rows, group, dtype, bits, interpret, tma, d2=None, m2=None):
    m_warps = rows // 16
    kb = k_step(xp.shape[1])
    ops = MmaOps(interpret, tma)
    optional = [a for a in (m, d2, m2) if a is not None]

    def jpa_mosaic_qmatmul(x_ref, c_ref, d_ref, *rest):
        refs = list(rest[:len(optional)])
        m_ref = refs.pop(0) if m is not None else None
        d2_ref = refs.pop(0) if d2 is not None else None
        m2_ref = refs.pop(0) if m2 is not None else None  # None with d2: Q6_K (no minimums)
        layer_ref, o_ref = rest[len(optional):]

        def scoped(x_smem, c_smem, *bars):
            _kernel(x_ref, c_ref, d_ref, m_ref, d2_ref, m2_ref, layer_ref, o_ref, x_smem, c_smem,
                    bars[0] if bars else None, ops=ops, rows=rows, group=group, m_warps=m_warps, dtype=dtype,
                    bits=bits, kb=kb)

        pl.run_scoped(scoped, plgpu.SMEM((SLOTS, rows, kb), dtype),
                      plgpu.SMEM((SLOTS, kb * bits // 8, TN), codes.dtype),
                      *([plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS)] if ops.tma else []))

    # Row tiles last: Mosaic GPU reverses the grid, so they are CUDA's x axis, launched fastest, and a column
    # tile's programs run together (the note at ROW_TILE); the column tiles are CUDA's y (MAX_COL_TILES).
    tiles = xp.shape[0] // rows
    out = launch(jpa_mosaic_qmatmul, jax.ShapeDtypeStruct((tiles * rows, n), jnp.float32), (n // TN, tiles),
                 ("n", "m"), interpret)(xp, codes, d, *optional, layer_operand(layer))
    return out[:mm]


def permute_k8(x):
    """x [..., K] in the 8-bit kernel's order of K: slot 16j + 2i + h holds value 16j + 8h + i (i < 8),
    rows i and 8 + i of a k16 slice side by side (`pair_rows`)."""
    *lead, k = x.shape
    return jnp.swapaxes(x.reshape(*lead, k // 16, 2, 8), -2, -1).reshape(*lead, k)


def unsupported_reason_scaled(m: int, k: int, n: int, codes_dtype, x_dtype=jnp.bfloat16) -> str | None:
    """`unsupported_reason` for `qmatmul_scaled` (8-bit codes with per-channel scales)."""
    if np.dtype(codes_dtype) not in (np.dtype(jnp.int8), np.dtype(jnp.float8_e4m3fn)):
        return f"codes of {np.dtype(codes_dtype)}: the 8-bit kernel reads int8 or float8_e4m3fn"
    return unsupported_reason(m, k, n, BLOCK, np.uint8, x_dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "tma"))
def qmatmul_scaled(x, q, scale, *, layer=0, interpret=False, tma=False):
    """(x @ q) * scale for one layer of a stacked 8-bit weight with per-output-channel scales (the
    int8 / fp8 path of jpa.core.quant: q int8 / float8_e4m3fn [L, K, N] or [K, N], scale f32[L, N] or
    [N]), q widened to x's dtype exactly inside the kernel. x [M, K] (any M). Returns f32[M, N]."""
    if q.ndim == 2:
        q, scale = q[None], scale[None]
    mm, k = x.shape
    _, kq, n = q.shape
    if kq != k or scale.shape != (q.shape[0], n):
        raise ValueError(f"qmatmul_scaled: x [{mm}, {k}] does not fit q {list(q.shape)} and scale "
                         f"{list(scale.shape)} (q [L, K, N], scale [L, N])")
    dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    why = unsupported_reason_scaled(mm, k, n, q.dtype, dtype)
    if why is not None:
        raise ValueError(f"qmatmul_scaled: {why}")
    rows = rows_for(mm)
    xp = jnp.pad(permute_k8(x.astype(dtype)), ((0, row_tiles(mm) * rows - mm), (0, 0)))  # [T * R, K]
    return _call(xp, q, scale.astype(jnp.float32), None, layer, mm, n, rows, BLOCK, dtype, 8, interpret, tma)


def unsupported_reason_grouped(m: int, k: int, n: int, group: int, codes_dtype, x_dtype=jnp.bfloat16,
                               sub_dtypes=None) -> str | None:
    """`unsupported_reason` for `qmatmul_grouped` (8-bit codes with scales per group of `group` values of K).
    sub_dtypes: a K-quant's (Q5_K / Q6_K) sub-block scale and minimum dtypes (minimum None: Q6_K), else None."""
    if np.dtype(codes_dtype) not in (np.dtype(jnp.int8), np.dtype(jnp.float8_e4m3fn)):
        return f"codes of {np.dtype(codes_dtype)}: the 8-bit kernel reads int8 or float8_e4m3fn"
    kb = k_step(k)
    if group % 16 or k % group or (kb % group and group % kb):
        return (f"group size {group}: a multiple of 16 that divides K = {k} and divides or is a multiple of the "
                f"kernel's K step there ({kb})")
    if sub_dtypes is not None:
        d_dtype, m_dtype = sub_dtypes
        if np.dtype(d_dtype) not in (np.dtype(np.uint8), np.dtype(np.int8)) or (
                m_dtype is not None and np.dtype(m_dtype) != np.uint8):
            return (f"K-quant sub-block scales / minimums of {np.dtype(d_dtype)} / "
                    f"{None if m_dtype is None else np.dtype(m_dtype)}: the kernel reads int8 / uint8 scales "
                    f"(Q6_K / Q5_K) and uint8 minimums")
    return unsupported_reason(m, k, n, BLOCK, np.uint8, x_dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "tma"))
def qmatmul_grouped(x, codes, d, m=None, d2=None, m2=None, *, layer=0, interpret=False, tma=False):
    """x @ W for one layer of a stacked 8-bit weight with scales per group of K (jpa.core.quant's Q8_0 form:
    GGUF Q8_0, Q5_K and Q6_K as jpa keeps them, block-wise FP8), W never materialized.

    Args:
      x: [M, K] float (any M: row tiles of 64 above 64 rows), rounded to bfloat16 (f16 x stays f16) for the mma.
      codes: int8 / float8_e4m3fn [L, K, N] or [K, N] (one layer).
      d: [L, K / G, N] group scales (f16 / bf16 / f32; G a multiple of 16); m: the same shape (w = q * d + m)
        or None (w = q * d).
      d2, m2: a K-quant's f16 super-block scales / negated minimums [L, K / G2, N] (G2 = 256) when d (and m)
        hold its integer sub-block scales (minimums): int8 d and no m (Q6_K), or uint8 d, m with m2 (Q5_K).
      layer: i32 scalar, the layer (clamped into [0, L)).
      interpret, tma: as `qmatmul`.

    Returns:
      f32[M, N]: x @ W with W = (q * d + m) in f32 (d, m times d2, m2 for a K-quant) rounded to x's dtype.
    """
    if codes.ndim == 2:
        codes, d = codes[None], d[None]
        m, d2, m2 = (None if a is None else a[None] for a in (m, d2, m2))
    mm, k = x.shape
    _, kq, n = codes.shape
    if (kq != k or d.ndim != 3 or d.shape[:1] + d.shape[2:] != codes.shape[:1] + (n,) or d.shape[1] == 0
            or k % d.shape[1]):
        raise ValueError(f"qmatmul_grouped: x [{mm}, {k}] does not fit codes {list(codes.shape)} and scales "
                         f"{list(d.shape)} (codes [L, K, N], scales [L, K / G, N])")
    if m is not None and m.shape != d.shape:
        raise ValueError(f"qmatmul_grouped: minimums {list(m.shape)} differ from scales {list(d.shape)}")
    if (m2 is not None) != (d2 is not None and m is not None) or (d2 is None and m2 is not None):
        raise ValueError("qmatmul_grouped: a K-quant's super-block minimums m2 come with its sub-block minimums m "
                         "and super-block scales d2 (Q5_K), and only then")
    if d2 is not None and (d2.shape[:1] + d2.shape[2:] != d.shape[:1] + d.shape[2:] or d2.shape[1] == 0
                           or d.shape[1] % d2.shape[1] or (m2 is not None and m2.shape != d2.shape)):
        raise ValueError(f"qmatmul_grouped: super-block scales {list(d2.shape)} do not fit sub-block scales "
                         f"{list(d.shape)} ([L, K / G2, N], G2 a multiple of G)")
    group = k // d.shape[1]
    dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    sub = None if d2 is None else (d.dtype, None if m is None else m.dtype)
    why = unsupported_reason_grouped(mm, k, n, group, codes.dtype, dtype, sub)
    if why is not None:
        raise ValueError(f"qmatmul_grouped: {why}")
    rows = rows_for(mm)
    xp = jnp.pad(permute_k8(x.astype(dtype)), ((0, row_tiles(mm) * rows - mm), (0, 0)))  # [T * R, K]
    return _call(xp, codes, d, m, layer, mm, n, rows, group, dtype, 8, interpret, tma, d2, m2)
