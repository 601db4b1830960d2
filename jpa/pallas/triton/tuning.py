"""Tiling of the Pallas Triton kernels (`decode`, `ragged`), kept apart from them: the knobs as frozen,
validated dataclasses (`DecodeTuning`, `RaggedTuning`) and their defaults by GPU generation and shape
(`DECODE_TABLE`, `RAGGED_TABLE`; `decode_tuning`, `ragged_tuning`).

A kernel takes its tiling as an argument (`tuning=`, a static argument: the dataclasses are
hashable); the lookups give the defaults. Add a row above the fallback rows for a GPU or a shape
that wants other values, and say in `measured` what was measured.

What "measured" means here: the A100 and H100 rows were checked by compiling every accepted
configuration of a covering grid for that GPU on a machine without one (XLA's whole GPU pipeline,
Triton and ptxas: registers, spills, shared memory; `jpa tools compile`, records in
`benchmarks/gpu_truth/`, BENCHMARKS.md "compiled for an H100 and an A100 without one"). That
measurement chose the ragged kernel's smaller tiles (its 8192-element tiles spilled). Speed has not
been measured on any GPU: tile sizes, partition sizes, warps and stages are the usual Triton flash-decoding starting
points, not timings (`benchmarks/bench_kernels.py` is the tool for that on a GPU).

Who picks the row: the kernels' `tuning=None` default is the row for compute capability None (the
fallback), because `jpa.ops` does not pass the target's tiling to the kernels yet; every
generation's row holds the fallback's values today, so nothing depends on it. A row that differs for a
generation needs the dispatch (which knows the target) to pass `tuning=lookup(cc, ...)`.
"""

import dataclasses

from jpa.pallas.common import TuningRow, lookup_tuning


def _pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


