#!/usr/bin/env python3
"""Benchmark: jpa's engine against two baselines with the same weights, on this machine.

Model: SmolLM2-135M-Instruct (float32, the real weights). Workload: `--num-requests` chat prompts
(ChatML template, varied lengths) with max_new_tokens drawn from [--min-new, --max-new] with a
fixed seed, greedy. Default: ignore_eos, so every request produces exactly its max_new_tokens and
all three systems generate the same number of tokens whatever their argmax tie-breaks do
(`--stop-at-eos` lets requests stop at <|im_end|> instead; lengths then vary naturally).

Systems (same GPT module and weights; the baselines' attention is written here through the
model's `_run` block loop, or its per-block equivalent):

- jpa: `jpa.engine.LLMEngine` (continuous batching, paged KV cache, `steps_per_call` decode steps
  per jitted call; pool = max_seqs * pages_per_seq pages, so it never preempts).
- dense: a dense per-sequence cache [B, max_model_len, K, H] per layer reserved at full length;
  static batches of max_seqs requests (a batch runs until all its requests finish, then the next
  batch starts); prompts left-padded to a power-of-two width (as jpa buckets its prefill); one
  jitted decode step (dynamic_update_slice write, length masking over max_model_len), one host
  round trip per step.
- concat: the naive cache: per layer K/V arrays [B, S, K, H] concatenated with the new token
  every step. Same static batches and prefill as dense. Per block, the projections/MLP are jitted
  once (static shapes) and only "concatenate + attend" is a jitted function whose shape changes
  every step, so each new S costs one small compilation (not one of the whole model: that would
  take seconds per step on this CPU); embedding and head are jitted once.

What is timed: wall time of generating the whole workload (prefill + decode + host work), after a
warm-up run of the same workload. jpa and dense then compile nothing at run time (checked:
compile/trace counters do not move). concat is reported twice: "concat" = a fresh jit (cold
shape cache), so the per-step-shape compilations it incurs at run time ARE counted (the
prefill shapes are warm, as for the other systems); "concat_warm" = all shapes already compiled
(its best case: only the O(S) copy per step). tokens/s = generated tokens / that wall time.
Runs are interleaved (jpa, dense, concat, concat_warm per repetition) and the median of
`--reps` is reported. Greedy token ids are compared across systems.

    .venv/bin/python benchmarks/bench_engine.py [--num-requests 24 --max-seqs 8 --reps 2]

Targets: jpa >= 2x concat, jpa >= 1.3x dense. `--profile` adds a breakdown of one decode step
(jpa's `models.decode` and the dense step, with donated caches; paged attention vs matmuls vs lm
head; minimum of 10 calls) with all slots busy at the workload's mean length, and the compile time
of one shape of a whole-model concat step (what a naive single-jit concat would pay per step).
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jpa import models  # noqa: E402
from jpa.engine import EngineConfig, EngineStats, LLMEngine, SamplingParams  # noqa: E402
from jpa.models.gpt import _run  # noqa: E402  (the block loop, for baselines with the same weights)
from jpa.tools.bench import machine, write_json
from jpa.tools.bench import PROMPTS  # the main job's built-in prompts, then more questions
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

TARGETS = {"concat": 2.0, "dense": 1.3}





def bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def attention(q, k, v, mask, scale):
    """q [B, T, N, H], k/v [B, S, K, H], mask bool[B, T, S] -> [B, T, N, H] (plain softmax)."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.reshape(batch, num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * scale
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v)
    return out.reshape(batch, num_tokens, num_q_heads, head_dim)


# ---------------------------------------------------------------------------------- baselines


