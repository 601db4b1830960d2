#!/usr/bin/env python3
"""The step-shape ladder against one full-size step: one user, 32 users, time to first token.

Two engines over one loaded model, the same sizes (default --max-seqs 32, budget 512, as
`jpa serve --max-seqs 32`), `step_shapes="off"` (every round computes max_seqs rows) and
"ladder" (each round on the smallest compiled shape that holds it; `jpa.engine.ladder`). Both are
compiled and warmed before anything is timed (the ladder waits for its background thread), then
measured interleaved (off, ladder, off, ladder, ...), medians of --reps:

  - one user: --prompts chat prompts one at a time, greedy, --max-new-tokens each: output tokens/s
    over the wall time (and per CPU second of this process: steadier on a shared machine), and the
    median time to first token (add_request -> the round that hands the first token out);
  - TTFT by prompt length: one user, prompts of --lengths random ordinary tokens (1 token out);
  - TTFT under load: one new request while --users - 1 others decode;
  - many users: --users chat prompts at once: output tokens/s and their median time to first token.

Engine-level (no HTTP): LLMEngine.step() rounds, as the server's engine loop drives them.
Also reported: the ladder's shapes, compiles and compile seconds (background), and the full shape's.

    ./run python benchmarks/bench_ladder.py                 # SmolLM2-135M Q4_1 GGUF, ~5 minutes on 2 cores
    ./run python benchmarks/bench_ladder.py --reps 1 --prompts 2 --users 8   # quicker

Results: JSON on stdout (and --out).
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()

CHAT = ["What is a paged KV cache?", "Name three rivers in Europe.", "Write a haiku about the sea.",
        "Explain continuous batching in one paragraph.", "What is the capital of France?",
        "Give me a recipe for pancakes.", "Why is the sky blue?", "List four prime numbers."]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--steps-per-call", type=int, default=4, help="default 4, as jpa serve")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="one-user prompts per rep")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--lengths", default="16,128,480", help="prompt lengths (tokens) of the TTFT-by-length rows")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="off,ladder", help="step_shapes of the engines compared (default: "
                    "a name not given to the engine, for a checkout from before the ladder)")
    ap.add_argument("--sweep", default=None, help="instead of the workloads above: users at once, e.g. "
                    "1,2,4,8,16,32 (chat prompts, --max-new-tokens each): output tokens per CPU second and per "
                    "wall second by users and mode, and the step shapes the rounds ran (what the ladder's rungs buy)")
    ap.add_argument("--no-compile-cache", action="store_true")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def run(eng, prompts, max_new):
    """Adds prompts (token-id lists or text) at once, steps to the end: (wall s, output tokens, TTFTs s,
    CPU s of this process)."""
    from jpa.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [eng.add_request(p, params).request_id for p in prompts]
    first, tokens = {}, 0
    while eng.has_unfinished:
        for o in eng.step():
            tokens += len(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
    return time.perf_counter() - t0, tokens, [first[i] for i in ids], time.process_time() - c0


def ttft_under_load(eng, chat, users, max_new):
    """One request added while users - 1 others decode: its time to first token (s)."""
    from jpa.engine import Phase, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    for p in chat[: users - 1]:
        eng.add_request(p, params)
    while eng.scheduler.phase_count(Phase.DECODING) < users - 1:
        eng.step()
    eng.step()
    t0 = time.perf_counter()
    rid = eng.add_request(chat[-1], SamplingParams(max_new_tokens=1, temperature=0.0)).request_id
    got = None
    while got is None:
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids:
                got = time.perf_counter() - t0
    while eng.has_unfinished:
        eng.step()
    return got


def main(argv=None):
    args = parse_args(argv)
    from jpa import LLM, models
    from jpa.args import enable_compile_cache

    if not args.no_compile_cache:
        enable_compile_cache()
    t = time.perf_counter()
    gpt, tok = models.load(args.model)
    print(f"[bench] model loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    chat = [tok.render_chat([{"role": "user", "content": CHAT[i % len(CHAT)]}]) for i in range(max(args.users, 8))]
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    lo, hi = (32, 127) if args.model.startswith("tiny") else (1000, 40000)   # ordinary tokens (byte-level tiny presets)
    long_prompts = {n: [int(x) for x in rng.integers(lo, hi, n)] for n in lengths}
    modes = args.modes.split(",")
    engines, compiles = {}, {}
    for mode in modes:
        # "default": the engine's defaults, no step_shapes keyword (an engine from before the ladder).
        shapes = {} if mode == "default" else dict(step_shapes=mode)
        llm = LLM.from_model(gpt, tok, max_seqs=args.max_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             steps_per_call=args.steps_per_call, max_model_len=2048, **shapes)
        eng = llm.engine
        t = time.perf_counter()
        run(eng, chat[:1], 2)                       # the full shape compiles (or loads) here
        first = time.perf_counter() - t
        if hasattr(eng.runner, "ladder"):
            eng.runner.ladder.wait()
        s = eng.summary()
        compiles[mode] = dict(first_round_s=round(first, 2), full_shape_compile_s=round(s["compile_seconds"], 2),
                              full_shape_source=s["step_source"], shapes=s.get("step_shapes"),
                              ladder_compiles=s.get("ladder_compiles"),
                              ladder_compile_s=round(s.get("ladder_compile_seconds") or 0.0, 2))
        print(f"[bench] {mode}: {compiles[mode]}", file=sys.stderr)
        run(eng, chat[: args.users], 4)             # warm every shape's first call
        for n in lengths:
            run(eng, [long_prompts[n]], 1)
        engines[mode] = eng

    if args.sweep:
        return sweep(args, engines, chat, [int(x) for x in args.sweep.split(",")], compiles)
    rows = {m: {k: [] for k in ("one_user_tok_s", "one_user_tok_per_cpu_s", "one_user_ttft_ms", "users_tok_s",
                                "users_tok_per_cpu_s", "users_ttft_ms",
                                "ttft_under_load_ms", *[f"ttft_len{n}_ms" for n in lengths])} for m in modes}
    for rep in range(args.reps):
        for mode in modes:
            eng, r = engines[mode], rows[mode]
            wall, cpu, tokens, ttfts = 0.0, 0.0, 0, []
            for p in chat[: args.prompts]:
                w, n, f, c = run(eng, [p], args.max_new_tokens)
                wall, cpu, tokens = wall + w, cpu + c, tokens + n
                ttfts += f
            r["one_user_tok_s"].append(tokens / wall)
            r["one_user_tok_per_cpu_s"].append(tokens / cpu)
            r["one_user_ttft_ms"].append(1e3 * statistics.median(ttfts))
            for n in lengths:
                r[f"ttft_len{n}_ms"].append(1e3 * run(eng, [long_prompts[n]], 1)[2][0])
            w, n, f, c = run(eng, chat[: args.users], args.max_new_tokens)
            r["users_tok_s"].append(n / w)
            r["users_tok_per_cpu_s"].append(n / c)
            r["users_ttft_ms"].append(1e3 * statistics.median(f))
            r["ttft_under_load_ms"].append(1e3 * ttft_under_load(eng, chat, args.users, args.max_new_tokens))
            print(f"[bench] rep {rep} {mode}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in r.items()), file=sys.stderr)
    result = dict(config=vars(args), compiles=compiles,
                  medians={m: {k: round(statistics.median(v), 1) if v else None for k, v in r.items()} for m, r in rows.items()},
                  runs=rows)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def sweep(args, engines, chat, users, compiles):
    """--sweep: for each count of users at once, each mode, --reps times interleaved: tokens per CPU
    second and per wall second (medians), and the shapes the rounds ran."""
    from jpa.engine.shapes import StepShape

    out = {m: {} for m in engines}
    for n in users:
        for rep in range(args.reps):
            for mode, eng in engines.items():
                shapes, step = [], eng.runner.step

                def spy(batch, step=step, shapes=shapes):
                    shapes.append(StepShape(batch.rows.seq_ids.shape[0], batch.rows.tokens.shape[0]))
                    return step(batch)

                eng.runner.step = spy
                w, k, _, c = run(eng, chat[:n], args.max_new_tokens)
                eng.runner.step = step
                r = out[mode].setdefault(n, dict(tok_per_cpu_s=[], tok_s=[], shapes=set()))
                r["tok_per_cpu_s"].append(k / c)
                r["tok_s"].append(k / w)
                r["shapes"] |= {(s.rows, s.tokens) for s in shapes}
                print(f"[bench] {n} users {mode}: {k / c:.1f} tokens per CPU s, {k / w:.1f} tokens/s", file=sys.stderr)
    result = dict(config=vars(args), compiles=compiles, sweep={
        m: {n: dict(tok_per_cpu_s=round(statistics.median(r["tok_per_cpu_s"]), 1),
                    tok_s=round(statistics.median(r["tok_s"]), 1), shapes=sorted(r["shapes"]))
            for n, r in by.items()} for m, by in out.items()})
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
