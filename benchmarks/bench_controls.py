#!/usr/bin/env python3
"""Benchmark: what the sampling controls cost in the multi-step decode loop.

Runs the same workload with no controls, with penalties (repetition 1.1, presence 0.3, frequency
0.3), with penalties + logit_bias (50 entries) + top_logprobs 5, with one request of the batch
asking for prompt_logprobs 5 and with every request asking (the echo/scoring case), on one engine
(its one compiled program serves every mix). Each system is run `--reps` times, interleaved; the fastest warm pass is
reported (the work is identical, other processes only add time) with its process CPU time.
Greedy with ignore_eos, so every pass generates exactly the same number of tokens.

    .venv/bin/python benchmarks/bench_controls.py                 # SmolLM2, 16 chats x 64 tokens
    .venv/bin/python benchmarks/bench_controls.py --tiny --quick  # the random tiny model (tests)
"""

import argparse
import json
import os
import sys
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)


# name -> (parameters of every request, more parameters of the first request only)
SYSTEMS = {
    "off": ({}, {}),
    "penalties": (dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3), {}),
    "penalties+bias+top5": (dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3,
                                 logit_bias={i: -1.0 for i in range(100, 150)}, top_logprobs=5), {}),
    "prompt_logprobs x1": ({}, dict(prompt_logprobs=5)),
    "prompt_logprobs all": (dict(prompt_logprobs=5), {}),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the random tiny-llama preset")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens, 1 rep")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new, args.reps = 4, 16, 1

    from jpa import models
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    gpt, tok = models.load("tiny-llama" if args.tiny else "smollm2-135m")
    eng = LLMEngine(models.GPTForEngine(gpt), tok,
                    EngineConfig(max_seqs=args.num_prompts, max_model_len=512, prefix_caching=False))
    questions = ["What is a paged KV cache?", "Name three rivers.", "Explain recursion briefly.",
                 "Write a haiku about the sea.", "Why is the sky blue?", "Give me a tip for clear code."]
    prompts = [tok.apply_chat_template(f"{questions[i % len(questions)]} (#{i})") if not args.tiny
               else f"prompt {i}: " + "abc" * (i + 1) for i in range(args.num_prompts)]
    eng.generate(prompts[:1], SamplingParams(max_new_tokens=2))    # compile once
    runs = {name: [] for name in SYSTEMS}
    outputs = {}
    for _ in range(args.reps):
        for name, (extra, first) in SYSTEMS.items():
            sps = [SamplingParams(max_new_tokens=args.max_new, greedy=True, ignore_eos=True, **extra,
                                  **(first if i == 0 else {})) for i in range(len(prompts))]
            d0, c0, w0, p0 = eng.stats.decode_tokens, eng.stats.decode_seconds, time.perf_counter(), time.process_time()
            f0, n0 = eng.stats.prefill_seconds, eng.stats.prefill_tokens
            outs = eng.generate(prompts, sps)
            wall, cpu = time.perf_counter() - w0, time.process_time() - p0
            toks = eng.stats.decode_tokens - d0
            ptoks = eng.stats.prefill_tokens - n0
            runs[name].append(dict(wall_s=wall, cpu_s=cpu, tokens=toks, tok_s=toks / wall, tok_per_cpu_s=toks / cpu,
                                   prompt_tokens=ptoks, prompt_tok_s=ptoks / wall, prompt_tok_per_cpu_s=ptoks / cpu,
                                   device_seconds=eng.stats.decode_seconds - c0,
                                   prefill_round_seconds=eng.stats.prefill_seconds - f0,
                                   prompt_tokens_scored=sum(len(o.prompt_ids) - 1 for o in outs
                                                            if o.prompt_logprobs is not None)))
            outputs[name] = [o.token_ids for o in outs]
    # The fastest pass (--max-new 1: the prompt-bound case, ranked by prompt tokens per second).
    key = "tok_s" if args.max_new > 1 else "prompt_tok_s"
    best = {name: max(r, key=lambda x: x[key]) for name, r in runs.items()}
    base = best["off"]
    report = dict(model="tiny-llama" if args.tiny else "smollm2-135m", num_prompts=args.num_prompts,
                  max_new=args.max_new, reps=args.reps, compiles=eng.runner.compiles, systems=best,
                  ratios={name: {k: b[k] / base[k] for k in (key, key.replace("_s", "_per_cpu_s"))}
                          for name, b in best.items()},
                  penalties_change_outputs=outputs["penalties"] != outputs["off"],
                  prompt_logprobs_leave_outputs=outputs["prompt_logprobs all"] == outputs["off"])
    for name, b in best.items():
        r = report["ratios"][name]
        cpu_key = key.replace("_s", "_per_cpu_s")
        print(f"{name:>20}: {b[key]:7.1f} {'' if key == 'tok_s' else 'prompt '}tok/s ({b[cpu_key]:7.1f} per CPU s)  "
              f"x{r[key]:.2f} wall, x{r[cpu_key]:.2f} CPU vs off; prefill rounds {b['prefill_round_seconds']:.3f} s, "
              f"{b['prompt_tokens_scored']} prompt tokens scored", file=sys.stderr)
    print(f"one compiled program for all: {eng.runner.compiles == 1}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
