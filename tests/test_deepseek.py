"""DeepSeek-V3 (models.deepseek): MLA over the engine's paged latent cache, against transformers.

tests/data/hf/deepseek_v3{,_noqlora}/ are tiny random checkpoints transformers made (scripts/make_hf_golden.py:
q/kv LoRA ranks, the interleaved-RoPE key, YaRN with mscale, grouped routing with a correction bias, a shared
expert, a dense first layer; the second with q_lora_rank None; deepseek_v2 with V2's softmax group-limited
router). The engine serves the model through `jpa.LLM`
with the latent pool (one kv head of kv_lora_rank + rope dim, a zero-wide V pool).
"""

import dataclasses
import functools
import json
import logging
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa import models
from jpa.engine import EngineConfig
from jpa.engine.speculative import SpeculativeConfig
from jpa.kv.spec import CacheSpec
from jpa.models import deepseek

DATA = pathlib.Path(__file__).parent / "data" / "hf"
FAMILIES = ["deepseek_v3", "deepseek_v3_noqlora", "deepseek_v2"]
PAGE_SIZE = 4


@functools.lru_cache(maxsize=None)
def loaded(family):
    return models.load(DATA / family, dtype=jnp.float32)


def golden(family):
    return json.loads((DATA / family / "golden.json").read_text()), np.load(DATA / family / "golden.npz")


def latent_cache(model, num_pages):
    c = model.config
    return jpa.KVCache.create(jpa.kv.cache.CacheConfig(c.num_layers, 1, c.latent_dim, num_pages, PAGE_SIZE,
                                                       "float32", v_head_dim=0))


@pytest.mark.parametrize("family", [
    "deepseek_v3", pytest.param("deepseek_v3_noqlora", marks=pytest.mark.bench),
    pytest.param("deepseek_v2", marks=pytest.mark.bench)])
