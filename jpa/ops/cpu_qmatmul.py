"""x @ W on a CPU from Q4_1 blocks as stored: a C++ loop over the GGUF blocks, called as an XLA FFI custom
call inside the jitted step (`jpa.ops.qmatmul.packed_matmul` routes a CPU's few-row products here).

XLA's CPU dot takes no dequantizing operand, and every expression of the product in XLA's own ops is slower
than dequantizing the layer's whole weight to f32 and then one dot (BENCHMARKS.md, "The CPU path for one
user"). This loop reads each 4-bit code once per block for all rows, accumulates in f32 (the products of the
reference, summed in another order: equal to dequantize-then-dot within f32 rounding) and reads layer
`layer` of the stacked [L, ...] arrays in place (the scan's slice as a custom-call operand would be copied).
One thread, AVX2 / FMA / F16C. At 1-4 rows it beats the dequantizing dot (2.7-3.3x at one row for
SmolLM2-135M's layers); at 16 it loses (`MAX_ROWS`).

The library is compiled with g++ at first use (a few seconds) into $JPA_CACHE_DIR/ffi (default
~/.cache/jpa/ffi), named by the hash of its source and flags, and registered once per process; where that
fails (no compiler, no x86-64 AVX2 / F16C, no FFI headers) `unsupported_reason` says why and the caller keeps
XLA's path. JPA_CPU_QMATMUL=0 turns it off.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jpa_cpu_q4_1_matmul"
MAX_ROWS = 4   # rows of x the loop serves: beyond, x is not reused from registers and the dot wins
GROUP = 32     # GGUF's block
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC")

SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// y[M, N] = x[M, K] @ W, W layer `layer` of Q4_1 blocks along K: codes u8[L, K / 2, N] (byte j of a block's
// 16 rows holds value j in its low nibble and value j + 16 in its high one), d and m f16[L, K / 32, N]:
// w = q * d + m. Per block: acc[n] = sum_j x[j] q[j, n], then y[n] += d[n] acc[n] + m[n] sum_j x[j].
static ffi::Error Q41(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> d,
                      ffi::Buffer<ffi::F16> m, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t L = codes.dimensions()[0], N = codes.dimensions()[2], nb = K / 32;
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error(ffi::ErrorCode::kOutOfRange, "layer out of range");
  const float* X = x.typed_data();
  const uint8_t* C = codes.typed_data() + l * (K / 2) * N;
  const uint16_t* D = reinterpret_cast<const uint16_t*>(d.typed_data()) + l * nb * N;
  const uint16_t* Mn = reinterpret_cast<const uint16_t*>(m.typed_data()) + l * nb * N;
  float* Y = y->typed_data();
  std::memset(Y, 0, sizeof(float) * M * N);
  std::vector<float> acc(N), dd(N), mm(N);
  const __m256i lo_mask = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < nb; ++b) {
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
      _mm256_storeu_ps(&dd[n], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(D + b * N + n))));
      _mm256_storeu_ps(&mm[n], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(Mn + b * N + n))));
    }
    for (; n < N; ++n) { dd[n] = _cvtsh_ss(D[b * N + n]); mm[n] = _cvtsh_ss(Mn[b * N + n]); }
    for (int64_t r = 0; r < M; ++r) {
      const float* xb = X + r * K + b * 32;
      float xs = 0.f;
      for (int j = 0; j < 32; ++j) xs += xb[j];
      std::memset(acc.data(), 0, sizeof(float) * N);
      for (int j = 0; j < 16; ++j) {
        const uint8_t* row = C + (b * 16 + j) * N;
        const __m256 x0 = _mm256_set1_ps(xb[j]), x1 = _mm256_set1_ps(xb[j + 16]);
        int64_t k = 0;
        for (; k + 8 <= N; k += 8) {
          __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + k)));
          __m256 a = _mm256_loadu_ps(&acc[k]);
          a = _mm256_fmadd_ps(x0, _mm256_cvtepi32_ps(_mm256_and_si256(q, lo_mask)), a);
          a = _mm256_fmadd_ps(x1, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), a);
          _mm256_storeu_ps(&acc[k], a);
        }
        for (; k < N; ++k) acc[k] += xb[j] * (row[k] & 15) + xb[j + 16] * (row[k] >> 4);
      }
      float* yr = Y + r * N;
      for (int64_t k = 0; k < N; ++k) yr[k] += dd[k] * acc[k] + mm[k] * xs;
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpaCpuQ41Matmul, Q41, ffi::Ffi::Bind()
    .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::F16>>()
    .Arg<ffi::Buffer<ffi::F16>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def _cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("JPA_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jpa") / "ffi"


_BUILD_LOCK = threading.Lock()   # the ladder's background thread may trace beside the first round


def library_reason() -> str | None:
    """None once the loop is built and registered in this process (built at the first call: a few seconds),
    else why it cannot be (then XLA's path serves)."""
    with _BUILD_LOCK:
        return _build_and_register()


@functools.cache
def _build_and_register() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU block matmul is x86-64 code (AVX2 / FMA / F16C); this is {platform.machine()}"
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if not all(f" {f}" in flags for f in ("avx2", "fma", "f16c")):
        return "this CPU lacks AVX2 / FMA / F16C, which the CPU block matmul uses"
    include = jax.ffi.include_dir()
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS) + jax.__version__).encode()).hexdigest()[:16]
    so = _cache_dir() / f"q4_1_{digest}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            src, out = pathlib.Path(tmp) / "q4_1.cc", pathlib.Path(tmp) / "q4_1.so"
            src.write_text(SOURCE)
            try:
                proc = subprocess.run(["g++", *FLAGS, f"-I{include}", str(src), "-o", str(out)],
                                      capture_output=True, text=True)
            except OSError as e:
                return f"no C++ compiler to build the CPU block matmul (g++: {e})"
            if proc.returncode != 0:
                return f"g++ could not build the CPU block matmul: {proc.stderr.strip()[-300:]}"
            os.replace(out, so)   # atomic: another process building the same source finds a whole file
    lib = ctypes.cdll.LoadLibrary(str(so))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JpaCpuQ41Matmul), platform="cpu")
    return None


