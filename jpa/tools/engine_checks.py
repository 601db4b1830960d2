"""Deviceless compile checks of the engine's one program, the unified step (a ragged pass over the
token budget, then the decode loop), with abstract weights and an abstract pool.

- `check_engine`: SmolLM2-135M (or any `jpa.models.ModelConfig`) in bfloat16 on one GPU, with
  `impl="auto"`: the target's kernels (Mosaic on an H100, Triton on an A100) in the program the
  expected number of times per scanned layer body, the donated pool aliased, no pool copy.
- `check_tp`: a Llama-shaped model tensor-parallel over a `Compiler(target, num_devices, hosts)`'s
  compile-only GPUs: collectives per step and per layer (exactly two row-parallel all-reduces per
  layer and model pass, nothing with a head axis or a pool dimension moved), the kernels once per
  layer body on every device, the pool shards aliased, per-device memory within the GPU's; over
  several hosts (`check_hosts`) every collective classified by the hosts its replica groups span.

`step_program` is the one place jpa.tools reaches into the runner for its jitted step function.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jpa.tools.deviceless import TARGETS, Compiler, record_line
from jpa.tools.hlo import (collective_summary, collectives, cross_host_problems, cross_host_role, host_collectives,
                           host_table, moves_heads_or_pool)


def step_program(runner, num_tokens: int, platform: str = "cuda"):
    """(fn, args, jit_options) of a ModelRunner's unified step for a budget of num_tokens, compiled
    for `platform` (a GPU: these tools compile for one): `jax.jit(fn, **jit_options).lower(*args)`
    is the program the engine compiles and runs there, with the XLA options it compiles with
    (`ModelRunner.compiler_options`: `jpa.core.xla_options.WEIGHTS_IN_PLACE` on a GPU).

    Through the runner's public methods (`step_function`, `state`, `step_inputs`, `jit_options`).
    """
    return (runner.step_function, (*runner.state(), runner.step_inputs(num_tokens)),
            runner.jit_options(platform))


def expected_kernel_calls(target: str, kernel_calls: int, decode_calls: int) -> dict:
    """{impl: calls} of an engine step with `kernel_calls` attention kernel calls, `decode_calls` of
    them the decode loop's plain `jpa.paged_decode`: all Mosaic on Hopper (WGMMA), Ampere/Ada (8.x)
    and Blackwell (10.x) (mma.sync: decode and the ragged op's two calls); Triton elsewhere."""
    del decode_calls  # every call is the same kernel family now
    major = TARGETS[target]["cc"][0]
    if major in (8, 9, 10, 12):
        return {"mosaic": kernel_calls}
    return {"triton": kernel_calls}


# ---- 1. The engine's unified step on one GPU, SmolLM2-135M in bfloat16 ----

def engine_steps(pool_gib: float = 1.5, max_seqs: int = 64, page_size: int = 16, max_model_len: int = 2048,
                 steps_per_call: int = 8, budget: int = 512, config=None, label: str = "SmolLM2",
                 which=("plain", "spec")):
    """[(name, fn, args, jit_options, pool shapes, expected kernel calls)] of the engine's one
    program, the unified step: a ragged step over `budget` tokens in one pass, then the decode loop
    ("plain"), and the same with n-gram speculation ("spec"); `which` picks. jit_options: what the
    engine jits its step with on a GPU (`step_program`: donation and its XLA compiler options).

    config: the jpa.models.ModelConfig (or a dict of its fields) to compile, named `label` in the
    record; default SmolLM2-135M's. The model and the engine's state are abstract (nnx.eval_shape;
    a runner with allocate=False): no weights are read and no pool is allocated, so this runs
    without the model package.
    """
    from flax import nnx

    from jpa.kv.cache import CacheConfig
    from jpa.engine.runner import ModelRunner
    from jpa.models import GPT, PRESETS, GPTForEngine, ModelConfig
    from jpa.models.gpt import layer_period

    config = PRESETS["smollm2-135m"] if config is None else config
    config = ModelConfig(**config) if isinstance(config, dict) else config
    model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    cache_cfg = CacheConfig.from_memory(int(pool_gib * 2 ** 30), num_layers=config.num_layers,
                                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                        page_size=page_size, dtype="bfloat16")
    from jpa.engine.speculative import SpeculativeConfig

    def runner_for(spec=None):
        r = ModelRunner(model, cache_cfg, max_seqs=max_seqs, pages_per_seq=max_model_len // page_size,
                        steps_per_call=steps_per_call, stop_ids=(config.eos_token_id,), allocate=False,
                        block_tokens=budget, speculative=spec)
        r.set_block_tokens(budget)   # the GPU default: the whole budget in one pass
        return r

    runner = runner_for()
    plain_fn, plain_args, plain_opts = step_program(runner, budget)
    # Speculative decoding as a GPU runs it: k = 4 n-gram drafts, a verify pass of max_seqs x (k + 1)
    # rows (the GPU default; set explicitly: this machine's backend is the CPU).
    k = 4
    spec = runner_for(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
                                        verify_rows=max_seqs * (k + 1)))
    spec_fn, spec_args, spec_opts = step_program(spec, budget)
    pool = ((config.num_layers, config.num_kv_heads, cache_cfg.num_pages, page_size, config.head_dim), "bfloat16")
    pools = [pool] * 2  # the stacked K and V pools (jpa.KVCache)
    steps = [
        # The ragged op is two kernel calls (prompt tiles + the last rows' decode kernel) per layer,
        # the decode loop one; the layers are a scan, so the program holds one layer body of each
        # (layer_period() layers: 1 for SmolLM2).
        (f"engine unified step ({label} bf16, {budget}-token budget + {steps_per_call} decode steps, "
         f"{max_seqs} seqs, {cache_cfg.num_pages} pages)",
         plain_fn, plain_args, plain_opts, pools,
         3 * layer_period(config)),
        # With speculation the decode loop holds the verify pass (a ragged op over k + 1 rows per
        # sequence: two kernel calls) and the plain decode pass of steps without drafts (one).
        (f"engine unified step, n-gram speculation k={k} ({label} bf16, verify pass of {max_seqs * (k + 1)} rows, "
         f"{max_seqs} seqs, {cache_cfg.num_pages} pages)",
         spec_fn, spec_args, spec_opts, pools,
         5 * layer_period(config)),
    ]
    return [s for s, kind in zip(steps, ("plain", "spec")) if kind in which]


