#!/usr/bin/env python3
"""Serving benchmark (after vLLM's benchmark_serving): Poisson arrivals against the OpenAI API.

For each request rate, `--num-prompts` requests arrive as a Poisson process (exponential gaps,
seeded) and stream `/v1/completions` with their own prompt and output lengths. Lengths follow
ShareGPT's shape as in benchmarks/bench_memory.py (log-normal, sigma 1.0, mean solved after
clipping), scaled down to what a CPU serves in minutes: input mean 128 tokens (clipped to
[4, 512]), output mean 64 (clipped to [4, 256]). Prompts are random ordinary token ids (the
API takes token-id prompts, so lengths are exact); outputs are greedy with ignore_eos, so each
request makes exactly its output length.

Per rate it reports, as vLLM does:
  - request throughput, output and total token throughput (over the rate's wall time);
  - TTFT (arrival -> first token), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (gaps
    between streamed chunks; one chunk carries one engine round, i.e. up to --steps-per-call
    tokens), end-to-end latency: mean, p50, p90, p99 in ms;
  - goodput: requests per second that met both SLOs (--slo-ttft-ms, --slo-tpot-ms).

Without --url it starts `jpa serve` itself on a free loopback port (and stops it). Before
measuring it compiles every prefill shape the run can meet (n parallel copies of a prompt of each
width bucket arrive in one round), so no compilation lands inside a measurement.

    .venv/bin/python benchmarks/bench_serving.py                 # SmolLM2, rates 0.25,0.5,1,2 req/s
    .venv/bin/python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model smollm2-135m

Results: benchmarks/serving.json and a plot of latency vs request rate (benchmarks/serving.png).
"""

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def token_range(model: str) -> tuple[int, int]:
    """Prompt token ids to draw from: ordinary SmolLM2 tokens (no control tokens), printable bytes
    for the tiny byte-level presets."""
    return (32, 127) if model.startswith("tiny") else (1000, 40000)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start `jpa serve`)")
    ap.add_argument("--model", default="smollm2-135m", help="model preset / served model name")
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="request rates (req/s), comma-separated")
    add_workload_args(ap)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "serving.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "serving.png"))
    ap.add_argument("--no-warmup", action="store_true")
    return ap.parse_args(argv)


def add_workload_args(ap):
    """The request set's flags and the settings of the servers this script starts (shared with bench_dp.py)."""
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    ap.add_argument("--input-mean", type=float, default=128)
    ap.add_argument("--output-mean", type=float, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000, help="goodput SLO on time to first token")
    ap.add_argument("--slo-tpot-ms", type=float, default=250, help="goodput SLO on time per output token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--steps-per-call", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)


# ---------------------------------------------------------------------- workload

def lengths(rng, n, mean, hi, sigma=1.0, lo=4):
    """Rounded log-normal lengths clipped to [lo, hi], mu solved so the clipped sample mean is `mean`."""
    z = rng.standard_normal(n)
    mu = math.log(mean) - sigma ** 2 / 2
    f = lambda mu: np.clip(np.rint(np.exp(mu + sigma * z)), lo, hi)
    for _ in range(50):
        mu += math.log(mean / f(mu).mean())
    return f(mu).astype(int)


def workload(args, rate: float, seed: int):
    """[(arrival offset s, prompt token ids, output length)] for one rate."""
    rng = np.random.default_rng(seed)
    n = args.num_prompts
    inp = lengths(rng, n, args.input_mean, args.max_input)
    out = lengths(rng, n, args.output_mean, args.max_output)
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    lo, hi = token_range(args.model)
    return [(float(t), rng.integers(lo, hi, int(i)).tolist(), int(o)) for t, i, o in zip(arrivals, inp, out)]


# ---------------------------------------------------------------------- client

async def one_request(client, model, prompt, max_tokens, start_at, t0):
    """Streams one completion; returns its timings (monotonic seconds since t0) or an error."""
    await asyncio.sleep(max(0.0, t0 + start_at - time.monotonic()))
    sent = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    chunks = []   # (time, tokens in the chunk)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return {"ok": False, "error": obj["error"]["message"]}
                lp = obj["choices"][0]["logprobs"] if obj["choices"] else None
                k = len(lp["tokens"]) if lp else 0
                if k:
                    chunks.append((time.monotonic(), k))
    except Exception as e:  # a failed request is counted, not fatal
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    done = time.monotonic()
    if not chunks:
        return {"ok": False, "error": "no tokens"}
    n_out = sum(k for _, k in chunks)
    ttft = chunks[0][0] - sent
    latency = done - sent
    return {"ok": True, "prompt_tokens": len(prompt), "output_tokens": n_out, "ttft": ttft, "latency": latency,
            "tpot": (latency - ttft) / (n_out - 1) if n_out > 1 else None,
            "itl": [b[0] - a[0] for a, b in zip(chunks, chunks[1:])], "sent": sent - t0, "done": done - t0}


def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")


