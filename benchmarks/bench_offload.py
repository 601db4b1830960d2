#!/usr/bin/env python3
"""Benchmark: KV offload (swap to a host tier) vs recompute on a preemption-heavy workload, or
(`--workload chat`) prefix-cache spill on a multi-turn chat workload.

Model: SmolLM2-135M-Instruct (float32, the real weights) on this machine (`--model tiny-llama`: the
random tiny model, for a quick run). Workload: `--num-requests` of the engine benchmarks' questions
(jpa.tools.bench.PROMPTS, ChatML-templated), half greedy and half seeded samples (temperature 0.8,
top_p 0.95), ignore_eos, exactly `--max-new` tokens each, all added at once. The pool is far too
small for them (`--num-pages`, default 40 pages of 16 tokens for 8 slots of sequences growing to
~100-130 tokens): the scheduler preempts over and over.

Systems: two LLMEngines on the same weights and EngineConfig except `kv_offload_bytes` 0 ("off":
a preempted request is recomputed) vs `--offload-gib` GiB ("on": its pages are swapped to the host
tier and back). Each runs the workload twice: the first run compiles every program (the unified
step and the swap programs, `ModelRunner.warm_swaps`: every block size) and is not timed; the second
is measured. Reported per system: wall
time of the measured run, generated tokens per second, preemptions, prompt tokens the engine
computed (prefill; with offload a swapped-in request prefills only its last token), tokens restored
from the host instead, and the bytes moved. The token ids of the greedy requests, and of the seeded
ones, are compared between the systems.

    .venv/bin/python benchmarks/bench_offload.py                       # SmolLM2, 16 requests
    .venv/bin/python benchmarks/bench_offload.py --model tiny-llama    # seconds

Chat workload (`--workload chat`): `--chats` conversations of `--turns` turns, one request at a
time (chat 0 turn 1, chat 1 turn 1, ..., chat 0 turn 2, ...): each turn's prompt is the chat's
whole history (ChatML: the earlier questions and the model's answers) plus a new question
(jpa.tools.bench.PROMPTS), greedy, `--max-new` tokens. The histories of all chats exceed the device
pool (`--num-pages`), so by the time a chat returns its pages have been evicted: without offload
its history is prefilled again, with offload the evicted pages were spilled to the host tier and
come back. Reported per system: prefix hit rate (prompt tokens served from the cache, both tiers),
host-tier hit tokens, prompt tokens computed, time to first token per request (p50, mean, and of
the turns after the first; with `--repeats`, each request's median over that many measured runs),
wall time (median); token ids compared between the systems. Each engine first
runs the same workload once (compiles the step, the spill and restore programs), then its
prefix cache is flushed (both tiers) and the measured run starts.

    .venv/bin/python benchmarks/bench_offload.py --workload chat --chats 4 --turns 3 --max-new 32 --num-pages 20 --repeats 3
"""

import argparse
import os
import sys
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from jpa import models  # noqa: E402
from jpa.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jpa.tools.bench import PROMPTS, machine, write_json  # noqa: E402


