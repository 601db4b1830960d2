"""Benchmark: what multi-step decode (steps_per_call = k) buys in tokens/s by cutting host round trips.

The random tiny model ("tiny-llama": 2 layers, d_model 64) makes the device work per step tiny, so
the host's share of each round (dispatch, device_get of the new tokens, Python bookkeeping) is as
large as it will ever be: this is the worst case for host overhead, the case k > 1 exists for.

The same requests (greedy, ignore_eos, fixed random byte prompts) run through `jpa.engine.LLMEngine`
once per k. Each engine first runs the whole workload once untimed (compiles every prefill shape
and the decode loop), then its stats are reset and the workload is timed `--reps` times; the
median run is reported. Reported per k: decode tok/s (engine summary: decode tokens / (decode
call wall time + host bookkeeping time), compile time excluded), the engine's host_overhead
(host bookkeeping seconds / that total) and decode calls. Greedy outputs must be identical
across k (checked). Target: tok/s at k=16 >= 1.5x k=1.

To explain the ratio, the script also fits t_call = c + steps * t_step (fixed cost per host round
trip vs device work per decode step) and times the parts of one device step alone (allocator,
model, sampler) with the same shapes.

    .venv/bin/python benchmarks/bench_host_overhead.py [--requests 16 --new-tokens 128 --reps 3]
"""

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

from jpa import models  # noqa: E402
from jpa.engine import EngineConfig, EngineStats, LLMEngine, SamplingParams  # noqa: E402
from jpa.tools.bench import machine, write_json
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

TARGET_RATIO = 1.5




