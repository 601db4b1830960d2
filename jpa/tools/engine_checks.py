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


def step_program(runner, num_tokens: int, platform: str = "cuda", rows: int | None = None):
    """(fn, args, jit_options) of a ModelRunner's unified step for a budget of num_tokens and `rows`
    entries (default max_seqs; fewer: a rung of the step-shape ladder, `jpa.engine.ladder`), compiled
    for `platform` (a GPU: these tools compile for one): `jax.jit(fn, **jit_options).lower(*args)`
    is the program the engine compiles and runs there, with the XLA options it compiles with
    (`ModelRunner.compiler_options`: `jpa.core.xla_options.WEIGHTS_IN_PLACE` on a GPU).

    Through the runner's public methods (`step_function`, `state`, `step_inputs`, `jit_options`).
    """
    return (runner.step_function, (*runner.state(), runner.step_inputs(num_tokens, rows)),
            runner.jit_options(platform))


def expected_kernel_calls(target: str, kernel_calls, decode_calls: int) -> dict:
    """{impl: calls} of an engine step with `kernel_calls` attention kernel calls, `decode_calls` of
    them the decode loop's plain `jpa.paged_decode`: all Mosaic on Hopper (WGMMA), Ampere/Ada (8.x)
    and Blackwell (10.x, 12.x) (mma.sync: decode and the ragged op's two calls); Triton elsewhere.
    kernel_calls: an int, or {"hopper": n, "other": m} when Hopper's count differs (the verify
    pass's one multi-row decode kernel call where the others make two)."""
    del decode_calls  # every call is the same kernel family now
    major = TARGETS[target]["cc"][0]
    if isinstance(kernel_calls, dict):
        kernel_calls = kernel_calls["hopper" if major == 9 else "other"]
    if major in (8, 9, 10, 12):
        return {"mosaic": kernel_calls}
    return {"triton": kernel_calls}


# ---- 1. The engine's unified step on one GPU, SmolLM2-135M in bfloat16 ----