def unsupported_reason(m: int, k: int, group: int, codes_dtype, d_dtype, has_min: bool, compute_dtype,
                       k_quant: bool = False) -> str | None:
    """Why `q4_1_matmul` does not serve an [m, k] x [k, n] product of a packed weight here, or None: it takes
    GGUF's Q4_1 form (uint8 codes, f16 scales and minimums per 32 values, no K-quant super-blocks), f32
    compute, at most MAX_ROWS rows, on an x86-64 CPU with AVX2 / FMA / F16C where g++ builds it."""
    if np.dtype(codes_dtype) != np.uint8 or not has_min or k_quant:
        return "the CPU block matmul takes Q4_1 blocks (4-bit codes with minimums, no K-quant super-blocks)"
    if group != GROUP or np.dtype(d_dtype) != np.float16:
        return f"the CPU block matmul takes GGUF's f16 scales per {GROUP} values; got {np.dtype(d_dtype)} per {group}"
    if np.dtype(compute_dtype) != np.float32:
        return f"the CPU block matmul computes in float32; the model computes in {np.dtype(compute_dtype)}"
    if m > MAX_ROWS:
        return f"{m} rows: the CPU block matmul serves at most {MAX_ROWS} (XLA's dot is faster beyond)"
    if k % GROUP:
        return f"K = {k} is not whole blocks of {GROUP}"
    if os.environ.get("JPA_CPU_QMATMUL", "1") == "0":
        return "JPA_CPU_QMATMUL=0 turns the CPU block matmul off"
    return library_reason()


def q4_1_matmul(x, codes, d, m, layer=None):
    """x f32[M, K] @ W for Q4_1 blocks codes u8[L, K / 2, N], d / m f16[L, K / 32, N] (layer `layer`, i32[]),
    or one weight codes [K / 2, N] (layer None) -> f32[M, N]. Only where `unsupported_reason` is None."""
    if layer is None:
        codes, d, m, layer = codes[None], d[None], m[None], 0
    out = jax.ShapeDtypeStruct((x.shape[0], codes.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), codes, d, m, jnp.asarray(layer, jnp.int32))
