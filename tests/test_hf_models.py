"""Hugging Face checkpoints (models.load(PATH)) against transformers, on CPU in float32.

tests/data/hf/<family>/ holds a tiny random checkpoint that transformers saved and golden data that
transformers computed from it (scripts/make_hf_golden.py, run offline in a separate virtualenv):
prompts and their token ids, prefill logits at every position (golden.npz), 32-token greedy
continuations, and chat template renderings. Each family switches on the options its loader must
get right (see that script's docstring).

Tolerance: 1e-4 absolute on float32 logits of magnitude ~5-13; measured differences are <= 3.5e-5.
"""

import dataclasses
import functools
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jpa
from jpa import models
from jpa.models import decode, forward_dense, prefill
from jpa.models import gpt as gpt_module
from jpa.models import hf
from jpa.models.chat_template import ChatTemplateError
from jpa.models.config import ModelConfig
from marks import tiered

DATA = pathlib.Path(__file__).parent / "data" / "hf"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen3_moe", "gpt_oss", "gpt_oss_mxfp4"]
ATOL = 1e-4
PAGE_SIZE = 4  # small pages: sequences span many, and windows start mid-page


def golden(family):
    return json.loads((DATA / family / "golden.json").read_text())


@functools.lru_cache(maxsize=None)
def loaded(family):
    return models.load(DATA / family, dtype=jnp.float32)


def dense_logits(model, rows):
    """forward_dense (jitted) on right-padded rows of ids -> f32[B, T, vocab]; padding does not
    change the logits at earlier positions (causal)."""
    graphdef, params = nnx.split(model)
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    fn = jax.jit(lambda p, t: forward_dense(nnx.merge(graphdef, p), t))
    return np.asarray(fn(params, jnp.asarray(tokens)))


