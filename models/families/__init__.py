"""One module per model family, registered by the Hugging Face `model_type` (and `architectures`).

A family module says what its checkpoints' config.json means for jpa's model: the `ModelConfig` options of
its variant (`Family.options`), the checkpoint names of its layer tensors where they differ from Llama's
(`Family.layer_names`), and its activation. `models.hf` reads the sizes, RoPE, quantization and layer types
every family shares, then asks the family. Adding a family is one module here, its line in `_MODULES`, and its
tests (a tiny checkpoint made with transformers, greedy tokens and logprobs against transformers'):

    llama     Llama 2/3, Mistral, Qwen2, Qwen3 (models.families.llama)
    gemma2    Gemma-2 (models.families.gemma2)
    mixtral   Mixtral, Qwen3-MoE (models.families.mixtral)
    gpt_oss   gpt-oss (models.families.gpt_oss)
    qwen3_next  Qwen3-Next, Qwen3.5 text: hybrids, not the GPT stack (models.families.qwen3_next, models.hybrid)
    deepseek_v3  DeepSeek-V3, DeepSeek-V2 (models.families.deepseek_v3; MLA, its own model: models.deepseek)

A family whose model is not the models.GPT stack sets `load_model`: models.hf.load then returns its model (an
`jpa.engine.EngineModel`) and the tokenizer, and `options` / `layer_names` are not asked.
"""

import dataclasses
import importlib
from typing import Callable

from jpa.models.families.base import CheckpointError

_MODULES = ("llama", "gemma2", "mixtral", "gpt_oss", "qwen3_next", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the Hugging Face model types and architectures it reads, and how.

    Attributes:
      name: the family module's name.
      model_types: config.json `model_type` values it reads.
      architectures: config.json `architectures` entries it reads, one per model type in the same order (used
        when model_type is absent).
      options: (cfg, where, sizes) -> ModelConfig keyword options of the variant (biases, norms, windows,
        experts, ...). `sizes` is a `base.Sizes`. Raises CheckpointError naming an unsupported option.
      layer_names: (config, model_type) -> {parameter: (checkpoint name after "model.layers.{i}.", transpose
        [, part])} for the layer tensors named otherwise than Llama's (`base.LLAMA_LAYER_NAMES`).
      tie_default: transformers' default for tie_word_embeddings in this family.
      load_model: None (the family is a models.GPT variant), or `load_model(path: pathlib.Path, cfg: dict,
        model_type: str, *, dtype, quantization) -> EngineModel` for a family that is not the models.GPT stack
        (a hybrid, MLA): models.hf.load then returns (family.load_model(...), tokenizer).
    """
    name: str
    model_types: tuple
    architectures: tuple
    options: Callable
    layer_names: Callable = lambda config, model_type: {}
    tie_default: bool = False
    load_model: Callable | None = None


REGISTRY: dict = {}


def register(family: Family) -> Family:
    if len(family.architectures) != len(family.model_types):
        raise ValueError(f"family {family.name!r}: architectures must name one class per model type "
                         f"{family.model_types}; got {family.architectures}")
    for t in family.model_types:
        if t in REGISTRY and REGISTRY[t] is not family:
            raise ValueError(f"model_type {t!r} is already registered by family {REGISTRY[t].name!r}")
        REGISTRY[t] = family
    return family


def _load_all():
    for name in _MODULES:
        importlib.import_module(f"jpa.models.families.{name}")


def supported_model_types() -> tuple:
    """The model types of every registered family, in registration order."""
    _load_all()
    return tuple(REGISTRY)


def family_of(cfg: dict, where: str = "config.json") -> tuple:
    """(Family, model_type) of a config.json dict: by its model_type, else by its architectures. Raises
    CheckpointError naming the model_type when no family reads it."""
    _load_all()
    model_type = cfg.get("model_type")
    if model_type is None:
        for arch in cfg.get("architectures") or ():
            for fam in dict.fromkeys(REGISTRY.values()):
                if arch in fam.architectures:
                    return fam, fam.model_types[fam.architectures.index(arch)]
    if model_type not in REGISTRY:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported; jpa loads "
                              f"{list(REGISTRY)}")
    return REGISTRY[model_type], model_type


__all__ = ["CheckpointError", "Family", "REGISTRY", "family_of", "register", "supported_model_types"]
