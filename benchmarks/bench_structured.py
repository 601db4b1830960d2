#!/usr/bin/env python3
"""Benchmark: what structured outputs cost, and what they cost the unconstrained requests beside them.

Workload: `--num-requests` chat prompts (SmolLM2-135M-Instruct, float32), all in one batch
(max_seqs = num_requests). Two systems, run on one engine (one compiled program), interleaved,
`--reps` times each, the fastest pass reported:

- "mixed": half of the requests are constrained by a JSON schema (greedy; they finish when the
  JSON is complete), the other half are unconstrained (greedy, ignore_eos, `--max-new` tokens);
- "none": the same prompts, none constrained (every request unconstrained, `--max-new` tokens).

Measured: tokens/s of the unconstrained half (the same 16 requests in both systems: their tokens /
the time until the last of them finished), mixed vs none (the constrained requests outlast them: they make one token per round,
the unconstrained ones steps_per_call); a constrained request's time per token; llguidance's
per-token mask time (`Grammars.masks`, host) and grammar compile time (one fresh schema per
compile, `--compiles` of them), and the one-time build of the llguidance tokenizer. The
constrained outputs are checked against the schema with jsonschema when it is installed.

    .venv/bin/python benchmarks/bench_structured.py                  # SmolLM2, 32 requests x 64 tokens
    .venv/bin/python benchmarks/bench_structured.py --tiny --quick   # the random tiny model (smoke test)
"""

import argparse
import json
import os
import statistics
import sys
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "river": {"type": "string", "maxLength": 24},
    "length_km": {"type": "integer", "minimum": 0, "maximum": 10000},
    "countries": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    "navigable": {"type": "boolean"}},
    "required": ["name", "river", "length_km", "countries", "navigable"], "additionalProperties": False}
QUESTIONS = ["Describe a famous river.", "Tell me about the Danube.", "What is a paged KV cache?",
             "Name three rivers.", "Explain recursion briefly.", "Write a haiku about the sea.",
             "Why is the sky blue?", "Give me a tip for clear code."]


