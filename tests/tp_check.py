"""Tensor-parallel runs on simulated CPU devices, reported as JSON (run by tests/test_tensor_parallel.py).

JAX fixes its device count when it starts, and the test session has already started it on one
device, so these runs need their own process:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/tp_check.py OUT.json

(the script sets both itself; `--hf` runs the tiny Hugging Face checkpoints (Gemma-2, Qwen3) and tiny-gpt2
(pad, with biases) instead of tiny-llama: CI's bench tier, tests/test_bench_tp_hf.py; `--full` runs both and adds tiny-gpt2 at tp=2,
tiny-llama at tp=3 and 4, and the real SmolLM2-135M at tp=2, 3 and 4). For each (model, tp) it runs the engine greedily and records the
tokens, how often each step was compiled, the shardings of the cache and the weights, and (tiny
models) the largest difference between the sharded and the single-device model's logits on
random inputs.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402


import jax  # noqa: E402
import numpy as np  # noqa: E402

from jpa import models  # noqa: E402
from jpa.testing.engine import context_gpt, gap_inputs, mixed_params, random_prompts  # noqa: E402
from jpa.kv.cache import KVCache  # noqa: E402
from jpa.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

HF = pathlib.Path(__file__).resolve().parent / "data" / "hf"
GEMMA2, QWEN3 = str(HF / "gemma2"), str(HF / "qwen3")  # tiny Hugging Face checkpoints (test data)
CASES = {  # model -> tensor-parallel sizes (1 first: the reference)
    "tiny-llama": (1, 2),         # 4 q / 2 kv heads: split (--full: and 4, replicate; 3, pad). Replicate at
                                  # tp=4 is in the suite over 2 processes (tests/test_multihost.py)
}
HF_CASES = {  # --hf (and --full): the Hugging Face families with their own layer code, and GPT-2's biases
    GEMMA2: (1, 2),               # soft caps, sliding window on alternating layers, post-norms
    QWEN3: (1, 2),                # q/k RMSNorm
    "tiny-gpt2": (1, 3),          # 4 heads with biases: pad (q/k/v biases, ffn 256 -> 258); the main tier
                                  # keeps pad's function in process (test_replicated_or_padded_heads_...)
}
# SmolLM2 (9 q / 3 kv heads: split at 3, pad at 2 and 4) runs with --full only: the suite's time.
FULL = {"tiny-llama": (1, 2, 4, 3), "tiny-gpt2": (1, 3, 2), "smollm2-135m": (1, 3, 2, 4)}
PROMPTS = {
    "tiny-llama": ["hello world", "the quick brown fox jumps", "a", "paged attention in jax and more"],
    "tiny-gpt2": ["hello world", "the quick brown fox jumps", "a"],
    "smollm2-135m": ["The capital of France is", "Paged attention stores the KV cache in"],
    GEMMA2: ["hello world, a prompt longer than the sliding window", "a"],
    QWEN3: ["hello world", "the quick brown fox"],
}
NEW_TOKENS = {"tiny-llama": 12, "tiny-gpt2": 12, "smollm2-135m": 16, GEMMA2: 12, QWEN3: 12}
SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, verify_rows=16)
# Logits compared directly on random inputs (4 more compiles per case: kept to the fast models; the
# greedy tokens of a real model are the check for SmolLM2).
LOGITS_GAP = ("tiny-llama", "tiny-gpt2")


def logits(model, mesh, inputs):
    """(prefill logits, then decode-step logits) of `model` on `inputs` (sharded over mesh if set)."""
    (num_pages, page_size), pre_args, dec_args = inputs
    cache = KVCache.create(model.cache_config(num_pages, page_size))
    if mesh is not None:
        cache = jax.device_put(cache, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp")))
    lp, cache = jax.jit(lambda mod, ca, *a: models.prefill(mod, ca, *a, mesh=mesh))(model, cache, *pre_args)
    ld, cache = jax.jit(lambda mod, ca, *a: models.decode(mod, ca, *a, mesh=mesh))(model, cache, *dec_args)
    return np.asarray(lp), np.asarray(ld)


def main(out_path, full=False, hf=False):
    rng = np.random.default_rng()
    assert len(jax.devices()) == 8, jax.devices()
    report = []
    cases = {**CASES, **HF_CASES, **FULL} if full else HF_CASES if hf else CASES
    for name, sizes in cases.items():
        # tiny-llama's n-gram speculation run must accept drafts (test_speculative_decoding_under_
        # tensor_parallelism), which depends on the weights and prompts drawn: they are seeded (this
        # draw accepts, the same every run); the other presets' weights and inputs stay fresh.
        draw = np.random.default_rng(20) if name == "tiny-llama" else rng
        gpt, tok = (models.load(name) if name.startswith("/") else
                    context_gpt(int(draw.integers(1 << 30))) if name == "tiny-llama" else
                    models.load(name, seed=int(draw.integers(1 << 30))))
        prompts = PROMPTS[name]
        sparams = [SamplingParams(max_new_tokens=NEW_TOKENS[name], greedy=True, ignore_eos=True)] * len(prompts)
        if name == "tiny-llama":
            # The context-dependent tiny model (tests/engine_util): random prompts across pages
            # too, greedy and seeded-sampled; logprobs compared as well.
            extra = random_prompts(draw, 4, hi=60)
            prompts = prompts + extra
            sparams = sparams + mixed_params(draw, len(extra), lo=NEW_TOKENS[name], hi=NEW_TOKENS[name])
        if name in LOGITS_GAP:
            inputs = gap_inputs(gpt.config, draw)
            reference = logits(gpt, None, inputs)
        # tiny-llama also runs with n-gram speculation at tp=2: its outputs must be tp=1's too.
        runs = [(tp, None) for tp in sizes] + ([(2, SPEC)] if name == "tiny-llama" else [])
        for tp, spec_cfg in runs:
            t0 = time.perf_counter()
            cfg = EngineConfig(max_seqs=4, num_pages=96, page_size=8, max_model_len=256, steps_per_call=4,
                               tensor_parallel=tp, prefix_caching=False, speculative=spec_cfg)
            engine = LLMEngine(models.GPTForEngine(gpt), tok, cfg)
            outs = engine.generate(prompts, sparams)
            s = engine.summary()
            params = engine.model.params
            layer = params["layers"]  # the stacked layer parameters ([num_layers, ...] each)
            rec = dict(model=name, tp=tp, tokens=[list(o.token_ids) for o in outs],
                       logprobs=[list(o.logprobs) for o in outs], sampled=[not p.is_greedy for p in sparams],
                       step_compiles=s["step_compiles"], head_plan=s["head_plan"],
                       pool_whole=engine.pool_is_whole(), seconds=0.0, speculative=s["speculative"])
            if tp > 1:
                spec = lambda x: list(x.sharding.spec)  # noqa: E731
                rec.update(
                    mode=engine.model.head_plan.mode,
                    cache_specs=sorted({str(spec(x)) for x in jax.tree_util.tree_leaves(engine.runner.cache)}),
                    cache_devices=len(engine.runner.cache.k.sharding.device_set),
                    local_kv_heads=engine.runner.cache.k.addressable_shards[0].data.shape[1],
                    page_state_specs=sorted({str(spec(x)) for x in jax.tree_util.tree_leaves(engine.runner.page_state)}),
                    slot_specs=sorted({str(spec(x)) for x in jax.tree_util.tree_leaves(engine.runner.slots)}),
                    weight_specs={k: spec(layer[k]) for k in ("wq", "wk", "wv", "wo", "w_up", "w_down")
                                  + (("w_gate",) if gpt.config.family == "llama" else ("bq", "bo", "b_up", "b_down"))},
                    embedding_spec=spec(params["tok_embeddings"]))
                if name in LOGITS_GAP and spec_cfg is None:
                    got = logits(_sharded_gpt(engine), engine.mesh, inputs)
                    rec["logits_gap"] = float(max(np.max(np.abs(a - b)) for a, b in zip(got, reference)))
            rec["seconds"] = round(time.perf_counter() - t0, 1)
            report.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "tokens"}), file=sys.stderr, flush=True)
    pathlib.Path(out_path).write_text(json.dumps(report, indent=1))


def _sharded_gpt(engine):
    from flax import nnx
    return nnx.merge(engine.model.graphdef, engine.model.params)


if __name__ == "__main__":
    main(sys.argv[1], full="--full" in sys.argv[2:], hf="--hf" in sys.argv[2:])