def engine_steps(pool_gib: float = 1.5, max_seqs: int = 64, page_size: int = 16, max_model_len: int = 2048,
                 steps_per_call: int = 8, budget: int = 512, config=None, label: str = "SmolLM2",
                 which=("plain", "spec"), quantization: str | None = None, embeddings_columns: bool | None = None,
                 rungs=()):
    """[(name, fn, args, jit_options, pool shapes, expected kernel calls)] of the engine's one
    program, the unified step: a ragged step over `budget` tokens in one pass, then the decode loop
    ("plain"), and the same with n-gram speculation ("spec"); `which` picks. jit_options: what the
    engine jits its step with on a GPU (`step_program`: donation and its XLA compiler options).

    config: the jpa.models.ModelConfig (or a dict of its fields) to compile, named `label` in the
    record; default SmolLM2-135M's. The model and the engine's state are abstract (nnx.eval_shape;
    a runner with allocate=False): no weights are read and no pool is allocated, so this runs
    without the model package. quantization: the model's weights as a quantized checkpoint keeps
    them (`jpa.tools.abstract.abstract_model`: "int8", "fp8", "Q4_0", "Q4_1", "Q4_K", "awq", "gptq");
    None: bfloat16. embeddings_columns: a tied quantized table's layout (`abstract_model`; None: the one the
    engine keeps on a GPU the Mosaic matmul serves, [d_model, vocab]). rungs: `jpa.engine.shapes.StepShape`s of
    the step-shape ladder (`step_ladder`) to compile besides, each the plain step at (rows, tokens) with the
    decode loop over its rows' slots (`jpa.engine.ladder`); the full shape is "plain" itself.
    """
    from flax import nnx

    from jpa.kv.cache import CacheConfig
    from jpa.engine.runner import ModelRunner
    from jpa.models import GPT, PRESETS, GPTForEngine, ModelConfig
    from jpa.models.gpt import layer_period
    from jpa.pallas.mosaic.ragged import short_rows

    config = PRESETS["smollm2-135m"] if config is None else config
    config = ModelConfig(**config) if isinstance(config, dict) else config
    if quantization is None:
        model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    else:
        from jpa.tools.abstract import abstract_model
        model = GPTForEngine(abstract_model(config, quantization, embeddings_columns))
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
        # sequence: on Hopper one multi-row decode kernel call when the rows' heads fit its q tile,
        # else two) and the plain decode pass of steps without drafts (one).
        (f"engine unified step, n-gram speculation k={k} ({label} bf16, verify pass of {max_seqs * (k + 1)} rows, "
         f"{max_seqs} seqs, {cache_cfg.num_pages} pages)",
         spec_fn, spec_args, spec_opts, pools,
         {"hopper": (4 if short_rows(config.num_q_heads // config.num_kv_heads, k + 1, 9.0) else 5)
          * layer_period(config), "other": 5 * layer_period(config)}),
    ]
    out = [s for s, kind in zip(steps, ("plain", "spec")) if kind in which]
    for shape in rungs:
        if (shape.rows, shape.tokens) == (max_seqs, budget):
            continue   # the full shape: "plain"
        r = runner_for()
        fn, args, opts = step_program(r, shape.tokens, rows=shape.rows)
        # A rung's ragged pass and decode loop hold the same kernels as the full shape's, on fewer rows.
        out.append((f"engine step-shape rung {shape.rows} rows x {shape.tokens} tokens ({label} bf16, "
                    f"{steps_per_call} decode steps, {max_seqs} slots, {cache_cfg.num_pages} pages)",
                    fn, args, opts, pools, 3 * layer_period(config)))
    return out


def check_engine(compiler: Compiler, log=print, **sizes) -> list:
    """Compiles the engine's unified step with impl="auto": it must hold the target's kernels three
    times per layer of the scanned body (ragged tiles, last rows, decode loop), with speculation the
    verify pass's besides (one on an H100, where its rows share a multi-row decode kernel call; two
    elsewhere): Mosaic on an H100 (WGMMA) and on an A100 / L4 / B200 (mma.sync)
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
# Mixtures of experts (models.moe). Qwen/Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 q / 4 kv heads of
# 128, 128 experts of width 768, top-8 renormalized, q/k RMSNorm, vocab 151936, untied head.
QWEN3_30B_A3B = dict(family="llama", vocab_size=151936, d_model=2048, num_layers=48, num_q_heads=32, num_kv_heads=4,
                     head_dim=128, ffn_dim=768, max_seq_len=40960, rope_base=1e6, norm_eps=1e-6, tie_embeddings=False,
                     bos_token_id=0, eos_token_id=1, qk_norm=True, num_experts=128, experts_per_token=8,
                     norm_topk_prob=True)
# openai/gpt-oss-20b's config.json (models.hf.config_from_hf of it): 24 layers, hidden 2880, 64 q / 8 kv heads of
# 64, 32 experts of width 2880 in MXFP4, top-4, sinks, q/k/v/o biases, sliding window 128 on the even layers, YaRN.
GPT_OSS_20B = dict(family="llama", vocab_size=201088, d_model=2880, num_layers=24, num_q_heads=64, num_kv_heads=8,
                   head_dim=64, ffn_dim=2880, max_seq_len=131072, rope_base=150000.0, norm_eps=1e-5,
                   tie_embeddings=False, bos_token_id=0, eos_token_id=1, qkv_bias=True, o_bias=True, attn_sinks=True,
                   router_bias=True, expert_bias=True, swiglu_clamp=(1.702, 7.0), num_experts=32, experts_per_token=4,
                   norm_topk_prob=True, expert_format="mxfp4", sliding_window=128,
                   sliding_window_layers=tuple(range(0, 24, 2)),
                   rope_scaling=("yarn", 32.0, 32.0, 1.0, 4096, 1.3465735902799727, 0.0))
# openai/gpt-oss-120b: 36 layers of 128 experts, otherwise gpt-oss-20b's shapes.
GPT_OSS_120B = dict(GPT_OSS_20B, num_layers=36, num_experts=128, sliding_window_layers=tuple(range(0, 36, 2)))
# A tiny gpt-oss-like mixture of experts (8 MXFP4 experts of width 64, top-2, sinks, biases; 8 kv heads): the
# fast case of the tensor-parallel MoE compile (tests/test_bench_moe_ep.py), expert-parallel over 8 devices.
TINY_MOE = dict(GPT_OSS_20B, vocab_size=2048, d_model=256, num_layers=2, num_q_heads=8, num_kv_heads=8, head_dim=64,
                ffn_dim=64, max_seq_len=4096, num_experts=8, experts_per_token=2, sliding_window=None,
                sliding_window_layers=(), rope_scaling=())
MODEL_SHAPES = {"llama3-8b": LLAMA_SHAPED, "llama3-70b": LLAMA3_70B_SHAPED, "qwen3-30b-a3b": QWEN3_30B_A3B,
                "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B, "tiny-moe": TINY_MOE}


def with_layers(shapes: dict, num_layers: int | None) -> dict:
    """A MODEL_SHAPES entry at num_layers layers (None: its own), gpt-oss's even layers sliding as released."""
    if not num_layers:
        return dict(shapes)
    out = dict(shapes, num_layers=num_layers)
    if out.get("sliding_window_layers"):
        out["sliding_window_layers"] = tuple(range(0, num_layers, 2))
    return out


def tp_engine_steps(compiler: Compiler, config: dict | None = None, pool_gib_per_device: float = 8.0,
                    max_seqs: int = 64, page_size: int = 16, max_model_len: int = 4096, steps_per_call: int = 8,
                    budget: int = 512, embeddings: str = "vocab", experts: str = "auto",
                    quantization: str | None = None):
    """The engine's unified step (a `budget`-token ragged pass, then the decode loop) of a
    tensor-parallel model on compiler.tp_mesh.

    The model is abstract (nnx.eval_shape) and sharded by models.sharding (params become
    ShapeDtypeStructs carrying their NamedShardings); the runner's state is abstract and sharded
    as the engine shards it. experts: a mixture of experts' layout (models.sharding.plan_experts).
    quantization: the weights stored in that format (`jpa.tools.abstract.abstract_model`); None: bfloat16.
    Returns (records' inputs, details): [(name, fn, args, jit_options, per-device pool shapes,
    expected kernel calls, model passes)] and a dict of the sizes.
    """
    from flax import nnx

    from jpa.kv.cache import CacheConfig
    from jpa.engine.runner import ModelRunner
    from jpa.models import GPT, GPTForEngine, ModelConfig
    from jpa.models.gpt import layer_period

    mesh = compiler.tp_mesh
    tp = mesh.shape["tp"]
    config = ModelConfig(**(config or LLAMA_SHAPED)) if not isinstance(config, ModelConfig) else config
    if quantization is None:
        model = GPTForEngine(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    else:
        from jpa.tools.abstract import abstract_model
        model = GPTForEngine(abstract_model(config, quantization))
    model = model.shard(mesh, embeddings=embeddings, **({"experts": experts} if config.num_experts else {}))
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
    layer_params = model.params["layers"]
    spec_names = [n for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "sinks", "router", "experts_gate",
                              "experts_gate_scales", "experts_up", "experts_down", "experts_down_scales",
                              "experts_gate_bias", "experts_down_bias") if n in layer_params]
    details = dict(tp=tp, head_plan=model.head_plan.describe(), embeddings=model.head_plan.embeddings,
                   head_plan_mode=model.head_plan.mode, orig_kv_heads=model.head_plan.orig_kv_heads,
                   budget=budget, max_model_len=max_model_len, pool_gib_per_device=pool_gib_per_device,
                   num_layers=mc.num_layers, layers_per_body=layer_period(mc),
                   d_model=mc.d_model, num_q_heads=mc.num_q_heads,
                   num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
                   num_pages=cache_cfg.num_pages, page_size=page_size, max_seqs=max_seqs,
                   steps_per_call=steps_per_call, param_bytes_per_device=param_bytes, pool_bytes_per_device=cache_cfg.nbytes // tp,
                   pool_spec=str(runner.cache.k.sharding.spec),
                   param_specs={n: str(layer_params[n].sharding.spec) for n in spec_names},
                   num_experts=mc.num_experts, expert_layout=model.head_plan.experts,
                   expert_format=mc.expert_format if mc.num_experts else None)
    # Two model passes (the ragged pass and the decode loop's body), each with the kernel calls of
    # a ragged op (2 per layer) or a decode (1 per layer).
    label = f"{mc.num_experts}-expert MoE ({model.head_plan.experts}), " if mc.num_experts else ""
    steps = [
        (f"tp={tp} {label}unified step ({budget}-token budget + {steps_per_call} decode steps, {max_seqs} seqs, "
         f"{cache_cfg.num_pages} pages)", fn, args, jit_options, pools, 3 * layer_period(mc), 2),
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
                                   num_pages=details["num_pages"], page_size=details["page_size"],
                                   max_tokens=details["budget"])
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
            # Every collective: where it runs (a layer body, another loop, once), how often, its role.
            table = host_table(host_collectives(hlo, [d.process_index for d in compiler.tp_mesh.devices.flat]),
                               num_layers)
            for r in table:
                r["role"] = cross_host_role(r, details["d_model"])
            rec["collective_table"] = [{k: r[k] for k in ("op", "type", "where", "count", "per_layer", "loops",
                                                          "bytes_each", "role")} for r in table]
            if len(row) != 2 * passes * num_layers:
                rec["problems"].append(f"expected 2 row-parallel all-reduces per layer and model pass "
                                       f"({2 * passes * num_layers}); found {len(row)}")
            # Nothing with a head axis (K/V, q, attention outputs) or a pool dimension may move.
            moved = [c for c in items
                     if moves_heads_or_pool(c, details["head_dim"], details["num_pages"], details["page_size"])]
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
        if compiler.hosts == 1:
            for r in rec.get("collective_table", []):
                where = (f"{r['per_layer']:g} per layer" if r["where"] == "layer"
                         else f"x{r['count']} ({'in loops ' + 'x'.join('?' if t is None else str(t) for t in r['loops']) if r['loops'] else 'once'})")
                log(f"      {r['op']} {r['type']} {where}, {r['bytes_each'] / 2**20:.3f} MiB each: {r['role']}")
        for r in rec.get("host_collectives", []):
            loops = "x".join("?" if t is None else str(t) for t in r["loops"])
            where = (f"{r['per_layer']:g} per layer" if r["where"] == "layer"
                     else f"x{r['count']} ({'in loops ' + loops if loops else 'once'})")
            log(f"      {'CROSS-HOST' if r['cross_host'] else 'in-host   '} {r['op']} {r['type']} {where}, "
                f"{r['bytes_each'] / 2**20:.3f} MiB each, groups of {r['group_size']} over {r['hosts_per_group']} "
                f"host(s): {r['role']}")
    return records


# ---- 3. One mixture-of-experts layer's experts, sharded over N GPUs (the fast case) ----

def check_moe_layer(compiler: Compiler, config: dict, token_counts=(64, 512), experts: str = "auto",
                    log=print) -> list:
    """Compiles one layer's MoE MLP (models.moe.moe_ffn with parallel=(mesh, layout)) over compiler.tp_mesh
    for each token count (64: a decode step of 64 sequences; 512: a prompt pass), abstract weights placed
    by models.sharding's expert rules. Checks: exactly one collective, an all-reduce of f32[tokens,
    d_model] (the experts' psum); per device only its shard of the expert weights as arguments."""
    from jpa.models import ModelConfig, moe, sharding

    mesh = compiler.tp_mesh
    tp = mesh.shape["tp"]
    c = ModelConfig(**config)
    layout = sharding.plan_experts(c, tp, experts)
    e, d, f = c.num_experts, c.d_model, c.ffn_dim
    mxfp4 = c.expert_format == "mxfp4"
    sg, su, sd, (bg, bu, bd) = moe.expert_specs(layout, mxfp4)
    bf16 = jnp.bfloat16
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))  # noqa: E731

    def weight(o, i, spec):  # an [E, in, out] weight, or MXFP4 codes [E, out, in / 2] + scales [E, out, in / 32]
        if mxfp4:
            return (sds((e, o, i // 2), jnp.uint8, spec[0]), sds((e, o, i // 32), jnp.uint8, spec[1]))
        return sds((e, i, o), bf16, spec)

    ws = (sds((d, e), bf16, jax.sharding.PartitionSpec()), weight(f, d, sg), weight(f, d, su), weight(d, f, sd),
          sds((e,), bf16, jax.sharding.PartitionSpec()) if c.router_bias else None,
          (sds((e, f), bf16, bg), sds((e, f), bf16, bu), sds((e, d), bf16, bd)) if c.expert_bias else None)
    local_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
                      for x in jax.tree_util.tree_leaves(ws))
    full_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(ws))
    records = []
    for tokens in token_counts:
        x = jax.ShapeDtypeStruct((tokens, d), jnp.float32, sharding=jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))

        def fn(x, ws):
            return moe.moe_ffn(x, ws[0], ws[1], ws[2], ws[3], c, bf16, router_bias=ws[4], biases=ws[5],
                               parallel=(mesh, layout))

        form = "gathered" if tokens * c.experts_per_token < (e // tp if layout == "experts" else e) else "blocked"
        rec = compiler.compile(f"tp={tp} MoE layer ({e} experts, {layout}, {form} form, {tokens} tokens)", fn,
                               (x, ws), keep_hlo=True)
        hlo = rec.pop("hlo", "")
        rec.update(kind="moe_layer", tp=tp, expert_layout=layout, tokens=tokens, form=form,
                   weight_bytes_per_device=local_bytes, weight_bytes_all=full_bytes)
        if "error" not in rec:
            items = [c2 for v in collectives(hlo).values() for c2 in v]
            rec["collectives"] = [f"{c2['op']} {c2['type']}" for c2 in items]
            want = [f"all-reduce f32[{tokens},{d}]"]
            if rec["collectives"] != want:
                rec["problems"].append(f"expected exactly {want}; found {rec['collectives']}")
            # The weights are arguments: each device's are its shard (1/N of them), never gathered whole.
            if rec["argument_bytes"] > local_bytes + tokens * d * 4 + 4096:
                rec["problems"].append(f"arguments {rec['argument_bytes']} bytes: more than the device's expert shard "
                                       f"({local_bytes}) and the tokens")
            rec["ok"] = not rec["problems"]
        records.append(rec)
        log(record_line(rec))
        log(f"      collectives: {rec.get('collectives')}; expert weights per device {local_bytes / 2**20:.1f} MiB "
            f"of {full_bytes / 2**20:.1f} MiB")
    return records
