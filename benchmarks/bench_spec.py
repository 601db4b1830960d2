#!/usr/bin/env python3
"""Benchmark: speculative decoding (n-gram drafts proposed on the device) vs plain decoding,
SmolLM2-135M-Instruct on this machine, greedy.

Two workloads (chat template applied):
- grounded: rewrite / copy / extract tasks over a given passage (8 passages x 4 instructions),
  where the answer copies spans of the prompt: what prompt lookup is for;
- open: the 32 open-ended prompts of examples/prompts32.jsonl.

For each workload and batch size (1, 4, 32 requests at once: max_seqs = the batch, so neither
system computes idle rows; max(batch, 8) requests in all, greedy, ending at EOS or --max-new),
the same requests run on a plain engine and on one with
`--spec` (default: vLLM's '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}'). Each engine is warmed up first (compile excluded). Reported per run:
generated tokens/s over the wall time (and per CPU-second of the process: the fairer figure on a
shared machine), inter-token latency (per request: end-to-end latency /
tokens, averaged; the multi-step loop hands tokens out in bursts, so single arrival times say
little), acceptance rate and mean
accepted length, and whether every request's tokens are identical in both systems (they must be).

    .venv/bin/python benchmarks/bench_spec.py              # about 10-15 minutes here
    .venv/bin/python benchmarks/bench_spec.py --quick      # batch 1 and 4, 32 new tokens
    .venv/bin/python benchmarks/bench_spec.py --plot       # also benchmarks/spec.png
"""

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = pathlib.Path(__file__).resolve().parents[1]

from jpa.tools.bench import machine, write_json

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

PASSAGES = [
    "The lighthouse stood on a rocky point at the edge of the bay. Every night its keeper climbed the ninety "
    "steps, trimmed the wick, and wound the clockwork that turned the great lens. Ships passing in the fog "
    "counted the flashes to know where they were.",
    "Bread dough needs flour, water, salt and yeast. Mix them until the dough is smooth, then let it rise in a "
    "warm place for about an hour. Shape the loaf, let it rise again, and bake it in a hot oven until the crust "
    "is brown and the bottom sounds hollow.",
    "The city library opens at nine in the morning and closes at eight in the evening on weekdays. On Saturdays "
    "it closes at five, and on Sundays it is closed. Members may borrow up to ten books at a time for three weeks.",
    "Honeybees live in colonies with one queen, thousands of workers and a few hundred drones. Workers collect "
    "nectar and pollen, build the comb, and care for the young. The queen lays the eggs, up to two thousand a day "
    "in early summer.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. If the light stays "
    "red after two minutes, press the small button on the back with a paper clip for ten seconds. The settings "
    "will return to the factory defaults.",
    "The river rises in the northern hills and flows south for three hundred kilometres before it reaches the "
    "sea. Along the way it passes four towns, two dams and a large wetland where herons and cranes spend the "
    "winter.",
    "Our meeting on Tuesday covered three topics: the budget for next year, the new hiring plan, and the move to "
    "the second floor. The budget was approved, the hiring plan needs more work, and the move will happen in "
    "March.",
    "A good password is long, hard to guess and used for one account only. A phrase of four or five unrelated "
    "words is easier to remember than a short string of symbols, and a password manager can keep track of the "
    "rest.",
]
INSTRUCTIONS = [
    "Copy the following text exactly, word for word:\n\n{}",
    "Rewrite the following text with every sentence on its own line, keeping the words the same:\n\n{}",
    "Repeat the following passage, then say in one sentence what it is about:\n\n{}",
    "Fix any mistakes in the following text and return the whole corrected text:\n\n{}",
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model preset (tiny-llama: fast smoke runs)")
    ap.add_argument("--batches", default="1,4,32", help="requests at once (comma-separated)")
    ap.add_argument("--workloads", default="grounded,open")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="the speculative config (vLLM's JSON)")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 32 new tokens")
    ap.add_argument("--plot", action="store_true", help="also write benchmarks/spec.png")
    ap.add_argument("--out", default="benchmarks/spec.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.max_new = "1,4", min(args.max_new, 32)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches must be comma-separated ints; got {args.batches!r}")
    args.workloads = args.workloads.split(",")
    if any(b < 1 for b in args.batches) or args.max_new < 1:
        ap.error("--batches and --max-new must be >= 1")
    if set(args.workloads) - {"grounded", "open"}:
        ap.error("--workloads: grounded and/or open")
    return args


def workload(name: str) -> list[str]:
    if name == "grounded":
        return [ins.format(p) for p in PASSAGES for ins in INSTRUCTIONS]
    lines = (ROOT / "examples" / "prompts32.jsonl").read_text().splitlines()
    return [json.loads(x)["prompt"] for x in lines if x.strip()]


