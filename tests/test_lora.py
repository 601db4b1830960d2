"""LoRA adapters (models.lora): PEFT directories read into stacked slots, the per-row LoRA matmuls, and the
model with a mix of adapters per row against transformers + peft (tests/data/hf/llama_lora, made by
scripts/make_lora_golden.py)."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpa import models
from jpa.models import lora
from jpa.models.gpt import forward_dense

DATA = pathlib.Path(__file__).parent / "data" / "hf"
ADAPTERS = DATA / "llama_lora"
GOLDEN = json.loads((ADAPTERS / "golden.json").read_text())
NAMES = sorted(GOLDEN["adapters"])
TOL = 2e-3


@pytest.fixture(scope="module")
def llama():
    model, _ = models.load(DATA / "llama", dtype=jnp.float32)
    return model


def slots_with(model, names, max_rank=8):
    """Slots 0..len(names)-1 holding the named adapters."""
    slots = lora.empty_slots(model.config, len(names), max_rank, jnp.float32)
    for i, name in enumerate(names):
        one = lora.read_adapter(ADAPTERS / name, model.config, max_rank)
        slots = jax.tree_util.tree_map(lambda s, o: s.at[i].set(o), slots, one)
    return slots


def test_mixed_adapters_match_transformers_peft(llama):
    """Every adapter and the base, one row each per prompt in ONE batch (rows of different adapters side by
    side): each row's greedy tokens are transformers + peft's, with their logprobs within 2e-3 (teacher
    forcing over the golden continuation: argmax at every step is the golden token)."""
    slots = slots_with(llama, NAMES)
    rows, index = [], []
    for who in ["base"] + NAMES:
        for key, p in GOLDEN["prompts"].items():
            g = GOLDEN["greedy"][who][key]
            rows.append((who, key, p["ids"], g["ids"], g["logprobs"]))
            index.append(-1 if who == "base" else NAMES.index(who))
    width = max(len(r[2]) + len(r[3]) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, (_, _, ids, gen, _) in enumerate(rows):
        seq = ids + gen
        tokens[i, :len(seq)] = seq
    idx = np.repeat(np.asarray(index, np.int32)[:, None], width, axis=1)
    logits = np.asarray(forward_dense(llama, jnp.asarray(tokens), lora=(slots, jnp.asarray(idx))))
    lsm = jax.nn.log_softmax(logits, axis=-1)
    for i, (who, key, ids, gen, lps) in enumerate(rows):
        at = np.arange(len(ids) - 1, len(ids) - 1 + len(gen))
        got = np.asarray(lsm[i, at])
        assert got.argmax(-1).tolist() == gen, (who, key)
        np.testing.assert_allclose(got[np.arange(len(gen)), gen], lps, atol=TOL, err_msg=f"{who} {key}")


@pytest.mark.parametrize("method", lora.LORA_METHODS)
def test_lora_delta_methods_agree(method):
    """Each method equals x @ A[slot] @ B[slot] row by row (zeros for -1), on fresh random rows and slots."""
    rng = np.random.default_rng()
    m, n, i, r, o = 37, 5, 24, 6, 40
    x = rng.normal(size=(m, i)).astype(np.float32)
    a = rng.normal(size=(n, i, r)).astype(np.float32)
    b = rng.normal(size=(n, r, o)).astype(np.float32)
    idx = rng.integers(-1, n, size=m).astype(np.int32)
    want = np.stack([xj @ a[k] @ b[k] if k >= 0 else np.zeros(o, np.float32) for xj, k in zip(x, idx)])
    got = lora.lora_delta(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(a), jnp.asarray(b), method)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_padding_to_max_rank_and_rslora_scale(llama):
    """A rank-8 rsLoRA adapter read with max_lora_rank 12: A/B zero past rank 8, B scaled by alpha / sqrt(r)."""
    cfg = json.loads((ADAPTERS / "all_r8_rs" / "adapter_config.json").read_text())
    from safetensors.numpy import load_file
    t = load_file(str(ADAPTERS / "all_r8_rs" / "adapter_model.safetensors"))
    one = lora.read_adapter(ADAPTERS / "all_r8_rs", llama.config, 12)
    b = t["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]  # [out, r]
    a = t["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]  # [r, in]
    np.testing.assert_allclose(one["wv"]["b"][1, :8], b.T * cfg["lora_alpha"] / np.sqrt(cfg["r"]), rtol=1e-6)
    np.testing.assert_array_equal(one["wv"]["a"][1, :, :8], a.T)
    assert not one["wv"]["a"][:, :, 8:].any() and not one["wv"]["b"][:, 8:].any()
    qv = lora.read_adapter(ADAPTERS / "qv_r4", llama.config, 8)
    assert not qv["wk"]["a"].any() and not qv["w_down"]["b"].any() and qv["wq"]["a"].any()


def _copy(tmp_path, name="qv_r4"):
    d = tmp_path / name
    shutil.copytree(ADAPTERS / name, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case, match", [
    ("missing_dir", "does not exist"),
    ("no_weights", "has no adapter_model.safetensors"),
    ("no_config", "has no adapter_config.json"),
    ("bad_json", "not a valid JSON object"),
    ("corrupt_weights", "cannot be read as safetensors"),
    ("rank_too_big", r"rank r=4, above max_lora_rank=2"),
    ("unknown_target", r"targets \['lm_head'\]"),
    ("dora", "use_dora=True is not supported"),
    ("wrong_shape", "must have shape"),
])
def test_bad_adapters_raise(tmp_path, llama, case, match):
    d = _copy(tmp_path)
    max_rank = 8
    if case == "missing_dir":
        d = tmp_path / "nowhere"
    elif case == "no_weights":
        (d / "adapter_model.safetensors").unlink()
    elif case == "no_config":
        (d / "adapter_config.json").unlink()
    elif case == "bad_json":
        (d / "adapter_config.json").write_text("{not json")
    elif case == "corrupt_weights":
        (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    elif case == "rank_too_big":
        max_rank = 2
    elif case == "unknown_target":
        _edit_config(d, target_modules=["q_proj", "v_proj", "lm_head"])
    elif case == "dora":
        _edit_config(d, use_dora=True)
    elif case == "wrong_shape":
        _edit_config(d, r=3)
    with pytest.raises(ValueError, match=match):
        lora.read_adapter(d, llama.config, max_rank)


def test_missing_target_of_a_model_without_dense_mlp(tmp_path):
    """A mixture of experts has no dense gate/up/down: an adapter targeting them is refused, naming them."""
    cfg = models.ModelConfig(family="llama", vocab_size=320, d_model=64, num_layers=2, num_q_heads=4,
                             num_kv_heads=2, head_dim=16, ffn_dim=32, max_seq_len=64, num_experts=4,
                             experts_per_token=2)
    with pytest.raises(ValueError, match=r"targets \['down_proj', 'gate_proj', 'up_proj'\], which this model"):
        lora.read_adapter(ADAPTERS / "mlp_r2", cfg, 8)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="max_loras must be an int >= 1"):
        lora.check_lora_sizes(0, 8)
    with pytest.raises(ValueError, match="max_lora_rank must be an int >= 1"):
        lora.check_lora_sizes(2, 0)
