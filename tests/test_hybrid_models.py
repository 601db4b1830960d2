"""Hybrid models (models.hybrid: Qwen3.5 text, Qwen3-Next, Qwen3.5-MoE text) loaded from tiny transformers checkpoints and run
through their ragged / decode steps with a paged cache and recurrent state slots, against transformers.

tests/data/hf/qwen3_5, qwen3_next and qwen3_5_moe (scripts/make_hf_golden.py --families qwen3_5 qwen3_next
qwen3_5_moe): random weights,
prompts of 28 to 150 tokens (the "long" one crosses two 64-token GDN chunk boundaries), transformers' prefill
logits at every position and 32 greedy tokens. Pages of 4 tokens, so every prompt spans many pages.
"""

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpa import KVCache
from jpa import models
from jpa.engine.model import cache_spec_of, check_model
from jpa.models.families import CheckpointError
from jpa.models.hybrid import HybridModel

DATA = pathlib.Path(__file__).parent / "data" / "hf"
FAMILIES = ["qwen3_5", "qwen3_next", "qwen3_5_moe"]
PAGE_SIZE, PAGES_PER_SEQ, SLOTS = 4, 48, 4
LOGPROB_TOL = 2e-3


@functools.lru_cache(maxsize=None)
def loaded(family):
    model, _ = models.load(DATA / family, dtype=jnp.float32)
    return model


def golden(family):
    g = json.loads((DATA / family / "golden.json").read_text())
    return g, np.load(DATA / family / "golden.npz")


def fresh(model):
    cache = KVCache.create(model.cache_config(num_pages=SLOTS * PAGES_PER_SEQ, page_size=PAGE_SIZE))
    return cache, model.init_states(SLOTS)


def tables(batch):
    """Slot s owns pages [s * PAGES_PER_SEQ, (s + 1) * PAGES_PER_SEQ), permuted so that pages are not in order."""
    perm = np.random.default_rng(0).permutation(SLOTS * PAGES_PER_SEQ).reshape(SLOTS, PAGES_PER_SEQ)
    return perm[:batch]


@functools.lru_cache(maxsize=None)
def steps(family):
    model = loaded(family)
    ragged = jax.jit(lambda p, c, s, *a: model.ragged_hidden(p, c, *a, states=s["states"], state_slots=s["slots"]))
    decode = jax.jit(lambda p, c, s, *a: model.decode(p, c, *a, states=s["states"], state_slots=s["slots"]))
    return ragged, decode