def summarize(results, args, rate, wall):
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    lat = [r["latency"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    good = [r for r in ok if r["ttft"] * 1e3 <= args.slo_ttft_ms and (r["tpot"] or 0) * 1e3 <= args.slo_tpot_ms]
    stats = lambda xs: {"mean": float(np.mean(xs)) * 1e3 if xs else float("nan"), "p50": pct(xs, 50),
                        "p90": pct(xs, 90), "p99": pct(xs, 99)}
    return {
        "rate": rate, "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "duration_s": wall, "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "total_token_throughput": (in_tokens + out_tokens) / wall, "input_tokens": in_tokens,
        "output_tokens": out_tokens, "goodput": len(good) / wall, "good_requests": len(good),
        "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl), "e2e_ms": stats(lat),
    }


async def run_rate(url, args, rate, seed):
    import httpx

    work = workload(args, rate, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.monotonic() + 0.05
        results = await asyncio.gather(*(one_request(client, args.model, p, o, t, t0) for t, p, o in work))
    wall = max(r["done"] for r in results if r["ok"]) if any(r["ok"] for r in results) else float("nan")
    return summarize(results, args, rate, wall)


async def warmup(url, args):
    """Compiles the engine's one program (the unified step) with a first request."""
    import httpx

    lo, _ = token_range(args.model)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        r = await client.post("/v1/completions", json={"model": args.model, "prompt": [lo + i for i in range(16)],
                                                       "max_tokens": 2, "temperature": 0})
        r.raise_for_status()


# ---------------------------------------------------------------------- server

def serve_flags(args) -> list[str]:
    """`jpa serve`'s flags for the server settings in args."""
    return ["--model", args.model, "--max-seqs", str(args.max_seqs), "--steps-per-call", str(args.steps_per_call),
            "--max-model-len", str(args.max_model_len), "--max-n", str(max(args.max_seqs, 1))]


def server_env() -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def start_server(args, log_path):
    cmd = [sys.executable, "-m", "jpa", "serve", *serve_flags(args), "--port", "0"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stderr=log, stdout=log, env=server_env())
    t0 = time.monotonic()
    while True:
        m = re.search(r"serving '[^']+' on (http://\S+)", open(log_path).read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            proc.kill()
            raise SystemExit(f"bench_serving.py: the server did not start; its log:\n{open(log_path).read()[-3000:]}")
        time.sleep(0.2)


def server_line(url):
    import httpx

    text = httpx.get(f"{url}/metrics").text
    vals = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {k: float(vals[k]) for k in ("jpa_kv_pool_whole", "jpa_num_requests_running", "jpa_kv_pages_total",
                                        "jpa_compilations_total", "jpa_compile_seconds_total") if k in vals}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"),
                           (axes[1], "tpot_ms", "time per output token (ITL: gap between chunks)")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(rates, [r[key][q] for r in results], style, label=q if key == "ttft_ms" else f"TPOT {q}")
        if key == "tpot_ms":
            for q, style in (("p50", "o-"), ("p99", "^:")):
                ax.plot(rates, [r["itl_ms"][q] for r in results], style, color="C3" if q == "p50" else "C4",
                        alpha=0.7, label=f"ITL {q}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="lower right" if key == "tpot_ms" else "upper left")
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    ax.plot(rates, [r["output_throughput"] for r in results], "o-", label="output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(rates, [r["request_throughput"] for r in results], "s--", color="C1", label="requests/s")
    ax2.plot(rates, [r["goodput"] for r in results], "^:", color="C2", label="goodput (req/s)")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax2.set_ylabel("req/s")
    ax.set_title("throughput")
    lines = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="upper left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    if any(r <= 0 for r in rates) or args.num_prompts < 1:
        print("bench_serving.py: error: rates must be > 0 and --num-prompts >= 1", file=sys.stderr)
        return 2
    proc, log_path = None, None
    url = args.url
    try:
        if url is None:
            log_path = os.path.join(tempfile.mkdtemp(prefix="jpa-bench-serving-"), "server.log")
            print(f"[bench] starting jpa serve --model {args.model} (log: {log_path})", file=sys.stderr)
            t = time.monotonic()
            proc, url = start_server(args, log_path)
            print(f"[bench] server up at {url} after {time.monotonic() - t:.0f} s", file=sys.stderr)
        if not args.no_warmup:
            t = time.monotonic()
            asyncio.run(warmup(url, args))
            print(f"[bench] warm-up (every prefill bucket compiled) took {time.monotonic() - t:.0f} s", file=sys.stderr)
        results = []
        for i, rate in enumerate(rates):
            before = server_line(url)
            r = asyncio.run(run_rate(url, args, rate, args.seed + i))
            r["compilations_during_run"] = server_line(url).get("jpa_compilations_total", 0) - \
                before.get("jpa_compilations_total", 0)
            results.append(r)
            print(f"[bench] rate {rate:g} req/s: {r['completed']}/{r['requests']} ok in {r['duration_s']:.1f} s | "
                  f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} out tok/s | TTFT p50 "
                  f"{r['ttft_ms']['p50']:.0f} p99 {r['ttft_ms']['p99']:.0f} ms | TPOT p50 {r['tpot_ms']['p50']:.0f} "
                  f"p99 {r['tpot_ms']['p99']:.0f} ms | ITL p50 {r['itl_ms']['p50']:.0f} p99 {r['itl_ms']['p99']:.0f} ms"
                  f" | goodput {r['goodput']:.2f} req/s | compilations {r['compilations_during_run']:g}",
                  file=sys.stderr)
        after = server_line(url)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    from jpa.tools.bench import machine, write_json

    write_json(args.out, {
        "benchmark": "serving (Poisson arrivals, streaming /v1/completions)", "machine": machine(),
        "command": "benchmarks/bench_serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "server": None if args.url else {
            "max_seqs": args.max_seqs, "steps_per_call": args.steps_per_call,
            "max_model_len": args.max_model_len},
        "workload": {"num_prompts_per_rate": args.num_prompts, "input_mean": args.input_mean,
                     "output_mean": args.output_mean, "max_input": args.max_input, "max_output": args.max_output,
                     "sigma": 1.0, "seed": args.seed, "sampling": "greedy, ignore_eos"},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "server_after": after, "results": results})
    plot(results, args.plot)
    failed = sum(r["failed"] for r in results)
    return 1 if failed or not after.get("jpa_kv_pool_whole") else 0


if __name__ == "__main__":
    sys.exit(main())