def drive(eng, prompts, params):
    """All prompts at t0, step() until done: (token ids per request, figures)."""
    s0 = dict(d=eng.stats.spec_draft_tokens, a=eng.stats.spec_accepted_tokens, n=eng.stats.spec_drafts)
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [eng.add_request(p, params).request_id for p in prompts]
    done, outs = {}, {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                outs[o.request_id], done[o.request_id] = o.output, time.perf_counter()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = [list(outs[i].token_ids) for i in ids]
    generated = sum(len(t) for t in tokens)
    # Per request: end-to-end latency / tokens. (Arrival times of single tokens are not observable
    # here: the multi-step loop hands tokens out in bursts of up to steps_per_call x (k + 1).)
    itl = [(done[i] - t0) / len(t) for i, t in zip(ids, tokens) if t]
    drafted, accepted = eng.stats.spec_draft_tokens - s0["d"], eng.stats.spec_accepted_tokens - s0["a"]
    drafts = eng.stats.spec_drafts - s0["n"]
    return tokens, dict(wall_s=round(wall, 3), cpu_s=round(cpu, 3), generated_tokens=generated,
                        tok_s=round(generated / wall, 2), tok_per_cpu_s=round(generated / cpu, 2),
                        itl_ms=round(1000 * float(np.mean(itl)), 2) if itl else None,
                        draft_tokens=drafted, accepted_tokens=accepted,
                        acceptance_rate=round(accepted / drafted, 4) if drafted else None,
                        mean_accepted_length=round(1 + accepted / drafts, 3) if drafts else None)


def main(argv=None):
    args = parse_args(argv)
    import jax.numpy as jnp

    from jpa import models
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig

    spec = SpeculativeConfig.parse(args.spec)
    model, tok = models.load(args.model, dtype=jnp.float32)
    gpt = models.GPTForEngine(model)
    chat = hasattr(tok, "apply_chat_template") and args.model != "tiny-llama"
    # Requests end at EOS (or max_new): past it SmolLM2 invents a new conversation, which no
    # workload would ask for. Lengths still match between the systems (identical outputs).
    params = SamplingParams(max_new_tokens=args.max_new, greedy=True)
    rows, identical = [], True
    for batch in args.batches:
        cfg = dict(max_seqs=batch, page_size=16, max_model_len=1024, num_pages=batch * 64 + 64,
                   max_num_batched_tokens=max(512, batch))
        engines = {"plain": LLMEngine(gpt, tok, EngineConfig(**cfg)),
                   "ngram": LLMEngine(gpt, tok, EngineConfig(speculative=spec, **cfg))}
        for eng in engines.values():   # compile, then forget the warm-up's prefix pages
            eng.generate(["Hello there"], SamplingParams(max_new_tokens=4, greedy=True))
            eng.flush_prefix_cache()
        for wl in args.workloads:
            texts = workload(wl)
            prompts = [tok.encode(tok.apply_chat_template(t) if chat else t) for t in texts]
            # max(batch, 8) requests (cycling through the workload's prompts), at most `batch` at once
            # (max_seqs = batch): a batch-1 figure is 8 requests one after the other.
            todo = [prompts[(i * 5) % len(prompts)] for i in range(max(batch, 8))]
            got = {}
            for name, eng in engines.items():
                got[name], fig = drive(eng, todo, params)
                eng.flush_prefix_cache()
                rows.append(dict(workload=wl, batch=batch, system=name, **fig))
                print(json.dumps(rows[-1]), flush=True)
            same = sum(a == b for a, b in zip(got["plain"], got["ngram"]))
            identical &= same == len(todo)
            rows[-1]["identical"] = rows[-2]["identical"] = f"{same}/{len(todo)}"
            rows[-1]["speedup"] = round(rows[-1]["tok_s"] / rows[-2]["tok_s"], 3)
            rows[-1]["cpu_speedup"] = round(rows[-1]["tok_per_cpu_s"] / rows[-2]["tok_per_cpu_s"], 3)
    print("\n| workload | batch | plain tok/s | ngram tok/s | speedup | speedup per CPU-s | plain ITL ms | ngram ITL ms | "
          "acceptance | mean accepted length | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, s in zip(rows[::2], rows[1::2]):
        acc = "n/a" if s["acceptance_rate"] is None else f"{100 * s['acceptance_rate']:.1f}%"
        print(f"| {s['workload']} | {s['batch']} | {p['tok_s']} | {s['tok_s']} | {s['speedup']}x | {s['cpu_speedup']}x | "
              f"{p['itl_ms']} | "
              f"{s['itl_ms']} | {acc} | {s['mean_accepted_length']} | {s['identical']} |")
    report = dict(benchmark="speculative decoding (n-gram on the device) vs plain decoding",
                  command=" ".join(["benchmarks/bench_spec.py"] + (argv if argv is not None else sys.argv[1:])),
                  machine=dict(machine(), loadavg=os.getloadavg()), model=args.model,
                  speculative=json.loads(args.spec), max_new_tokens=args.max_new, greedy=True, rows=rows)
    write_json(str(ROOT / args.out) if not os.path.isabs(args.out) else args.out, report)
    if args.plot:
        plot(rows, ROOT / "benchmarks" / "spec.png")
    return 0 if identical else 1


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    workloads = sorted({r["workload"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(workloads)
    for i, wl in enumerate(workloads):
        sp = [next(r["speedup"] for r in rows if r["workload"] == wl and r["batch"] == b and "speedup" in r)
              for b in batches]
        bars = ax.bar(np.arange(len(batches)) + i * width, sp, width, label=wl)
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(np.arange(len(batches)) + width * (len(workloads) - 1) / 2, [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens/s, n-gram speculation / plain")
    ax.set_title("Speculative decoding (n-gram on the device), SmolLM2-135M, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