def run_ragged(model, cache, states, entries, budget):
    """entries: [(slot, first position, ids)], one per sequence entry (entry b reads/writes slot entries[b][0] and
    uses block table row slot). Returns (hidden f32[rows, D] of the live rows, cache, states)."""
    bt = tables(SLOTS)
    toks, pos, slots_map, cu, seq_lens, eslots = [], [], [], [0], [], []
    for slot, start, ids in entries:
        p = np.arange(start, start + len(ids))
        toks += list(ids)
        pos += list(p)
        slots_map += list(bt[slot, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
        cu.append(cu[-1] + len(ids))
        seq_lens.append(start + len(ids))
        eslots.append(slot)
    n = len(entries)
    pad = budget - len(toks)
    arr = lambda a, fill=0: jnp.asarray(np.concatenate([np.asarray(a, np.int32), np.full(pad, fill, np.int32)]))
    extra = SLOTS - n  # padding entries: no rows, slot -1
    block = jnp.asarray(np.concatenate([bt[[e[0] for e in entries]], np.zeros((extra, PAGES_PER_SEQ), int)]), jnp.int32)
    ragged, _ = steps(model_family(model))
    hidden, cache, states = ragged(
        model.params, cache, {"states": states, "slots": jnp.asarray(eslots + [-1] * extra, jnp.int32)},
        arr(toks), arr(pos), arr(slots_map, -1), block, jnp.asarray(seq_lens + [0] * extra, jnp.int32),
        jnp.asarray(cu + [cu[-1]] * extra, jnp.int32), jnp.int32(n))
    return np.asarray(hidden[:cu[-1]]), cache, states, cu


def model_family(model):
    return next(f for f in FAMILIES if loaded(f) is model)


def logprobs(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


@pytest.mark.bench  # ~12 s each on the shared 2-core VM: two compiles and 31 decode steps
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logprobs_and_greedy_tokens_match_transformers(family):
    model = loaded(family)
    g, arrays = golden(family)
    keys = list(g["prompts"])
    assert max(len(g["prompts"][k]["ids"]) for k in keys) > 2 * 64  # crosses two GDN chunk boundaries
    cache, states = fresh(model)
    entries = [(slot, 0, g["prompts"][k]["ids"]) for slot, k in enumerate(keys)]
    hidden, cache, states, cu = run_ragged(model, cache, states, entries, budget=400)
    lp = logprobs(model.head(model.params, jnp.asarray(hidden)))
    for b, k in enumerate(keys):
        want = logprobs(arrays[f"{k}_logits"])
        err = np.abs(lp[cu[b]:cu[b + 1]] - want).max()
        assert err <= LOGPROB_TOL, f"{family}/{k}: prefill logprobs differ by {err}"
    # greedy decode of every prompt at once, the GDN layers in their recurrent form
    _, decode = steps(family)
    bt = jnp.asarray(tables(SLOTS), jnp.int32)
    lens = np.array([len(g["prompts"][k]["ids"]) for k in keys])
    tok = np.argmax(lp[np.array(cu[1:]) - 1], axis=-1)
    got, step_lp = [tok], []
    slots = jnp.arange(len(keys), dtype=jnp.int32)
    for _ in range(len(g["prompts"][keys[0]]["greedy_ids"]) - 1):
        lens = lens + 1
        p = lens - 1
        slot_map = np.asarray(bt)[np.arange(len(keys)), p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
        logits, cache, states = decode(model.params, cache, {"states": states, "slots": slots},
                                       jnp.asarray(tok, jnp.int32), jnp.asarray(lens, jnp.int32),
                                       jnp.asarray(slot_map, jnp.int32), bt)
        step = logprobs(logits)
        tok = np.argmax(step, axis=-1)
        got.append(tok)
        step_lp.append(step)
    got = np.stack(got, axis=1)
    for b, k in enumerate(keys):
        assert got[b].tolist() == g["prompts"][k]["greedy_ids"], f"{family}/{k}"
    # the decode steps' logprobs equal one prefill of prompt + continuation (the recurrent form against the chunked)
    b = keys.index("long")
    ids = g["prompts"]["long"]["ids"] + got[b].tolist()
    cache2, states2 = fresh(model)
    hidden2, *_ = run_ragged(model, cache2, states2, [(0, 0, ids[:-1])], budget=400)
    want = logprobs(model.head(model.params, jnp.asarray(hidden2)))[len(g["prompts"]["long"]["ids"]):]
    np.testing.assert_allclose(np.stack([s[b] for s in step_lp]), want, atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.bench)])
def test_a_prompt_in_two_ragged_calls_equals_one_call(family):
    model = loaded(family)
    g, _ = golden(family)
    ids = g["prompts"]["long"]["ids"]
    other = g["prompts"]["robot"]["ids"]
    rng = np.random.default_rng()
    cache, states = fresh(model)
    # garbage in every slot: a sequence starting at position 0 must not read it (the reset rule)
    garbage = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), states)
    untouched = jax.tree.map(np.asarray, garbage)
    one, _, s_one, _ = run_ragged(model, cache, states, [(1, 0, ids)], budget=160)  # from zero states
    states = garbage
    cut = 67  # odd, past the first 64-token chunk
    cache, _ = fresh(model)
    first, cache, s_two, _ = run_ragged(model, cache, states, [(1, 0, ids[:cut]), (2, 0, other)], budget=160)
    second, cache, s_two, _ = run_ragged(model, cache, s_two, [(1, cut, ids[cut:])], budget=160)
    # float32 rounding differs with where the chunks fall, and these random weights amplify it at some rows
    # (hidden rows up to ~1e-3 apart): compare logprobs at the golden tests' tolerance
    head = lambda h: logprobs(model.head(model.params, jnp.asarray(h)))
    np.testing.assert_allclose(head(np.concatenate([first[:cut], second])), head(one), atol=LOGPROB_TOL, rtol=0)
    for name in ("conv", "ssm"):
        got, want = np.asarray(s_two["linear"][name]), np.asarray(s_one["linear"][name])
        np.testing.assert_allclose(got[:, 1], want[:, 1], atol=1e-3, rtol=1e-3)
        np.testing.assert_array_equal(got[:, [0, 3]], untouched["linear"][name][:, [0, 3]])  # no entry's slots