class StaticBaseline:
    """Static batches, left-padded prompts, greedy. Subclasses own the decode cache."""

    name = "?"

    def __init__(self, model, max_seqs: int, max_len: int, stop_ids, pad_id: int):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config
        self.max_seqs, self.max_len = max_seqs, max_len
        self.stop_ids, self.pad_id = frozenset(stop_ids), pad_id
        self.scale = self.config.head_dim ** -0.5
        self._prefill = jax.jit(self._prefill_impl)

    def _prefill_impl(self, params, tokens, pads):
        """tokens i32[B, W] left-padded, pads i32[B] -> (first tokens i32[B], ks, vs [B, W, K, H])."""
        model = nnx.merge(self.graphdef, params)
        batch, width = tokens.shape
        col = jnp.arange(width, dtype=jnp.int32)
        positions = jnp.maximum(col[None, :] - pads[:, None], 0)  # i32[B, W]
        mask = (col[None, None, :] <= col[None, :, None]) & (col[None, None, :] >= pads[:, None, None])

        def attend(i, q, k, v, state):
            return attention(q, k, v, mask, self.scale), state + ((k, v),)

        x, kv = _run(model, tokens, positions, attend, ())
        tok = jnp.argmax(model.logits(x[:, -1]), axis=-1).astype(jnp.int32)
        return tok, tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def generate(self, prompt_ids, max_new, ignore_eos):
        """Runs all requests in static batches of max_seqs. Returns a list of generated id lists."""
        outs = [None] * len(prompt_ids)
        for b0 in range(0, len(prompt_ids), self.max_seqs):
            idx = list(range(b0, min(b0 + self.max_seqs, len(prompt_ids))))
            width = bucket(max(len(prompt_ids[i]) for i in idx))
            tokens = np.full((self.max_seqs, width), self.pad_id, np.int32)
            pads = np.full((self.max_seqs,), width - 1, np.int32)  # filler rows: a 1-token prompt
            for r, i in enumerate(idx):
                tokens[r, width - len(prompt_ids[i]):] = prompt_ids[i]
                pads[r] = width - len(prompt_ids[i])
            limit = [min(max_new[i], self.max_len - len(prompt_ids[i])) for i in idx]
            tok, ks, vs = self._prefill(self.params, jnp.asarray(tokens), jnp.asarray(pads))
            state = self.start(ks, vs)
            pads_d = jnp.asarray(pads)
            gen = [[] for _ in idx]
            done = [False] * len(idx)
            col = width
            while True:
                host = np.asarray(tok)
                for r in range(len(idx)):
                    if done[r]:
                        continue
                    t = int(host[r])
                    gen[r].append(t)
                    if len(gen[r]) >= limit[r] or (t in self.stop_ids and not ignore_eos):
                        done[r] = True
                if all(done) or col >= self.max_len:
                    break
                tok, state = self.step(state, tok, jnp.int32(col), pads_d)
                col += 1
            for r, i in enumerate(idx):
                outs[i] = gen[r]
        return outs


class DenseStatic(StaticBaseline):
    """A dense [B, max_len, K, H] cache per layer; one jitted step, cache donated."""

    name = "dense"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.compiles = 0
        self._step = jax.jit(self._step_impl, donate_argnums=(1,))
        self._start = jax.jit(self._start_impl)

    def _start_impl(self, ks, vs):
        pad = lambda a: jnp.pad(a, ((0, 0), (0, self.max_len - a.shape[1]), (0, 0), (0, 0)))
        return tuple(map(pad, ks)), tuple(map(pad, vs))

    def start(self, ks, vs):
        return self._start(ks, vs)

    def _step_impl(self, params, cache, tokens, col, pads):
        self.compiles += 1
        model = nnx.merge(self.graphdef, params)
        positions = (col - pads)[:, None]  # i32[B, 1]
        keys = jnp.arange(self.max_len, dtype=jnp.int32)
        mask = ((keys[None, :] >= pads[:, None]) & (keys[None, :] <= col))[:, None, :]  # [B, 1, L]

        def attend(i, q, k, v, cache):
            ks, vs = cache
            kc = lax.dynamic_update_slice(ks[i], k, (0, col, 0, 0))  # [B, L, K, H]
            vc = lax.dynamic_update_slice(vs[i], v, (0, col, 0, 0))
            put = lambda t, a: t[:i] + (a,) + t[i + 1:]
            return attention(q, kc, vc, mask, self.scale), (put(ks, kc), put(vs, vc))

        x, cache = _run(model, tokens[:, None], positions, attend, cache)
        return jnp.argmax(model.logits(x[:, 0]), axis=-1).astype(jnp.int32), cache

    def step(self, cache, tok, col, pads):
        tok, cache = self._step(self.params, cache, tok, col, pads)
        return tok, cache


