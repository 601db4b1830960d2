"""The XLA options the engine's step compiles with, per platform.

`WEIGHTS_IN_PLACE`: on a GPU, the options under which the scanned layers' gemms read their weights
in place (measured with `jpa.tools.traffic`, BENCHMARKS.md "Memory traffic of a decode step"):

- `xla_gpu_enable_triton_gemm=False`: gemms through cuBLAS rather than XLA's Triton gemm fusions.
  XLA GPU feeds cuBLAS a layer's slice of a stacked `[num_layers, ...]` weight by its offset (a
  dynamic-slice fusion); a Triton gemm fusion gets a copy of the slice first (each weight read,
  written and read again: about 3x a decode step's weight bytes).
- `xla_gpu_dot_merger_threshold_mb=0`: no dot merger, which would concatenate wq, wk and wv into a
  new array every layer.
- `xla_gpu_default_to_alg_dot_bf16_bf16_f32=True`: bf16 x bf16 -> f32 as the dots' algorithm (what
  the model asks), without which a one-row gemm (one sequence: a vector-matrix product) goes to
  cuBLAS with both operands converted to float32 first (the weight slice copied at twice its size).

`step_compiler_options(platform, overrides)` is what `jpa.engine.runner.ModelRunner` passes to
`jax.jit(..., compiler_options=)`: these on a GPU platform ("gpu", "cuda", "rocm"), nothing on a
CPU (its programs stay exactly as XLA compiles them by default). An option named in the
`XLA_FLAGS` environment variable is left to it (the user's flag wins), and `overrides` (a dict)
replace or, with the value None, remove single options.
"""

import os
import re

WEIGHTS_IN_PLACE = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0,
                    "xla_gpu_default_to_alg_dot_bf16_bf16_f32": True}

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def flags_in_env(env=None) -> set:
    """Names of the XLA options set in XLA_FLAGS (`--name=value` or `--name`)."""
    text = (os.environ if env is None else env).get("XLA_FLAGS", "")
    return set(re.findall(r"--([A-Za-z0-9_]+)", text))


def step_compiler_options(platform: str, overrides: dict | None = None, env=None) -> dict:
    """The XLA compiler options of the engine's step compiled for `platform` (a JAX platform name:
    "cpu", "gpu", "cuda", "rocm", "tpu"): `WEIGHTS_IN_PLACE` on a GPU, none elsewhere; less any
    option XLA_FLAGS sets (`env`: that environment instead of os.environ); then `overrides`
    applied (a value of None removes that option)."""
    out = dict(WEIGHTS_IN_PLACE) if platform in GPU_PLATFORMS else {}
    for name in flags_in_env(env):
        out.pop(name, None)
    for name, value in (overrides or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"compiler option names are strings; got {name!r}")
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out