@pytest.mark.bench  # a decode compile
def test_decode_of_a_first_token_starts_from_zero_whatever_its_slot_holds():
    model = loaded("qwen3_5")
    g, _ = golden("qwen3_5")
    tok = g["prompts"]["robot"]["ids"][0]
    cache, states = fresh(model)
    want, *_ = run_ragged(model, cache, states, [(2, 0, [tok])], budget=160)
    rng = np.random.default_rng()
    garbage = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), states)
    _, decode = steps("qwen3_5")
    bt = jnp.asarray(tables(SLOTS), jnp.int32)
    rows = jnp.array([2, 0, 1, 3])  # row 0: the sequence of slot 2, at position 0; the others idle
    slot_map = jnp.array([int(bt[2, 0]) * PAGE_SIZE, -1, -1, -1], jnp.int32)
    cache, _ = fresh(model)
    logits, _, new = decode(model.params, cache, {"states": garbage, "slots": jnp.array([2, -1, -1, -1], jnp.int32)},
                            jnp.full(SLOTS, tok, jnp.int32), jnp.array([1, 0, 0, 0], jnp.int32), slot_map, bt[rows])
    np.testing.assert_allclose(logprobs(logits[0]), logprobs(model.head(model.params, jnp.asarray(want[0]))),
                               atol=1e-4, rtol=0)
    for name in ("conv", "ssm"):  # slots of padding rows untouched
        np.testing.assert_array_equal(np.asarray(new["linear"][name])[:, [0, 1, 3]],
                                      np.asarray(garbage["linear"][name])[:, [0, 1, 3]])


def test_cache_spec_and_the_engine_protocol():
    model = loaded("qwen3_5")
    c = model.config
    check_model(model)
    spec = cache_spec_of(model)
    groups = {grp.name: grp for grp in spec.groups}
    assert groups["full"].layers == (3, 7) and groups["linear"].layers == (0, 1, 2, 4, 5, 6)
    assert groups["linear"].layout.shapes == (("conv", (c.conv_dim, 3), "float32"),
                                              ("ssm", (c.lin_v_heads, c.lin_v_dim, c.lin_k_dim), "float32"))
    assert model.cache_config(8).num_layers == 2
    assert isinstance(loaded("qwen3_next"), HybridModel) and loaded("qwen3_next").config.moe_layers == (0, 2, 3)


def test_call_errors_are_named():
    model = loaded("qwen3_5")
    cache, states = fresh(model)
    args = (jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="states and state_slots are required"):
        model.decode(model.params, cache, *args)
    with pytest.raises(ValueError, match="state_slots must have shape i32\\[2\\]"):
        model.decode(model.params, cache, *args, states=states, state_slots=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="states must be"):
        model.decode(model.params, cache, *args, states={"linear": {}}, state_slots=jnp.zeros(2, jnp.int32))
    wrong = KVCache.create(model.cache_config(8).__class__(num_layers=8, num_kv_heads=1, head_dim=32, num_pages=8))
    with pytest.raises(ValueError, match="cache must hold the 2 full-attention layers"):
        model.decode(model.params, wrong, *args, states=states, state_slots=jnp.zeros(2, jnp.int32))


