#!/usr/bin/env python3
"""What a CPU kernel that reads Q4_1 blocks would buy, against XLA's dequantize-then-dot (a measurement,
not a jpa code path).

XLA's CPU dot takes no dequantizing operand (scripts/bench_cpu_matmul.py measures every expression of
it), so this builds a plain C++ loop over the GGUF blocks (one thread, g++ -O3 with AVX2 / FMA / F16C,
the codes read once per block for all rows, f32 accumulation), calls it through XLA's FFI
(`jax.ffi.ffi_call`, a custom call inside the jitted program, as a model layer would), checks it
against dequantize-then-dot on fresh random blocks, and times both at SmolLM2-135M's layer shapes:
best of --reps, ms for one layer's 7 matmuls. Needs g++ and jaxlib's FFI headers (`jax.ffi.include_dir()`).

    ./run python scripts/bench_cpu_ffi.py --rows 1,4,16
"""

import argparse
import ctypes
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_cpu_matmul import best_ms, q4_1, ref_layer  # noqa: E402

SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// y[M, N] = x[M, K] @ W, W in Q4_1 blocks along K: codes u8[K / 2, N] (byte j of a block's 16 rows holds
// value j in its low nibble and value j + 16 in its high one), d and m f16[K / 32, N]: w = q * d + m.
static ffi::Error Q41(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> d,
                      ffi::Buffer<ffi::F16> m, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = codes.dimensions()[1], nb = K / 32;
  const float* X = x.typed_data();
  const uint8_t* C = codes.typed_data();
  const uint16_t* D = reinterpret_cast<const uint16_t*>(d.typed_data());
  const uint16_t* Mn = reinterpret_cast<const uint16_t*>(m.typed_data());
  float* Y = y->typed_data();
  std::memset(Y, 0, sizeof(float) * M * N);
  std::vector<float> acc(N), dd(N), mm(N);
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
        const __m256i lo_mask = _mm256_set1_epi32(15);
        int64_t k = 0;
        for (; k + 8 <= N; k += 8) {
          __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + k)));
          __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, lo_mask));
          __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
          __m256 a = _mm256_loadu_ps(&acc[k]);
          a = _mm256_fmadd_ps(x0, lo, a);
          a = _mm256_fmadd_ps(x1, hi, a);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpaQ41Matmul, Q41, ffi::Ffi::Bind()
    .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::F16>>()
    .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def build() -> None:
    """Compiles SOURCE and registers its handler as the CPU custom call "jpa_q41_matmul"."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="jpa_ffi_"))
    (tmp / "q41.cc").write_text(SOURCE)
    so = tmp / "q41.so"
    subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC",
                    f"-I{jax.ffi.include_dir()}", str(tmp / "q41.cc"), "-o", str(so)], check=True)
    lib = ctypes.cdll.LoadLibrary(str(so))
    jax.ffi.register_ffi_target("jpa_q41_matmul", jax.ffi.pycapsule(lib.JpaQ41Matmul), platform="cpu")


def ffi_layer(x, codes, d, m):
    return jax.ffi.ffi_call("jpa_q41_matmul", jax.ShapeDtypeStruct((x.shape[0], codes.shape[1]), jnp.float32))(
        x, codes, d, m)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    build()
    rng = np.random.default_rng()
    per_layer = {(576, 576): 2, (576, 192): 2, (576, 1536): 2, (1536, 576): 1}   # wq wo, wk wv, gate up, down
    out = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        tot = {"dequant_dot": 0.0, "ffi_q4_1": 0.0}
        for (k, n), count in per_layer.items():
            w = q4_1(rng, k, n)
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            ref, got = np.asarray(jax.jit(ref_layer)(x, *w)), np.asarray(jax.jit(ffi_layer)(x, *w))
            err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            if err > 1e-5:
                raise SystemExit(f"the FFI kernel differs from dequantize-then-dot at {rows}x{k}x{n}: {err}")
            for name, f in (("dequant_dot", ref_layer), ("ffi_q4_1", ffi_layer)):
                tot[name] += count * best_ms(jax.jit(f), (x, *w), args.reps)
        out[rows] = {name: round(v, 3) for name, v in tot.items()}
        print(f"[bench] rows {rows}: {out[rows]} ms a layer", file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
