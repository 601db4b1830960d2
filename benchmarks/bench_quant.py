#!/usr/bin/env python3
"""Quantized weights (issue 35): SmolLM2-135M's weight bytes, greedy agreement and logprob drift
against the float32 model, and what the H100 compiler makes of each format's matmuls.

    .venv/bin/python benchmarks/bench_quant.py quality int8 fp8 gguf   # the 32 chat prompts, greedy
    .venv/bin/python benchmarks/bench_quant.py hlo --batch 64           # deviceless H100 decode step
    .venv/bin/python benchmarks/bench_quant.py bytes                    # Llama-3-8B device bytes per format

`bytes`: the device bytes of Llama-3-8B's layer weights as jpa keeps each checkpoint format (FP8 / int8
per channel, AWQ, GPTQ, compressed-tensors pack-quantized, GGUF blocks), from jpa's own converters.

`quality`: each format's model (models.load("smollm2-135m", quantization=Q)) answers the 32 chat
prompts of jpa.tools.bench.PROMPTS greedily (32 new tokens) through jpa.LLM, as does the float32
model (quantization "none": the GGUF file dequantized at load). Reported: device weight bytes,
completions identical to the float model's, tokens before the first divergence, and the
teacher-forced drift |logprob_Q - logprob_float| of the float model's own completion tokens.

`hlo`: one decode step of SmolLM2 (bfloat16 compute) compiled for an H100 without one
(jpa.tools.deviceless) per format; reports the gemm fusions that read int8 / fp8 / uint8 weights
directly and every other fusion that converts a quantized weight to a dense float buffer (a
dense copy materialized before its gemm).
"""

import argparse
import re
import sys
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)


def quality(formats, n=32, new_tokens=32):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jpa import models
    from jpa.engine import SamplingParams
    from jpa.llm import LLM
    from jpa.models import forward_dense
    from jpa.tools.bench import PROMPTS

    res = {}
    for q in ["none"] + list(formats):
        t = time.time()
        gpt, tok = models.load("smollm2-135m", quantization=q)
        load = time.time() - t
        llm = LLM.from_model(gpt, tok, max_seqs=32, max_model_len=512, kv_memory_bytes=256 << 20)
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS[:n]],
                        SamplingParams(max_new_tokens=new_tokens, greedy=True))
        prompts = [tok.encode(tok.render_chat([{"role": "user", "content": p}])) for p in PROMPTS[:n]]
        res[q] = (gpt, outs, prompts)
        print(f"{q}: device weight bytes {gpt.weight_bytes():,} (loaded in {load:.1f} s)", flush=True)
    fgpt, fouts, prompts = res["none"]
    seqs = [p + list(o.token_ids) for p, o in zip(prompts, fouts)]
    width = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)

    def chosen(model):  # logprob of each float completion token, teacher-forced
        out = []
        for i in range(0, n, 8):
            lp = np.asarray(jax.nn.log_softmax(forward_dense(model, batch[i:i + 8]), -1))
            for j, (s, p) in enumerate(zip(seqs[i:i + 8], prompts[i:i + 8])):
                rows = lp[j, len(p) - 1:len(s) - 1]
                out.append(rows[np.arange(len(rows)), s[len(p):]])
        return out

    ref = chosen(fgpt)
    total = sum(len(o.token_ids) for o in fouts)
    bf16 = fgpt.weight_bytes() // 2
    print(f"| format | device weight bytes | vs bf16 | identical completions | tokens before first divergence "
          f"| logprob drift mean / max |")
    print("|---|---|---|---|---|---|")
    for q in formats:
        gpt, outs, _ = res[q]
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, fouts))
        lead = 0
        for a, b in zip(outs, fouts):
            k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            lead += k
        d = np.concatenate([np.abs(a - b) for a, b in zip(chosen(gpt), ref)])
        print(f"| {q} | {gpt.weight_bytes():,} | {gpt.weight_bytes() / bf16:.2f}x | {same}/{n} | {lead}/{total} "
              f"({100 * lead / total:.0f}%) | {d.mean():.4f} / {d.max():.3f} |", flush=True)