class Concat(StaticBaseline):
    """Per-layer K/V [B, S, K, H] grown by concatenation every step (a new shape every step)."""

    name = "concat"

    def __init__(self, model, *a, **kw):
        super().__init__(model, *a, **kw)
        # The model's layer parameters are stacked: one block's structure, each layer's slice of them.
        self.block_graphdef, stacked = nnx.split(model.layers)
        self.block_params = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.config.num_layers)]
        self._embed = jax.jit(self._embed_impl)
        self._head = jax.jit(self._head_impl)
        self._qkv = jax.jit(self._qkv_impl)        # static shapes: compiled once
        self._finish = jax.jit(self._finish_impl)  # static shapes: compiled once
        self.reset_shapes()

    def reset_shapes(self):
        """A fresh jit of the concat + attention step: its shape cache starts empty (a cold run)."""
        self.compiles = 0

        def grow_and_attend(q, k, v, kc, vc, pads):
            self.compiles += 1
            kc = jnp.concatenate([kc, k], axis=1)  # [B, S + 1, K, H]
            vc = jnp.concatenate([vc, v], axis=1)
            keys = jnp.arange(kc.shape[1], dtype=jnp.int32)
            mask = (keys[None, :] >= pads[:, None])[:, None, :]  # [B, 1, S + 1]
            return attention(q, kc, vc, mask, self.scale), kc, vc

        self._attend = jax.jit(grow_and_attend)

    def _qkv_impl(self, bp, x, positions):
        return nnx.merge(self.block_graphdef, bp).qkv(x, positions)

    def _finish_impl(self, bp, x, attn):
        return nnx.merge(self.block_graphdef, bp).finish(x, attn)

    def _embed_impl(self, params, tokens, positions):
        return nnx.merge(self.graphdef, params).embed(tokens, positions)

    def _head_impl(self, params, x):
        return jnp.argmax(nnx.merge(self.graphdef, params).logits(x[:, 0]), axis=-1).astype(jnp.int32)

    def start(self, ks, vs):
        return list(ks), list(vs)

    def step(self, cache, tok, col, pads):
        ks, vs = cache
        positions = (col - pads)[:, None]
        x = self._embed(self.params, tok[:, None], positions)
        for i, bp in enumerate(self.block_params):
            q, k, v = self._qkv(bp, x, positions)
            attn, ks[i], vs[i] = self._attend(q, k, v, ks[i], vs[i], pads)
            x = self._finish(bp, x, attn)
        return self._head(self.params, x), (ks, vs)


# ---------------------------------------------------------------------------------- runs


def run_jpa(eng, prompt_ids, params):
    c0, t0 = eng.runner.compile_seconds, eng.runner.compiles
    eng.stats = EngineStats()
    start = time.perf_counter()
    outs = eng.generate(prompt_ids, params)
    wall = time.perf_counter() - start
    compiled = eng.runner.compile_seconds - c0
    traces = eng.runner.compiles - t0
    ids = [list(o.token_ids) for o in outs]
    s = eng.summary()
    return ids, dict(wall_seconds=wall, compile_seconds_in_run=compiled, compiles_in_run=traces,
                     decode_calls=eng.stats.decode_calls, decode_steps=s["decode_steps"],
                     decode_call_ms_per_step=1e3 * eng.stats.decode_seconds / max(s["decode_steps"], 1),
                     prefill_seconds=eng.stats.prefill_seconds, host_seconds=eng.stats.host_seconds,
                     preemptions=s["preemptions"])


def run_baseline(sys_, prompt_ids, max_new, ignore_eos):
    c0 = sys_.compiles
    start = time.perf_counter()
    ids = sys_.generate(prompt_ids, max_new, ignore_eos)
    wall = time.perf_counter() - start
    return ids, dict(wall_seconds=wall, compiles_in_run=sys_.compiles - c0)