def workload(tok, n, max_new):
    prompts = []
    for i in range(n):
        q = PROMPTS[i % len(PROMPTS)]
        chat = getattr(tok, "apply_chat_template", None)
        prompts.append(chat([{"role": "user", "content": q}]) if chat else q)
    params = [SamplingParams(max_new_tokens=max_new, greedy=True, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=max_new, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def measure(model, tok, cfg, prompts, params):
    eng = LLMEngine(model, tok, cfg)
    eng.generate(prompts, params)              # warm-up: compiles the step and the swap programs
    if cfg.kv_offload_bytes:
        eng.runner.warm_swaps()                # every block size (the runs may swap other sizes)
    before = dict(vars(eng.stats))
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert eng.pool_is_whole()
    d = {k: v - before[k] for k, v in vars(eng.stats).items() if isinstance(v, (int, float))}
    gen = sum(len(o.token_ids) for o in outs)
    return outs, dict(wall_seconds=round(wall, 2), gen_tok_s=round(gen / wall, 1), generated_tokens=gen,
                      preemptions=d["preemptions"], prefill_tokens=d["prefill_tokens"],
                      swapped_out=d["swapped_out"], swapped_in=d["swapped_in"],
                      recompute_avoided_tokens=d["recompute_avoided_tokens"],
                      bytes_out=d["swap_out_bytes"], bytes_in=d["swap_in_bytes"])


def chat_run(eng, tok, chats, turns, max_new):
    """The chat workload on eng: (outputs, per-request (turn, ttft seconds, prompt tokens))."""
    params = SamplingParams(max_new_tokens=max_new, greedy=True, ignore_eos=True)
    history = [[] for _ in range(chats)]
    outs, ttft = [], []
    for t in range(turns):
        for c in range(chats):
            history[c].append({"role": "user", "content": PROMPTS[(c * turns + t) % len(PROMPTS)]})
            chat = getattr(tok, "apply_chat_template", None)
            prompt = chat(history[c]) if chat else " ".join(m["content"] for m in history[c])
            t0 = time.perf_counter()
            req = eng.add_request(prompt, params)
            first, out = None, None
            while out is None:
                for o in eng.step():
                    if o.request_id == req.request_id:
                        if first is None and o.new_token_ids:
                            first = time.perf_counter() - t0
                        if o.finished:
                            out = o.output
            if out.finish_reason == "error":
                raise RuntimeError(f"chat {c} turn {t}: {out.error} (fewer --turns or --max-new, or a larger "
                                   f"--num-pages)")
            history[c].append({"role": "assistant", "content": out.completion})
            outs.append(out)
            ttft.append((t, first, len(req.prompt_ids)))
    return outs, ttft


class ChatSystem:
    """One engine of the chat benchmark: built and warmed up (the workload once: every program it
    meets compiles), then `run()` as often as wanted (the prefix cache flushed, both tiers, before
    each), `result()` the figures: TTFT per request the median over the runs, counts of the first."""

    def __init__(self, model, tok, cfg, args):
        self.eng, self.tok, self.args = LLMEngine(model, tok, cfg), tok, args
        chat_run(self.eng, tok, args.chats, args.turns, args.max_new)
        self.runs, self.walls = [], []

    def run(self):
        eng, prefix = self.eng, self.eng.scheduler.prefix
        eng.flush_prefix_cache()
        assert eng.pool_is_whole()
        before = dict(vars(eng.stats))
        q0, h0, hh0 = prefix.query_tokens, prefix.hit_tokens, prefix.host_hit_tokens
        t0 = time.perf_counter()
        outs, ttft = chat_run(eng, self.tok, self.args.chats, self.args.turns, self.args.max_new)
        self.walls.append(time.perf_counter() - t0)
        assert eng.pool_is_whole()
        self.runs.append(ttft)
        if len(self.runs) == 1:
            self.outs = outs
            self.d = {k: v - before[k] for k, v in vars(eng.stats).items() if isinstance(v, (int, float))}
            self.d.update(queries=prefix.query_tokens - q0, hits=prefix.hit_tokens - h0,
                          host_hits=prefix.host_hit_tokens - hh0)

    def result(self):
        import numpy as np

        d, runs = self.d, self.runs
        ttft = [(t, float(np.median([r[i][1] for r in runs])), n) for i, (t, _, n) in enumerate(runs[0])]
        all_t = np.array([x[1] for x in ttft])
        later = np.array([x[1] for x in ttft if x[0] > 0])
        return dict(wall_seconds=round(float(np.median(self.walls)), 2),
                    prefix_hit_rate=round(d["hits"] / d["queries"], 3), prompt_tokens=d["queries"],
                    hit_tokens=d["hits"], host_hit_tokens=d["host_hits"], prefill_tokens=d["prefill_tokens"],
                    ttft_p50_s=round(float(np.median(all_t)), 3), ttft_mean_s=round(float(all_t.mean()), 3),
                    ttft_later_turns_mean_s=round(float(later.mean()), 3) if later.size else None,
                    ttft_first_turn_mean_s=round(float(all_t[[x[0] == 0 for x in ttft]].mean()), 3),
                    spilled_pages=d["spill_pages"], restored_pages=d["restore_pages"],
                    spill_bytes=d["spill_bytes"], restore_bytes=d["restore_bytes"],
                    max_prompt_tokens=max(x[2] for x in ttft),
                    per_request=[dict(turn=x[0], ttft_s=round(x[1], 3), prompt_tokens=x[2]) for x in ttft])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=40)
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--steps-per-call", type=int, default=8, help="decode steps per device call (1: the first "
                    "token comes back right after the prompt's last chunk, so TTFT is the prefill's time)")
    ap.add_argument("--json", default=None, help="default: benchmarks/offload.json (offload_chat.json for chat)")
    ap.add_argument("--workload", choices=("preempt", "chat"), default="preempt")
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="chat: measured runs (TTFT: the median per request)")
    args = ap.parse_args(argv)
    if args.json is None:
        args.json = "benchmarks/offload_chat.json" if args.workload == "chat" else "benchmarks/offload.json"
    import jax.numpy as jnp

    model, tok = models.load(args.model, dtype=jnp.float32)
    engine_model = models.GPTForEngine(model)
    base = dict(max_seqs=args.max_seqs, page_size=args.page_size, num_pages=args.num_pages, max_model_len=512,
                watermark=0.0, steps_per_call=args.steps_per_call)
    command = "python " + " ".join(["benchmarks/bench_offload.py"] + (argv or sys.argv[1:]))
    if args.workload == "chat":
        return chat_main(engine_model, tok, base, args, command)
    prompts, params = workload(tok, args.num_requests, args.max_new)
    results, outs = {}, {}
    for name, off in (("off", 0), ("on", int(args.offload_gib * 2 ** 30))):
        outs[name], results[name] = measure(engine_model, tok, EngineConfig(**base, kv_offload_bytes=off),
                                            prompts, params)
        print(name, results[name], flush=True)
    same = [a.token_ids == b.token_ids for a, b in zip(outs["off"], outs["on"])]
    r = dict(results, same_tokens=f"{sum(same)}/{len(same)}",
             prefill_reduction=round(1 - results["on"]["prefill_tokens"] / results["off"]["prefill_tokens"], 3),
             speedup=round(results["off"]["wall_seconds"] / results["on"]["wall_seconds"], 3),
             config=dict(vars(args)), machine=machine(), command=command)
    print({k: r[k] for k in ("same_tokens", "prefill_reduction", "speedup")})
    if args.json:
        write_json(os.path.join(ROOT, args.json) if not os.path.isabs(args.json) else args.json, r)
    return r


