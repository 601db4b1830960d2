#!/usr/bin/env python3
"""Randomized soak of the engine under page pressure (tiny-llama with context-dependent random weights).

Random prompts, max_new_tokens, stop strings and sampling parameters go through engines with tiny
page pools (forcing preemptions), driven round by round with step(): requests arrive in waves
between steps and a few are aborted. Every result is checked against the same requests run on an
ample pool without prefix caching, where nothing is preempted or shared:

- lost / duplicated: every request comes out of step() exactly once as finished;
- leaked: after each run every page is free (and, after every round, the device's free pages plus
  the pages the running sequences hold add up to the pool, and each running request's seq_len
  matches its tokens);
- streamed tokens and text concatenate to the final token_ids and completion;
- mismatches: a request's tokens, completion or finish reason differ from the ample run, greedy
  and seeded-sampled alike (same per-request keys; must be 0), or a logprob differs by more than
  1e-5 (float32);
- stop strings: a "stop" completion never contains its stop string, and its tokens end at it.

    .venv/bin/python benchmarks/soak_engine.py                      # 1000 requests, <= 10 minutes
    .venv/bin/python benchmarks/soak_engine.py --requests 200 --time-limit 60
    .venv/bin/python benchmarks/soak_engine.py --kv-offload-memory 0.01 --check-every-round   # with a host tier

With `--kv-offload-memory GIB` the tiny pools' engines get a host tier (KV offload): preempted
requests are swapped to it and evicted prefix pages spilled to it; the same equalities must hold,
nothing may stay in either tier after a run, and `--check-every-round` checks both tiers' page
state after every round (each host page free, in one swap block or holding one spilled page; each
block a waiting request's; each prefix key in exactly one tier). The figures then count swaps
(swapped_out / swapped_in) and spilled / restored prefix pages.

tests/test_engine_random.py runs the same driver (jpa/testing/soak.py) at CI size.
"""

import argparse
import json
import pathlib
import sys

from jpa.testing.soak import soak
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds; stops starting new batches after it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every-round", action="store_true",
                    help="also check the device page state after every round (slower)")
    ap.add_argument("--kv-offload-memory", type=float, default=0.0, metavar="GIB",
                    help="a host tier of this many GiB for the tiny pools' engines (KV offload; 0 = off)")
    ap.add_argument("--json", default=None, help="write the figures here (e.g. benchmarks/soak.json)")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent "
                    "compilation cache ($JPA_CACHE_DIR/xla)")
    args = ap.parse_args(argv)
    if not (args.kv_offload_memory >= 0 and args.kv_offload_memory != float("inf")):
        ap.error(f"--kv-offload-memory must be a number of GiB >= 0; got {args.kv_offload_memory}")
    if not args.no_compile_cache:
        from jpa.args import cache_dir, enable_compile_cache

        enable_compile_cache(cache_dir() / "xla")
    total = soak(args.requests, args.time_limit, args.seed, check=args.check_every_round,
                 kv_offload_bytes=int(args.kv_offload_memory * 2 ** 30))
    print(json.dumps(total, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(total, indent=1) + "\n")
    bad = total["lost"] + total["duplicated"] + total["leaked_runs"] + total["greedy_mismatch"] \
        + total["sampled_mismatch"] + total["logprob_mismatch"] + total["stream_mismatch"] \
        + total["abort_not_prefix"] + total["bad_stop"] + total["errors"] + total["reference_preemptions"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
