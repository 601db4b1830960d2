#!/usr/bin/env python3
"""Benchmark: parallel sampling (n samples of one prompt on forked, copy-on-write pages) vs n
independent copies of the request, SmolLM2-135M-Instruct on this machine.

Workload: the 32 chat prompts of examples/prompts32.jsonl (ChatML template), each asked for
`--n` samples (temperature 0.8, seeds seed..seed+n-1, `--max-new` tokens with ignore_eos so every
sample has the same length in both systems). Two engines with the same EngineConfig:

- parallel: SamplingParams(n=N): the prompt is prefilled once; the samples fork its pages and copy
  the shared partly filled last page on their first write (vLLM's parallel sampling).
- copies: N separate requests per prompt with the same seeds, prefix caching off (every copy
  prefills and stores its own prompt: what the engine did before parallel sampling).

Both run a warm-up first (compile excluded). Reported: pages in use at peak (sampled after every
round; the vLLM paper's "memory saving" is 1 - parallel/copies), generated tokens/s over the wall
time, prompt tokens computed, copy-on-write copies, and whether each sample's tokens are
identical in both systems (they must be: same seeds, same model).

    .venv/bin/python benchmarks/bench_parallel.py                 # about 6-10 minutes here
    .venv/bin/python benchmarks/bench_parallel.py --quick         # 8 prompts, 16 tokens
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = pathlib.Path(__file__).resolve().parents[1]

from jpa.tools.bench import machine, write_json


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model preset (tiny-llama: fast smoke runs)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 prompts, 16 new tokens")
    ap.add_argument("--out", default="benchmarks/parallel.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new = min(args.num_prompts, 8), min(args.max_new, 16)
    for name in ("n", "num_prompts", "max_new", "max_seqs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.n > args.max_seqs:
        ap.error("--n must be <= --max-seqs (each sample takes a decode slot)")
    return args


def run(eng, prompts, params, n, *, parallel: bool):
    """All requests at t0, step() until done. Returns (tokens per sample, figures)."""
    t0, s0 = time.perf_counter(), dict(prefill=eng.stats.prefill_tokens, cow=eng.runner.cow_copies)
    eng.stats.peak_pages_used = 0
    if parallel:
        leaders = [eng.add_request(p, params).request_id[0] for p in prompts]
        ids = [[(r, i) for i in range(n)] for r in leaders]
    else:
        ids = [[eng.add_request(p, dataclasses.replace(params, n=1, seed=params.seed + i)).request_id
                for i in range(n)] for p in prompts]
    outs = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output
    wall = time.perf_counter() - t0
    tokens = [[list(outs[i].token_ids) for i in group] for group in ids]
    generated = sum(len(t) for g in tokens for t in g)
    return tokens, dict(wall_s=round(wall, 2), generated_tokens=generated, gen_tok_s=round(generated / wall, 2),
                        prompt_tokens_computed=eng.stats.prefill_tokens - s0["prefill"],
                        peak_pages_in_use=eng.stats.peak_pages_used, cow_copies=eng.runner.cow_copies - s0["cow"],
                        preemptions=eng.stats.preemptions, pool_whole=eng.pool_is_whole())


def main(argv=None):
    args = parse_args(argv)
    import jax.numpy as jnp

    from jpa import models
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    model, tok = models.load(args.model, dtype=jnp.float32)
    lines = [json.loads(x) for x in (ROOT / "examples" / "prompts32.jsonl").read_text().splitlines() if x.strip()]
    texts = [x["prompt"] for x in lines][: args.num_prompts]
    chat = hasattr(tok, "apply_chat_template") and args.model != "tiny-llama"
    prompts = [tok.encode(tok.apply_chat_template(t) if chat else t) for t in texts]
    params = SamplingParams(max_new_tokens=args.max_new, temperature=0.8, seed=args.seed, n=args.n, ignore_eos=True)
    gpt = models.GPTForEngine(model)
    cfg = dict(max_seqs=args.max_seqs, page_size=16, max_model_len=1024, num_pages=args.max_seqs * 64)
    engines = {"parallel": LLMEngine(gpt, tok, EngineConfig(**cfg)),
               "copies": LLMEngine(gpt, tok, EngineConfig(prefix_caching=False, **cfg))}
    results, tokens = {}, {}
    for name, eng in engines.items():
        run(eng, prompts[:2], dataclasses.replace(params, max_new_tokens=2), args.n, parallel=name == "parallel")
        eng.flush_prefix_cache()
        compile_s = eng.runner.compile_seconds
        tokens[name], results[name] = run(eng, prompts, params, args.n, parallel=name == "parallel")
        results[name]["compile_s"] = round(compile_s, 1)
        results[name]["compiles_during_run"] = eng.runner.compiles - 1
        print(f"{name}: {results[name]}", flush=True)
    same = sum(a == b for ga, gb in zip(tokens["parallel"], tokens["copies"]) for a, b in zip(ga, gb))
    par, cop = results["parallel"], results["copies"]
    saving = 1 - par["peak_pages_in_use"] / cop["peak_pages_in_use"]
    summary = dict(pages_saved=round(saving, 4), throughput_ratio=round(par["gen_tok_s"] / cop["gen_tok_s"], 3),
                   identical_samples=same, samples=args.n * len(prompts))
    prompt_lens = [len(p) for p in prompts]
    report = dict(benchmark="parallel sampling vs independent copies", command=" ".join(["benchmarks/bench_parallel.py"] + (argv or sys.argv[1:])),
                  machine=dict(machine(), loadavg=os.getloadavg()), model=args.model,
                  workload=dict(prompts=len(prompts), n=args.n, max_new_tokens=args.max_new,
                                prompt_tokens_min=min(prompt_lens), prompt_tokens_mean=round(float(np.mean(prompt_lens)), 1),
                                prompt_tokens_max=max(prompt_lens), temperature=0.8, engine=cfg),
                  systems=results, summary=summary)
    print(f"\n| system | gen tok/s | wall s | prompt tokens computed | peak pages in use | copy-on-write copies |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['gen_tok_s']} | {r['wall_s']} | {r['prompt_tokens_computed']} | {r['peak_pages_in_use']} | "
              f"{r['cow_copies']} |")
    print(f"\npages saved at peak: {100 * saving:.1f}% | throughput x{summary['throughput_ratio']} | identical "
          f"samples {same}/{summary['samples']} | prompts {min(prompt_lens)}-{max(prompt_lens)} tokens "
          f"(mean {np.mean(prompt_lens):.0f}), {args.max_new} new tokens per sample")
    write_json(str(ROOT / args.out) if not os.path.isabs(args.out) else args.out, report)
    return 0 if same == summary["samples"] else 1


if __name__ == "__main__":
    sys.exit(main())