def check_engine(compiler: Compiler, log=print, **sizes) -> list:
    """Compiles the engine's unified step with impl="auto": it must hold the target's kernels three
    times per layer of the scanned body (ragged tiles, last rows, decode loop), five with speculation
    (the verify pass's two besides): Mosaic on an H100 (WGMMA) and on an A100 / L4 / B200 (mma.sync)
    (`expected_kernel_calls`)."""
    from jpa.engine.runner import attention_in
    records = []
    from jpa.models import PRESETS, ModelConfig
    from jpa.models.gpt import layer_period
    config = sizes.get("config")
    config = PRESETS["smollm2-135m"] if config is None else config
    config = ModelConfig(**config) if isinstance(config, dict) else config
    for name, fn, args, jit_options, pools, kernel_calls in engine_steps(**sizes):
        rec = compiler.compile(name, fn, args, jit_options=jit_options, pool_shapes=pools, keep_hlo=True)
        hlo = rec.pop("hlo", "")
        rec.update(kind="engine", attention=attention_in(hlo) if kernel_calls else None)
        if rec["ok"] and kernel_calls:
            # The decode loop's plain decode pass: one call per layer of the scanned body.
            want = expected_kernel_calls(compiler.target, kernel_calls, layer_period(config))
            found = {impl: rec[f"{impl}_calls"] for impl in ("mosaic", "triton")}
            if any(found[i] != want.get(i, 0) for i in found):
                rec["ok"] = False
                rec["problems"].append(f"expected kernel calls {want}; found {found}")
        records.append(rec)
        log(record_line(rec))
    return records


# ---- 2. Tensor parallelism: a Llama-shaped model over N GPUs of one or more hosts ----

# Llama-3-8B's shapes (random weights: nothing is read, only shapes matter to the compiler).
LLAMA_SHAPED = dict(family="llama", vocab_size=128256, d_model=4096, num_layers=32, num_q_heads=32,
                    num_kv_heads=8, head_dim=128, ffn_dim=14336, max_seq_len=8192, rope_base=500000.0,
                    tie_embeddings=False, bos_token_id=0, eos_token_id=1)
# Llama-3-70B's shapes (its config.json: 80 layers, hidden 8192, 64 heads, 8 kv heads, head_dim 128,
# intermediate 28672, vocab 128256, rope_theta 500000, 8192 positions, untied head).
LLAMA3_70B_SHAPED = dict(LLAMA_SHAPED, d_model=8192, num_layers=80, num_q_heads=64, ffn_dim=28672)
MODEL_SHAPES = {"llama3-8b": LLAMA_SHAPED, "llama3-70b": LLAMA3_70B_SHAPED}