def run_paged_greedy(model, prompts, steps):
    """Prefills `prompts` (lists of ids) as one ragged batch, then decodes `steps` greedy tokens each,
    through jitted steps with the cache donated (as the engine runs them) and scattered pages.

    Returns (prefill logits f32[B, vocab], decode logits f32[steps, B, vocab], tokens i32[B, steps]).
    """
    graphdef, params = nnx.split(model)
    prefill_step = jax.jit(lambda p, c, *a: prefill(nnx.merge(graphdef, p), c, *a), donate_argnums=1)
    decode_step = jax.jit(lambda p, c, *a: decode(nnx.merge(graphdef, p), c, *a), donate_argnums=1)
    rng = np.random.default_rng(0)
    num_seqs = len(prompts)
    lens = np.array([len(p) for p in prompts])
    pages_per_seq = -(-int(lens.max() + steps) // PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq + 2
    order = np.arange(pages_per_seq)[None, :] * num_seqs + np.arange(num_seqs)[:, None]
    tables = rng.permutation(num_pages)[order].astype(np.int32)  # [B, pages_per_seq], interleaved
    slot = lambda b, t: tables[b, t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE
    cache = jpa.KVCache.create(model.cache_config(num_pages, PAGE_SIZE))
    width = int(lens.max())
    tokens = np.zeros((num_seqs, width), np.int32)
    slots = np.full((num_seqs, width), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        slots[b, : len(p)] = [slot(b, t) for t in range(len(p))]
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    first, cache = prefill_step(params, cache, i32(tokens), i32(np.zeros(num_seqs)), i32(lens), i32(slots),
                                i32(tables))
    out_logits, out_tokens = [], []
    logits = first
    for s in range(steps):
        tok = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
        pos = lens + s
        logits, cache = decode_step(params, cache, i32(tok), i32(pos + 1),
                                    i32([slot(b, pos[b]) for b in range(num_seqs)]), i32(tables))
        out_tokens.append(tok)
        out_logits.append(np.asarray(logits))
    return np.asarray(first), np.stack(out_logits), np.stack(out_tokens, axis=1)


# ---- numerics against transformers ----

@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family):
    model, tok = loaded(family)
    g, arrays = golden(family), np.load(DATA / family / "golden.npz")
    for key, p in g["prompts"].items():
        assert tok.encode(p["text"]) == p["ids"], key
    dense = dense_logits(model, [p["ids"] for p in g["prompts"].values()])  # [B, T, vocab]
    for b, (key, p) in enumerate(g["prompts"].items()):
        want = arrays[f"{key}_logits"]  # [T_b, vocab]
        np.testing.assert_allclose(dense[b, : len(p["ids"])], want, atol=ATOL, rtol=0, err_msg=f"{family}/{key}")


@pytest.mark.parametrize("family", tiered(FAMILIES, soak=("gpt_oss",), bench=(
    "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen3_moe", "gpt_oss_mxfp4")))
def test_greedy_continuation_and_paged_decode_equal_dense_every_step(family):
    model, _ = loaded(family)
    g, arrays = golden(family), np.load(DATA / family / "golden.npz")
    prompts = [p["ids"] for p in g["prompts"].values()]
    steps = len(next(iter(g["prompts"].values()))["greedy_ids"])
    assert steps == 32
    first, step_logits, tokens = run_paged_greedy(model, prompts, steps)
    for b, (key, p) in enumerate(g["prompts"].items()):
        # The paged prefill's last-token logits are transformers' too.
        np.testing.assert_allclose(first[b], arrays[f"{key}_logits"][-1], atol=ATOL, rtol=0)
        assert tokens[b].tolist() == p["greedy_ids"], f"{family}/{key}"
    # Dense recomputation of every whole sequence (causal: position t sees what step t saw).
    dense = dense_logits(model, [p + tokens[b].tolist() for b, p in enumerate(prompts)])  # [B, T, vocab]
    for b, p in enumerate(prompts):
        want = dense[b, len(p): len(p) + steps]  # logits after each decoded token
        np.testing.assert_allclose(step_logits[:, b], want, atol=ATOL, rtol=0, err_msg=f"{family}/{b}")


@pytest.mark.bench
def test_gemma2_soft_caps_and_window_go_through_paged_attention(monkeypatch):
    model, _ = loaded("gemma2")
    c = model.config
    assert (c.attn_soft_cap, c.final_soft_cap, c.sliding_window) == (2.0, 5.0, 8)
    assert c.sliding_window_layers == (0, 2) and c.attn_scale == pytest.approx(24 ** -0.5)
    g = golden("gemma2")
    prompts = [p["ids"] for p in g["prompts"].values()]
    assert min(map(len, prompts)) > 2 * c.sliding_window  # the window cuts the context
    calls = []

    def spy(fn, kind):
        def wrapped(*args, **kw):
            calls.append((kind, kw.get("scale"), kw.get("soft_cap"), kw.get("sliding_window")))
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(gpt_module, "paged_decode", spy(jpa.paged_decode, "decode"))
    monkeypatch.setattr(gpt_module, "paged_prefill", spy(jpa.paged_prefill, "prefill"))
    first, step_logits, tokens = run_paged_greedy(model, prompts, 3)
    # The layers are a scan whose body is one period of the window pattern (2 layers: window, none),
    # so one trace makes one call per layer of the body.
    assert model.layer_period() == 2
    windows = [8, None]
    for kind in ("prefill", "decode"):
        got = [(s, cap, w) for k, s, cap, w in calls if k == kind][:2]
        assert got == [(pytest.approx(24 ** -0.5), 2.0, w) for w in windows], kind
    assert tokens.tolist() == [p["greedy_ids"][:3] for p in g["prompts"].values()]
    # Each option matters: without it the logits are far from transformers'.
    want = np.load(DATA / "gemma2" / "golden.npz")["paged_logits"]
    for over in (dict(attn_soft_cap=None), dict(sliding_window=None, sliding_window_layers=()),
                 dict(final_soft_cap=None), dict(attn_scale=None)):
        other = gpt_module.GPT(dataclasses.replace(c, **over), rngs=nnx.Rngs(0))
        nnx.update(other, nnx.state(model, nnx.Param))
        got = dense_logits(other, [prompts[0]])[0]
        assert np.abs(got - want).max() > 1e-2, over


# ---- tokenizer and chat templates ----

@pytest.mark.parametrize("family", FAMILIES)
def test_chat_templates_render_as_transformers(family):
    _, tok = loaded(family)
    g = golden(family)
    assert g["chats"], family
    for name, chat in g["chats"].items():
        if "error" in chat:
            message = chat["error"].split(": ", 1)[1]
            with pytest.raises(ChatTemplateError, match=message.replace(".", r"\.")):
                tok.render_chat(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
            continue
        text = tok.render_chat(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
        assert text == chat["text"], f"{family}/{name}"
        assert tok.encode(text) == chat["ids"], f"{family}/{name}"  # apply_chat_template(tokenize=True)
    p = g["prompts"]["chat"]
    assert tok.apply_chat_template(p["user"], system=p["system"]) == p["text"]


def test_gemma2_refuses_a_system_turn_and_every_family_renders_system_user_assistant():
    _, tok = loaded("gemma2")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tok.apply_chat_template("hi", system="be brief")
    rendered = {f: golden(f)["chats"]["multi_turn/gen"] for f in FAMILIES}
    assert [f for f, c in rendered.items() if "text" in c] == ["llama", "mistral", "qwen2", "qwen3", "mixtral",
                                                               "qwen3_moe", "gpt_oss", "gpt_oss_mxfp4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_special_ids_match_transformers(family):
    model, tok = loaded(family)
    g = golden(family)
    for text, want in g["tokenize"].items():
        assert tok.encode(text) == want["ids"], text
        assert tok.decode(want["ids"]) == want["decoded"]
        assert tok.decode(want["ids"], skip_special_tokens=True) == want["decoded_skip_special"]
    s = g["special"]
    assert tok.eos_token_id == s["eos_token_id"] and tok.vocab_size == s["vocab"]
    assert set(tok.stop_token_ids) == {s["eos_token_id"], *s["generation_eos"]}
    if s["bos_token_id"] is not None:
        assert tok.bos_token_id == model.config.bos_token_id == s["bos_token_id"]
    assert model.config.eos_token_id == tok.eos_token_id
    if family == "qwen2":  # ids in the model's padded vocabulary past the tokenizer's decode to nothing
        assert model.config.vocab_size == tok.vocab_size + 16
        want = g["tokenize"]["The capital of France is"]
        assert tok.decode([*want["ids"], model.config.vocab_size - 1]) == want["decoded"]
    with pytest.raises(ValueError, match=r"decode: ids must be >= 0; got \[-1\]"):
        tok.decode([3, -1])


# ---- loading: dtype, paths, and every refusal ----

def test_bfloat16_load_and_path_forms():
    m32, _ = loaded("qwen3")
    m16, _ = models.load(str(DATA / "qwen3"), dtype=jnp.bfloat16)
    assert m16.dtype == jnp.bfloat16 and m16.layers.wq[...].dtype == jnp.bfloat16
    # The checkpoint is stored in bfloat16: both loads hold exactly its values.
    np.testing.assert_array_equal(np.asarray(m16.layers.w_down[...][1], np.float32),
                                  np.asarray(m32.layers.w_down[...][1]))
    ids = jnp.asarray([golden("qwen3")["prompts"]["robot"]["ids"]], jnp.int32)
    a, b = forward_dense(m32, ids), forward_dense(m16, ids)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() < 0.25  # bf16 activations, logits ~10


def copy_checkpoint(family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(DATA / family, dst)
    return dst


@pytest.fixture
def reads(monkeypatch):
    """Counts tensor reads: a refused checkpoint must be refused before any."""
    count = []
    original = hf._read
    monkeypatch.setattr(hf, "_read", lambda *a: count.append(a) or original(*a))
    return count


def edit_json(path, **changes):
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("case,exc,match", [
    ("missing_shard", FileNotFoundError, r"model-00003-of-00005.safetensors is missing \(listed in "
                                         r"model.safetensors.index.json\)"),
    ("missing_config", FileNotFoundError, r"config.json is missing"),
    ("missing_tokenizer", FileNotFoundError, r"no tokenizer.json"),
    ("truncated", hf.CheckpointError, r"model-00002-of-00005.safetensors is not a whole safetensors file"),
    ("shape", hf.CheckpointError, r"tensor model.layers.0.mlp.gate_proj.weight has shape \[128, 64\]; "
                                  r"config.json implies \[192, 64\]"),
    ("model_type", hf.CheckpointError, r"model_type 'gpt_neox' is not supported; jpa loads \['llama'"),
    ("rope_type", hf.CheckpointError, r"RoPE type 'longrope' is not supported"),
    ("bias", hf.CheckpointError, r"attention_bias = True is not supported"),
    ("activation", hf.CheckpointError, r"activation 'gelu' is not supported for llama"),
    ("index", hf.CheckpointError, r"puts model.norm.weight in model-00001-of-00005.safetensors, but that file"),
])
def test_sharded_checkpoint_errors(case, exc, match, tmp_path, reads):
    d = copy_checkpoint("llama", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    if case == "missing_shard":
        (d / "model-00003-of-00005.safetensors").unlink()
    elif case == "missing_config":
        (d / "config.json").unlink()
    elif case == "missing_tokenizer":
        (d / "tokenizer.json").unlink()
    elif case == "truncated":
        f = d / "model-00002-of-00005.safetensors"
        os.truncate(f, f.stat().st_size - 1000)
    elif case == "shape":
        edit_json(d / "config.json", intermediate_size=192)
    elif case == "model_type":
        edit_json(d / "config.json", model_type="gpt_neox")
    elif case == "rope_type":
        edit_json(d / "config.json", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0})
    elif case == "bias":
        edit_json(d / "config.json", attention_bias=True)
    elif case == "activation":
        edit_json(d / "config.json", hidden_act="gelu")
    elif case == "index":
        index["weight_map"]["model.norm.weight"] = "model-00001-of-00005.safetensors"
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(exc, match=match):
        models.load(d)
    assert reads == []  # refused before any tensor was read: nothing half-loaded


def rewrite_tensor(path: pathlib.Path, name, fn):
    """Rewrites a single-file checkpoint with tensor `name` replaced by fn(tensor) (None: dropped),
    or with `name` added when it is absent."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    new = fn(tensors.get(name))
    if new is None:
        tensors.pop(name)
    else:
        tensors[name] = new
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("case,match", [
    ("float64", r"tensor model.layers.1.self_attn.q_proj.bias has dtype F64; jpa loads \['BF16', 'F16', 'F32'\]"),
    ("int32", r"tensor model.norm.weight has dtype I32"),
    ("missing", r"tensor model.layers.0.self_attn.k_proj.bias is missing"),
    ("extra", r"tensors this qwen2 config does not use: \['model.layers.0.self_attn.o_proj.bias'\]"),
    ("shape", r"tensor model.embed_tokens.weight has shape \[336, 32\]; config.json implies \[336, 64\]"),
])
def test_single_file_checkpoint_errors(case, match, tmp_path, reads):
    d = copy_checkpoint("qwen2", tmp_path)
    f = d / "model.safetensors"
    if case == "float64":
        rewrite_tensor(f, "model.layers.1.self_attn.q_proj.bias", lambda t: t.astype(np.float64))
    elif case == "int32":
        rewrite_tensor(f, "model.norm.weight", lambda t: t.astype(np.int32))
    elif case == "missing":
        rewrite_tensor(f, "model.layers.0.self_attn.k_proj.bias", lambda t: None)
    elif case == "extra":
        rewrite_tensor(f, "model.layers.0.self_attn.o_proj.bias", lambda t: np.zeros(64, np.float32))
    elif case == "shape":
        rewrite_tensor(f, "model.embed_tokens.weight", lambda t: np.ascontiguousarray(t[:, :32]))
    with pytest.raises(hf.CheckpointError, match=match):
        models.load(d)
    assert reads == []


@pytest.mark.parametrize("dtype,match", [
    (jnp.float16, r"dtype must be float32 or bfloat16; got float16"),
    ("int8", r"dtype must be float32 or bfloat16; got int8"),
    ("float7", r"dtype must be float32 or bfloat16; got 'float7'"),
])
def test_unknown_requested_dtype(dtype, match, reads):
    with pytest.raises(ValueError, match=match):
        models.load(DATA / "qwen2", dtype=dtype)
    assert reads == []


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'nope'; presets are .* Hugging Face checkpoint directory"):
        models.load("nope")
    (tmp_path / "config.json").write_text(json.dumps(golden_config("qwen2")))
    shutil.copy(DATA / "qwen2" / "tokenizer.json", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds no \*.safetensors file"):
        models.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hf.CheckpointError, match=r"config.json is not valid JSON"):
        models.load(tmp_path)


def golden_config(family):
    return json.loads((DATA / family / "config.json").read_text())


# ---- config.json translation ----

def test_config_defaults_and_layouts():
    g2 = golden_config("gemma2")
    g2.pop("layer_types")
    c = hf.config_from_hf(g2)
    assert c.sliding_window_layers == (0, 2) and c.embed_scale == 8.0 and c.norm_weight_offset == 1.0
    m = hf.config_from_hf(golden_config("mistral"))
    assert (m.sliding_window, m.sliding_window_layers) == (6, (0, 1))
    assert hf.config_from_hf({**golden_config("mistral"), "sliding_window": None}).sliding_window is None
    new = golden_config("llama")
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    rp = new["rope_parameters"]
    old.update(rope_theta=rp["rope_theta"], rope_scaling={k: v for k, v in rp.items() if k != "rope_theta"})
    assert hf.config_from_hf(old) == hf.config_from_hf(new)
    assert hf.config_from_hf(new).rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64)
    q3 = hf.config_from_hf(golden_config("qwen3"))
    assert (q3.head_dim, q3.qk_norm, q3.qkv_bias, q3.tie_embeddings) == (32, True, False, False)


@pytest.mark.parametrize("family,over,match", [
    ("qwen2", dict(use_sliding_window=True), r"use_sliding_window = True is not supported"),
    ("llama", dict(mlp_bias=True), r"mlp_bias = True is not supported"),
    ("llama", dict(partial_rotary_factor=0.5), r"partial_rotary_factor != 1 is not supported"),
    ("llama", dict(layer_types=["full_attention", "chunked_attention"]), r"layer_types must be 2 entries"),
    ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]),
     r"sliding_attention layers are not supported for qwen3"),
    ("gemma2", dict(hidden_activation="gelu"), r"activation 'gelu' is not supported for gemma2"),
    ("gemma2", dict(use_bidirectional_attention=True), r"use_bidirectional_attention = True is not supported"),
    ("qwen3", dict(quantization_config={"quant_method": "awq", "bits": 8, "group_size": 128}),
     r"quantization_config \('awq'\) has bits 8: jpa loads 4-bit AWQ checkpoints"),
    ("qwen3", dict(quantization_config={"quant_method": "hqq"}), r"quantization_config \('hqq'\) is not supported"),
    ("llama", dict(hidden_size=None), r"'hidden_size' is missing"),
    ("llama", dict(num_attention_heads=3), r"num_q_heads \(3\) must be a multiple of num_kv_heads"),
])
def test_unsupported_options_are_named(family, over, match):
    cfg = golden_config(family)
    for k, v in over.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    with pytest.raises(hf.CheckpointError, match=match):
        hf.config_from_hf(cfg)


@pytest.mark.parametrize("over,match", [
    (dict(rope_scaling=("yarn", 2.0)), r"rope_scaling must be \(\), \('linear', factor\)"),
    (dict(rope_scaling=("llama3", 8.0, 4.0, 1.0, 64)), r"needs high_freq_factor > low_freq_factor"),
    (dict(mlp_activation="relu"), r"mlp_activation must be one of \('silu', 'gelu_tanh'\)"),
    (dict(sliding_window=8), r"sliding_window \(8\) and sliding_window_layers \(\(\)\) must be set together"),
    (dict(sliding_window=8, sliding_window_layers=(2,)), r"sliding_window_layers must be a tuple of layer "
                                                         r"indices in \[0, num_layers = 2\)"),
    (dict(attn_soft_cap=0.0), r"attn_soft_cap must be a number > 0 or None"),
    (dict(qk_norm=1), r"qk_norm must be a bool"),
    (dict(family="gpt2", num_kv_heads=4, qkv_bias=True), r"\['qkv_bias'\] are llama-family options"),
])
def test_variant_config_value_errors(over, match):
    base = dataclasses.asdict(models.PRESETS["tiny-llama"])
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **over})


@pytest.mark.soak
def test_generate_command_runs_a_checkpoint_directory(capsys):
    from jpa.cli import generate as mod
    g = golden("qwen2")
    rc = mod.main(["--model", str(DATA / "qwen2"), "--greedy", "--max-new-tokens", "6", "--json", "--no-compile-cache",
                   "--no-progress", "--max-seqs", "2", "--max-model-len", "128", "--kv-memory", "1",
                   "--steps-per-call", "2", "--chat", g["prompts"]["chat"]["user"],
                   "--system", g["prompts"]["chat"]["system"]])
    out, err = capsys.readouterr()
    rec = json.loads(out.splitlines()[0])
    assert rc == 0 and rec["error"] is None
    greedy = g["prompts"]["chat"]["greedy_ids"]
    stop = next((i for i, t in enumerate(greedy) if t in loaded("qwen2")[1].stop_token_ids), None)
    assert rec["token_ids"] == greedy[: 6 if stop is None else min(6, stop + 1)]


# ---- mixture of experts (models.moe) ----

@pytest.mark.parametrize("m,k,norm,skew,impl,oss", [
    (37, 2, True, False, "blocked", False), (37, 3, False, True, "blocked", False),
    (37, 3, False, True, "ragged_dot", False), (3, 2, True, False, "blocked", False),
    (37, 4, True, True, "blocked", "float"),
    pytest.param(1, 4, True, False, "blocked", "float", marks=pytest.mark.bench),
    pytest.param(37, 4, True, False, "ragged_dot", "mxfp4", marks=pytest.mark.bench),
    pytest.param(37, 4, True, False, "blocked", "mxfp4", marks=pytest.mark.bench),
    (1, 4, True, False, "blocked", "mxfp4")])
def test_moe_grouped_matmuls_equal_the_dense_oracle_and_router_matches_numpy(m, k, norm, skew, impl, oss, monkeypatch):
    """moe_ffn (the pairs sorted by expert, then tiles of one expert each ("blocked", 8-row tiles
    here: runs spanning several tiles and padded ones) or ragged_dot; with m * k < 8 experts the
    gathered small-batch form) = moe_dense (every token through every expert, masked) on fresh
    random inputs; the router's choices and weights = a NumPy oracle. skew: a router bias that
    sends every token to expert 5 and none to some experts (empty groups). oss: gpt-oss's router
    bias, expert biases and clamped SwiGLU, the output also against a NumPy oracle of
    transformers' GptOssExperts (the clamps bite: limit 1.0); "mxfp4": the expert weights as
    MXFP4 codes and scales (dequantized in the matmuls; the oracle dequantizes with NumPy)."""
    from jpa.models import moe
    from jpa.models.moe import moe_dense, moe_ffn, route
    monkeypatch.setattr(moe, "EXPERT_MATMUL", impl)
    rng = np.random.default_rng(m * k + len(str(oss)) + 10 * (impl == "ragged_dot"))
    d, f, e = (32, 32, 8) if oss == "mxfp4" else (16, 24, 8)  # MXFP4: blocks of 32 along `in`
    cfg = dataclasses.replace(models.PRESETS["tiny-llama"], d_model=d, ffn_dim=f, num_experts=e,
                              experts_per_token=k, norm_topk_prob=norm)
    if oss:
        cfg = dataclasses.replace(cfg, router_bias=True, expert_bias=True, swiglu_clamp=(1.702, 1.0),
                                  expert_format="mxfp4" if oss == "mxfp4" else "float")
    x = rng.normal(size=(m, d)).astype(np.float32)
    router = rng.normal(size=(d, e)).astype(np.float32)
    if skew:
        x[:, 0] = np.abs(x[:, 0]) + 2.0
        router[0] = -3.0
        router[0, 5] = 3.0
        router[0, 6:] = -12.0  # never chosen
    w = [(rng.normal(size=s) / np.sqrt(s[1])).astype(np.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
    wargs = w
    if oss == "mxfp4":  # random codes; scales 2^-4..2^-2 (weights of about the float ones' size)
        wargs = [(rng.integers(0, 256, (e, o, i // 2), dtype=np.uint8),
                  rng.integers(123, 126, (e, o, i // 32), dtype=np.uint8)) for o, i in ((f, d), (f, d), (d, f))]
        w = [mxfp4_numpy(*a) for a in wargs]
    rb = rng.normal(size=(e,)).astype(np.float32) if oss else None
    biases = tuple(rng.normal(size=s).astype(np.float32) for s in ((e, f), (e, f), (e, d))) if oss else None
    kw = dict(router_bias=rb, biases=biases)
    experts, weights = (np.asarray(a) for a in jax.jit(lambda a, r, kw: route(a, r, cfg, kw["router_bias"]))(
        x, router, kw))
    logits = x.astype(np.float64) @ router + (0.0 if rb is None else rb)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    want_w = np.take_along_axis(probs, want, axis=-1)
    if norm:
        want_w /= want_w.sum(-1, keepdims=True)
    np.testing.assert_array_equal(experts, want)
    np.testing.assert_allclose(weights, want_w, atol=1e-6)
    counts = np.bincount(experts.ravel(), minlength=e)
    if skew:
        assert counts[5] == m and (counts == 0).any()
    got = jax.jit(lambda kw, *a: moe_ffn(*a, cfg, jnp.float32, **kw))(kw, x, router, *wargs)
    oracle = jax.jit(lambda kw, *a: moe_dense(*a, cfg, jnp.float32, **kw))(kw, x, router, *wargs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(oracle), atol=2e-5, rtol=0)
    assert np.abs(np.asarray(oracle)).max() > 0.1
    if oss:  # transformers' GptOssExperts._apply_gate, per chosen expert, in float64
        want = np.zeros((m, d))
        for t in range(m):
            for j, ex in enumerate(want_e := experts[t]):
                g = np.minimum(x[t] @ w[0][ex] + biases[0][ex], 1.0)
                u = np.clip(x[t] @ w[1][ex] + biases[1][ex], -1.0, 1.0)
                h = (u + 1) * g / (1 + np.exp(-1.702 * g))
                want[t] += want_w[t, j] * (h @ w[2][ex] + biases[2][ex])
            assert len(want_e) == k
        np.testing.assert_allclose(np.asarray(got), want, atol=5e-5, rtol=0)


def mxfp4_numpy(codes, scales):
    """NumPy oracle of MXFP4: codes u8[..., O, I/2], scales u8[..., O, I/32] -> f32[..., I, O]. Each nibble
    is e2m1 (sign bit, 2 exponent bits, 1 mantissa bit; exponent 0 is subnormal: m / 2), the low nibble
    the earlier value; a block of 32 values is times 2^(scale - 127)."""
    nib = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1).astype(np.int64)
    sign, ex, man = np.where(nib & 8, -1.0, 1.0), (nib >> 1) & 3, nib & 1
    val = sign * np.where(ex == 0, man / 2.0, 2.0 ** (ex - 1) * (1 + man / 2.0))
    val = val * np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1)
    return np.swapaxes(val, -1, -2).astype(np.float32)


def test_dequantize_mxfp4_equals_numpy():
    from jpa.models.moe import dequantize_mxfp4
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, (3, 5, 48), dtype=np.uint8)  # 3 experts, 5 rows, 96 values (3 blocks)
    scales = rng.integers(100, 140, (3, 5, 3), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 2, 1] = 2, 250  # near the e8m0 range's ends (f32 normals, no overflow)
    want = mxfp4_numpy(codes, scales)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(jax.jit(lambda c, s: dequantize_mxfp4(c, s, dtype))(codes, scales)).astype(np.float32)
        np.testing.assert_array_equal(got, want)  # exact: 2-bit mantissas times powers of two
    assert want.shape == (3, 96, 5) and np.abs(want).max() > 1e4


def test_moe_refusals_are_named():
    from jpa.models.sharding import plan_heads
    cfg = golden_config("qwen3_moe")
    c = hf.config_from_hf(cfg)
    assert (c.num_experts, c.experts_per_token, c.norm_topk_prob, c.ffn_dim, c.qk_norm) == (16, 4, False, 32, True)
    m = hf.config_from_hf(golden_config("mixtral"))
    assert (m.num_experts, m.experts_per_token, m.norm_topk_prob, m.ffn_dim) == (8, 2, True, 48)
    with pytest.raises(hf.CheckpointError, match=r"layers \[1\] are dense MLP layers"):
        hf.config_from_hf({**cfg, "mlp_only_layers": [1]})
    with pytest.raises(hf.CheckpointError, match=r"layers \[0\] are dense MLP layers"):
        hf.config_from_hf({**cfg, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="quantization='int8' is not supported for a mixture-of-experts"):
        models.GPT(m, rngs=nnx.Rngs(0), quantization="int8")
    # Under tensor parallelism (tests/test_moe_ep.py): 8 experts of width 48 fit neither layout over 5 devices.
    with pytest.raises(ValueError, match="tensor_parallel=5 does not fit this mixture of experts: num_experts=8"):
        plan_heads(m, 5)
    assert plan_heads(m, 1).experts is None
    with pytest.raises(ValueError, match="experts_per_token must be in"):
        dataclasses.replace(m, experts_per_token=9)
    with pytest.raises(ValueError, match="experts_per_token must be in"):
        dataclasses.replace(m, num_experts=0)


@pytest.mark.soak
def test_generate_command_runs_a_moe_checkpoint(capsys):
    """The engine's unified (ragged) step on a Mixtral checkpoint: transformers' greedy tokens."""
    from jpa.cli import generate as mod
    g = golden("mixtral")["prompts"]["robot"]
    rc = mod.main(["--model", str(DATA / "mixtral"), "--greedy", "--max-new-tokens", "8", "--json",
                   "--no-compile-cache", "--no-progress", "--max-seqs", "2", "--max-model-len", "128",
                   "--kv-memory", "1", "--steps-per-call", "2", g["text"]])
    out, err = capsys.readouterr()
    rec = json.loads(out.splitlines()[0])
    assert rc == 0 and rec["error"] is None
    assert rec["token_ids"] == g["greedy_ids"][:8]


# ---- gpt-oss ----

# openai/gpt-oss-20b's config.json (transformers 4.55 layout: rope_scaling + rope_theta, MXFP4 experts),
# less its 24-entry layer_types (the default: sliding on even layers).
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
    experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
    initializer_range=0.02, intermediate_size=2880, max_position_embeddings=131072, model_type="gpt_oss",
    num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24, num_key_value_heads=8,
    num_local_experts=32, output_router_logits=False, pad_token_id=199999,
    quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    rms_norm_eps=1e-05, rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    use_cache=True, vocab_size=201088)


def test_gpt_oss_config_layouts_defaults_and_refusals():
    from jpa.models.sharding import plan_heads
    c = hf.config_from_hf(golden_config("gpt_oss"))
    assert (c.num_experts, c.experts_per_token, c.norm_topk_prob, c.ffn_dim, c.head_dim) == (8, 4, True, 32, 32)
    assert (c.qkv_bias, c.o_bias, c.attn_sinks, c.router_bias, c.expert_bias) == (True,) * 5
    assert c.swiglu_clamp == (1.5, 1.2) and (c.sliding_window, c.sliding_window_layers) == (6, (0,))
    assert c.rope_scaling == pytest.approx(("yarn", 8.0, 4.0, 1.0, 64, 0.1 * np.log(8.0) + 1, 0.0))
    real = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
    r = hf.config_from_hf(real)
    assert (r.num_experts, r.experts_per_token, r.swiglu_clamp, r.rope_base) == (32, 4, (1.702, 7.0), 150000.0)
    assert r.sliding_window == 128 and r.sliding_window_layers == tuple(range(0, 24, 2))
    assert r.rope_scaling == pytest.approx(("yarn", 32.0, 32.0, 1.0, 4096, 0.1 * np.log(32.0) + 1, 0.0))
    bare = {k: v for k, v in real.items() if k not in ("rope_scaling", "rope_theta")}
    assert hf.config_from_hf(bare).rope_scaling == r.rope_scaling  # transformers' GptOssConfig defaults
    assert hf.config_from_hf({**bare, "rope_theta": 1e4}).rope_base == 1e4
    assert hf.config_from_hf(GPT_OSS_20B) == dataclasses.replace(r, expert_format="mxfp4")
    assert hf.config_from_hf(golden_config("gpt_oss_mxfp4")) == dataclasses.replace(c, expert_format="mxfp4")
    with pytest.raises(hf.CheckpointError, match=r"quantization_config \('awq'\) has bits None"):
        hf.config_from_hf({**GPT_OSS_20B, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(hf.CheckpointError, match=r"quantization_config \('mxfp4'\) is not supported"):
        hf.config_from_hf({**golden_config("mixtral"), "quantization_config": {"quant_method": "mxfp4"}})
    # Under tensor parallelism: float experts of width 32 split it; MXFP4's one block of 32 cannot, so the
    # 8 experts are split instead (tests/test_moe_ep.py).
    assert plan_heads(c, 2).experts == "ffn"
    assert plan_heads(dataclasses.replace(c, expert_format="mxfp4"), 2).experts == "experts"
    with pytest.raises(ValueError, match=r"swiglu_clamp must be \(\) or \(alpha, limit\)"):
        dataclasses.replace(c, swiglu_clamp=(1.0,))
    with pytest.raises(ValueError, match=r"router_bias, expert_bias, swiglu_clamp and expert_format are mixture-of-"):
        dataclasses.replace(models.PRESETS["tiny-llama"], router_bias=True)


@pytest.mark.bench
def test_gpt_oss_ragged_step_equals_transformers():
    """The engine's unified step (`ragged_hidden`, jpa.ragged_paged_attention with the layers' sinks) on
    the gpt-oss checkpoint: a first call with a 50-token chunk of one prompt and the whole of another,
    a second call with the rest of the first (a chunk after a cached prefix, past the sliding window
    and YaRN's original context) and one decode token of the second. Every row's logits are
    transformers' (golden prefill logits) or forward_dense's (the decode row)."""
    from jpa.models.gpt import ragged_hidden
    model, _ = loaded("gpt_oss")
    g, arrays = golden("gpt_oss"), np.load(DATA / "gpt_oss" / "golden.npz")
    a, b = g["prompts"]["chat"], g["prompts"]["robot"]
    assert len(a["ids"]) > 64 > 50 > len(b["ids"])
    graphdef, params = nnx.split(model)
    step = jax.jit(lambda p, c, *x: (lambda h, c: (nnx.merge(graphdef, p).logits(h), c))(
        *ragged_hidden(nnx.merge(graphdef, p), c, *x)), donate_argnums=1)
    pages_per_seq, budget = 24, 80
    tables = np.arange(2 * pages_per_seq, dtype=np.int32).reshape(pages_per_seq, 2).T[:, ::-1].copy()
    cache = jpa.KVCache.create(model.cache_config(2 * pages_per_seq, PAGE_SIZE))
    i32 = lambda x: jnp.asarray(x, jnp.int32)

    def run(cache, rows):  # rows: [(seq, first position, token ids)]
        tokens, pos, slots, cu, lens = [], [], [], [0, 0, 0], [0, 0]
        for s, p0, ids in rows:
            tokens += ids
            pos += list(range(p0, p0 + len(ids)))
            slots += [int(tables[s, t // PAGE_SIZE]) * PAGE_SIZE + t % PAGE_SIZE for t in range(p0, p0 + len(ids))]
            cu[s + 1] = len(tokens)
            lens[s] = p0 + len(ids)
        pad = budget - len(tokens)
        logits, cache = step(params, cache, i32(tokens + [0] * pad), i32(pos + [0] * pad), i32(slots + [-1] * pad),
                             i32(tables), i32(lens), i32(cu), i32(2))
        return np.asarray(logits)[: len(tokens)], cache

    got, cache = run(cache, [(0, 0, a["ids"][:50]), (1, 0, b["ids"])])
    want = np.concatenate([arrays["chat_logits"][:50], arrays["robot_logits"]])
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    nxt = b["greedy_ids"][0]
    got, cache = run(cache, [(0, 50, a["ids"][50:]), (1, len(b["ids"]), [nxt])])
    dense = dense_logits(model, [b["ids"] + [nxt]])[0, -1]
    np.testing.assert_allclose(got, np.concatenate([arrays["chat_logits"][50:], dense[None]]), atol=ATOL, rtol=0)
    assert int(np.argmax(got[-1])) == b["greedy_ids"][1]


def test_yarn_rope_equals_transformers():
    """YaRN's inverse frequencies and attention factor (models.gpt.rope_inv_freq / rope_attention_factor
    of models.hf's config) = transformers' _compute_yarn_parameters (tests/data/hf/gpt_oss/yarn.json):
    truncate on and off, mscale / mscale_all_dim, two factors. The gpt_oss checkpoint's logits check
    the rotation itself (cos and sin times the factor)."""
    from jpa.models.gpt import rope_attention_factor, rope_inv_freq
    cases = json.loads((DATA / "gpt_oss" / "yarn.json").read_text())
    assert len(cases) == 4
    for case in cases:
        c = hf.config_from_hf({**golden_config("gpt_oss"), **case["config"]})
        np.testing.assert_array_equal(rope_inv_freq(c), np.asarray(case["inv_freq"], np.float32))
        assert rope_attention_factor(c) == pytest.approx(case["attention_factor"], rel=1e-12)
    assert len({round(c["attention_factor"], 6) for c in cases}) == 3