def compare(ref, other):
    """Per-request first mismatch index (None = identical)."""
    res = []
    for a, b in zip(ref, other):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if n is None and len(a) != len(b):
            n = min(len(a), len(b))
        res.append(n)
    return res


# ---------------------------------------------------------------------------------- profile


# Microbenchmarks take the minimum of 10 calls: the machine is shared, and interference only adds.
def timeit(fn, *args, reps=10):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def timeit_donated(fn, cache, *args, reps=10):
    """Times fn(cache, *args) -> (out, cache) with the cache donated and threaded through."""
    out, cache = fn(cache, *args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out, cache = fn(cache, *args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return min(times)


def profile_decode_step(model, eng, dense, max_seqs, seq_len):
    """Times the parts of one decode step at seq_len tokens per sequence (all max_seqs slots busy)."""
    from jpa.kv.cache import KVCache
    from jpa.ops.reference import paged_decode_xla
    from jpa.models import decode

    c = model.config
    gd, params = nnx.split(model)
    cc = eng.cache_config
    cache = KVCache.create(cc)
    pps = eng.pages_per_seq
    rng = np.random.default_rng(0)
    tables = rng.permutation(cc.num_pages)[: max_seqs * pps].reshape(max_seqs, pps).astype(np.int32)
    tables = jnp.asarray(tables)
    seq_lens = jnp.full((max_seqs,), seq_len, jnp.int32)
    slots = tables[:, (seq_len - 1) // cc.page_size] * cc.page_size + (seq_len - 1) % cc.page_size
    tokens = jnp.ones((max_seqs,), jnp.int32)
    scale = c.head_dim ** -0.5

    def jpa_step_impl(cache, params):
        logits, cache = decode(nnx.merge(gd, params), cache, tokens, seq_lens, slots, tables)
        return jnp.argmax(logits, -1), cache

    jpa_step = jax.jit(jpa_step_impl, donate_argnums=(0,))

    @jax.jit
    def no_attention(params):
        m = nnx.merge(gd, params)
        x, _ = _run(m, tokens[:, None], (seq_lens - 1)[:, None], lambda r, i, q, k, v, s: (q, s), None)
        return jnp.argmax(m.logits(x[:, 0]), -1)

    @jax.jit
    def blocks_only(params):
        m = nnx.merge(gd, params)
        x, _ = _run(m, tokens[:, None], (seq_lens - 1)[:, None], lambda r, i, q, k, v, s: (q, s), None)
        return x

    @jax.jit
    def head_only(params, x):
        return jnp.argmax(nnx.merge(gd, params).logits(x), -1)

    @jax.jit
    def attention_only(cache, q):
        outs = [paged_decode_xla(q, cache.k, cache.v, tables, seq_lens, scale=scale, layer=jnp.int32(i))
                for i in range(c.num_layers)]
        return jnp.stack(outs)

    @jax.jit
    def attention_small_chunks(cache, q):
        # The same reference path visiting only the occupied 64-token chunks (pages_per_chunk is
        # its static option; the engine uses the default, CHUNK_TOKENS = 512 tokens per chunk).
        ppc = max(1, 64 // cc.page_size)
        outs = [paged_decode_xla(q, cache.k, cache.v, tables, seq_lens, scale=scale, layer=jnp.int32(i),
                                 pages_per_chunk=ppc) for i in range(c.num_layers)]
        return jnp.stack(outs)

    @jax.jit
    def gather_only(cache):
        # Every page of the block table (max_model_len tokens per sequence) gathered for K and V
        # and reduced: what a gather of the whole table would cost if it were materialized. The
        # reference path gathers only occupied chunks, inside a fused loop; this is not its cost.
        return jnp.stack([jnp.take(cache.k[i], tables, axis=1).sum() + jnp.take(cache.v[i], tables, axis=1).sum()
                          for i in range(c.num_layers)])

    def concat_whole_step(params, ks, vs, tokens, positions):
        # The textbook naive step: the whole model under one jit with the cache concatenated
        # inside, so every new S recompiles all 30 blocks. Only its compile time is measured.
        def attend(i, q, k, v, state):
            kc, vc = jnp.concatenate([state[0][i], k], 1), jnp.concatenate([state[1][i], v], 1)
            mask = jnp.ones((max_seqs, 1, kc.shape[1]), bool)
            return attention(q, kc, vc, mask, scale), (state[0][:i] + (kc,) + state[0][i + 1:],
                                                       state[1][:i] + (vc,) + state[1][i + 1:])
        m = nnx.merge(gd, params)
        x, state = _run(m, tokens[:, None], positions, attend, (ks, vs))
        return jnp.argmax(m.logits(x[:, 0]), -1), state

    kv = tuple(jnp.zeros((max_seqs, seq_len - 1, c.num_kv_heads, c.head_dim)) for _ in range(c.num_layers))
    t = time.perf_counter()
    jax.jit(concat_whole_step).lower(params, kv, kv, tokens, (seq_lens - 1)[:, None]).compile()
    whole_step_compile = time.perf_counter() - t

    q = jnp.ones((max_seqs, c.num_q_heads, c.head_dim), jnp.float32)
    x = jnp.ones((max_seqs, c.d_model), jnp.float32)
    zeros = lambda: tuple(jnp.zeros((max_seqs, dense.max_len, c.num_kv_heads, c.head_dim))
                          for _ in range(c.num_layers))
    pads = jnp.zeros((max_seqs,), jnp.int32)
    dense_step = jax.jit(lambda cache, params, *a: dense._step_impl(params, cache, *a), donate_argnums=(0,))
    return {
        # Both steps with the cache donated (updated in place), as in the engine and the baseline.
        "dense_static_step_ms": 1e3 * timeit_donated(dense_step, (zeros(), zeros()), params, tokens,
                                                     jnp.int32(seq_len - 1), pads),
        "seq_len": seq_len,
        "concat_whole_model_step_compile_s": whole_step_compile,
        "jpa_decode_step_ms": 1e3 * timeit_donated(jpa_step, KVCache.create(cc), params),
        "step_without_attention_ms": 1e3 * timeit(no_attention, params),
        "blocks_without_attention_ms": 1e3 * timeit(blocks_only, params),
        "lm_head_ms": 1e3 * timeit(head_only, params, x),
        "paged_attention_30_layers_ms": 1e3 * timeit(attention_only, cache, q),
        "paged_attention_30_layers_64_token_chunks_ms": 1e3 * timeit(attention_small_chunks, cache, q),
        "page_gather_30_layers_ms": 1e3 * timeit(gather_only, cache),
    }


# ---------------------------------------------------------------------------------- main


def plot(results, path, title):
    """Bar chart of tokens/s per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    vals = [results[n]["tok_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(names, vals, color=["C0" if n == "jpa" else "C7" for n in names])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylim(0, 1.15 * max(vals))
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-seqs", type=int, default=8, help="jpa decode slots = static batch size")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512, help="jpa max_model_len = dense cache length")
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-at-eos", action="store_true", help="requests stop at EOS (default: ignore_eos)")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per system (median)")
    ap.add_argument("--systems", default="jpa,dense,concat", help="comma list")
    ap.add_argument("--profile", action="store_true", help="break down one jpa decode step")
    ap.add_argument("--jpa-chunk-tokens", type=int, default=None,
                    help="what-if experiment: override jpa.ops.reference.CHUNK_TOKENS (key tokens per loop "
                         "iteration of jpa's CPU attention path) before the engine is built")
    ap.add_argument("--json", default="benchmarks/engine.json")
    ap.add_argument("--plot", default="benchmarks/engine_throughput.png")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    systems = args.systems.split(",")
    t_start = time.perf_counter()
    model, tok = models.load("smollm2-135m", dtype=jnp.float32)
    rng = np.random.default_rng(args.seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in rng.permutation(max(args.num_requests, len(PROMPTS)))
               [: args.num_requests]]
    prompt_ids = [tok.encode(tok.apply_chat_template(p)) for p in prompts]
    max_new = [int(n) for n in rng.integers(args.min_new, args.max_new + 1, size=args.num_requests)]
    ignore_eos = not args.stop_at_eos
    params = [SamplingParams(max_new_tokens=n, greedy=True, ignore_eos=ignore_eos) for n in max_new]
    stop_ids = set(tok.stop_token_ids) | {tok.eos_token_id}
    print(f"{args.num_requests} requests, prompt tokens {min(map(len, prompt_ids))}..{max(map(len, prompt_ids))}, "
          f"max_new_tokens {min(max_new)}..{max(max_new)}, ignore_eos={ignore_eos}", file=sys.stderr)

    if args.jpa_chunk_tokens:
        import jpa.ops.reference
        jpa.ops.reference.CHUNK_TOKENS = args.jpa_chunk_tokens  # read by chunk_pages() at trace time
    cfg = EngineConfig(max_seqs=args.max_seqs, page_size=args.page_size, max_model_len=args.max_model_len,
                       num_pages=args.max_seqs * -(-args.max_model_len // args.page_size),
                       steps_per_call=args.steps_per_call)
    eng = LLMEngine(models.GPTForEngine(model), tok, cfg)
    base_args = (args.max_seqs, args.max_model_len, stop_ids, tok.eos_token_id)
    dense = DenseStatic(model, *base_args)
    concat = Concat(model, *base_args)

    # Warm-up: compiles every shape the timed runs use (prefill buckets, decode steps).
    warm = {}
    for name in systems:
        t = time.perf_counter()
        if name == "jpa":
            warm[name] = run_jpa(eng, prompt_ids, params)[0]
        else:
            sysobj = dense if name == "dense" else concat
            warm[name] = run_baseline(sysobj, prompt_ids, max_new, ignore_eos)[0]
        print(f"warm-up {name}: {time.perf_counter() - t:.1f}s", file=sys.stderr)

    runs = {n: [] for n in systems + (["concat_warm"] if "concat" in systems else [])}
    outputs = {}
    for rep in range(args.reps):
        for name in systems:
            if name == "jpa":
                outputs[name], r = run_jpa(eng, prompt_ids, params)
                runs[name].append(r)
            elif name == "dense":
                outputs[name], r = run_baseline(dense, prompt_ids, max_new, ignore_eos)
                runs[name].append(r)
            else:
                concat.reset_shapes()  # cold: every decode shape compiles again, at run time
                outputs[name], r = run_baseline(concat, prompt_ids, max_new, ignore_eos)
                runs[name].append(r)
                ids, r = run_baseline(concat, prompt_ids, max_new, ignore_eos)  # warm shape cache
                assert ids == outputs[name]
                runs["concat_warm"].append(r)
        print(f"rep {rep}: " + ", ".join(f"{n} {runs[n][-1]['wall_seconds']:.1f}s" for n in runs),
              file=sys.stderr)

    results = {}
    for name, rs in runs.items():
        ids = outputs["concat" if name == "concat_warm" else name]
        ntok = sum(len(t) for t in ids)
        walls = [r["wall_seconds"] for r in rs]
        wall = statistics.median(walls)
        results[name] = dict(generated_tokens=ntok, wall_seconds=wall, wall_seconds_all=walls,
                             tok_s=ntok / wall, runs=rs)

    # Output equality (greedy ids), jpa as the reference.
    ref_name = "jpa" if "jpa" in outputs else systems[0]
    equality = {}
    for name in outputs:
        if name == ref_name:
            continue
        first = compare(outputs[ref_name], outputs[name])
        bad = [(i, n) for i, n in enumerate(first) if n is not None]
        equality[f"{ref_name}_vs_{name}"] = dict(
            identical_requests=len(first) - len(bad), requests=len(first),
            mismatches=[dict(request=i, first_diff_token=n, prompt_tokens=len(prompt_ids[i]),
                             ref_len=len(outputs[ref_name][i]), other_len=len(outputs[name][i]))
                        for i, n in bad])
    # Warm-up outputs must equal the timed ones (determinism).
    for name in outputs:
        if warm.get(name) != outputs[name]:
            equality[f"{name}_warmup_vs_timed"] = "DIFFERENT"

    ratios = {}
    if "jpa" in results:
        for name in ("concat", "concat_warm", "dense"):
            if name in results:
                ratios[f"jpa/{name}"] = results["jpa"]["tok_s"] / results[name]["tok_s"]
    targets = {f"jpa/{n}": dict(target=t, ratio=ratios.get(f"jpa/{n}"),
                                met=ratios.get(f"jpa/{n}", 0) >= t) for n, t in TARGETS.items()
               if f"jpa/{n}" in ratios}

    profile = None
    if args.profile:
        mean_len = int(np.mean([len(p) for p in prompt_ids]) + np.mean(max_new) / 2)
        profile = profile_decode_step(model, eng, dense, args.max_seqs, mean_len)

    mach = machine()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        import subprocess
        git = lambda *a: subprocess.run(["git", "-C", repo, *a], capture_output=True, text=True).stdout.strip()
        mach["git_commit"] = git("rev-parse", "HEAD")
        mach["jpa_models_uncommitted_changes"] = bool(git("status", "--porcelain", "--", "jpa", "models"))
    except OSError:
        pass
    report = dict(
        machine=mach, model="smollm2-135m (SmolLM2-135M-Instruct, float32)",
        workload=dict(num_requests=args.num_requests, prompt_tokens=[len(p) for p in prompt_ids],
                      max_new_tokens=max_new, greedy=True, ignore_eos=ignore_eos, seed=args.seed),
        engine_config=dict(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=cfg.num_pages,
                           max_model_len=args.max_model_len, steps_per_call=args.steps_per_call,
                           jpa_chunk_tokens_override=args.jpa_chunk_tokens),
        timing=("wall time of generating the whole workload (prefill + decode + host), after a warm-up run; "
                "jpa/dense compile nothing at run time; concat = fresh shape cache, run-time compilations "
                "of its per-step shapes counted; concat_warm = all shapes precompiled; median of reps"),
        results=results, ratios=ratios, targets=targets, output_equality=equality, profile=profile,
        total_benchmark_seconds=time.perf_counter() - t_start, command=" ".join(sys.argv))

    print(f"\nmachine: {mach['platform']}, {mach['cpu_count']} CPUs, jax {mach['jax_version']}, {mach['device']}")
    print(f"model: SmolLM2-135M-Instruct f32; {args.num_requests} requests, greedy, ignore_eos={ignore_eos}, "
          f"max_seqs={args.max_seqs}, page_size={args.page_size}, steps_per_call={args.steps_per_call}, "
          f"max_model_len={args.max_model_len}\n")
    print("| system | generated tokens | wall s (median) | tokens/s | jpa / system | run-time compiles |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = ratios.get(f"jpa/{name}")
        print(f"| {name} | {r['generated_tokens']} | {r['wall_seconds']:.2f} | {r['tok_s']:.1f} | "
              f"{'%.2fx' % ratio if ratio else '-'} | {r['runs'][-1].get('compiles_in_run', 0)} |")
    print()
    for k, t in targets.items():
        print(f"target {k} >= {t['target']}x: {t['ratio']:.2f}x -> {'MET' if t['met'] else 'MISSED'}")
    for k, e in equality.items():
        if isinstance(e, str):
            print(f"outputs {k}: {e}")
        else:
            print(f"outputs {k}: {e['identical_requests']}/{e['requests']} requests identical"
                  + "".join(f"; request {m['request']} differs from token {m['first_diff_token']}"
                            for m in e["mismatches"]))
    if profile:
        print("\njpa decode step breakdown (all slots busy, seq_len %d):" % profile["seq_len"])
        for k, v in profile.items():
            if k != "seq_len":
                print(f"  {k}: {v:.2f}")

    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(results, args.plot, f"SmolLM2-135M f32, {args.num_requests} requests, batch {args.max_seqs}\n"
                                 f"{mach['cpu_count']} CPUs, jax {mach['jax_version']}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