def _abstract_gguf(c):
    """SmolLM2 as its GGUF file stores it (Q8_0 embeddings, Q4_1 layers), zero-filled."""
    import jax.numpy as jnp
    import numpy as np

    from jpa.models import GPT
    from jpa.models.gpt import PackedWeight, expected_shapes

    sh = expected_shapes(c)

    def packed(shape, fmt, axis):
        codes, d = list(shape), list(shape)
        d[axis] //= 32
        if fmt == "Q8_0":
            return PackedWeight(np.zeros(codes, np.int8), np.ones(d, np.float16), None, axis)
        codes[axis] //= 2
        return PackedWeight(np.zeros(codes, np.uint8), np.ones(d, np.float16), np.zeros(d, np.float16), axis)

    w = {"tok_embeddings": packed(sh["tok_embeddings"], "Q8_0", -1), "norm": np.ones(c.d_model, np.float32),
         "layers": [{n: packed(s, "Q4_1", -2) if len(s) == 2 else np.ones(s, np.float32)
                     for n, s in sh["layers"].items()} for _ in range(c.num_layers)]}
    return GPT.from_weights(c, w, jnp.bfloat16)


def hlo(formats, batch):
    from jpa.tools.deviceless import configure_environment
    configure_environment()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jpa.kv.cache import CacheConfig, KVCache
    from jpa.models import GPT, PRESETS, decode
    from jpa.tools.deviceless import Compiler

    c = PRESETS["smollm2-135m"]
    comp = Compiler("h100")
    cc = CacheConfig(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, num_pages=1024,
                     page_size=16, dtype="bfloat16")
    cache = jax.eval_shape(lambda: KVCache.create(cc))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    for q in formats:
        if q == "gguf":
            model = _abstract_gguf(c)
        else:
            model = nnx.eval_shape(lambda: GPT(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                               quantization=None if q == "none" else q))
        graphdef, params = nnx.split(model)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

        def step(params, cache, tokens, seq_lens, slots, tables):
            return decode(nnx.merge(graphdef, params), cache, tokens, seq_lens, slots, tables, impl="xla")

        rec = comp.compile(q, step, (params, cache, i32(batch), i32(batch), i32(batch), i32(batch, 64)),
                           donate_argnums=(1,), keep_hlo=True)
        if not rec["ok"]:
            print(q, "FAILED", rec.get("error") or rec["problems"])
            continue
        gemms, dense = analyze(rec["hlo"])
        print(f"{q}: weight bytes {model.weight_bytes():,}; {len(gemms)} gemm fusions read quantized weights "
              f"directly; {len(dense)} other fusions write a dequantized weight: "
              + "; ".join(f"{name} -> {root}" for name, root in dense), flush=True)


