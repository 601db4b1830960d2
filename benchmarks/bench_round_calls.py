"""Benchmark: device calls and host time per round on a workload that stops on stop strings.

Requests that end on a stop string are found on the host after their round; their pages are
released by the device. This counts the engine's device calls per round (`ModelRunner.step` and
the release-only `ModelRunner.retire`) and its host bookkeeping per round on such a workload:
the context-dependent tiny model (`jpa.testing.engine.context_llama`), greedy requests on seeded
random byte prompts, each with a stop string taken from the middle of its own output (a first,
untimed run without stop strings), a pool small enough to preempt. The timed runs repeat the
workload `--reps` times on one engine (compiled by the first) and report the median.

    .venv/bin/python benchmarks/bench_round_calls.py [--requests 24 --new-tokens 48 --reps 3]
"""

import argparse
import statistics
import time

import numpy as np

from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.testing.engine import context_llama
from jpa.tools.bench import machine, write_json
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)


def workload(eng, n, new_tokens, seed):
    """(prompts, params): seeded byte prompts, each with a stop string from its own greedy output."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(97, 123, int(rng.integers(8, 40)))] for _ in range(n)]
    plain = SamplingParams(max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    outs = eng.generate(prompts, plain)
    params = []
    for i, o in enumerate(outs):
        text = o.completion
        at = int(rng.integers(len(text) // 4, max(len(text) // 4 + 1, 3 * len(text) // 4)))
        stop = text[at: at + 2]
        params.append(SamplingParams(max_new_tokens=new_tokens, greedy=True, ignore_eos=True,
                                     stop=(stop,) if stop.strip() and i % 3 else ()))
    return prompts, params


def timed(eng, prompts, params):
    """One run: rounds, device calls by kind, host seconds and stop-string finishes."""
    calls = {"step": 0, "retire": 0}
    runner = eng.runner
    originals = {k: getattr(runner, k) for k in calls}

    def counting(kind):
        def call(*a, **kw):
            calls[kind] += 1
            return originals[kind](*a, **kw)
        return call

    for k in calls:
        setattr(runner, k, counting(k))
    h0, p0, rounds, stops = eng.stats.host_seconds, eng.stats.preemptions, 0, 0
    t0 = time.perf_counter()
    try:
        for p, sp in zip(prompts, params):
            eng.add_request(p, sp)
        while eng.has_unfinished:
            rounds += 1
            stops += sum(1 for o in eng.step() if o.finished and o.output.finish_reason == "stop")
    finally:
        for k in calls:
            delattr(runner, k)
    wall = time.perf_counter() - t0
    return dict(rounds=rounds, step_calls=calls["step"], retire_calls=calls["retire"],
                calls_per_round=(calls["step"] + calls["retire"]) / rounds,
                host_ms_per_round=1e3 * (eng.stats.host_seconds - h0) / rounds, wall_s=wall,
                stop_finishes=stops, preemptions=eng.stats.preemptions - p0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--num-pages", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tok = context_llama(seed=1)
    eng = LLMEngine(model, tok, EngineConfig(max_seqs=8, page_size=8, num_pages=args.num_pages, steps_per_call=4,
                                              max_model_len=192, watermark=0.0, max_num_batched_tokens=64))
    prompts, params = workload(eng, args.requests, args.new_tokens, args.seed)
    runs = [timed(eng, prompts, params) for _ in range(args.reps)]
    best = sorted(runs, key=lambda r: r["host_ms_per_round"])[len(runs) // 2]
    for k, v in best.items():
        print(f"{k:18s} {v:.3f}" if isinstance(v, float) else f"{k:18s} {v}")
    for key in ("host_ms_per_round", "wall_s"):
        vals = [round(r[key], 3) for r in runs]
        print(f"{key} over runs: {vals} (median {statistics.median(vals):.3f})")
    if args.json:
        write_json(args.json, dict(args=vars(args), machine=machine(), runs=runs, median=best))


if __name__ == "__main__":
    main()
