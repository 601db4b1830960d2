"""Tiling of the Mosaic GPU kernels (`decode`, `ragged`), kept apart from them: `MosaicTuning` (the
knobs, frozen and validated) and `TABLE`, the defaults by GPU generation and head_dim.

A kernel takes its tiling as an argument (`tuning=`, a static argument: the dataclass is
hashable); `lookup` gives the default. Add a row above the fallback for a GPU or a shape that
wants other values, and say in `measured` what was measured.

What "measured" means here: the H100 row's values were checked by compiling every accepted
configuration for an H100 on a machine without one (XLA's whole GPU pipeline and Mosaic's own
ptxas: registers, spills, SMEM; `jpa tools compile`, records in `benchmarks/gpu_truth/`,
BENCHMARKS.md "compiled for an H100 and an A100 without one"). Speed has not been measured on any
GPU: the values are design choices (double buffering as deep as SMEM allows, two waves of programs),
not timings.

Who picks the row: `unsupported_reason(spec, compute_capability)` checks a configuration against
the row of the GPU it is asked about. The kernels' `tuning=None` default is the row for
compute capability None (the fallback), because `jpa.ops` does not pass the target's tiling to the
kernels yet; every row holds the same values today, so the two agree. A row that differs for a
generation needs the dispatch (which knows the target) to pass `tuning=lookup(cc, ...)`.

The mma.sync kernels (`decode_ampere`, `ragged_ampere`; Ampere/Ada and Blackwell) have their own
table, `AMPERE_TABLE` (`lookup_ampere`): there the dispatch does pass the target's compute
capability (`decode.paged_decode(..., compute_capability=)`, `ragged.ragged_paged_attention(...,
compute_capability=)`), and its rows differ by GPU (SMEM per block) and head_dim (block size); the
ragged op's two kernels share a row.
"""

import dataclasses

from jpa.pallas.common import TuningRow, lookup_tuning

# H100 SXM / H200: shared memory per block with opt-in (227 KiB), the most a program may plan.
MAX_SMEM_PER_BLOCK = 232448


@dataclasses.dataclass(frozen=True)
class MosaicTuning:
    """The tiling knobs of both Mosaic GPU kernels (one program walks its keys a block at a time).

    Attributes:
      block_tokens: key tokens per block: the N of the Q @ K^T WGMMA and the K of P @ V. The f32
        scores of a block live in registers next to the [64, head_dim] f32 accumulator, so blocks
        stay small: ptxas spilled with 128- and 256-token blocks (pages of 128/256 tokens are read
        a 64-token slice at a time). Pages must divide it or be multiples of it.
      max_slots: blocks buffered in SMEM per program at most (slots - 1 in flight during each
        block's compute); fewer when `smem_budget` holds fewer, and a shape where two do not fit
        is refused.
      smem_budget: bytes of SMEM a program may plan for its buffers (Mosaic's own scratch and the
        barriers come on top), at most MAX_SMEM_PER_BLOCK.
      target_programs: programs the decode kernel aims for when it chooses split-K partitions.
    """
    block_tokens: int = 64
    max_slots: int = 4
    smem_budget: int = 200 * 1024
    target_programs: int = 2 * 132

    def __post_init__(self):
        bt = self.block_tokens
        if not (isinstance(bt, int) and 16 <= bt <= 256 and bt & (bt - 1) == 0):
            raise ValueError(f"block_tokens must be a power of two from 16 to 256 (the N of a WGMMA "
                             f"and the K of P @ V); got {bt!r}")
        if not (isinstance(self.max_slots, int) and self.max_slots >= 2):
            raise ValueError(f"max_slots must be an int >= 2 (one block computed while the next "
                             f"is copied); got {self.max_slots!r}")
        if not (isinstance(self.smem_budget, int) and 0 < self.smem_budget <= MAX_SMEM_PER_BLOCK):
            raise ValueError(f"smem_budget must be a positive int of at most {MAX_SMEM_PER_BLOCK} "
                             f"bytes (227 KiB of SMEM per block); got {self.smem_budget!r}")
        if not (isinstance(self.target_programs, int) and self.target_programs >= 1):
            raise ValueError(f"target_programs must be a positive int; got {self.target_programs!r}")


