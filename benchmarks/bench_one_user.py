#!/usr/bin/env python3
"""One user on the CPU: decode tokens/s, time to first token, memory and compiles, as `jpa serve` runs it.

One engine over the loaded model (default SmolLM2-135M's Q4_1 GGUF, float32 compute), the sizes of
`jpa serve --max-seqs 32` (budget 512, 4 decode steps a round, the step-shape ladder), compiled and
warmed before anything is timed (the ladder's background thread waited for). Then --reps times:
--prompts chat prompts one at a time, greedy, --max-new-tokens each, and for each prompt:

  - TTFT: add_request -> the round that hands its first token out (wall);
  - decode tokens/s: the tokens after the first over the time after the first (wall), and the
    whole request's output tokens over this process's CPU seconds (steadier on a shared machine).

Reported: the best and the median of the reps (the machine is shared: the best run is the least
disturbed), the process's resident and peak memory (VmRSS, VmHWM) after the runs (and VmRSS at each
stage: imported, model loaded, engine built, first answer, ladder ready), the model's weight bytes, and the
engine's compiles (the full shape, the ladder's) and each compiled shape's XLA temporaries. Also, with
--parts: one decode row's parts timed alone on the model's own weights (the blocks' weight matmuls, the
head).

Engine-level (no HTTP): LLMEngine.step() rounds, as the server's engine loop drives them. To
measure a checkout from before a change, run this file with PYTHONPATH=<that checkout> (its
jpa/models linked to its models/).

    ./run python benchmarks/bench_one_user.py --reps 5
"""

import argparse
import json
import statistics
import sys
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()

CHAT = ["What is a paged KV cache?", "Name three rivers in Europe.", "Write a haiku about the sea.",
        "Explain continuous batching in one paragraph."]


def memory(trim: bool = False) -> dict:
    """{VmRSS, VmHWM} of this process in MB (Linux /proc); trim: after glibc's malloc_trim(0) (what the
    allocator holds freed, in every thread's arena, given back first)."""
    if trim:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(line.split()[1]) / 1024)
    return out


def one(eng, prompt, max_new):
    """One request alone to its end: (TTFT s, decode tokens/s after the first, output tokens, CPU s, ids)."""
    from jpa.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    rid = eng.add_request(prompt, params).request_id
    ids, first = [], None
    while eng.has_unfinished:
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids:
                if first is None:
                    first = (time.perf_counter() - t0, len(o.new_token_ids))
                ids += o.new_token_ids
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ttft, n_first = first
    return ttft, (len(ids) - n_first) / (wall - ttft), len(ids), cpu, ids


