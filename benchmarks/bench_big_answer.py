#!/usr/bin/env python3
"""How one big completions answer affects the server (issue 50's first probe): /health latency and the
server's resident memory while it is served.

Starts `jpa serve --model tiny-llama` on a free loopback port (or uses --url and --pid), sends one
warm-up request (n 1: compiles, fills the prefix cache), then the probe: a prompt of --prompt-tokens
random token ids with `echo`, `logprobs` 20, `prompt_logprobs` 20, `max_tokens` 1 and `n` --n, while a
thread GETs /health every 20 ms. Prints, as JSON: the answer's status and size, its wall time, the
worst /health latency during it and the server's peak resident memory over its level before the probe
(VmRSS from /proc, sampled with each /health).

    .venv/bin/python benchmarks/bench_big_answer.py --n 8 --prompt-tokens 1500
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def start_server(max_model_len: int):
    proc = subprocess.Popen([sys.executable, "-m", "jpa", "serve", "--model", "tiny-llama", "--port", "0",
                             "--max-model-len", str(max_model_len), "--max-seqs", "16"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()   # keep draining its log
            return proc, m.group(1)
    raise RuntimeError("jpa serve did not start")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start `jpa serve --model tiny-llama`)")
    ap.add_argument("--pid", type=int, default=None, help="its process id (with --url), for its memory")
    ap.add_argument("--model", default="tiny-llama", help="the served model name (with --url)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = start_server(args.prompt_tokens + 64)
        pid = proc.pid
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 600:
                raise RuntimeError("the server never became ready")
            time.sleep(0.5)
        rng = random.Random(args.seed)
        body = {"model": args.model, "prompt": [rng.randrange(32, 127) for _ in range(args.prompt_tokens)],
                "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 1, "n": 1}
        warm = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        warm.raise_for_status()
        worst, peak, stop = [0.0], [0.0], threading.Event()
        base = rss_mib(pid) if pid else 0.0

        def poll():
            while not stop.is_set():
                t = time.perf_counter()
                httpx.get(f"{url}/health", timeout=120)
                worst[0] = max(worst[0], time.perf_counter() - t)
                if pid:
                    peak[0] = max(peak[0], rss_mib(pid))
                time.sleep(0.02)

        th = threading.Thread(target=poll)
        th.start()
        t = time.perf_counter()
        try:
            r = httpx.post(f"{url}/v1/completions", json={**body, "n": args.n}, timeout=600)
            wall = time.perf_counter() - t
        finally:
            stop.set()
            th.join()
        print(json.dumps({"n": args.n, "prompt_tokens": args.prompt_tokens, "status": r.status_code,
                          "answer_mb": round(len(r.content) / 1e6, 2), "seconds": round(wall, 2),
                          "worst_health_s": round(worst[0], 3),
                          "server_rss_growth_mib": round(peak[0] - base, 1) if pid else None,
                          "error": r.json()["error"]["message"][:200] if r.status_code != 200 else None}))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
