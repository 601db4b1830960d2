"""KV + recurrent-state bytes per sequence: a Qwen3.5-27B-shaped hybrid next to dense models of the same size.

Prints, for each context length, what one sequence holds in the engine (`jpa.kv.spec.CacheSpec.bytes_per_sequence`:
whole pages of every paged group plus the recurrent states), split into pages and states. The shapes are stated
in the table's header; nothing is loaded.

    python benchmarks/state_bytes.py [--contexts 4096,32768,131072,262144] [--kv-dtype bfloat16] [--page-size 16]

Qwen3.5-27B (text): 64 layers, every 4th full attention (16 layers: 4 KV heads x 256, gated), the other 48 Gated
DeltaNet (16 key heads and 48 value heads of 128, conv kernel 4). A GDN layer keeps the ssm state [48, 128, 128]
and the conv state [conv_dim = 2 * 16 * 128 + 48 * 128, 3], both float32 as jpa keeps them.
"""

import argparse

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

from jpa.kv.spec import CacheGroup, CacheSpec, FullAttention, RecurrentState


def qwen35_spec(num_layers=64, interval=4, kv_heads=4, head_dim=256, k_heads=16, v_heads=48, k_dim=128, v_dim=128,
                conv=4) -> CacheSpec:
    """The cache spec of a Qwen3.5-shaped hybrid: every `interval`-th layer full attention, the rest GDN."""
    attn = tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    gdn = tuple(i for i in range(num_layers) if (i + 1) % interval)
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    state = RecurrentState((("conv", (conv_dim, conv - 1), "float32"), ("ssm", (v_heads, k_dim, v_dim), "float32")))
    return CacheSpec((CacheGroup("full_attention", attn, FullAttention(kv_heads, head_dim)),
                      CacheGroup("linear_attention", gdn, state)))


MODELS = {
    "Qwen3.5-27B (hybrid: 16 attention + 48 GDN layers)": qwen35_spec(),
    "Qwen3.5-27B shapes, all 64 layers full attention": CacheSpec.attention(64, 4, 256),
    "Qwen3-32B (dense: 64 layers, 8 KV heads x 128)": CacheSpec.attention(64, 8, 128),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768,131072,262144")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    mib = 2 ** 20
    print(f"KV cache {args.kv_dtype}, page size {args.page_size}; recurrent states float32. MiB per sequence "
          f"(pages + states).")
    print("| model | KV B/token | state MiB/seq | " + " | ".join(f"{c // 1024}k context" for c in contexts) + " |")
    print("|---|---:|---:|" + "---:|" * len(contexts))
    for name, spec in MODELS.items():
        states = spec.state_bytes_per_sequence()
        cells = [f"{spec.bytes_per_sequence(c, args.kv_dtype, args.page_size) / mib:,.0f}" for c in contexts]
        print(f"| {name} | {spec.bytes_per_token(args.kv_dtype):,.0f} | {states / mib:,.1f} | " + " | ".join(cells)
              + " |")
    hybrid, dense = (list(MODELS.values())[i] for i in (0, 1))
    for c in contexts:
        h = hybrid.bytes_per_sequence(c, args.kv_dtype, args.page_size)
        d = dense.bytes_per_sequence(c, args.kv_dtype, args.page_size)
        print(f"at {c:,} tokens the hybrid holds {h / d:.2f}x the all-attention model's bytes")


if __name__ == "__main__":
    main()
