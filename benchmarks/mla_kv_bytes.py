"""KV cache bytes per token and per sequence: DeepSeek's latent cache (MLA) next to Llama-3's K and V.

Each figure is the model's declared cache spec as the engine sizes it (`jpa.kv.spec.CacheSpec.bytes_per_token`,
`bytes_per_sequence`), from published sizes; nothing is loaded.

    ./run python benchmarks/mla_kv_bytes.py [--dtype bfloat16] [--context 32768]
"""

import argparse

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

from jpa.kv.spec import CacheSpec
from jpa.models import deepseek

LLAMA = {"llama-3-70b": (80, 8, 128), "llama-3-8b": (32, 8, 128)}   # layers, kv heads, head_dim


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()
    import ml_dtypes  # noqa: F401  (numpy learns bfloat16)

    specs = {name: deepseek.cache_spec(deepseek.published(name)) for name in sorted(deepseek.PUBLISHED)}
    specs.update({name: CacheSpec.attention(*sizes) for name, sizes in LLAMA.items()})
    ref = specs["llama-3-70b"].bytes_per_token(args.dtype)
    print(f"| model | cache | B/token ({args.dtype}) | MiB per {args.context}-token sequence | vs Llama-3-70B |")
    print("|---|---|---:|---:|---:|")
    for name, spec in specs.items():
        per_token = spec.bytes_per_token(args.dtype)
        per_seq = spec.bytes_per_sequence(args.context, args.dtype) / 2**20
        print(f"| {name} | {spec.describe()} | {per_token:,.0f} | {per_seq:,.0f} | {ref / per_token:.1f}x less |"
              if per_token != ref else f"| {name} | {spec.describe()} | {per_token:,.0f} | {per_seq:,.0f} | 1 |")


if __name__ == "__main__":
    main()