def tp_engine_steps(compiler: Compiler, config: dict | None = None, pool_gib_per_device: float = 8.0,
                    max_seqs: int = 64, page_size: int = 16, max_model_len: int = 4096, steps_per_call: int = 8,
                    budget: int = 512, embeddings: str = "vocab"):
    """The engine's unified step (a `budget`-token ragged pass, then the decode loop) of a
    tensor-parallel model on compiler.tp_mesh.

    The model is abstract (nnx.eval_shape) and sharded by models.sharding (params become
    ShapeDtypeStructs carrying their NamedShardings); the runner's state is abstract and sharded
    as the engine shards it. Returns (records' inputs, details): [(name, fn, args, jit_options,
    per-device pool shapes, expected kernel calls, model passes)] and a dict of the sizes.
    """
    from flax import nnx

    from jpa.kv.cache import CacheConfig
    from jpa.engine.runner import ModelRunner
    from jpa.models import GPT, GPTForEngine, ModelConfig
    from jpa.models.gpt import layer_period

    mesh = compiler.tp_mesh
    tp = mesh.shape["tp"]
    config = ModelConfig(**(config or LLAMA_SHAPED))
    model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    model = model.shard(mesh, embeddings=embeddings)
    mc = model.config
    cache_cfg = CacheConfig.from_memory(int(pool_gib_per_device * 2 ** 30 * tp), num_layers=mc.num_layers,
                                        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                        page_size=page_size, dtype="bfloat16")
    runner = ModelRunner(model, cache_cfg, max_seqs=max_seqs, pages_per_seq=max_model_len // page_size,
                         steps_per_call=steps_per_call, stop_ids=(mc.eos_token_id,), allocate=False, mesh=mesh,
                         block_tokens=budget)
    runner.set_block_tokens(budget)   # the GPU default: the whole budget in one pass
    fn, args, jit_options = step_program(runner, budget)
    local_pool = ((mc.num_layers, mc.num_kv_heads // tp, cache_cfg.num_pages, page_size, mc.head_dim), "bfloat16")
    pools = [local_pool] * 2  # the stacked K and V pools, each device's heads
    param_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
                      for x in jax.tree_util.tree_leaves(model.params))
    details = dict(tp=tp, head_plan=model.head_plan.describe(), embeddings=model.head_plan.embeddings,
                   head_plan_mode=model.head_plan.mode, orig_kv_heads=model.head_plan.orig_kv_heads,
                   budget=budget, max_model_len=max_model_len, pool_gib_per_device=pool_gib_per_device,
                   num_layers=mc.num_layers, layers_per_body=layer_period(mc),
                   d_model=mc.d_model, num_q_heads=mc.num_q_heads,
                   num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
                   num_pages=cache_cfg.num_pages, max_seqs=max_seqs, steps_per_call=steps_per_call,
                   param_bytes_per_device=param_bytes, pool_bytes_per_device=cache_cfg.nbytes // tp,
                   pool_spec=str(runner.cache.k.sharding.spec),
                   param_specs={n: str(model.params["layers"][n].sharding.spec)
                                for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")})
    # Two model passes (the ragged pass and the decode loop's body), each with the kernel calls of
    # a ragged op (2 per layer) or a decode (1 per layer).
    steps = [
        (f"tp={tp} unified step ({budget}-token budget + {steps_per_call} decode steps, {max_seqs} seqs, "
         f"{cache_cfg.num_pages} pages)", fn, args, jit_options, pools, 3, 2),
    ]
    return steps, details


def check_hosts(rec: dict, hlo: str, compiler: Compiler, details: dict) -> list:
    """The cross-host analysis of a tensor-parallel record over several hosts: adds the collective
    table (each kind with its role, where it runs, whether it crosses hosts) and the hosts of
    each kv head's copies to rec; returns the problems of `cross_host_problems`."""
    partition_hosts = [d.process_index for d in compiler.tp_mesh.devices.flat]
    items = host_collectives(hlo, partition_hosts)
    table = host_table(items, details["layers_per_body"])
    for r in table:
        r["role"] = cross_host_role(r, details["d_model"])
    tp, orig_k = details["tp"], details["orig_kv_heads"]
    # Which hosts hold each of the model's kv heads (informational: a copy is computed on its device
    # from replicated wk/wv columns, so copies on two hosts would move nothing either). Device i
    # holds pool heads [i*K'/tp, (i+1)*K'/tp); under "replicate" pool head j is a copy of kv head
    # j // (K'/K), under "split" it is head j; "pad" appends zero heads (not listed).
    kv_hosts = None
    if details["head_plan_mode"] in ("split", "replicate"):
        per_dev, copies = details["num_kv_heads"] // tp, details["num_kv_heads"] // orig_k
        kv_hosts = [sorted({partition_hosts[i] for i in range(tp) for j in range(i * per_dev, (i + 1) * per_dev)
                            if j // copies == k}) for k in range(orig_k)]
    rec.update(topology=compiler.topology, hosts=compiler.hosts, devices_per_host=tp // compiler.hosts,
               partition_hosts=partition_hosts, kv_head_hosts=kv_hosts, host_collectives=table,
               cross_host_collectives=sum(r["count"] for r in table if r["cross_host"]),
               within_host_collectives=sum(r["count"] for r in table if not r["cross_host"]))
    problems = cross_host_problems(items, d_model=details["d_model"], head_dim=details["head_dim"],
                                   num_pages=details["num_pages"], max_tokens=details["budget"])
    return problems


def check_tp(compiler: Compiler, log=print, **sizes) -> list:
    """Compiles a Llama-shaped model's unified step over compiler.tp_mesh and checks the data
    movement: exactly two f32[tokens, d_model] all-reduces per layer and model pass (after wo and
    w_down; the ragged pass and the decode loop) plus a fixed few for sampling, no
    all-gather/all-to-all, the target's kernels three times per layer, the donated pool shards
    aliased and no pool copy."""
    records = []
    steps, details = tp_engine_steps(compiler, **sizes)
    # The layers are a scan: the program text holds one body of layer_period() layers (1 here), so
    # per-layer counts are read per body (an XLA pass that unrolled the loop would show up as more).
    num_layers = details["layers_per_body"]
    for name, fn, args, opts, pools, kernel_calls, passes in steps:
        rec = compiler.compile(name, fn, args, jit_options=opts, pool_shapes=pools, keep_hlo=True)
        hlo = rec.pop("hlo", "")
        rec.update(kind="tp", **details)
        if "error" not in rec:
            coll = collectives(hlo)
            rec["collectives_per_step"] = collective_summary(coll["step"], num_layers)
            rec["collectives_outside_loop"] = collective_summary(coll["outside"], num_layers)
            items = coll["step"] + coll["outside"]
            # The row-parallel sums: f32[tokens..., d_model] all-reduces, two per layer.
            row = [c for c in items if c["op"] == "all-reduce" and c["type"].startswith("f32[")
                   and c["type"].endswith(f",{details['d_model']}]")]
            rec["row_parallel_all_reduces"] = len(row)
            rec["other_collectives"] = collective_summary([c for c in items if c not in row], num_layers)
            if len(row) != 2 * passes * num_layers:
                rec["problems"].append(f"expected 2 row-parallel all-reduces per layer and model pass "
                                       f"({2 * passes * num_layers}); found {len(row)}")
            # Nothing with a head axis (K/V, q, attention outputs) or a pool dimension may move.
            h, pages = details["head_dim"], details["num_pages"]
            moved = [c for c in items if moves_heads_or_pool(c, h, pages)]
            if moved:
                rec["problems"].append(f"K/V, heads or pool moved between devices: {moved[:3]}")
            if compiler.hosts > 1:
                rec["problems"] += check_hosts(rec, hlo, compiler, details)
            if rec["temp_bytes"] + rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"] > \
                    TARGETS[compiler.target]["device_memory_size"]:
                rec["problems"].append("arguments + outputs + temporaries exceed the device's memory")
            if kernel_calls:
                # One plain decode call per layer of the body (the decode loop's pass).
                want = expected_kernel_calls(compiler.target, kernel_calls, num_layers)
                found = {impl: rec[f"{impl}_calls"] for impl in ("mosaic", "triton")}
                if any(found[i] != want.get(i, 0) for i in found):
                    rec["problems"].append(f"expected kernel calls {want}; found {found}")
            rec["ok"] = not rec["problems"]
        records.append(rec)
        log(record_line(rec))
        for key in ("collectives_per_step", "collectives_outside_loop"):
            if key in rec:
                log(f"      {key}: " + "; ".join(f"{op} x{v['count']} ({v['per_layer']:.2f}/layer) {v['types']} "
                                                  f"{v['bytes'] / 2**20:.2f} MiB" for op, v in rec[key].items()))
        for r in rec.get("host_collectives", []):
            loops = "x".join("?" if t is None else str(t) for t in r["loops"])
            where = (f"{r['per_layer']:g} per layer" if r["where"] == "layer"
                     else f"x{r['count']} ({'in loops ' + loops if loops else 'once'})")
            log(f"      {'CROSS-HOST' if r['cross_host'] else 'in-host   '} {r['op']} {r['type']} {where}, "
                f"{r['bytes_each'] / 2**20:.3f} MiB each, groups of {r['group_size']} over {r['hosts_per_group']} "
                f"host(s): {r['role']}")
    return records
