"""Plain-JAX ragged attention vs the separate calls it replaces, on this machine (CPU).

SmolLM2-135M attention shapes (9 q heads, 3 kv heads, head_dim 64, f32, page size 16), a 512-token
budget and 32 running sequences of 800-1200 cached tokens:

- decode-only step: 32 decode rows (q_len 1) -> `jpa.ragged_paged_attention` vs `paged_decode_xla`;
- mixed step: 31 decode rows + one 481-token prompt chunk after a 500-token cached prefix ->
  ragged vs `paged_decode_xla` on the 31 + the plain-JAX prefill on the chunk.

One attention layer per call, jitted, median of --reps interleaved rounds (the machine is shared).

    python benchmarks/bench_ragged.py [--reps 15] [--json benchmarks/ragged_cpu.json]
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpa.tools.bench import machine, write_json

from jpa.ops.reference import paged_prefill_xla  # noqa: E402
from jpa.ops.ragged import ragged_paged_attention_xla  # noqa: E402
from jpa.ops.reference import paged_decode_xla  # noqa: E402
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ = 512, 32, 128
PREFIX, CHUNK = 500, NUM_TOKENS - (NUM_SEQS - 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    num_pages = NUM_SEQS * PAGES_PER_SEQ + 8
    shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tables = jnp.asarray(rng.permutation(num_pages)[:NUM_SEQS * PAGES_PER_SEQ]
                         .reshape(NUM_SEQS, PAGES_PER_SEQ), jnp.int32)
    lens = rng.integers(800, 1200, NUM_SEQS).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((NUM_TOKENS, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
    scale = HEAD_DIM ** -0.5
    ragged = jax.jit(lambda *x: ragged_paged_attention_xla(*x, scale=scale))
    decode = jax.jit(lambda q, *x: paged_decode_xla(q, *x, scale=scale))
    prefill = jax.jit(lambda *x: paged_prefill_xla(*x, scale=scale))

    cu_decode = jnp.arange(NUM_SEQS + 1, dtype=jnp.int32)
    q_lens = np.ones(NUM_SEQS, np.int32)
    q_lens[-1] = CHUNK
    mixed_lens = lens.copy()
    mixed_lens[-1] = PREFIX + CHUNK
    cu_mixed = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    cases = {
        "decode_only/ragged": (ragged, (q, k_pages, v_pages, tables, jnp.asarray(lens), cu_decode,
                                        jnp.int32(NUM_SEQS))),
        "decode_only/paged_decode_xla": (decode, (q[:NUM_SEQS], k_pages, v_pages, tables,
                                                  jnp.asarray(lens))),
        "mixed/ragged": (ragged, (q, k_pages, v_pages, tables, jnp.asarray(mixed_lens), cu_mixed,
                                  jnp.int32(NUM_SEQS))),
        "mixed/decode_part": (decode, (q[:NUM_SEQS - 1], k_pages, v_pages, tables[:-1],
                                       jnp.asarray(lens[:-1]))),
        "mixed/prefill_part": (prefill, (q[None, NUM_SEQS - 1:], k_pages, v_pages, tables[-1:],
                                         jnp.asarray([PREFIX], jnp.int32),
                                         jnp.asarray([CHUNK], jnp.int32))),
    }
    for fn, args in cases.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in cases}
    for _ in range(a.reps):
        for name, (fn, args) in cases.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    for name, v in ms.items():
        print(f"{name:32s} {v:8.2f} ms")
    print(f"mixed: ragged {ms['mixed/ragged']:.2f} ms vs separate "
          f"{ms['mixed/decode_part'] + ms['mixed/prefill_part']:.2f} ms")
    if a.json:
        write_json(a.json, dict(machine=machine(), median_ms=ms, reps=a.reps))


if __name__ == "__main__":
    main()
