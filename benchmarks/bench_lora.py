#!/usr/bin/env python3
"""Benchmark: LoRA adapters on a CPU. Two parts (both by default):

1. `--part methods`: the LoRA term of one linear for a per-row adapter index (`models.lora.lora_delta`), each
   method ("gather": every row's A and B gathered; "ragged": rows sorted by adapter and `jax.lax.ragged_dot`;
   "dense": every row through every slot's A), jitted, median of `--repeats` calls after a warm-up, for a
   SmolLM2-135M-sized linear (576 -> 1536) at rank 16 with 4 slots, at rows 8 (a decode step), 64 (the CPU
   ragged block) and 512 (a whole token budget), the rows' adapters drawn uniformly from the 4 slots and the
   base (-1).
2. `--part engine`: end-to-end throughput of `--model` (default smollm2-135m, float32 dense weights) with
   `--num-requests` greedy requests of `--max-new` tokens each (ignore_eos, prompts of about 20 tokens), all
   added at t0 and stepped to the end: (a) the engine without LoRA, every request on the base; (b) the engine
   with --enable-lora (max_loras 4, max_lora_rank 16), every request on the base; (c) the same engine, the
   requests spread round-robin over 4 adapters (all 4 active in every batch). The adapters are random PEFT
   directories of rank 16 on all seven targets, written here with numpy + safetensors (the layout peft saves:
   adapter_config.json and adapter_model.safetensors). Each engine is warmed up first (its compile is not
   timed); then `--rounds` interleaved timed runs of the three, the best of each kept (the machine is
   shared). Generated tokens / wall seconds.

    .venv/bin/python benchmarks/bench_lora.py                       # both parts
    .venv/bin/python benchmarks/bench_lora.py --part methods
    .venv/bin/python benchmarks/bench_lora.py --part engine --model tiny-llama --num-requests 16 --max-new 32
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jpa.models import lora  # noqa: E402



def bench_methods(repeats: int) -> None:
    rng = np.random.default_rng(0)
    n, i, r, o = 4, 576, 16, 1536
    a = jnp.asarray(rng.normal(size=(n, i, r)).astype(np.float32))
    b = jnp.asarray(rng.normal(size=(n, r, o)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(i, o)).astype(np.float32))
    print(f"\nLoRA term of one [{i} -> {o}] linear, rank {r}, {n} slots (median of {repeats} calls, ms; the base "
          f"x @ W beside it)\n")
    print("| rows | " + " | ".join(lora.LORA_METHODS) + " | base x @ W |")
    print("|---:|" + "---:|" * (len(lora.LORA_METHODS) + 1))
    for rows in (8, 64, 512):
        x = jnp.asarray(rng.normal(size=(rows, i)).astype(np.float32))
        idx = jnp.asarray(rng.integers(-1, n, size=rows).astype(np.int32))
        times = []
        for method in lora.LORA_METHODS:
            f = jax.jit(lambda x, idx, m=method: lora.lora_delta(x, idx, a, b, m))
            times.append(_median(lambda: f(x, idx), repeats))
        dot = jax.jit(lambda x: x @ w)
        base = _median(lambda: dot(x), repeats)
        print(f"| {rows} | " + " | ".join(f"{t * 1e3:.3f}" for t in times) + f" | {base * 1e3:.3f} |")


def _median(f, repeats):
    f().block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f().block_until_ready()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def write_adapter(path: pathlib.Path, config, rank: int, seed: int) -> None:
    """A random PEFT LoRA directory for a model of `config` (all seven targets, rank `rank`)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = lora.target_shapes(config)
    modules = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
               "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    tensors = {}
    for layer in range(config.num_layers):
        for name, (i, o) in shapes.items():
            pre = f"base_model.model.model.layers.{layer}.{modules[name]}"
            tensors[f"{pre}.lora_A.weight"] = (rng.normal(size=(rank, i)) * 0.02).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = (rng.normal(size=(o, rank)) * 0.02).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in
                                                                                   modules.values()],
        "bias": "none", "use_rslora": False}))


def bench_engine(model_name: str, num_requests: int, max_new: int, max_seqs: int, rounds: int) -> None:
    from jpa import LLM, LoRARequest, SamplingParams

    base_opts = dict(max_seqs=max_seqs, max_num_batched_tokens=256, page_size=16, kv_memory_bytes=64 * 2 ** 20,
                     max_model_len=256, steps_per_call=8)
    dtype = "float32"
    quant = "none" if model_name == "smollm2-135m" else None
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        plain = LLM(model_name, dtype=dtype, quantization=quant, **base_opts)
        vocab = plain.engine.model.config.vocab_size
        prompts = [rng.integers(10, min(vocab, 30000), size=20).tolist() for _ in range(num_requests)]
        adapters = []
        for k in range(4):
            write_adapter(pathlib.Path(tmp) / f"a{k}", plain.engine.model.config, 16, k)
            adapters.append(LoRARequest(f"a{k}", k + 1, str(pathlib.Path(tmp) / f"a{k}")))
        with_lora = LLM(model_name, dtype=dtype, quantization=quant, enable_lora=True, max_loras=4,
                        max_lora_rank=16, **base_opts)
        spread = [adapters[j % 4] for j in range(num_requests)]
        systems = [("no LoRA (engine without --enable-lora), base", plain, None),
                   ("--enable-lora, every request on the base", with_lora, None),
                   ("--enable-lora, 4 adapters active (round-robin)", with_lora, spread)]
        for _, llm, loras in systems:   # warm-up: compiles (not timed)
            llm.generate([prompts[0]] * 2, params, lora_request=None if loras is None else loras[:2])
        best = {}
        for _ in range(rounds):   # interleaved rounds, the best of each (the machine is shared)
            for name, llm, loras in systems:
                best[name] = max(best.get(name, (0, 0)), _run(llm, prompts, params, loras))
        rows = [(name, (*best[name], llm.engine.runner.compile_seconds)) for name, llm, _ in systems]
    print(f"\n{model_name} float32, {num_requests} requests x {max_new} greedy tokens, max_seqs {max_seqs}, "
          f"LoRA rank 16 on q/k/v/o/gate/up/down\n")
    print("| system | gen tok/s | wall s | compile s (not timed) |")
    print("|---|---:|---:|---:|")
    for name, (tps, wall, comp) in rows:
        print(f"| {name} | {tps:.1f} | {wall:.2f} | {comp:.1f} |")


def _run(llm, prompts, params, loras):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["methods", "engine", "both"], default="both")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed runs per system (the best is kept)")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; {' '.join(sys.argv)}")
    if args.part in ("methods", "both"):
        bench_methods(args.repeats)
    if args.part in ("engine", "both"):
        bench_engine(args.model, args.num_requests, args.max_new, args.max_seqs, args.rounds)


if __name__ == "__main__":
    main()