def parts(eng) -> dict:
    """One decode row's parts on the engine model's weights, each jitted alone (best of 20, ms): every
    block's 7 weight matmuls (x @ W in each weight's format, the layers' scan), and the head (final norm
    and logits)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench_cpu_matmul import best_ms   # scripts/: best of N calls

    model = eng.runner.model
    gpt = nnx.merge(model.graphdef, model.params)
    d = gpt.config.d_model
    names = (("wq", d), ("wk", d), ("wv", d), ("wo", gpt.config.num_q_heads * gpt.config.head_dim),
             ("w_gate", d), ("w_up", d), ("w_down", gpt.config.ffn_dim))

    @jax.jit
    def blocks(params, x):  # x f32[1, 1]: every layer's 7 matmuls on one row, their sums carried (nothing dead)
        g = nnx.merge(model.graphdef, params)

        def body(i, y):   # as a step runs them: layer i of the stacked weights (models.gpt._run's stack_packed)
            return y + sum(jnp.sum(g.layers._linear(jnp.broadcast_to(y, (1, k)), n, layer=i)) for n, k in names)

        return jax.lax.fori_loop(0, g.config.num_layers, body, x)

    x = jnp.full((1, 1), 1e-3, jnp.float32)
    h = jnp.ones((1, d), jnp.float32)
    return dict(blocks_matmuls_ms=round(best_ms(blocks, (model.params, x)), 2),
                head_ms=round(best_ms(jax.jit(lambda p, h: nnx.merge(model.graphdef, p).logits(h)),
                                      (model.params, h)), 2))


def _temp_mb(exe):
    """MB of XLA temporaries a compiled step holds (`memory_analysis()`), or None where it does not say."""
    try:
        return round(exe.memory_analysis().temp_size_in_bytes / 2**20, 1)
    except Exception:   # an executable loaded some other way: no analysis
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--steps-per-call", type=int, default=4, help="default 4, as jpa serve")
    ap.add_argument("--step-shapes", default="ladder")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per rep, one at a time")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", action="store_true", help="also time one decode row's parts alone")
    ap.add_argument("--dump-prompts", default=None, help="also write the rendered chat prompts (JSON) here")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) before each memory reading")
    ap.add_argument("--no-compile-cache", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from jpa import LLM, models
    from jpa.args import enable_compile_cache

    if not args.no_compile_cache:
        enable_compile_cache()
    rss = dict(imported=memory(args.trim)["VmRSS"])
    t = time.perf_counter()
    gpt, tok = models.load(args.model)
    load_s = time.perf_counter() - t
    rss["model_loaded"] = memory(args.trim)["VmRSS"]
    chat = [tok.render_chat([{"role": "user", "content": c}]) for c in CHAT]
    if args.dump_prompts:   # the same rendered prompts, for another system run on the same text
        with open(args.dump_prompts, "w") as f:
            json.dump(chat[: args.prompts], f)
        if args.reps == 0:
            return
    t = time.perf_counter()
    llm = LLM.from_model(gpt, tok, max_seqs=args.max_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         steps_per_call=args.steps_per_call, max_model_len=2048, step_shapes=args.step_shapes)
    eng = llm.engine
    rss["engine_built"] = memory(args.trim)["VmRSS"]
    one(eng, chat[0], 2)
    first_answer_s = time.perf_counter() - t
    rss["first_answer"] = memory(args.trim)["VmRSS"]
    if getattr(eng.runner, "ladder", None) is not None:
        eng.runner.ladder.wait()
    rss["ladder_ready"] = memory(args.trim)["VmRSS"]
    for p in chat[: args.prompts]:   # every shape a one-user round meets, called once
        one(eng, p, args.max_new_tokens)
    s = eng.summary()
    compiles = dict(full_shape_compile_s=round(s["compile_seconds"], 2), full_shape_source=s["step_source"],
                    ladder_compiles=s.get("ladder_compiles"),
                    ladder_compile_s=round(s.get("ladder_compile_seconds") or 0.0, 2), shapes=s.get("step_shapes"))
    ladder = getattr(eng.runner, "ladder", None)
    exes = ladder.exes.items() if ladder else ()
    compiles["temp_mb"] = {f"{sh.rows}x{sh.tokens}": _temp_mb(exe) for sh, exe in exes}
    print(f"[bench] loaded in {load_s:.1f} s, first answer {first_answer_s:.1f} s later; {compiles}", file=sys.stderr)
    rows = dict(ttft_ms=[], decode_tok_s=[], tok_per_cpu_s=[])
    outputs = None
    for rep in range(args.reps):
        ttfts, rates, tokens, cpu, outs = [], [], 0, 0.0, []
        for p in chat[: args.prompts]:
            ttft, rate, n, c, ids = one(eng, p, args.max_new_tokens)
            ttfts.append(ttft)
            rates.append(rate)
            tokens, cpu = tokens + n, cpu + c
            outs.append(ids)
        if outputs is not None and outs != outputs:
            raise SystemExit("greedy outputs changed between reps")
        outputs = outs
        rows["ttft_ms"].append(1e3 * statistics.median(ttfts))
        rows["decode_tok_s"].append(statistics.median(rates))
        rows["tok_per_cpu_s"].append(tokens / cpu)
        print(f"[bench] rep {rep}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), file=sys.stderr)
    result = dict(config=vars(args), compiles=compiles, load_s=round(load_s, 2),
                  first_answer_s=round(first_answer_s, 2),
                  best=dict(ttft_ms=round(min(rows["ttft_ms"]), 1), decode_tok_s=round(max(rows["decode_tok_s"]), 1),
                            tok_per_cpu_s=round(max(rows["tok_per_cpu_s"]), 1)),
                  median={k: round(statistics.median(v), 1) for k, v in rows.items()},
                  memory_mb=dict(memory(args.trim), rss_by_stage=rss, weight_mb=round(gpt.weight_bytes() / 2**20, 1),
                                 kv_cache=s["kv_cache"]), runs=rows, outputs=outputs)
    if args.parts:
        result["parts"] = parts(eng)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