def analyze(text):
    """(gemm fusions with an int8/fp8/uint8/int4 parameter, [(fusion, root type)] of non-gemm fusions
    that convert such a parameter into a float buffer) of an optimized HLO module."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^%?(\S+) \((.*)\) -> (.*) \{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif cur:
            comps[cur].append(line)
    gemms, dense = [], []
    for name, lines in comps.items():
        body = "\n".join(lines)
        quant = re.search(r"= (s8|f8e4m3fn|u8|u4|s4)\[[^\]]*\]\S* parameter", body)
        if not quant:
            continue
        if "gemm_fusion" in name:
            gemms.append(name)
            continue
        root = [line for line in lines if "ROOT" in line]
        m = re.search(r"ROOT %\S+ = ((bf16|f32|f16)\[[\d,]+\])", root[0]) if root else None
        if m and re.search(r"convert\(", body) and int(_size(m.group(1))) >= 2 ** 16:
            dense.append((name, m.group(1)))
    return gemms, dense


def _size(t):
    dims = re.findall(r"\d+", t.split("[")[1])
    out = 1
    for x in dims:
        out *= int(x)
    return out


# Llama-3-8B: 32 layers of q [4096, 4096], k / v [4096, 1024], o [4096, 4096], gate / up [4096, 14336],
# down [14336, 4096] ([in, out]); embeddings and the untied head [128256, 4096] each.
LLAMA3_8B_LINEARS = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336),
                     (14336, 4096)]
LLAMA3_8B = dict(layers=32, vocab=128256, d=4096)


def _stored(fmt, k, n, rng):
    """The device arrays jpa keeps for one [in=k, out=n] linear stored in `fmt`, made by jpa's own converters
    from random bytes in the format's layout (models.hf / jpa.core.quant; bytes do not depend on the values)."""
    import ml_dtypes
    import numpy as np

    from jpa.core import quant

    i32 = lambda *s: rng.integers(-2 ** 31, 2 ** 31, s, dtype=np.int64).astype(np.int32)
    f16 = lambda *s: rng.uniform(1e-3, 1e-2, s).astype(np.float16)
    g = 128
    if fmt in ("fp8", "int8"):  # q [in, out] + an f32 scale per output channel (per-tensor scales: repeated)
        dt = ml_dtypes.float8_e4m3fn if fmt == "fp8" else np.int8
        return [np.zeros((k, n), dt), np.ones(n, np.float32)]
    if fmt == "fp8-block128":  # DeepSeek-V3 / Qwen3-*-FP8: [128, 128] block scales (models.hf "block" layout)
        return list(quant.fp8_block(np.zeros((n, k), ml_dtypes.float8_e4m3fn),
                                    np.ones((-(-n // 128), -(-k // 128)), np.float32), (128, 128)))
    if fmt == "awq-g128":
        return list(quant.awq_int4(i32(k, n // 8), i32(k // g, n // 8), f16(k // g, n)))
    if fmt == "gptq-sym-g128":
        return list(quant.gptq_int4(i32(k // 8, n), np.full((k // g, n // 8), 0x77777777, np.int32), f16(k // g, n)))
    if fmt == "gptq-asym-g128":
        return list(quant.gptq_int4(i32(k // 8, n), i32(k // g, n // 8), f16(k // g, n)))
    if fmt == "pack-quantized-sym-g128":
        return list(quant.pack_quantized_int4(i32(n, k // 8), f16(n, k // g).astype(ml_dtypes.bfloat16)))
    if fmt in quant.K_FORMATS or fmt in quant.PACKED_FORMATS:  # GGUF [out, in] rows of blocks
        per = quant.K_FORMATS.get(fmt)
        blk, nbytes = (256, per) if per else (32, quant.PACKED_FORMATS[fmt][0])
        raw = rng.integers(0, 256, (n, k // blk, nbytes)).astype(np.uint8)
        for at in ([208] if fmt == "Q6_K" else [0, 2] if per or fmt == "Q4_1" else [0]):
            raw[..., at:at + 2] = f16(n, k // blk, 1).view(np.uint8)
        unpack = quant.unpack_k_blocks if per else quant.unpack_gguf_rows  # what models.smollm2 keeps
        return list(unpack(raw.reshape(n, -1), fmt, n, k))
    raise ValueError(fmt)


def weight_bytes(formats):
    """Device bytes of Llama-3-8B's layer weights per format, each linear converted by jpa's own loader code
    on an [in, 1024] slice and scaled to its `out` (exact: every stored array is per output channel)."""
    import numpy as np

    rng = np.random.default_rng(0)
    L, V, d = LLAMA3_8B["layers"], LLAMA3_8B["vocab"], LLAMA3_8B["d"]
    n_lin = L * sum(k * n for k, n in LLAMA3_8B_LINEARS)
    other = 2 * (2 * V * d + (2 * L + 1) * d)  # bf16 embeddings, head and norms (checkpoints keep them dense)
    print(f"| format | layer weights: bits per weight | layer weight bytes | vs bf16 | with bf16 embeddings + head |")
    print("|---|---:|---:|---:|---:|")
    print(f"| bf16 | 16.00 | {2 * n_lin:,} | 1.00x | {2 * n_lin + other:,} (1.00x) |")
    total_bf16 = 2 * n_lin + other
    for fmt in formats:
        per_k = {}
        for k in sorted({k for k, _ in LLAMA3_8B_LINEARS}):
            arrays = _stored(fmt, k, 1024, rng)
            per_k[k] = sum(a.nbytes for a in arrays if a is not None) / 1024  # bytes per output channel
        b = int(L * sum(per_k[k] * n for k, n in LLAMA3_8B_LINEARS))
        print(f"| {fmt} | {8 * b / n_lin:.2f} | {b:,} | {b / (2 * n_lin):.3f}x | {b + other:,} "
              f"({(b + other) / total_bf16:.3f}x) |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quality")
    q.add_argument("formats", nargs="*", default=["int8", "fp8", "gguf"])
    h = sub.add_parser("hlo")
    h.add_argument("formats", nargs="*", default=["none", "int8", "fp8", "gguf"])
    h.add_argument("--batch", type=int, default=64)
    b = sub.add_parser("bytes")
    b.add_argument("formats", nargs="*", default=["fp8", "int8", "fp8-block128", "awq-g128", "gptq-sym-g128",
                                                  "gptq-asym-g128", "pack-quantized-sym-g128", "Q8_0", "Q4_1", "Q4_K",
                                                  "Q5_K", "Q6_K"])
    args = ap.parse_args(argv)
    if args.cmd == "bytes":
        weight_bytes(args.formats)
    elif args.cmd == "quality":
        quality(args.formats)
    else:
        hlo(args.formats, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
