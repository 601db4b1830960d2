#!/usr/bin/env python3
"""Benchmark: automatic prefix caching on a chat workload with one shared system prompt.

Model: SmolLM2-135M-Instruct (float32, the real weights) on this machine (`--model tiny-llama`:
the random tiny model and its byte tokenizer, for the test). Workload: `--num-requests` chat
requests (ChatML template) that share one system prompt of about `--system-tokens` tokens (by the
model's tokenizer: a fixed support-policy document, jpa.tools.bench.POLICY, cut at a word boundary) and
each ask a distinct user question (jpa.tools.bench.PROMPTS and
examples/prompts32.jsonl; past those, numbered variants). Greedy, ignore_eos, exactly
`--max-new` tokens each, so both runs generate the same number of tokens.

Systems: two LLMEngines built on the same weights with the same EngineConfig (max_seqs 16, the
default token budget 512, chunked prefill) except `prefix_caching` True ("on") vs False ("off").
The pool holds max_seqs whole sequences (`num_pages = max_seqs * pages_per_seq`), so neither run
is short of pages: the difference measured is the prefill compute saved, not extra batching room.

What is timed: each engine first runs a warm-up of a few requests of the same shape (this
compiles the unified step; compile seconds are reported apart), then the prefix cache is flushed
so the measured "on" run starts cold (its first requests miss and fill the cache). The measured
run adds every request at t0 (all arrive at once) and calls `engine.step()` until all finish;
time to first token is perf_counter() when step() returns a request's first token, minus t0
(queueing included). Throughput = generated tokens (or requests) / wall time of the run.
Prefill tokens = prompt tokens the engine actually computed (cache hits excluded). The greedy
token ids of "on" and "off" are compared request by request.

    .venv/bin/python benchmarks/bench_prefix.py                 # 64 requests, ~600-token system prompt
    .venv/bin/python benchmarks/bench_prefix.py --quick         # ~1 min smoke run

Targets (issue 14): >= 80% fewer prefill tokens and >= 2x end-to-end throughput with caching on.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from jpa import models  # noqa: E402
from jpa.engine import EngineConfig, EngineStats, LLMEngine, SamplingParams  # noqa: E402
from jpa.tools.bench import PROMPTS, build_system_prompt, distinct_questions, machine, write_json

TARGETS = {"prefill_reduction": 0.80, "throughput_ratio": 2.0}

def questions(n: int) -> list[str]:
    """n distinct user questions: jpa.tools.bench.PROMPTS, then examples/prompts32.jsonl, then
    numbered variants of those."""
    with open(os.path.join(ROOT, "examples", "prompts32.jsonl")) as f:
        extra = [json.loads(line)["prompt"] for line in f if line.strip()]
    return distinct_questions(n, list(PROMPTS) + extra)


def run(eng: LLMEngine, prompt_ids, params) -> tuple[list[list[int]], dict]:
    """All requests added at t0, then step() until every one finished. Returns the greedy ids
    (submission order) and the run's figures."""
    prefix = eng.scheduler.prefix
    h0, q0 = (prefix.hit_tokens, prefix.query_tokens) if prefix else (0, 0)
    c0, n0 = eng.runner.compile_seconds, eng.runner.compiles
    eng.stats = EngineStats()
    t0 = time.perf_counter()
    ids = [eng.add_request(p, sp).request_id for p, sp in zip(prompt_ids, params)]
    first, done, rounds, peak_live = {}, {}, 0, 0
    sch = eng.scheduler
    while len(done) < len(ids):
        outs = eng.step()
        now = time.perf_counter()
        rounds += 1
        # Pages running requests hold (shared ones once), between rounds: the pool's used pages
        # minus cached-idle ones (which the engine's peak_pages_used counts, as they are not free).
        idle = prefix.num_idle(sch.held_cached_pages()) if prefix else 0
        peak_live = max(peak_live, eng.num_pages - sch.free_pages - idle)
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now - t0
            if o.finished:
                if o.output.error:
                    raise RuntimeError(f"request {o.request_id} failed: {o.output.error}")
                done[o.request_id] = o.output
    wall = time.perf_counter() - t0
    s = eng.summary()
    ttft = np.array([first[i] for i in ids])
    out_ids = [list(done[i].token_ids) for i in ids]
    gen = sum(map(len, out_ids))
    hits = (prefix.hit_tokens - h0) if prefix else 0
    queried = (prefix.query_tokens - q0) if prefix else sum(map(len, prompt_ids))
    return out_ids, dict(
        wall_seconds=wall, generated_tokens=gen, tok_s=gen / wall, req_s=len(ids) / wall,
        prompt_tokens=sum(map(len, prompt_ids)), prefill_tokens=s["prefill_tokens"],
        prefix_hit_tokens=hits, prefix_hit_rate=hits / queried if queried else float("nan"),
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
        ttft_mean_s=float(ttft.mean()), ttft_s=[float(t) for t in ttft],
        peak_pages_used=s["peak_pages_used"], peak_pages_held_between_rounds=peak_live,
        peak_shared_pages=s["peak_shared_pages"],
        cached_pages_after=s["cached_pages"], preemptions=s["preemptions"], rounds=rounds,
        decode_steps=s["decode_steps"], compile_seconds_in_run=eng.runner.compile_seconds - c0,
        compiles_in_run=eng.runner.compiles - n0)


