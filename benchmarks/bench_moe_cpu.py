#!/usr/bin/env python3
"""Decode tokens/s of a tiny mixture of experts on this CPU against a dense model of the same ACTIVE
parameters (the same attention; a SwiGLU MLP of width k * F, the width of the k experts a token uses).

Both are random float32 Llama-family models built from a ModelConfig (nnx.Rngs(0)), run by the engine
greedily with every slot busy (ignore_eos), the tokenizer of the tiny Qwen3-MoE test checkpoint (its
320-token vocabulary). Each configuration runs once to compile, then --repeats measured runs in the same
engine; the table gives the engine summary's decode tokens/s (median) of the measured runs.

    python benchmarks/bench_moe_cpu.py [--max-seqs 1 16] [--new-tokens 64] [--repeats 3] [--json PATH]

CPU timings on a shared machine: compare the two rows of one run, not runs of different days.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jpa import models  # noqa: E402
from jpa.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jpa.models import ModelConfig  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# 16 experts of width 256, top-2: 2 * 256 = 512 active ffn columns of 16 * 256 = 4096.
MOE = ModelConfig(family="llama", vocab_size=320, d_model=256, num_layers=4, num_q_heads=4, num_kv_heads=2,
                  head_dim=64, ffn_dim=256, max_seq_len=512, rope_base=10000.0, tie_embeddings=True,
                  bos_token_id=0, eos_token_id=0, num_experts=16, experts_per_token=2, norm_topk_prob=True)
DENSE = dataclasses.replace(MOE, num_experts=0, experts_per_token=0, ffn_dim=MOE.experts_per_token * MOE.ffn_dim)


def run(config, max_seqs, new_tokens, repeats, tok):
    gpt = models.GPT(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    params = sum(x.size for x in __import__("jax").tree_util.tree_leaves(nnx.state(gpt, nnx.Param)))
    cfg = EngineConfig(max_seqs=max_seqs, num_pages=max_seqs * 16 + 8, page_size=16, max_model_len=256,
                       steps_per_call=8, prefix_caching=False)
    prompts = [[1 + (7 * i + j) % 300 for j in range(16)] for i in range(max_seqs)]
    sp = SamplingParams(max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    rates = []
    engine = LLMEngine(models.GPTForEngine(gpt), tok, cfg)
    engine.generate(prompts, sp)  # compile
    for _ in range(repeats):
        engine = LLMEngine(models.GPTForEngine(gpt), tok, cfg)  # the step program is cached per process
        engine.generate(prompts, sp)
        rates.append(engine.summary()["decode_tok_s"])
    return dict(params=int(params), decode_tok_s=[round(r, 1) for r in rates], median=round(statistics.median(rates), 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-seqs", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args(argv)
    _, tok = models.load(str(ROOT / "tests" / "data" / "hf" / "qwen3_moe"))
    rows = []
    print("| model | parameters | active per token | sequences | decode tok/s (median) | runs |")
    print("|---|---:|---:|---:|---:|---|")
    for seqs in args.max_seqs:
        for name, config in (("MoE 16 x 256, top-2", MOE), ("dense, ffn 512", DENSE)):
            r = run(config, seqs, args.new_tokens, args.repeats, tok)
            c = config
            attn = c.num_layers * c.d_model * (2 * c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim
            mlp = c.num_layers * 3 * c.d_model * c.ffn_dim * (c.experts_per_token or 1)
            active = attn + mlp + c.vocab_size * c.d_model
            rows.append(dict(model=name, max_seqs=seqs, active=active, **r))
            print(f"| {name} | {r['params']:,} | {active:,} | {seqs} | {r['median']} | {r['decode_tok_s']} |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
