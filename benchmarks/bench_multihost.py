#!/usr/bin/env python3
"""Benchmark: what running one engine over several processes costs on this machine.

The same requests (greedy, fixed length, EOS ignored) through `generate.py --json` three ways, all
over 4 simulated CPU devices:

- `1 process, tp=4`: one process with 4 devices (the reference);
- `2 processes, tp=4`: two processes with 2 devices each, joined by `--coordinator` (process 0
  sends each device call to process 1; the collectives go over Gloo on loopback instead of
  within one process);
- and `1 process, tp=1` for scale (the model on one device).

Reported per run: decode tokens/s and host overhead from process 0's summary, the wall time of
the generate call, and whether every request's tokens equal the 1-process tp=4 run's (they must).
On a 2-core machine the two processes share the same cores: the ratio measures the lockstep
machinery and the cross-process collectives, not what two hosts would do.

    .venv/bin/python benchmarks/bench_multihost.py                     # tiny-llama, 16 requests
    .venv/bin/python benchmarks/bench_multihost.py --model smollm2-135m --requests 8
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # this process only reads the machine's description

from jpa.testing.procs import cpu_env, free_port
from jpa.tools.bench import machine, write_json


def run(name: str, processes: int, devices: int, tp: int, common: list, timeout: float) -> dict:
    """One configuration: process 0's records and summary, and the wall time of the whole job."""
    coord = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", str(processes)] if processes > 1 else []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(processes):
            argv = [sys.executable, "-m", "jpa", "generate", *common, "--tp", str(tp), *coord,
                    *(["--process-id", str(i)] if processes > 1 else [])]
            procs.append(subprocess.Popen(argv, stdout=open(f"{tmp}/out{i}", "w"), stderr=open(f"{tmp}/err{i}", "w"),
                                          stdin=subprocess.DEVNULL, env=cpu_env(devices), start_new_session=True))
        t0 = time.perf_counter()
        try:
            rcs = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        wall = time.perf_counter() - t0
        if rcs != [0] * processes:
            raise SystemExit(f"{name}: exit codes {rcs}\n{pathlib.Path(f'{tmp}/err0').read_text()[-2000:]}")
        *recs, summary = [json.loads(line) for line in pathlib.Path(f"{tmp}/out0").read_text().splitlines()]
    s = summary["summary"]
    return {"system": name, "processes": processes, "devices_per_process": devices, "tp": tp,
            "decode_tokens": s["decode_tokens"], "decode_tok_s": round(s["decode_tok_s"], 2),
            "host_overhead": round(s["host_overhead"], 4), "compile_s": round(s["compile_seconds"], 2),
            "job_wall_s": round(wall, 2), "peak_pages_used": s["peak_pages_used"],
            "token_ids": [r["token_ids"] for r in recs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    ap.add_argument("--out", default="benchmarks/multihost.json")
    args = ap.parse_args(argv)
    words = "river stone cloud lamp seven green quiet north paper salt".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(3 + i % 5)) for i in range(args.requests)]
    common = ["--model", args.model, "--json", "--no-progress", "--no-compile-cache", "--greedy",
              "--max-new-tokens", str(args.max_new), "--max-seqs", str(min(args.requests, 16)),
              "--kv-memory", "64", *prompts]
    rows = [run("1 process, tp=4", 1, 4, 4, common, args.timeout),
            run("2 processes, tp=4", 2, 2, 4, common, args.timeout),
            run("1 process, tp=1", 1, 1, 1, common, args.timeout)]
    ref = rows[0]
    print("| system | decode tok/s | vs 1 process tp=4 | host overhead | job wall s | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["vs_one_process"] = round(r["decode_tok_s"] / ref["decode_tok_s"], 3)
        r["same_tokens"] = r["token_ids"] == ref["token_ids"]
        print(f"| {r['system']} | {r['decode_tok_s']:.1f} | {r['vs_one_process']:.2f}x | "
              f"{100 * r['host_overhead']:.1f}% | {r['job_wall_s']:.1f} | {r['same_tokens']} |")
    for r in rows:
        del r["token_ids"]
    write_json(args.out, {"machine": machine(), "model": args.model, "requests": args.requests,
                          "max_new": args.max_new, "rows": rows,
                          "note": "2 processes share this machine's cores; the ratio is the cost of lockstep "
                                  "messages and cross-process collectives on loopback, not a 2-host figure"})
    return 0 if all(r["same_tokens"] for r in rows[:2]) else 1


if __name__ == "__main__":
    sys.exit(main())
