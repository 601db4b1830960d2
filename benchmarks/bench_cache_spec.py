"""Benchmark: KV bytes per sequence from the cache each model declares (jpa.kv.spec), as served today and with
sliding-window pages freed.

For model shapes taken from their Hugging Face config.json files (sizes only, no weights), prints each model's
cache groups and the bytes one sequence holds at 8k and 32k tokens, bfloat16 cache, page size 16:

- "as served": what jpa's engine holds today. The paged attention groups share one stacked pool and one
  block table per sequence, so a sliding-window layer keeps every page of the sequence.
- "windows freed": what the same sequence would hold if each sliding-window group kept only the pages its
  window can still read (`CacheSpec.bytes_per_sequence(freed=True)`): the figure per-group pools that release
  out-of-window pages inside the step would reach. NOT built yet: a projection from the spec, labelled so.

    python benchmarks/bench_cache_spec.py [--json out.json]
"""

import argparse
import json

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

from jpa.kv.spec import CacheSpec  # noqa: E402

# (name, layers, kv heads, head_dim, window, sliding layers) from each model's config.json.
SHAPES = (
    ("SmolLM2-135M", 30, 3, 64, None, ()),
    ("Llama-3-8B", 32, 8, 128, None, ()),
    ("Llama-3-70B", 80, 8, 128, None, ()),
    # gpt-oss-20b: 24 layers, layer_types alternate sliding (window 128) and full, starting sliding
    ("gpt-oss-20b", 24, 8, 64, 128, tuple(range(0, 24, 2))),
    # gpt-oss-120b: 36 layers, the same pattern
    ("gpt-oss-120b", 36, 8, 64, 128, tuple(range(0, 36, 2))),
    # Gemma-2-9b: 42 layers, even layers slide over 4096 tokens
    ("Gemma-2-9b", 42, 8, 256, 4096, tuple(range(0, 42, 2))),
)


def rows(contexts=(8192, 32768), dtype="bfloat16", page_size=16):
    out = []
    for name, layers, heads, head_dim, window, sliding in SHAPES:
        spec = CacheSpec.attention(layers, heads, head_dim, window=window, window_layers=sliding)
        for ctx in contexts:
            served = spec.bytes_per_sequence(ctx, dtype, page_size)
            freed = spec.bytes_per_sequence(ctx, dtype, page_size, freed=True)
            out.append(dict(model=name, context=ctx, groups=spec.describe(dtype, page_size),
                            served_mib=served / 2**20, freed_mib=freed / 2**20, ratio=served / freed))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    table = rows()
    seen = set()
    for r in table:
        if r["model"] not in seen:
            seen.add(r["model"])
            print(f"{r['model']}: {r['groups']}")
    print()
    print(f"| model | context | as served (MiB / sequence) | windows freed, projected (MiB) | served / freed |")
    print(f"|---|---|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['context']:,} | {r['served_mib']:,.1f} | {r['freed_mib']:,.1f} | "
              f"{r['ratio']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