def chat_main(engine_model, tok, base, args, command):
    systems = {name: ChatSystem(engine_model, tok, EngineConfig(**base, kv_offload_bytes=off), args)
               for name, off in (("off", 0), ("on", int(args.offload_gib * 2 ** 30)))}
    for _ in range(args.repeats):   # the systems' runs alternate, so a change of machine load hits both
        for sys_ in systems.values():
            sys_.run()
    results = {name: sys_.result() for name, sys_ in systems.items()}
    outs = {name: sys_.outs for name, sys_ in systems.items()}
    for name in systems:
        print(name, {k: v for k, v in results[name].items() if k != "per_request"}, flush=True)
    same = [a.token_ids == b.token_ids for a, b in zip(outs["off"], outs["on"])]
    on, off = results["on"], results["off"]
    r = dict(results, same_tokens=f"{sum(same)}/{len(same)}",
             ttft_speedup=round(off["ttft_mean_s"] / on["ttft_mean_s"], 3),
             config=dict(vars(args)), machine=machine(), command=command)
    print({k: r[k] for k in ("same_tokens", "ttft_speedup")})
    if args.json:
        write_json(os.path.join(ROOT, args.json) if not os.path.isabs(args.json) else args.json, r)
    return r


if __name__ == "__main__":
    main()
