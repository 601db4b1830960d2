#!/usr/bin/env python3
"""Tensor parallelism on simulated CPU devices: communication per decode step and per token.

Runs the engine (greedy, every slot busy) with the model sharded over N simulated CPU devices
(`--xla_force_host_platform_device_count`, set here before JAX starts) and reads the collectives
of the compiled decode loop from its optimized HLO (jpa.tools.hlo.collectives): how
many, of what, how many bytes per device per step, and per generated token. CPU time means little
for a multi-GPU method (the "devices" share this machine's cores), so the shape of the data
movement is the result; the tokens/s column is only there to show the runs are real.

    python benchmarks/bench_tp.py [--model smollm2-135m] [--tp 1 2 3 4] [--max-seqs 8] [--json PATH]

Wire bytes assume a ring all-reduce: each device sends and receives 2 (N-1)/N times the buffer.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jpa import models  # noqa: E402
from jpa.tools.hlo import collective_summary, collectives  # noqa: E402
from jpa.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def run(model: str, tp: int, max_seqs: int, new_tokens: int, gpt, tok) -> dict:
    cfg = EngineConfig(max_seqs=max_seqs, num_pages=max_seqs * 16, page_size=16, max_model_len=256,
                       steps_per_call=8, tensor_parallel=tp)
    engine = LLMEngine(models.GPTForEngine(gpt), tok, cfg)
    prompts = [f"Request {i}: tell me about paged attention." for i in range(max_seqs)]
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, greedy=True, ignore_eos=True))
    wall = time.perf_counter() - t0
    s = engine.summary()
    coll = collectives(engine.runner.compiled_step.as_text())
    c = engine.model.config
    step = collective_summary(coll["step"], c.num_layers)
    step_bytes = sum(v["bytes"] for v in step.values())
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    per_dev_params = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                         for x in jax.tree_util.tree_leaves(engine.model.params))
    return dict(model=model, tp=tp, head_plan=s["head_plan"], max_seqs=max_seqs, num_layers=c.num_layers,
                d_model=c.d_model, collectives_per_step=step,
                collectives_outside_loop=collective_summary(coll["outside"], c.num_layers),
                bytes_per_step=step_bytes, bytes_per_token=step_bytes / max_seqs,
                wire_bytes_per_token=ring * step_bytes / max_seqs,
                param_bytes_per_device=per_dev_params, kv_bytes_per_device=engine.cache_config.nbytes // tp,
                decode_tok_s=s["decode_tok_s"], wall_s=round(wall, 1), step_compiles=s["step_compiles"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    gpt, tok = models.load(args.model)
    rows = []
    print("| tp | heads per device | collectives per decode step (per device) | bytes/step | bytes/token "
          "| ring wire bytes/token | weights/device | KV pool/device | CPU tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        r = run(args.model, tp, args.max_seqs, args.new_tokens, gpt, tok)
        rows.append(r)
        colls = "; ".join(f"{op} x{v['count']} ({v['per_layer']:.2f}/layer) {'/'.join(v['types'])}"
                          for op, v in r["collectives_per_step"].items()) or "none"
        plan = (r["head_plan"] or "one device").split(";")[0]
        print(f"| {tp} | {plan} | {colls} | {r['bytes_per_step'] / 1024:.1f} KiB | {r['bytes_per_token'] / 1024:.1f} KiB "
              f"| {r['wire_bytes_per_token'] / 1024:.1f} KiB | {r['param_bytes_per_device'] / 2**20:.1f} MiB "
              f"| {r['kv_bytes_per_device'] / 2**20:.1f} MiB | {r['decode_tok_s']:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