def step_breakdown(model, args, steps=64, reps=5):
    """ms per decode step of the parts of the engine's device loop, each alone in a jitted fori_loop
    with the engine's shapes (max_seqs sequences at 100 tokens): allocator (pages.append + release),
    model (models.decode: K/V write + paged attention + MLP, all layers, logits), sampler."""
    import jax.numpy as jnp
    from flax import nnx
    from jax import lax

    from jpa.kv import pages
    from jpa.kv.cache import CacheConfig, KVCache
    from jpa.engine.sampling import sample

    mc, b, ps = model.config, args.max_seqs, args.page_size
    state = pages.init(args.num_pages, b, -(-args.max_model_len // ps), ps)
    state, ok = pages.reserve(state, list(range(b)), [100] * b)
    assert bool(ok)
    lens, tables = state.seq_lens, state.block_tables
    slots = jnp.take_along_axis(tables, ((lens - 1) // ps)[:, None], axis=1)[:, 0] * ps + (lens - 1) % ps
    active, none = jnp.ones((b,), bool), jnp.full((b,), -1, jnp.int32)
    graphdef, params = nnx.split(model)
    cache = KVCache.create(CacheConfig(mc.num_layers, mc.num_kv_heads, mc.head_dim, args.num_pages, ps,
                                       "float32"))
    tokens = jnp.arange(b, dtype=jnp.int32) + 65
    logits0 = jnp.zeros((b, mc.vocab_size), jnp.float32)
    z_f, z_i = jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32)

    def alloc(state):
        return lax.fori_loop(0, steps, lambda i, s: pages.release(pages.append(s, active)[0], none), state)

    def model_step(params, cache):
        m = nnx.merge(graphdef, params)

        def body(i, carry):
            c, acc = carry
            logits, c = models.decode(m, c, tokens, lens, slots, tables)
            return c, acc + logits
        return lax.fori_loop(0, steps, body, (cache, logits0))

    def sampler(logits):
        return lax.fori_loop(0, steps, lambda i, acc: acc + sample(
            logits + i.astype(jnp.float32), z_f, z_i, z_f + 1, z_i, z_i + i), z_i)

    out = {}
    for name, fn, a in (("allocator", alloc, (state,)), ("model", model_step, (params, cache)),
                        ("sampler", sampler, (logits0,))):
        f = jax.jit(fn)
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(ts) / steps
    return out


def run_k(model, tok, prompts, params, k, args):
    cfg = EngineConfig(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages,
                       max_model_len=args.max_model_len, steps_per_call=k)
    eng = LLMEngine(models.GPTForEngine(model), tok, cfg)
    eng.generate(prompts, params)  # warm-up: compiles prefill shapes and the decode loop
    runs, outputs = [], None
    for _ in range(args.reps):
        eng.stats = EngineStats()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        wall = time.perf_counter() - t0
        s = eng.summary()
        runs.append(dict(decode_tok_s=s["decode_tok_s"], host_overhead=s["host_overhead"],
                         decode_seconds=s["decode_seconds"], decode_tokens=s["decode_tokens"],
                         decode_calls=eng.stats.decode_calls, decode_steps=s["decode_steps"],
                         preemptions=s["preemptions"], generate_wall_seconds=wall))
        ids = [o.token_ids for o in outs]
        if any(len(t) != args.new_tokens for t in ids):
            raise SystemExit(f"k={k}: a request did not produce {args.new_tokens} tokens")
        if outputs is None:
            outputs = ids
        elif ids != outputs:
            raise SystemExit(f"k={k}: greedy outputs differ between repetitions")
    assert eng.pool_is_whole(), "pages leaked"
    med = sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]
    return dict(steps_per_call=k, **med, tok_s_all_reps=[round(r["decode_tok_s"], 1) for r in runs],
                compile_seconds=eng.runner.compile_seconds), outputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,4,16", help="steps_per_call values")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/host_overhead.json")
    args = ap.parse_args()
    ks = [int(x) for x in args.ks.split(",")]

    m = machine()
    print(f"machine: {m['platform']}, {m['processor']}, {m['cpu_count']} cpus, jax {m['jax_version']}, "
          f"device {m['device']}")
    model, tok = models.load("tiny-llama", seed=args.seed)
    rng = np.random.default_rng(args.seed)
    # Prompts: random printable ASCII of 16..48 bytes (the byte tokenizer adds BOS).
    prompts = ["".join(chr(c) for c in rng.integers(32, 127, size=int(n)))
               for n in rng.integers(16, 49, size=args.requests)]
    params = SamplingParams(max_new_tokens=args.new_tokens, greedy=True, ignore_eos=True)
    print(f"workload: tiny-llama, {args.requests} requests x {args.new_tokens} new tokens, greedy, "
          f"ignore_eos, max_seqs {args.max_seqs}, page_size {args.page_size}, {args.num_pages} pages; "
          f"median of {args.reps} timed runs after a warm-up run")
    rows, ref = [], None
    for k in ks:
        r, outs = run_k(model, tok, prompts, params, k, args)
        if ref is None:
            ref = outs
        r["outputs_match_first_k"] = outs == ref
        rows.append(r)
    base = rows[0]["decode_tok_s"]
    print(f"\n| steps_per_call k | decode tok/s | vs k={ks[0]} | host_overhead | decode calls | "
          f"ms per call | ms per step | tok/s per rep | same outputs |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        r["ratio_vs_first"] = r["decode_tok_s"] / base
        r["ms_per_call"] = 1e3 * r["decode_seconds"] / r["decode_calls"]
        r["ms_per_step"] = 1e3 * r["decode_seconds"] / r["decode_steps"]
        print(f"| {r['steps_per_call']} | {r['decode_tok_s']:.1f} | {r['ratio_vs_first']:.2f}x | "
              f"{r['host_overhead']:.1%} | {r['decode_calls']} | {r['ms_per_call']:.2f} | "
              f"{r['ms_per_step']:.2f} | {r['tok_s_all_reps']} | {r['outputs_match_first_k']} |")
    if len(rows) > 1:
        # Fixed cost of one host round trip, from two k: t_call(k) = overhead + k_eff * t_step.
        a, b = rows[0], rows[-1]
        sa, sb = a["decode_steps"] / a["decode_calls"], b["decode_steps"] / b["decode_calls"]
        t_step = (b["ms_per_call"] - a["ms_per_call"]) / (sb - sa)
        per_call = a["ms_per_call"] - sa * t_step
        print(f"fit t_call = c + steps * t_step over k={a['steps_per_call']},{b['steps_per_call']}: "
              f"t_step = {t_step:.2f} ms of device work per decode step, c = {per_call:.2f} ms fixed per "
              f"call (dispatch + device_get + bookkeeping); best possible gain from removing every "
              f"round trip = (c + t_step) / t_step = {(per_call + t_step) / t_step:.2f}x")
    bd = step_breakdown(model, args)
    print("device work per decode step, by part (each alone in a jitted loop, ms): "
          + ", ".join(f"{k_} {v:.3f}" for k_, v in bd.items()) + f"; sum {sum(bd.values()):.3f}")
    identical = all(r["outputs_match_first_k"] for r in rows)
    by_k = {r["steps_per_call"]: r for r in rows}
    ratio = by_k[16]["decode_tok_s"] / by_k[1]["decode_tok_s"] if 1 in by_k and 16 in by_k else None
    met = ratio is not None and ratio >= TARGET_RATIO
    print(f"\ngreedy outputs identical across k: {identical}")
    if ratio is not None:
        print(f"target: tok/s(k=16) / tok/s(k=1) >= {TARGET_RATIO}: {'MET' if met else 'MISSED'} ({ratio:.2f}x)")
    out = dict(machine=m, command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               config=vars(args), target_ratio=TARGET_RATIO, ratio_k16_over_k1=ratio, target_met=met,
               outputs_identical_across_k=identical, rows=rows, step_breakdown_ms=bd)
    if args.out:
        write_json(args.out, out)
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