def _positive(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _check_tile(tile_elements):
    if not (_pow2(tile_elements) and tile_elements >= 256):
        raise ValueError(f"tile_elements must be a power of two >= 256 (16 x 16, tl.dot's smallest "
                         f"tile); got {tile_elements!r}")


def _check_launch(num_warps, num_stages):
    if not (_pow2(num_warps) and num_warps <= 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32; got {num_warps!r}")
    if not _positive(num_stages):
        raise ValueError(f"num_stages must be a positive int; got {num_stages!r}")


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """The tiling knobs of the Triton decode kernel (see `decode.plan`).

    Attributes:
      tile_elements: key tile elements per inner step, block_k * head_dim_pad: one K and one V tile
        of block_k x head_dim_pad are in flight per step (8192: 64 x 128 with 4 warps, the tile
        Triton flash-decoding kernels commonly start from).
      partition_tokens: key tokens per split-K partition: 1024 tokens is 8-32 inner steps, enough
        work per program to amortize its launch and q load, while a 32k context still yields 32
        programs per (sequence, kv head) to fill the SMs when the batch is small.
      full_grid_programs: with at least this many (sequence, kv head) programs the GPU is already
        full (about 4 programs per SM on A100/H100, 108/132 SMs), so contexts up to
        no_split_max_tokens run in one pass and skip the partials' write + merge (vLLM's v1/v2
        rule has the same shape).
      no_split_max_tokens: see full_grid_programs.
      num_warps, num_stages: Triton's launch parameters.
    """
    tile_elements: int = 8192
    partition_tokens: int = 1024
    full_grid_programs: int = 512
    no_split_max_tokens: int = 8192
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_tile(self.tile_elements)
        for name in ("partition_tokens", "full_grid_programs", "no_split_max_tokens"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int; got {getattr(self, name)!r}")
        _check_launch(self.num_warps, self.num_stages)


@dataclasses.dataclass(frozen=True)
class RaggedTuning:
    """The tiling knobs of the Triton ragged (prefill tile) kernel (see `ragged.plan`).

    Attributes:
      rows: MMA rows per program (tile_tokens * q_per_kv), a power of two >= 16 (raised to
        q_per_kv when that is larger: one token's heads always fit a tile).
      tile_elements: key tile elements (block_k * head_dim_pad) per step.
      num_warps, num_stages: Triton's launch parameters.
    """
    rows: int = 64
    tile_elements: int = 4096
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not (_pow2(self.rows) and self.rows >= 16):
            raise ValueError(f"rows must be a power of two >= 16 (tl.dot's smallest M); got {self.rows!r}")
        _check_tile(self.tile_elements)
        _check_launch(self.num_warps, self.num_stages)


_PTXAS = ("ptxas, deviceless {gpu} compile (JAX 0.12.0.1, 2026-11-24): {what}, 0 spills "
          "(benchmarks/gpu_truth/{files}). Speed: not measured.")

# First match wins; rows keyed by compute capability [min, max) and head_dim (inclusive).
DECODE_TABLE = (
    TuningRow(gpus="A100 (sm_80)", compute_capability=(8.0, 8.6), tuning=DecodeTuning(),
              measured=_PTXAS.format(gpu="A100", what="the covering grid (decode, ragged, engine steps: "
                                                      "117 compiled)", files="after_a100.json")),
    TuningRow(gpus="H100 / H200 (sm_90)", compute_capability=(9.0, 10.0), tuning=DecodeTuning(),
              measured=_PTXAS.format(gpu="H100", what="the decode covering grid, 86 configurations, "
                                                      "88-255 registers", files="after_h100_triton.json")),
    # sm_86 / sm_89 (A10, L4, L40), Blackwell and interpret mode: the same values, unchecked there.
    TuningRow(gpus="any other (interpret mode)", compute_capability=None, tuning=DecodeTuning()),
)

_RAGGED_MEASURED = dict(
    a100=dict(gpu="A100", files="after_a100.json, after_a100_ragged2.json"),
    h100=dict(gpu="H100", files="after_h100_ragged.json, after_h100_ragged2.json"))


def _ragged_rows(gpus, cc, measured_on=None):
    """The four shape rows of one generation: head_dim <= 128 or wider, 16-bit or f32 compute.

    Measured by ptxas (the `_RAGGED_MEASURED` runs): with the decode kernel's 8192-element tiles
    this kernel spilled 16-240 bytes at 255 registers (A100: bf16/hd128, f16 q + int8 cache/hd64,
    f32, fp8/hd80; H100: f32); 8 warps are no way out (Triton then caps registers at 128 and
    fp8/hd192 and bf16/hd80/q_per_kv 16 spilled). For head_dim > 128 the [rows, head_dim_pad] f32
    accumulator and the index tensors of q's gather and the output's scatter stay live across the
    key loop: with 32 rows ptxas spilled 8 bytes (H100, bf16, head_dim 256), with 16 it uses
    94-157 registers. float32 compute halves the tile again."""
    def note(what):
        return _PTXAS.format(what=what, **_RAGGED_MEASURED[measured_on]) if measured_on else ""
    narrow, wide = (1, 128), (129, 1 << 30)
    return (
        TuningRow(gpus, cc, RaggedTuning(rows=64, tile_elements=2048), note("f32, head_dim <= 128"),
                  head_dims=narrow, compute_dtypes=("float32",)),
        TuningRow(gpus, cc, RaggedTuning(rows=16, tile_elements=2048), note("f32, head_dim > 128"),
                  head_dims=wide, compute_dtypes=("float32",)),
        TuningRow(gpus, cc, RaggedTuning(rows=64, tile_elements=4096),
                  note("16-bit q (bf16/f16/8-bit caches), head_dim <= 128"), head_dims=narrow),
        TuningRow(gpus, cc, RaggedTuning(rows=16, tile_elements=4096),
                  note("16-bit q (bf16/f16/8-bit caches), head_dim > 128"), head_dims=wide),
    )


RAGGED_TABLE = (
    *_ragged_rows("A100 (sm_80)", (8.0, 8.6), "a100"),
    *_ragged_rows("H100 / H200 (sm_90)", (9.0, 10.0), "h100"),
    # sm_86 / sm_89, Blackwell and interpret mode: the same values, unchecked there.
    *_ragged_rows("any other (interpret mode)", None),
)


def decode_tuning(compute_capability: float | None = None, head_dim: int = 128,
                  compute_dtype: str | None = None) -> DecodeTuning:
    """The decode kernel's default tiling for a GPU of `compute_capability` (None: interpret mode /
    unknown), a head_dim and the dot operands' dtype (numpy name): DECODE_TABLE's first match."""
    return lookup_tuning(DECODE_TABLE, compute_capability, head_dim, compute_dtype).tuning


def ragged_tuning(compute_capability: float | None = None, head_dim: int = 128,
                  compute_dtype: str | None = None) -> RaggedTuning:
    """The ragged kernel's default tiling, as `decode_tuning` (RAGGED_TABLE's first match)."""
    return lookup_tuning(RAGGED_TABLE, compute_capability, head_dim, compute_dtype).tuning
