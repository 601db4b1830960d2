"""Mixtures of experts under tensor parallelism on simulated CPU devices, reported as JSON (run by
tests/test_moe_ep.py and tests/test_bench_moe_ep.py).

JAX fixes its device count when it starts, so these runs need their own process:

    python tests/moe_ep_check.py OUT.json MODE [--full]

(the script sets XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu itself, and
compiles its CPU programs at LLVM O0 as the test session does). The tiny Qwen3-MoE (16 float experts of
width 32, 4 per token) and gpt-oss MXFP4 (8 experts, expert biases, attention sinks) checkpoints, sharded
by models.sharding.shard in an expert layout (models.sharding.plan_experts). MODE:

- ffn (the main tier): the MoE MLP alone (models.moe.moe_ffn of layer 0, sharded vs one device, on fresh
  random tokens at a decode size (the gathered form) and a prefill size (the blocked form)) and which
  experts / ffn slices each device holds: Qwen3-MoE "experts" at tp=2 (with the whole model's prefill
  logits vs one device) and "ffn" at tp=4 (--full: both models, every layout that fits at tp = 2 and 4);
  and gpt-oss-like MXFP4 experts split on their width at tp=2 (synthetic codes, `mxfp4_ffn_run`);
- model (bench tier): the whole model's prefill and decode-step logits (models.prefill / models.decode
  with mesh=, the engine's model code) vs one device, and which experts (MXFP4 codes and scales, biases)
  each device holds: gpt-oss MXFP4 "experts" at tp=4 (--full: both models, every layout at tp = 2 and 4);
- engine (soak): LLMEngine.generate at tp = 1, 2, 4 and at tp=2 with n-gram speculation (auto layout;
  --full: every layout): greedy tokens and per-token logprobs, one compile per run.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jpa import models  # noqa: E402
import jpa.models.hf  # noqa: E402,F401
from jpa.core.sharding import tp_mesh  # noqa: E402
from jpa.models import moe, sharding  # noqa: E402

# Run as a script, its own folder (tests/) is first on the path.
from conftest import _cpu_programs_at_llvm_o0  # noqa: E402
from jpa.testing.engine import gap_inputs  # noqa: E402

_cpu_programs_at_llvm_o0()

HF = pathlib.Path(__file__).resolve().parent / "data" / "hf"
MODELS = ("qwen3_moe", "gpt_oss_mxfp4")
FAST = {"ffn": [("qwen3_moe", 2, "experts"), ("qwen3_moe", 4, "ffn")],
        "model": [("gpt_oss_mxfp4", 4, "experts")]}
# ffn mode: the whole model's prefill logits too (models.prefill with mesh=: the wiring from the scan over
# layers to the sharded experts), for these cases.
FAST_PREFILL = {("qwen3_moe", 2, "experts")}
PROMPTS = ["hello world, the quick brown fox jumps over the lazy dog", "a", "mixture of experts"]
# The engine runs: tp = 1, 2, 4, and tp=2 with n-gram speculation (the verify pass on the sharded experts).
SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, verify_rows=16)


def logits(model, mesh, inputs, decode=True):
    """(prefill logits[, then decode-step logits]) of `model` on gap inputs (jpa.testing.engine.gap_inputs; sharded over mesh if set)."""
    from jpa.kv.cache import KVCache

    (num_pages, page_size), pre_args, dec_args = inputs
    cache = KVCache.create(model.cache_config(num_pages, page_size))
    if mesh is not None:
        cache = jax.device_put(cache, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp")))
    lp, cache = jax.jit(lambda mod, ca, *a: models.prefill(mod, ca, *a, mesh=mesh))(model, cache, *pre_args)
    if not decode:
        return (np.asarray(lp),)
    ld, cache = jax.jit(lambda mod, ca, *a: models.decode(mod, ca, *a, mesh=mesh))(model, cache, *dec_args)
    return np.asarray(lp), np.asarray(ld)


def layouts(config, tp):
    """The expert layouts that fit (config, tp)."""
    out = []
    for layout in moe.EXPERT_LAYOUTS:
        try:
            sharding.plan_experts(config, tp, layout)
            out.append(layout)
        except ValueError:
            pass
    return out


def expert_weights(gpt, layer=0):
    """One layer's (router, gate, up, down, router_bias, biases) of a GPT, as moe_ffn takes them."""
    c, lay = gpt.config, gpt.layers
    get = lambda n: getattr(lay, n)[...][layer]  # noqa: E731
    w = lambda n: (get(n), get(n + "_scales")) if c.expert_format == "mxfp4" else get(n)  # noqa: E731
    biases = tuple(get(f"experts_{n}_bias") for n in ("gate", "up", "down")) if c.expert_bias else None
    return (get("router"), w("experts_gate"), w("experts_up"), w("experts_down"),
            get("router_bias") if c.router_bias else None, biases)