def copy_checkpoint(family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(DATA / family, dst)
    return dst


def test_mtp_weights_are_ignored_with_a_notice_and_other_extras_refused(tmp_path, capsys):
    from safetensors.numpy import save_file

    path = copy_checkpoint("qwen3_next", tmp_path)
    save_file({"mtp.fc.weight": np.zeros((4, 4), np.float32)}, str(path / "mtp.safetensors"))
    model, _ = models.load(path, dtype=jnp.float32)
    assert isinstance(model, HybridModel)
    err = capsys.readouterr().err
    assert "multi-token-prediction" in err and len(err.strip().splitlines()) == 1
    save_file({"model.layers.0.linear_attn.extra.weight": np.zeros((4,), np.float32)}, str(path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="does not use"):
        models.load(path, dtype=jnp.float32)


def test_the_conditional_generation_layout_loads_its_text_model(tmp_path, capsys):
    """qwen3_5 (Qwen3_5ForConditionalGeneration, the released Qwen3.5 checkpoints): text_config, tensors under
    model.language_model., the vision tower ignored. Written here from the qwen3_5_text checkpoint."""
    from safetensors.numpy import load_file, save_file

    src = DATA / "qwen3_5"
    path = tmp_path / "vl"
    shutil.copytree(src, path)
    (path / "model.safetensors").unlink()
    cfg = json.loads((src / "config.json").read_text())
    top = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": cfg,
           "tie_word_embeddings": cfg["tie_word_embeddings"], "vision_config": {"depth": 1}}
    (path / "config.json").write_text(json.dumps(top))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    model, _ = models.load(path, dtype=jnp.float32)
    assert "vision tower" in capsys.readouterr().err
    assert model.config == loaded("qwen3_5").config
    jax.tree.map(np.testing.assert_array_equal, model.params, loaded("qwen3_5").params)


@pytest.mark.parametrize("change,match", [
    (dict(hidden_act="gelu"), "activation 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)), "RoPE type 'yarn'"),
    (dict(layer_types=["linear_attention"] * 8), "must hold both"),
    (dict(layer_types=["mamba"] * 8), "layer_types must be 8 entries"),
    (dict(linear_num_value_heads=3), "lin_v_heads \\(3\\) must be a multiple"),
])
def test_unsupported_config_options_are_named(change, match, tmp_path):
    path = copy_checkpoint("qwen3_5", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        models.load(path, dtype=jnp.float32)


def test_a_moe_config_without_expert_sizes_is_refused(tmp_path):
    path = copy_checkpoint("qwen3_next", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'moe_intermediate_size' is missing"):
        models.load(path, dtype=jnp.float32)


def test_weight_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization 'int8' is not supported for qwen3_5_text"):
        models.load(DATA / "qwen3_5", dtype=jnp.float32, quantization="int8")


def test_traffic_counts_the_recurrent_state_of_a_decode_step():
    """jpa.tools.traffic's ideal for a hybrid decode step: each GDN layer reads and writes every sequence's state
    once, B x (Hv x Dk x Dv + conv_dim x (kernel - 1)) x 4 B x 2; arrays of a state's shape are "state" traffic."""
    from jpa.tools import traffic as tr

    model = loaded("qwen3_next")
    c = model.config
    gdn_layers = sum(t == "linear_attention" for t in c.layer_types)
    for b in (1, 64):
        want = gdn_layers * b * (c.lin_v_heads * c.lin_k_dim * c.lin_v_dim + c.conv_dim * (c.conv_kernel - 1)) * 4 * 2
        assert tr.recurrent_state_ideal(model.cache_spec(), b) == want
    states = model.init_states(5)
    spec = tr.Spec(state_types={("f32", tuple(a.shape)) for a in jax.tree_util.tree_leaves(states)})
    one = (c.lin_v_heads, c.lin_v_dim, c.lin_k_dim)  # one sequence's GDN state
    assert spec.purpose("f32", (3, 5, *one)) == "state"
    assert spec.purpose("f32", (7, *one)) == "state"   # one layer, 7 entries
    assert spec.purpose("f32", (7, *one[:2], 1, 1, one[2])) == "state"   # a view of it with axes of 1
    assert spec.purpose("f32", (7, c.conv_dim, c.conv_kernel - 1)) == "state"
    assert spec.purpose("f32", one) == "other"  # no sequence axis
    assert spec.purpose("bf16", (7, *one)) == "other"


@pytest.mark.bench  # one CPU compile of a decode step (~6 s)
def test_the_traffic_model_of_a_compiled_decode_step_reads_and_writes_every_state():
    from jpa import KVCache as Cache
    from jpa.tools import traffic as tr

    model = loaded("qwen3_5")
    b = 3
    states = jax.eval_shape(lambda: model.init_states(b))
    cache = jax.eval_shape(lambda: Cache.create(model.cache_config(b * 8 + 1, 16)))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)

    def step(params, cache, tokens, seq_lens, slot_mapping, block_tables, states, slots):
        return model.decode(params, cache, tokens, seq_lens, slot_mapping, block_tables, states=states,
                            state_slots=slots)

    hlo = jax.jit(step, donate_argnums=(1, 6)).lower(model.params, cache, i32(b), i32(b), i32(b), i32(b, 8), states,
                                                     i32(b)).compile().as_text()
    out = tr.hybrid_traffic(config=model.config, num_seqs=b, context=128, dtype="float32", hlo=hlo)["summary"]
    ideal = tr.recurrent_state_ideal(model.cache_spec(), b)
    assert out["state"]["ideal"] == ideal
    assert out["state"]["read"] >= ideal / 2 and out["state"]["written"] >= ideal / 2
    assert out["kv_write"]["total"] == out["kv_write"]["ideal"]
