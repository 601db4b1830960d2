"""Pallas GPU kernels behind `jpa.paged_decode`. One kernel per file.

Every kernel module exposes the same two functions (the contract `jpa.ops.dispatch` relies on):

- `unsupported_reason(spec: DecodeSpec, compute_capability: float | None = None) -> str | None`:
  why this kernel cannot serve a configuration on a GPU of that compute capability (None:
  interpret mode, no device limits), or None when it can. It must accept exactly what compiles:
  `scripts/gpu_compile_check.py` compiles every accepted configuration of a covering grid.
- `paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap,
  alibi_slopes, sliding_window, k_scales, v_scales, interpret) -> out`: arguments already
  validated by `jpa.paged_decode`; `interpret=True` runs the kernel on CPU.
"""