def ffn_gap(gpt, sharded, mesh, layout, x):
    """max |moe_ffn sharded - moe_ffn on one device| on tokens x (layer 0)."""
    c = gpt.config
    one = expert_weights(gpt)
    many = expert_weights(sharded)
    run = lambda ws, par: jax.jit(lambda x, ws: moe.moe_ffn(  # noqa: E731
        x, ws[0], ws[1], ws[2], ws[3], c, gpt.dtype, router_bias=ws[4], biases=ws[5], parallel=par))(x, ws)
    want = np.asarray(run(one, None))
    got = np.asarray(run(many, (mesh, layout)))
    return float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))


def holdings(sharded, layout, tp):
    """Per expert parameter: whether each device holds exactly its part (layout "experts": experts
    [d*E/N, (d+1)*E/N) whole; "ffn": its ffn slice of every expert), checked against the global array."""
    out = {}
    for name in sorted(sharding.EXPERT_NAMES):
        if not hasattr(sharded.layers, name):
            continue
        arr = getattr(sharded.layers, name)[...]
        full = np.asarray(arr)
        ok = len(arr.addressable_shards) == tp
        shapes = set()
        for shard in arr.addressable_shards:
            data = np.asarray(shard.data)
            shapes.add(tuple(data.shape))
            ok &= np.array_equal(data, full[shard.index])
        out[name] = dict(ok=bool(ok), global_shape=list(full.shape), shard_shapes=sorted(map(list, shapes)),
                         spec=[s if s is None or isinstance(s, str) else list(s) for s in arr.sharding.spec])
    return out


def experts_of_device(sharded, tp):
    """Which experts (global ids) each device's experts_gate shard holds, by matching rows of the global array."""
    arr = sharded.layers.experts_gate[...]
    full = np.asarray(arr)
    per_dev = {}
    for shard in arr.addressable_shards:
        data = np.asarray(shard.data)
        ids = [e for e in range(full.shape[1]) for j in range(data.shape[1])
               if np.array_equal(full[:, e], data[:, j])]
        per_dev[int(shard.device.id)] = sorted(set(ids))
    return per_dev


def model_runs(report, rng, mode, full):
    for name in MODELS:
        gpt, _ = models.load(str(HF / name))
        c = gpt.config
        cases = ([(tp, lay) for tp in (2, 4) for lay in layouts(c, tp)] if full else
                 [(tp, lay) for n, tp, lay in FAST[mode] if n == name])
        if not cases:
            continue
        if mode == "model" or any((name, tp, lay) in FAST_PREFILL for tp, lay in cases):
            inputs = gap_inputs(c, rng)
            reference = logits(gpt, None, inputs, decode=mode == "model")
        x_dec = jnp.asarray(rng.standard_normal((1, c.d_model)), jnp.float32)  # 1 token: the gathered form
        x_pre = jnp.asarray(rng.standard_normal((24, c.d_model)), jnp.float32)  # 24 tokens: the blocked form
        for tp, layout in cases:
            t0 = time.perf_counter()
            mesh = tp_mesh(tp)
            sharded, plan = sharding.shard(gpt, mesh, experts=layout)
            rec = dict(kind=mode, model=name, tp=tp, layout=layout, plan=plan.describe(),
                       auto=sharding.plan_experts(c, tp), expert_layout=sharded.expert_layout,
                       num_experts=c.num_experts, ffn_dim=c.ffn_dim)
            if mode == "model":
                got = logits(sharded, mesh, inputs)
                rec.update(logits_gap=float(max(np.max(np.abs(a - b)) for a, b in zip(got, reference))),
                           logits_scale=float(max(np.max(np.abs(b)) for b in reference)),
                           argmax_equal=all(bool(np.array_equal(a.argmax(-1), b.argmax(-1)))
                                            for a, b in zip(got, reference)))
            else:
                rec.update(ffn_gap_decode=ffn_gap(gpt, sharded, mesh, layout, x_dec),
                           ffn_gap_prefill=ffn_gap(gpt, sharded, mesh, layout, x_pre))
                if (name, tp, layout) in FAST_PREFILL or full:
                    (got,) = logits(sharded, mesh, inputs, decode=False)
                    rec.update(prefill_logits_gap=float(np.max(np.abs(got - reference[0]))),
                               logits_scale=float(np.max(np.abs(reference[0]))))
            rec.update(holdings=holdings(sharded, layout, tp), router_spec=list(sharded.layers.router[...].sharding.spec))
            if layout == "experts":
                rec["experts_of_device"] = experts_of_device(sharded, tp)
            rec["seconds"] = round(time.perf_counter() - t0, 1)
            report.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "holdings"}), file=sys.stderr, flush=True)


