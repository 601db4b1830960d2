#!/usr/bin/env python3
"""Data parallelism under load: N replicas behind vllm-router vs one replica, the same requests.

Systems (--systems, comma-separated):
  direct  one scripts/serve.py, requests straight to it;
  dpN     `jpa serve-dp --dp N` (N replicas behind vllm-router, --policy), requests to the router.
Each system is started, measured and stopped before the next (they never run at the same time).

The request set is benchmarks/bench_serving.py's (ShareGPT-shaped log-normal prompt and output
lengths, random ordinary token ids, greedy with ignore_eos, streamed /v1/completions), sent as
Poisson arrivals at each of --rates (`inf`: all at once, a closed burst), identical for every
system (same seeds). Per system and rate: requests/s, output tokens/s, TTFT and TPOT p50/p90/p99,
and how many requests each replica served (from its /metrics). Every replica compiles its one
program before it reports healthy, so no compilation falls inside a measurement (checked: the
compilation counters of every replica are recorded before and after).

On a CPU the replicas share the machine's cores (and XLA's thread pools compete for them), so two
replicas are not expected to serve twice as fast as one: this run shows that the router and the
replicas work under load and what the extra hop costs, not a scaling figure. On a GPU machine give
each replica its own GPUs (`jpa serve-dp --devices-per-replica`).

    .venv/bin/python benchmarks/bench_dp.py                           # tiny-llama: direct vs dp2
    .venv/bin/python benchmarks/bench_dp.py --model smollm2-135m --rates 1,inf --num-prompts 32

Results: benchmarks/dp_router.json.
"""

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import bench_serving  # a sibling script: Python puts this directory first when it runs a script
from jpa.cli import serve_dp

CPU_NOTE = ("measured on a CPU: every replica runs on the same cores, so N replicas share one machine's compute "
            "and no N-fold speed-up is expected; the figures show the router path works under load and its cost")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="model preset / served model name (default tiny-llama)")
    ap.add_argument("--systems", default="direct,dp2", help="what to measure: direct and/or dpN (default direct,dp2)")
    ap.add_argument("--policy", default="cache_aware", choices=serve_dp.POLICIES, help="the router's policy")
    ap.add_argument("--rates", default="8,inf", help="request rates (req/s; inf: all at once), comma-separated")
    bench_serving.add_workload_args(ap)
    ap.set_defaults(num_prompts=64)
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds a system may take to start")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "dp_router.json"))
    args = ap.parse_args(argv)
    try:
        args.rate_list = [float(x) for x in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates must be numbers or inf; got {args.rates!r}")
    args.system_list = args.systems.split(",")
    if any(r <= 0 for r in args.rate_list) or args.num_prompts < 1:
        ap.error("rates must be > 0 and --num-prompts >= 1")
    for s in args.system_list:
        if not (s == "direct" or re.fullmatch(r"dp[1-9]\d*", s)):
            ap.error(f"--systems: {s!r} is neither 'direct' nor dpN (N >= 1)")
    return args


def _replica_counts(replicas: list[str]) -> list[dict]:
    return [{"requests": serve_dp.metric(u, "jpa_requests_total"),
             "compilations": serve_dp.metric(u, "jpa_compilations_total")} for u in replicas]


def _rate(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate


def measure(args, system: str, url: str, replicas: list[str]) -> dict:
    """Runs every rate against url; replicas: the servers behind it (their /metrics)."""
    rows = []
    for i, rate in enumerate(args.rate_list):
        before = _replica_counts(replicas)
        r = asyncio.run(bench_serving.run_rate(url, args, rate, args.seed + i))
        after = _replica_counts(replicas)
        r["requests_per_replica"] = [a["requests"] - b["requests"] for a, b in zip(after, before)]
        r["compilations_during_run"] = sum(a["compilations"] - b["compilations"] for a, b in zip(after, before))
        r["rate"] = _rate(rate)   # JSON has no infinity
        rows.append(r)
        print(f"[bench] {system} rate {rate:g}: {r['completed']}/{r['requests']} ok in {r['duration_s']:.1f} s | "
              f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} out tok/s | TTFT p50 "
              f"{r['ttft_ms']['p50']:.0f} p90 {r['ttft_ms']['p90']:.0f} ms | TPOT p50 {r['tpot_ms']['p50']:.0f} ms | "
              f"per replica {[int(n) for n in r['requests_per_replica']]} | compilations "
              f"{r['compilations_during_run']:g}", file=sys.stderr)
    return {"system": system, "replicas": len(replicas), "router": None if system == "direct" else
            {"policy": args.policy, "package": "vllm-router 0.1.17"}, "results": rows}


def run_system(args, system: str, log_dir: str) -> dict:
    log = os.path.join(log_dir, f"{system}.log")
    t = time.monotonic()
    if system == "direct":
        proc, url = bench_serving.start_server(args, log)
        try:
            serve_dp.wait_healthy(url, timeout=args.ready_timeout, what="jpa serve")
            print(f"[bench] direct: {url} ready after {time.monotonic() - t:.0f} s (log: {log})", file=sys.stderr)
            return measure(args, system, url, [url])
        finally:
            serve_dp.stop([proc], grace=60)
    proc = serve_dp.start(["--dp", system[2:], "--port", "0", "--router-port", "0", "--policy", args.policy,
                           "--ready-timeout", str(args.ready_timeout), *bench_serving.serve_flags(args)],
                          log_path=log, env=bench_serving.server_env())
    try:
        url, replicas = serve_dp.wait_started(proc, log, args.ready_timeout)
        print(f"[bench] {system}: router {url} -> {replicas} ready after {time.monotonic() - t:.0f} s (log: {log})",
              file=sys.stderr)
        return measure(args, system, url, replicas)
    finally:
        serve_dp.stop_group(proc)


def table(systems: list[dict]) -> str:
    # rates are floats or "inf"; the table writes 8 for 8.0
    fmt = lambda rate: rate if isinstance(rate, str) else f"{rate:g}"
    lines = ["| system | rate (req/s) | requests/s | output tok/s | TTFT p50 / p90 (ms) | TPOT p50 (ms) | "
             "requests per replica |", "|---|---|---|---|---|---|---|"]
    for s in systems:
        for r in s["results"]:
            lines.append(f"| {s['system']} | {fmt(r['rate'])} | {r['request_throughput']:.2f} | "
                         f"{r['output_throughput']:.0f} | {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p90']:.0f} | "
                         f"{r['tpot_ms']['p50']:.0f} | {' + '.join(str(int(n)) for n in r['requests_per_replica'])} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    from jpa.tools.bench import machine, write_json

    log_dir = tempfile.mkdtemp(prefix="jpa-bench-dp-")
    systems = [run_system(args, s, log_dir) for s in args.system_list]
    print(table(systems))
    print(f"note: {CPU_NOTE}")
    write_json(args.out, {
        "benchmark": "data parallelism: replicas behind vllm-router vs one replica (Poisson arrivals, streaming "
                     "/v1/completions)", "machine": machine(), "note": CPU_NOTE,
        "command": "benchmarks/bench_dp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "server": {"max_seqs": args.max_seqs, "steps_per_call": args.steps_per_call,
                   "max_model_len": args.max_model_len},
        "workload": {"num_prompts_per_rate": args.num_prompts, "rates": [_rate(r) for r in args.rate_list],
                     "input_mean": args.input_mean,
                     "output_mean": args.output_mean, "max_input": args.max_input, "max_output": args.max_output,
                     "sigma": 1.0, "seed": args.seed, "sampling": "greedy, ignore_eos"},
        "systems": systems})
    failed = sum(r["failed"] for s in systems for r in s["results"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