def test_prefill_logits_match_transformers(family):
    """The three prompts as one ragged batch (absorbed MLA over latent pages, interleaved tables): every row's
    logits equal transformers' within 2e-4 (logits of magnitude ~10-13)."""
    model, _ = loaded(family)
    assert isinstance(model, deepseek.DeepSeekForEngine) and isinstance(model, jpa.engine.EngineModel)
    g, arrays = golden(family)
    prompts = [p["ids"] for p in g["prompts"].values()]
    pages_per_seq = max(-(-len(ids) // PAGE_SIZE) for ids in prompts)
    tables = np.arange(3 * pages_per_seq, dtype=np.int32).reshape(pages_per_seq, 3).T[:, ::-1].copy()
    tokens, pos, slots = [], [], []
    for b, ids in enumerate(prompts):
        tokens += ids
        pos += range(len(ids))
        slots += [int(tables[b, t // PAGE_SIZE]) * PAGE_SIZE + t % PAGE_SIZE for t in range(len(ids))]
    cu = np.concatenate([[0], np.cumsum([len(ids) for ids in prompts])])
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    hidden, _ = model.ragged_hidden(model.params, latent_cache(model, 3 * pages_per_seq), i32(tokens), i32(pos),
                                    i32(slots), i32(tables), i32([len(ids) for ids in prompts]), i32(cu), i32(3))
    got = np.asarray(model.head(model.params, hidden))
    want = np.concatenate([arrays[f"{key}_logits"] for key in g["prompts"]])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def _generate(family, **options):
    model, tok = loaded(family)
    g, _ = golden(family)
    cfg = dict(max_seqs=4, page_size=PAGE_SIZE, num_pages=64, max_num_batched_tokens=32)
    llm = jpa.LLM.from_model(model, tok, engine_config=EngineConfig(**{**cfg, **options}))
    prompts = [p["ids"] for p in g["prompts"].values()]
    steps = len(next(iter(g["prompts"].values()))["greedy_ids"])
    outs = llm.generate(prompts, dict(max_tokens=steps, temperature=0, ignore_eos=True))
    return llm, outs


@functools.lru_cache(maxsize=None)
def _baseline(family):
    return _generate(family)[1]


@pytest.mark.bench
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers_through_the_engine(family):
    """jpa.LLM on the checkpoint (prompts chunked by a 32-token budget, then decode steps over the latent pool):
    transformers' greedy tokens, each token's logprob within 2e-3 of transformers' log-softmax at that step."""
    g, arrays = golden(family)
    for out, (key, p) in zip(_baseline(family), g["prompts"].items()):
        assert list(out.token_ids) == p["greedy_ids"], key
        want = _log_softmax(arrays[f"{key}_step_logits"])[np.arange(len(p["greedy_ids"])), p["greedy_ids"]]
        np.testing.assert_allclose(out.logprobs, want, atol=2e-3, rtol=0)


@pytest.mark.bench
@pytest.mark.parametrize("options", [
    dict(prefix_caching=True),
    dict(num_pages=24),                # preemption: the three sequences need ~50 pages
    dict(max_num_batched_tokens=8),    # another chunk budget
    dict(num_pages=24, kv_offload_bytes=64 << 20),   # preempted sequences swapped to the host tier and back
    dict(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
], ids=["prefix_caching", "preemption", "budget8", "offload", "ngram_speculation"])
def test_engine_features_leave_outputs_identical(options):
    """The latent pool under the engine's page work: outputs equal to the baseline's, token for token and
    logprob for logprob, and the feature really ran."""
    llm, outs = _generate("deepseek_v3", **options)
    base = _baseline("deepseek_v3")
    for o, b in zip(outs, base):
        assert o.token_ids == b.token_ids
        np.testing.assert_allclose(o.logprobs, b.logprobs, atol=1e-5, rtol=0)
    s, st = llm.engine.scheduler, llm.engine.stats
    assert llm.engine.runner.compiles == 1   # one program for every mix of lengths, chunks and decode rows
    if "num_pages" in options:
        assert s.num_preemptions > 0
    if "kv_offload_bytes" in options:
        assert st.swapped_out > 0 and st.swapped_in > 0
    if "speculative" in options:
        assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0
    if options.get("prefix_caching"):
        g, _ = golden("deepseek_v3")
        prompt = next(iter(g["prompts"].values()))["ids"]
        again = llm.generate([prompt], dict(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert again.token_ids == base[0].token_ids[:4] and s.prefix.hit_tokens > 0


@pytest.mark.bench
def test_parallel_samples_share_pages_and_copy_on_write():
    """n=2 greedy samples of one prompt share its pages; the first write into the shared last page copies it
    (copy-on-write of the latent pages): both samples equal the single run."""
    model, tok = loaded("deepseek_v3")
    g, _ = golden("deepseek_v3")
    p = g["prompts"]["robot"]
    assert len(p["ids"]) % PAGE_SIZE, "the prompt must end mid-page for its last page to be shared"
    llm = jpa.LLM.from_model(model, tok, max_seqs=4, page_size=PAGE_SIZE, num_pages=64, max_num_batched_tokens=32)
    out = llm.generate([p["ids"]], dict(n=2, max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert [list(o.token_ids) for o in out.outputs] == [p["greedy_ids"][:8]] * 2
    assert llm.engine.runner.cow_copies > 0


def test_the_engine_allocates_a_latent_pool_without_a_v_pool():
    """The spec is one latent group; the pool is one kv head of latent_dim, V zero wide; a page costs exactly the
    latents (kv_lora_rank + rope dim values per token per layer)."""
    model, tok = loaded("deepseek_v3")
    c = model.config
    llm = jpa.LLM.from_model(model, tok, max_seqs=2, page_size=PAGE_SIZE, num_pages=8, max_num_batched_tokens=16)
    eng = llm.engine
    assert eng.cache_spec.latent and eng.cache_spec.check_served() == (1, c.latent_dim)
    assert eng.runner.cache.k.shape == (c.num_layers, 1, 8, PAGE_SIZE, c.latent_dim)
    assert eng.runner.cache.v.shape == (c.num_layers, 1, 8, PAGE_SIZE, 0)
    assert eng.cache_config.bytes_per_page == c.num_layers * PAGE_SIZE * c.latent_dim * 4
    assert eng.cache_spec.bytes_per_token("float32") == c.num_layers * c.latent_dim * 4
    assert "latent [40]" in eng.cache_report()


def test_kv_bytes_per_token_next_to_llama_3_70b():
    """DeepSeek-V3's spec (61 layers of a 512 + 64 latent) against Llama-3-70B's (80 layers, 8 kv heads x 128,
    K and V), bf16: 70,272 vs 327,680 B/token (4.7x less)."""
    v3 = deepseek.cache_spec(deepseek.published("deepseek-v3"))
    llama = CacheSpec.attention(80, 8, 128)
    assert v3.bytes_per_token(jnp.bfloat16) == 61 * 576 * 2 == 70272
    assert llama.bytes_per_token(jnp.bfloat16) == 80 * 2 * 8 * 128 * 2 == 327680
    with pytest.raises(ValueError, match="name must be one of \\['deepseek-v2-lite', 'deepseek-v3'\\]"):
        deepseek.published("deepseek-r2")


def test_mtp_layers_are_noticed_and_not_loaded_and_unknown_tensors_are_refused(tmp_path, caplog):
    from safetensors.numpy import save_file

    src = DATA / "deepseek_v3"
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    save_file({f"model.layers.{layers}.eh_proj.weight": np.zeros((4, 4), np.float32),
               f"model.layers.{layers}.enorm.weight": np.zeros((4,), np.float32)}, str(d / "mtp.safetensors"))
    with caplog.at_level(logging.WARNING, logger="jpa.models.deepseek"):
        model, _ = models.load(d, dtype=jnp.float32)
    notes = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(notes) == 1 and f"[{layers}]" in notes[0] and "2 tensors" in notes[0]
    assert model.config.num_layers == layers
    save_file({"model.layers.0.self_attn.extra.weight": np.zeros((2,), np.float32)}, str(d / "extra.safetensors"))
    with pytest.raises(models.hf.CheckpointError, match="tensors jpa does not read for deepseek_v3: "
                                                        r"\['model.layers.0.self_attn.extra.weight'\]"):
        models.load(d, dtype=jnp.float32)


def test_refusals_are_named(tmp_path):
    model, _ = loaded("deepseek_v3")
    with pytest.raises(ValueError, match="quantization 'int8' is not supported for deepseek_v3"):
        models.load(DATA / "deepseek_v3", dtype=jnp.float32, quantization="int8")
    cfg = json.loads((DATA / "deepseek_v3" / "config.json").read_text())
    for over, match in ((dict(attention_bias=True), "attention_bias = True is not supported"),
                        (dict(topk_method="greedy"), "topk_method = 'greedy' is not supported"),
                        (dict(quantization_config={"quant_method": "fp8"}), r"quantization_config = .* \(block FP8\)"),
                        (dict(n_group=3), "must split into n_group \\(3\\) groups")):
        with pytest.raises(models.hf.CheckpointError, match=match):
            deepseek.config_from_hf({**cfg, **over})
    with pytest.raises(ValueError, match="impl must be 'auto' or 'xla' for MLA"):
        model.decode(model.params, latent_cache(model, 2), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                     jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32), impl="mosaic")


def test_router_groups_bias_and_scaling_match_numpy():
    """route() against a NumPy transcription of transformers' DeepseekV3TopkRouter on random tokens: the groups'
    top-2 sums pick topk_group groups, the bias steers the choice only, weights normalized and scaled."""
    rng = np.random.default_rng(7)
    c = dataclasses.replace(deepseek.published("deepseek-v3"), num_experts=16, n_group=4, topk_group=2,
                            experts_per_token=3, d_model=8)
    h = rng.standard_normal((20, 8)).astype(np.float32)
    router = rng.standard_normal((8, 16)).astype(np.float32)
    bias = (0.5 * rng.standard_normal(16)).astype(np.float32)
    experts, weights = deepseek.route(jnp.asarray(h), jnp.asarray(router), jnp.asarray(bias), c)
    scores = 1 / (1 + np.exp(-(h @ router)))
    choice = scores + bias
    group = np.sort(choice.reshape(20, 4, 4), -1)[..., -2:].sum(-1)
    keep = np.zeros((20, 4), bool)
    np.put_along_axis(keep, np.argsort(-group, -1)[:, :2], True, -1)
    masked = np.where(np.repeat(keep, 4, 1), choice, -np.inf)
    want = np.argsort(-masked, -1)[:, :3]
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(want, -1))
    w = np.take_along_axis(scores, np.asarray(experts), -1)
    np.testing.assert_allclose(np.asarray(weights), w / w.sum(-1, keepdims=True) * 2.5, rtol=1e-5)
    assert np.all(np.repeat(keep, 4, 1)[np.arange(20)[:, None], np.asarray(experts)])


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routers_match_numpy(method):
    """DeepSeek-V2's routers against a NumPy transcription of transformers' DeepseekV2TopkRouter: softmax scores,
    groups by their best score (masked to 0 outside the topk_group best), top k, times routed_scaling_factor."""
    rng = np.random.default_rng(3)
    c = dataclasses.replace(deepseek.published("deepseek-v2-lite"), num_experts=16, n_group=4, topk_group=2,
                            experts_per_token=3, d_model=8, routed_scaling_factor=1.5, router=method)
    h = rng.standard_normal((20, 8)).astype(np.float32)
    router = (2 * rng.standard_normal((8, 16))).astype(np.float32)
    experts, weights = deepseek.route(jnp.asarray(h), jnp.asarray(router), None, c)
    logits = h @ router
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    if method == "group_limited_greedy":
        best = np.argsort(-scores.reshape(20, 4, 4).max(-1), -1)[:, :2]
        keep = np.zeros((20, 4), bool)
        np.put_along_axis(keep, best, True, -1)
        scores = np.where(np.repeat(keep, 4, 1), scores, 0.0)
    want = np.argsort(-scores, -1)[:, :3]
    np.testing.assert_array_equal(np.asarray(experts), want)
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(scores, want, -1) * 1.5, rtol=1e-5)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


@pytest.mark.bench
def test_prompt_logprobs_match_transformers():
    """SamplingParams.prompt_logprobs through the engine (its ragged_hidden/head pair over the latent pool, the
    prompt in 8-token chunks): each prompt token's logprob is transformers' within 2e-3."""
    model, tok = loaded("deepseek_v3")
    g, arrays = golden("deepseek_v3")
    llm = jpa.LLM.from_model(model, tok, max_seqs=4, page_size=PAGE_SIZE, num_pages=64, max_num_batched_tokens=8)
    keys = list(g["prompts"])
    outs = llm.generate([g["prompts"][k]["ids"] for k in keys],
                        dict(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True))
    for key, out in zip(keys, outs):
        ids = g["prompts"][key]["ids"]
        want = _log_softmax(arrays[f"{key}_logits"])[np.arange(len(ids) - 1), ids[1:]]
        assert out.prompt_logprobs[0] is None
        np.testing.assert_allclose([e.logprob for e in out.prompt_logprobs[1:]], want, atol=2e-3, rtol=0)


@pytest.mark.bench
def test_bfloat16_weights_and_latent_cache_stay_near_transformers():
    """bf16 weights and a bf16 latent pool: prefill logits within 0.25 of transformers' float32 ones (measured
    0.12 at most, logits of magnitude ~12.5)."""
    model, _ = models.load(DATA / "deepseek_v3", dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16 and model.params["moe"]["router_bias"].dtype == jnp.float32
    g, arrays = golden("deepseek_v3")
    ids = g["prompts"]["robot"]["ids"]
    n = len(ids)
    pages = -(-n // PAGE_SIZE)
    c = model.config
    cache = jpa.KVCache.create(jpa.kv.cache.CacheConfig(c.num_layers, 1, c.latent_dim, pages, PAGE_SIZE, "bfloat16",
                                                        v_head_dim=0))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    hidden, cache = model.ragged_hidden(model.params, cache, i32(ids), i32(range(n)), i32(range(n)),
                                        i32([list(range(pages))]), i32([n]), i32([0, n]), i32(1))
    assert cache.k.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(model.head(model.params, hidden)), arrays["robot_logits"], atol=0.25, rtol=0)


@pytest.mark.bench
@pytest.mark.filterwarnings("ignore:XLA started before")   # ptxas's register report is not needed here
@pytest.mark.skipif(__import__("jpa.tools.deviceless", fromlist=["x"]).missing_packages() is not None,
                    reason="needs the gpu extra (compile-only CUDA packages)")
def test_engine_step_compiles_for_an_h100_with_the_latent_pool_in_place():
    """The engine's unified step (ragged pass + decode loop) over the latent pool, bf16, compiled deviceless for an
    H100: the latent pool is donated and aliased, with no copy of it (XLA does copy the zero-wide V pool, a
    constant of 0 bytes: measured, not asserted)."""
    from jpa.engine.runner import ModelRunner
    from jpa.kv.cache import CacheConfig
    from jpa.tools import deviceless
    from jpa.tools.engine_checks import step_program

    model, _ = models.load(DATA / "deepseek_v3", dtype=jnp.bfloat16)
    c = model.config
    runner = ModelRunner(model, CacheConfig(c.num_layers, 1, c.latent_dim, 256, 16, "bfloat16", v_head_dim=0),
                         max_seqs=8, pages_per_seq=16, steps_per_call=4, stop_ids=(1,), allocate=False,
                         block_tokens=64)
    runner.set_block_tokens(64)
    fn, args, opts = step_program(runner, 64)
    latent = ((c.num_layers, 1, 256, 16, c.latent_dim), "bfloat16")
    rec = deviceless.Compiler("h100").compile("deepseek step", fn, args, jit_options=opts, pool_shapes=[latent])
    assert rec["ok"], rec.get("error") or rec["problems"]
    assert rec["pool_bytes"] == c.num_layers * 256 * 16 * c.latent_dim * 2 <= rec["alias_bytes"]