def mxfp4_ffn_run(report, rng):
    """gpt-oss-like MXFP4 experts split on their width ("ffn", gpt-oss-20b's layout at tp=2: 2880 = 2 x 45
    blocks of 32): the tiny gpt-oss config at ffn_dim 64 (2 blocks), fresh random codes, scales and biases,
    sharded by models.moe.expert_specs, 24 tokens (the blocked form, tiles' codes decoded) vs one device."""
    import dataclasses

    from jax.sharding import NamedSharding

    c = dataclasses.replace(models.hf.config_from_hf(json.loads((HF / "gpt_oss_mxfp4" / "config.json").read_text())),
                            ffn_dim=64)
    e, d, f = c.num_experts, c.d_model, c.ffn_dim
    mx = lambda o, i: (rng.integers(0, 256, (e, o, i // 2), dtype=np.uint8),  # noqa: E731
                       rng.integers(118, 130, (e, o, i // 32), dtype=np.uint8))
    ws = (mx(f, d), mx(f, d), mx(d, f))
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    router, rb, biases = f32(d, e), f32(e), (f32(e, f), f32(e, f), f32(e, d))
    x = f32(24, d)
    mesh = tp_mesh(2)
    layout = sharding.plan_experts(c, 2)
    *specs, bspecs = moe.expert_specs(layout, True)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    sws = tuple(tuple(put(a, sp) for a, sp in zip(w, s)) for w, s in zip(ws, specs))
    sb = tuple(put(b, sp) for b, sp in zip(biases, bspecs))
    run = lambda ws, b, par: np.asarray(jax.jit(lambda x, ws, b: moe.moe_ffn(  # noqa: E731
        x, router, *ws, c, jnp.float32, router_bias=rb, biases=b, parallel=par))(x, ws, b))
    want, got = run(ws, biases, None), run(sws, sb, (mesh, layout))
    report.append(dict(kind="mxfp4_ffn", tp=2, layout=layout, gap=float(np.max(np.abs(got - want))),
                       scale=float(np.max(np.abs(want))), down_codes_shard=list(sws[2][0].addressable_shards[0].data.shape),
                       down_codes=list(ws[2][0].shape)))


def engine_runs(report, full):
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    for name in MODELS:
        gpt, tok = models.load(str(HF / name))
        runs = [(1, None, None), (2, None, None), (4, None, None), (2, None, SPEC)]
        if full:
            runs += [(tp, lay, None) for tp in (2, 4) for lay in layouts(gpt.config, tp)]
        for tp, layout, spec in runs:
            t0 = time.perf_counter()
            old = sharding.EXPERT_LAYOUT
            sharding.EXPERT_LAYOUT = layout or "auto"
            try:
                cfg = EngineConfig(max_seqs=4, num_pages=64, page_size=8, max_model_len=128, steps_per_call=4,
                                   tensor_parallel=tp, prefix_caching=False, speculative=spec)
                engine = LLMEngine(models.GPTForEngine(gpt), tok, cfg)
                sp = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
                outs = engine.generate(PROMPTS, [sp] * len(PROMPTS))
            finally:
                sharding.EXPERT_LAYOUT = old
            s = engine.summary()
            rec = dict(kind="engine", model=name, tp=tp, layout=layout, head_plan=s["head_plan"],
                       speculative=s["speculative"] if spec else None,
                       tokens=[list(o.token_ids) for o in outs], logprobs=[list(o.logprobs) for o in outs],
                       step_compiles=s["step_compiles"], pool_whole=engine.pool_is_whole(),
                       seconds=round(time.perf_counter() - t0, 1))
            report.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k not in ("tokens", "logprobs")}), file=sys.stderr,
                  flush=True)


def main(out_path, mode, full=False):
    assert len(jax.devices()) == 8, jax.devices()
    if mode not in ("ffn", "model", "engine"):
        raise SystemExit(f"MODE must be ffn, model or engine; got {mode!r}")
    rng = np.random.default_rng()
    report = []
    if mode == "engine":
        engine_runs(report, full)
    else:
        model_runs(report, rng, mode, full)
    if mode == "ffn":
        mxfp4_ffn_run(report, rng)
    pathlib.Path(out_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], full="--full" in sys.argv[3:])