# First match wins; rows keyed by compute capability [min, max) and head_dim (inclusive).
TABLE = (
    TuningRow(
        gpus="H100 / H200 (sm_90)", compute_capability=(9.0, 10.0),
        # Two waves over an H100's 132 SMs: with 4 slots a program takes ~150 KiB of SMEM, so one
        # is resident per SM; the second wave evens out partitions whose sequence ends early.
        tuning=MosaicTuning(block_tokens=64, max_slots=4, smem_budget=200 * 1024,
                            target_programs=2 * 132),
        measured="ptxas, deviceless H100 compile (JAX 0.12.0.1, 2026-11-24): every accepted decode "
                 "and ragged configuration of the covering grid, 127-255 registers, 0 spills, "
                 "60-172 KiB SMEM (benchmarks/gpu_truth/mosaic_after.json, after_h100_ragged.json). "
                 "Speed: not measured."),
    # Interpret mode and any GPU without a row of its own (the kernels serve Hopper only; the
    # dispatch refuses the others before a tiling is looked up).
    TuningRow(
        gpus="any other (interpret mode)", compute_capability=None,
        tuning=MosaicTuning(),
        measured=""),
)


def lookup(compute_capability: float | None = None, head_dim: int = 128) -> MosaicTuning:
    """The default tiling for a GPU of `compute_capability` (None: interpret mode / unknown) and a
    head_dim: the first row of TABLE that serves them."""
    return lookup_tuning(TABLE, compute_capability, head_dim).tuning


# The Ampere/Ada kernel (`decode_ampere`): cp.async + mma.sync, SMEM opt-in per block of 163 KiB on
# an A100 (sm_80) and 99 KiB on sm_86 / sm_89 (A10, A6000, L4, RTX 4090); the budgets leave ~2 KiB
# for Mosaic's own scratch. Blocks of 32 tokens on
# every part above head_dim 128 (registers; on the small-SMEM parts SMEM too).
AMPERE_TABLE = (
    TuningRow(
        gpus="A100 / A800 / A30 (sm_80), head_dim <= 128", compute_capability=(8.0, 8.6),
        head_dims=(1, 128),
        tuning=MosaicTuning(block_tokens=64, max_slots=3, smem_budget=161 * 1024,
                            target_programs=2 * 108),
        measured="ptxas, deviceless sm_80 compile (JAX 0.12.0.1): see BENCHMARKS.md 'Mosaic GPU "
                 "on Ampere and Ada'. Speed: not measured."),
    # 64-token blocks spilled at head_dim 192 (84 B) and 256 (104 B): the [64, 64] f32 scores
    # next to a [64, head_dim] f32 accumulator exceed 255 registers. 32-token blocks halve them.
    TuningRow(
        gpus="A100 / A800 / A30 (sm_80), head_dim > 128", compute_capability=(8.0, 8.6),
        tuning=MosaicTuning(block_tokens=32, max_slots=3, smem_budget=161 * 1024,
                            target_programs=2 * 108),
        measured="ptxas, deviceless sm_80 compile (JAX 0.12.0.1). Speed: not measured."),
    TuningRow(
        gpus="A10 / A6000 / L4 / RTX 4090 (sm_86, sm_89), head_dim <= 128",
        compute_capability=(8.6, 9.0), head_dims=(1, 128),
        tuning=MosaicTuning(block_tokens=64, max_slots=3, smem_budget=97 * 1024,
                            target_programs=2 * 58),
        measured="ptxas, deviceless sm_86 / sm_89 compile (JAX 0.12.0.1). Speed: not measured."),
    TuningRow(
        gpus="A10 / A6000 / L4 / RTX 4090 (sm_86, sm_89), head_dim > 128",
        compute_capability=(8.6, 9.0),
        tuning=MosaicTuning(block_tokens=32, max_slots=3, smem_budget=97 * 1024,
                            target_programs=2 * 58),
        measured="ptxas, deviceless sm_86 / sm_89 compile (JAX 0.12.0.1). Speed: not measured."),
    # Hopper (sm_90a: H100 / H200) through the same kernel with TMA copies, for the shapes the WGMMA
    # kernels refuse (`decode.runs_mma`): the B200 rows' SMEM budget (227 KiB a block as a B200),
    # 132 SMs.
    TuningRow(
        gpus="H100 / H200 (sm_90a) where WGMMA refuses, head_dim <= 128", compute_capability=(9.0, 10.0),
        head_dims=(1, 128),
        tuning=MosaicTuning(block_tokens=64, max_slots=4, smem_budget=200 * 1024,
                            target_programs=2 * 132),
        measured="ptxas, deviceless H100 compile (JAX 0.12.0.1). Speed: not measured."),
    TuningRow(
        gpus="H100 / H200 (sm_90a) where WGMMA refuses, head_dim > 128", compute_capability=(9.0, 10.0),
        tuning=MosaicTuning(block_tokens=32, max_slots=4, smem_budget=200 * 1024,
                            target_programs=2 * 132),
        measured="ptxas, deviceless H100 compile (JAX 0.12.0.1). Speed: not measured."),
    # Blackwell (sm_100: B200 / GB200; B300 is 10.3) through the same kernel with TMA copies:
    # 227 KiB of SMEM per block as an H100.
    TuningRow(
        gpus="B200 / GB200 / B300 (sm_100), head_dim <= 128", compute_capability=(10.0, 11.0),
        head_dims=(1, 128),
        tuning=MosaicTuning(block_tokens=64, max_slots=4, smem_budget=200 * 1024,
                            target_programs=2 * 148),
        measured="ptxas, deviceless B200 compile (JAX 0.12.0.1). Speed: not measured."),
    TuningRow(
        gpus="B200 / GB200 / B300 (sm_100), head_dim > 128", compute_capability=(10.0, 11.0),
        tuning=MosaicTuning(block_tokens=32, max_slots=4, smem_budget=200 * 1024,
                            target_programs=2 * 148),
        measured="ptxas, deviceless B200 compile (JAX 0.12.0.1). Speed: not measured."),
    # Blackwell RTX (sm_120: RTX PRO 6000, RTX 50xx) through the TMA path: 99 KiB of SMEM per block
    # as sm_86 / sm_89; 188 SMs on the RTX PRO 6000.
    TuningRow(
        gpus="RTX PRO 6000 / RTX 50xx (sm_120), head_dim <= 128", compute_capability=(12.0, 13.0),
        head_dims=(1, 128),
        tuning=MosaicTuning(block_tokens=64, max_slots=3, smem_budget=97 * 1024,
                            target_programs=2 * 188),
        measured="ptxas, deviceless RTX PRO 6000 compile (JAX 0.12.0.1). Speed: not measured."),
    TuningRow(
        gpus="RTX PRO 6000 / RTX 50xx (sm_120), head_dim > 128", compute_capability=(12.0, 13.0),
        tuning=MosaicTuning(block_tokens=32, max_slots=3, smem_budget=97 * 1024,
                            target_programs=2 * 188),
        measured="ptxas, deviceless RTX PRO 6000 compile (JAX 0.12.0.1). Speed: not measured."),
    # Interpret mode / unknown: the A100 rows' tiling.
    TuningRow(
        gpus="any other (interpret mode), head_dim > 128", compute_capability=None,
        head_dims=(129, 1 << 30),
        tuning=MosaicTuning(block_tokens=32, max_slots=3, smem_budget=161 * 1024,
                            target_programs=2 * 108)),
    TuningRow(
        gpus="any other (interpret mode)", compute_capability=None,
        tuning=MosaicTuning(block_tokens=64, max_slots=3, smem_budget=161 * 1024,
                            target_programs=2 * 108)),
)