def run(eng, prompts, params, constrained):
    """Drives eng to completion; returns ((wall s, process CPU s) from the start to each request's
    finish, outputs)."""
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [eng.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    done, outs = {}, {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (time.perf_counter() - t0, time.process_time() - c0)
                outs[o.request_id] = o.output
    return [done[i] for i in ids], [outs[i] for i in ids]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the random tiny-llama preset")
    ap.add_argument("--quick", action="store_true", help="8 requests x 16 tokens, 1 rep, 4 compiles")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--ragged-block-tokens", type=int, default=None,
                    help="EngineConfig.ragged_block_tokens (rows per model pass of the ragged step; default: 64 on a "
                         "CPU): a constrained round's ragged step costs one such block")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--compiles", type=int, default=16, help="fresh schemas compiled for the compile time")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_new, args.reps, args.compiles = 8, 16, 1, 4

    from jpa import models
    from jpa.tools.bench import machine
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    name = "tiny-llama" if args.tiny else "smollm2-135m"
    gpt, tok = models.load(name)
    n = args.num_requests
    eng = LLMEngine(models.GPTForEngine(gpt), tok, EngineConfig(
        max_seqs=n, max_model_len=512, steps_per_call=args.steps_per_call, prefix_caching=False,
        ragged_block_tokens=args.ragged_block_tokens))
    prompts = [tok.apply_chat_template(f"{QUESTIONS[i % len(QUESTIONS)]} Answer in JSON. (#{i})") for i in range(n)]
    free = SamplingParams(max_new_tokens=args.max_new, greedy=True, ignore_eos=True)
    # The constrained half may run longer than the free half (one token per round): room for it.
    tied = SamplingParams(max_new_tokens=4 * args.max_new, greedy=True, structured={"json": SCHEMA})
    is_tied = [i % 2 == 1 for i in range(n)]
    systems = {"mixed": [tied if t else free for t in is_tied], "none": [free] * n}

    t0 = time.perf_counter()
    g = eng.grammars
    g.llg_tokenizer()
    tokenizer_s = time.perf_counter() - t0
    run(eng, prompts, systems["mixed"], is_tied)   # warm-up: compiles the step, the schema
    runs = {k: [] for k in systems}
    checked = None
    for _ in range(args.reps):
        for key, params in systems.items():
            m0, ms0 = g.masks_computed, g.mask_seconds
            times, outs = run(eng, prompts, params, is_tied)
            free_idx = [i for i in range(n) if not is_tied[i]]   # the same half in both systems
            free_tokens = sum(len(outs[i].token_ids) for i in free_idx)
            last = max(free_idx, key=lambda i: times[i][0])
            free_wall, free_cpu = times[last]
            r = dict(free_tokens=free_tokens, free_wall_s=free_wall, free_tok_s=free_tokens / free_wall,
                     free_cpu_s=free_cpu, free_tok_per_cpu_s=free_tokens / free_cpu,
                     wall_s=max(t for t, _ in times), masks=g.masks_computed - m0, mask_seconds=g.mask_seconds - ms0)
            if key == "mixed":
                tied_outs = [outs[i] for i in range(n) if is_tied[i]]
                r["constrained_tokens"] = sum(len(o.token_ids) for o in tied_outs)
                r["constrained_s_per_token"] = statistics.mean(
                    times[i][0] / max(len(outs[i].token_ids), 1) for i in range(n) if is_tied[i])
                r["constrained_finish_reasons"] = sorted({o.finish_reason for o in tied_outs})
                r["constrained_sample"] = tied_outs[0].completion
                try:
                    import jsonschema
                    for o in tied_outs:
                        if o.finish_reason == "stop":
                            jsonschema.validate(json.loads(o.completion), SCHEMA)
                    checked = True
                except ImportError:
                    checked = None
            runs[key].append(r)
    best = {k: max(v, key=lambda r: r["free_tok_s"]) for k, v in runs.items()}

    # Compile time: fresh schemas (property names varied, so the compile cache never serves them).
    compile_s = []
    for i in range(args.compiles):
        schema = {**SCHEMA, "properties": {f"{k}_{i}": v for k, v in SCHEMA["properties"].items()}}
        schema["required"] = list(schema["properties"])
        c0 = g.compile_seconds
        g.matcher(SamplingParams(structured={"json": schema}).structured)
        compile_s.append(g.compile_seconds - c0)
    mask_ms = 1000 * best["mixed"]["mask_seconds"] / max(best["mixed"]["masks"], 1)
    report = dict(
        model=name, num_requests=n, max_new=args.max_new, steps_per_call=args.steps_per_call, reps=args.reps,
        ragged_block_tokens=eng.runner.block_tokens,
        machine=machine(), systems=best,
        free_tok_s_ratio=best["mixed"]["free_tok_s"] / best["none"]["free_tok_s"],
        free_tok_per_cpu_s_ratio=best["mixed"]["free_tok_per_cpu_s"] / best["none"]["free_tok_per_cpu_s"],
        mask_ms_per_token=mask_ms, compile_ms_mean=1000 * statistics.mean(compile_s),
        compile_ms_max=1000 * max(compile_s), llguidance_tokenizer_s=tokenizer_s,
        constrained_outputs_valid=checked, step_compiles=eng.runner.compiles)
    s = best["mixed"]
    print(f"unconstrained half: {s['free_tok_s']:.1f} tok/s beside {n // 2} constrained vs "
          f"{best['none']['free_tok_s']:.1f} tok/s with none constrained (x{report['free_tok_s_ratio']:.3f} wall, "
          f"x{report['free_tok_per_cpu_s_ratio']:.3f} per CPU s)", file=sys.stderr)
    print(f"constrained: {1000 * s['constrained_s_per_token']:.1f} ms per token (one per round), "
          f"{s['constrained_tokens']} tokens, finish {s['constrained_finish_reasons']}, valid {checked}; "
          f"e.g. {s['constrained_sample'][:80]!r}", file=sys.stderr)
    print(f"llguidance: mask {mask_ms:.3f} ms per token (host), compile {report['compile_ms_mean']:.2f} ms mean / "
          f"{report['compile_ms_max']:.2f} ms max per schema, tokenizer build {tokenizer_s:.2f} s once; "
          f"one compiled program: {eng.runner.compiles == 1}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
