#!/usr/bin/env python3
"""Benchmark: KV offload (swap to a host tier) vs recompute on a preemption-heavy workload.

Model: SmolLM2-135M-Instruct (float32, the real weights) on this machine (`--model tiny-llama`: the
random tiny model, for a quick run). Workload: `--num-requests` of the engine benchmarks' questions
(jpa.tools.bench.PROMPTS, ChatML-templated), half greedy and half seeded samples (temperature 0.8,
top_p 0.95), ignore_eos, exactly `--max-new` tokens each, all added at once. The pool is far too
small for them (`--num-pages`, default 40 pages of 16 tokens for 8 slots of sequences growing to
~100-130 tokens): the scheduler preempts over and over.

Systems: two LLMEngines on the same weights and EngineConfig except `kv_offload_bytes` 0 ("off":
a preempted request is recomputed) vs `--offload-gib` GiB ("on": its pages are swapped to the host
tier and back). Each runs the workload twice: the first run compiles every program (the unified
step and the swap programs, `ModelRunner.warm_swaps`: every block size) and is not timed; the second
is measured. Reported per system: wall
time of the measured run, generated tokens per second, preemptions, prompt tokens the engine
computed (prefill; with offload a swapped-in request prefills only its last token), tokens restored
from the host instead, and the bytes moved. The token ids of the greedy requests, and of the seeded
ones, are compared between the systems.

    .venv/bin/python scripts/bench_offload.py                       # SmolLM2, 16 requests
    .venv/bin/python scripts/bench_offload.py --model tiny-llama    # seconds
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from jpa import models  # noqa: E402
from jpa.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jpa.tools.bench import PROMPTS, machine, write_json  # noqa: E402


def workload(tok, n, max_new):
    prompts = []
    for i in range(n):
        q = PROMPTS[i % len(PROMPTS)]
        chat = getattr(tok, "apply_chat_template", None)
        prompts.append(chat([{"role": "user", "content": q}]) if chat else q)
    params = [SamplingParams(max_new_tokens=max_new, greedy=True, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=max_new, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def measure(model, tok, cfg, prompts, params):
    eng = LLMEngine(model, tok, cfg)
    eng.generate(prompts, params)              # warm-up: compiles the step and the swap programs
    if cfg.kv_offload_bytes:
        eng.runner.warm_swaps()                # every block size (the runs may swap other sizes)
    before = dict(vars(eng.stats))
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert eng.pool_is_whole()
    d = {k: v - before[k] for k, v in vars(eng.stats).items() if isinstance(v, (int, float))}
    gen = sum(len(o.token_ids) for o in outs)
    return outs, dict(wall_seconds=round(wall, 2), gen_tok_s=round(gen / wall, 1), generated_tokens=gen,
                      preemptions=d["preemptions"], prefill_tokens=d["prefill_tokens"],
                      swapped_out=d["swapped_out"], swapped_in=d["swapped_in"],
                      recompute_avoided_tokens=d["recompute_avoided_tokens"],
                      bytes_out=d["swap_out_bytes"], bytes_in=d["swap_in_bytes"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=40)
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--json", default="benchmarks/offload.json")
    args = ap.parse_args(argv)
    import jax.numpy as jnp

    model, tok = models.load(args.model, dtype=jnp.float32)
    engine_model = models.GPTForEngine(model)
    prompts, params = workload(tok, args.num_requests, args.max_new)
    base = dict(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages, max_model_len=512,
                watermark=0.0)
    results, outs = {}, {}
    for name, off in (("off", 0), ("on", int(args.offload_gib * 2 ** 30))):
        outs[name], results[name] = measure(engine_model, tok, EngineConfig(**base, kv_offload_bytes=off),
                                            prompts, params)
        print(name, results[name], flush=True)
    same = [a.token_ids == b.token_ids for a, b in zip(outs["off"], outs["on"])]
    r = dict(results, same_tokens=f"{sum(same)}/{len(same)}",
             prefill_reduction=round(1 - results["on"]["prefill_tokens"] / results["off"]["prefill_tokens"], 3),
             speedup=round(results["off"]["wall_seconds"] / results["on"]["wall_seconds"], 3),
             config=dict(vars(args)), machine=machine(), command="python " + " ".join(["scripts/bench_offload.py"]
                                                                                  + (argv or sys.argv[1:])))
    print({k: r[k] for k in ("same_tokens", "prefill_reduction", "speedup")})
    if args.json:
        write_json(os.path.join(ROOT, args.json) if not os.path.isabs(args.json) else args.json, r)
    return r


if __name__ == "__main__":
    main()