def compare(ref, other) -> list:
    """Per-request first differing token index (None = identical)."""
    res = []
    for a, b in zip(ref, other):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        res.append(min(len(a), len(b)) if n is None and len(a) != len(b) else n)
    return res


def plot(results, path, title):
    """Bars of prefill tokens and throughput (on vs off), and the TTFT CDFs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, colors = ["off", "on"], ["C7", "C0"]
    labels = ["caching off", "caching on"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, key, ylabel, fmt in ((axes[0], "prefill_tokens", "prompt tokens computed", "%d"),
                                 (axes[1], "tok_s", "generated tokens / s (end to end)", "%.1f")):
        vals = [results[n][key] for n in names]
        bars = ax.bar(labels, vals, color=colors)
        ax.bar_label(bars, fmt=fmt)
        ax.set_ylim(0, 1.15 * max(vals))
        ax.set_ylabel(ylabel)
    ax = axes[2]
    for n, c, label in zip(names, colors, labels):
        t = np.sort(results[n]["ttft_s"])
        ax.step(t, np.arange(1, len(t) + 1) / len(t), where="post", color=c, label=label)
    ax.set_xlabel("time to first token (s)")
    ax.set_title("TTFT CDF (all requests arrive at t0)", fontsize=9)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (real weights) or tiny-llama (random)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=600, help="shared system prompt length (tokens)")
    ap.add_argument("--max-new", type=int, default=32, help="tokens generated per request (ignore_eos)")
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 256-token system prompt, "
                    "8 new tokens (unless given explicitly)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "prefix.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "prefix.png"), help="'' = no plot")
    args = ap.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        for flag, value in (("--num-requests", 16), ("--system-tokens", 256), ("--max-new", 8)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    for name in ("num_requests", "system_tokens", "max_new", "max_seqs", "page_size", "warmup_requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    import jax.numpy as jnp
    model, tok = models.load(args.model, dtype=jnp.float32)
    system = build_system_prompt(tok, args.system_tokens)
    qs = questions(args.num_requests + args.warmup_requests)
    prompt_ids = [tok.encode(tok.apply_chat_template(q, system=system)) for q in qs[:args.num_requests]]
    # Warm-up requests: the same system prompt, questions the measured run does not ask.
    warm_ids = [tok.encode(tok.apply_chat_template(q, system=system)) for q in qs[args.num_requests:]]
    shared = next(j for j, (a, b) in enumerate(zip(prompt_ids[0], prompt_ids[-1])) if a != b) \
        if len(prompt_ids) > 1 else len(prompt_ids[0])
    params = SamplingParams(max_new_tokens=args.max_new, greedy=True, ignore_eos=True)
    longest = max(map(len, prompt_ids + warm_ids)) + args.max_new
    max_model_len = -(-longest // args.page_size) * args.page_size
    cfg = dict(max_seqs=args.max_seqs, page_size=args.page_size, max_model_len=max_model_len,
               num_pages=args.max_seqs * (max_model_len // args.page_size),
               max_num_batched_tokens=args.max_num_batched_tokens)
    lens = list(map(len, prompt_ids))
    print(f"{args.model}: {args.num_requests} requests, system prompt {len(tok.encode(system))} tokens, "
          f"prompts {min(lens)}..{max(lens)} tokens ({shared} shared), max_new {args.max_new}, {cfg}",
          file=sys.stderr)

    gpt = models.GPTForEngine(model)
    engines = {name: LLMEngine(gpt, tok, EngineConfig(prefix_caching=(name == "on"), **cfg)) for name in ("off", "on")}
    warm = {}
    for name, eng in engines.items():
        t = time.perf_counter()
        _, warm[name] = run(eng, warm_ids, [params] * len(warm_ids))
        flushed = eng.flush_prefix_cache()
        warm[name].update(warmup_seconds=time.perf_counter() - t, compile_seconds=eng.runner.compile_seconds,
                          flushed_pages=flushed, pool_whole_after_flush=eng.pool_is_whole())
        print(f"warm-up {name}: {warm[name]['warmup_seconds']:.1f}s (compile {eng.runner.compile_seconds:.1f}s), "
              f"flushed {flushed} cached pages", file=sys.stderr)

    outputs, results = {}, {}
    for name in ("off", "on"):
        eng = engines[name]
        outputs[name], results[name] = run(eng, prompt_ids, [params] * len(prompt_ids))
        r = results[name]
        r["flushed_pages_after"] = eng.flush_prefix_cache()
        r["pool_whole_after_flush"] = eng.pool_is_whole()
        print(f"{name}: {r['wall_seconds']:.1f}s, {r['prefill_tokens']} prefill tokens, "
              f"compiles in run {r['compiles_in_run']}", file=sys.stderr)

    first = compare(outputs["off"], outputs["on"])
    bad = [(i, n) for i, n in enumerate(first) if n is not None]
    equality = dict(identical_requests=len(first) - len(bad), requests=len(first),
                    mismatches=[dict(request=i, first_diff_token=n, question=qs[i]) for i, n in bad])
    off, on = results["off"], results["on"]
    ratios = dict(prefill_reduction=1 - on["prefill_tokens"] / off["prefill_tokens"],
                  throughput_ratio=on["tok_s"] / off["tok_s"],
                  ttft_p50_ratio=off["ttft_p50_s"] / on["ttft_p50_s"],
                  ttft_p99_ratio=off["ttft_p99_s"] / on["ttft_p99_s"])
    targets = {k: dict(target=t, value=ratios[k], met=ratios[k] >= t) for k, t in TARGETS.items()}

    mach = machine()
    try:
        git = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()
        mach["git_commit"] = git("rev-parse", "HEAD")
        mach["jpa_models_uncommitted_changes"] = bool(git("status", "--porcelain", "--", "jpa", "models"))
    except OSError:
        pass
    mach["load_average_before"] = load_before
    mach["load_average_after"] = os.getloadavg()
    report = dict(
        machine=mach, model=args.model + (" (SmolLM2-135M-Instruct, float32)" if args.model == "smollm2-135m"
                                          else " (random init, float32)"),
        workload=dict(num_requests=args.num_requests, system_prompt_tokens=len(tok.encode(system)),
                      shared_prefix_tokens=shared, prompt_tokens=lens, max_new_tokens=args.max_new,
                      greedy=True, ignore_eos=True, arrivals="all at t0", questions=qs[:args.num_requests],
                      system_prompt=system, warmup_requests=args.warmup_requests, quick=args.quick),
        engine_config=dict(cfg, prefix_caching={"off": False, "on": True}),
        timing=("wall time from adding all requests to the last one finishing, after a warm-up run of "
                f"{args.warmup_requests} requests per engine (compiles; the prefix cache is flushed after it, "
                "so the 'on' run starts cold); TTFT = step() return with the first token - t0 (queueing "
                "included)"),
        warmup=warm, results=results, ratios=ratios, targets=targets, output_equality=equality,
        total_benchmark_seconds=time.perf_counter() - t_start, command=" ".join(["benchmarks/bench_prefix.py"] +
                                                                               (argv if argv is not None else sys.argv[1:])))

    print(f"\nmachine: {mach['platform']}, {mach['cpu_count']} CPUs, jax {mach['jax_version']}, {mach['device']}, "
          f"load average {load_before[0]:.2f} before / {mach['load_average_after'][0]:.2f} after")
    print(f"model: {report['model']}; {args.num_requests} requests, system prompt "
          f"{report['workload']['system_prompt_tokens']} tokens ({shared} prompt tokens shared), prompts "
          f"{min(lens)}..{max(lens)} tokens, {args.max_new} new tokens each (greedy, ignore_eos), max_seqs "
          f"{args.max_seqs}, budget {args.max_num_batched_tokens}, page_size {args.page_size}, "
          f"{cfg['num_pages']} pages\n")
    print("| caching | prefill tokens | hit rate | wall s | gen tok/s | req/s | TTFT p50 s | TTFT p99 s "
          "| peak pages used | peak pages held | peak shared | compiles in run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("off", "on"):
        r = results[name]
        print(f"| {name} | {r['prefill_tokens']} | {r['prefix_hit_rate']:.1%} | {r['wall_seconds']:.2f} | "
              f"{r['tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
              f"{r['peak_pages_used']} | {r['peak_pages_held_between_rounds']} | {r['peak_shared_pages']} | {r['compiles_in_run']} |")
    print(f"\ncompile seconds (warm-up, not in the wall times): off {warm['off']['compile_seconds']:.1f}, "
          f"on {warm['on']['compile_seconds']:.1f}")
    print(f"target prefill tokens >= {TARGETS['prefill_reduction']:.0%} fewer: "
          f"{ratios['prefill_reduction']:.1%} fewer -> {'PASS' if targets['prefill_reduction']['met'] else 'MISS'}")
    print(f"target end-to-end throughput >= {TARGETS['throughput_ratio']:.0f}x: "
          f"{ratios['throughput_ratio']:.2f}x -> {'PASS' if targets['throughput_ratio']['met'] else 'MISS'}")
    print(f"greedy outputs on vs off: {equality['identical_requests']}/{equality['requests']} requests identical"
          + "".join(f"; request {i} differs from token {n}" for i, n in bad))
    print(f"pool whole after flush: off {off['pool_whole_after_flush']}, on {on['pool_whole_after_flush']}")

    if args.out:
        write_json(args.out, report)
    if args.plot:
        plot(results, args.plot, f"{report['model']}: {args.num_requests} requests sharing a "
                                 f"{report['workload']['system_prompt_tokens']}-token system prompt, "
                                 f"{args.max_new} new tokens each; {mach['cpu_count']} CPUs, jax {mach['jax_version']}")
    print(f"total {time.perf_counter() - t_start:.0f}s", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
