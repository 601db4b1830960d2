"""Pallas GPU kernels behind `jpa.paged_decode` and `jpa.ragged_paged_attention`. One kernel per file.

Layout: one folder per backend (`mosaic/`, `triton/`), each with its kernels (`decode.py`,
`ragged.py`), the pipeline pieces both of them run (`pipeline.py`) and their tiling apart from them
(`tuning.py`: a frozen, validated dataclass and a table of defaults by GPU generation and shape,
passed to a kernel as `tuning=`). `common.py` holds the math both backends share (split-K merge,
pool layouts, query tiles, the tuning-table lookup), `spec.py` the static call descriptions.

Every kernel module exposes the same two functions (the contract `jpa.ops.dispatch` relies on):

- `unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None) -> str | None`:
  why this kernel cannot serve a configuration on a GPU of that compute capability (None:
  interpret mode, no device limits), or None when it can. It must accept exactly what compiles:
  `jpa tools compile` compiles every accepted configuration of a covering grid.
- `paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap,
  alibi_slopes, sliding_window, k_scales, v_scales, interpret) -> out`: arguments already
  validated by `jpa.paged_decode`; `interpret=True` runs the kernel on CPU.
"""