# 8-bit caches: blocks of at most this many tokens on Ampere/Ada, and of at most
# QUANTIZED_BLOCK_TOKENS_WIDE above head_dim 128 on every generation. The widened K/V blocks, the
# per-token scales and (sm_80/86) float8's bit manipulation sit next to the scores: with 64-token
# blocks the decode kernel spilled 12-16 B on sm_80 (float16 q, e5m2, GQA 8, head_dim 128), and
# with 32-token blocks the ragged tile kernel spilled 32 B on sm_120 at head_dim 256 (int8 and
# e5m2). On Hopper (sm_90a, TMA copies) the ragged op's decode kernel spilled 36 B with 64-token
# blocks (int8, GQA 8, head_dim 128, pages of 16): 32 there too.
QUANTIZED_BLOCK_TOKENS_SM8X = 32
QUANTIZED_BLOCK_TOKENS_WIDE = 16


def lookup_ampere(compute_capability: float | None = None, head_dim: int = 128,
                  quantized: bool = False) -> MosaicTuning:
    """The Ampere/Ada kernel's default tiling (AMPERE_TABLE) for a GPU and a head_dim; 8-bit caches
    (`quantized`) take smaller blocks: at most QUANTIZED_BLOCK_TOKENS_SM8X tokens on 8.x and 9.x (and
    in interpret mode, which stands for 8.x), at most QUANTIZED_BLOCK_TOKENS_WIDE above head_dim 128."""
    tuning = lookup_tuning(AMPERE_TABLE, compute_capability, head_dim).tuning
    if quantized:
        cap = tuning.block_tokens
        if compute_capability is None or compute_capability < 10.0:
            cap = min(cap, QUANTIZED_BLOCK_TOKENS_SM8X)
        if head_dim > 128:
            cap = min(cap, QUANTIZED_BLOCK_TOKENS_WIDE)
        tuning = dataclasses.replace(tuning, block_tokens=cap)
    return tuning
