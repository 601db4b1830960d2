"""DeepSeek-V3 (V3, V3.1: model_type deepseek_v3) and DeepSeek-V2 (deepseek_v2: V2, V2-Lite): multi-head latent
attention and DeepSeek's mixtures of experts. Not the models.GPT stack: its own model class
(`models.deepseek.DeepSeekForEngine`), built by `Family.load_model`."""

from jpa.models.families import Family, register
from jpa.models.families.base import CheckpointError


def options(cfg: dict, where: str, sizes) -> dict:
    raise CheckpointError(f"{where}: {cfg.get('model_type')} is not a models.GPT: models.hf.load builds it with "
                          f"its family's load_model (models.deepseek)")


def load_model(path, cfg: dict, model_type: str, *, dtype, quantization):
    from jpa.models import deepseek

    return deepseek.load_model(path, cfg, model_type, dtype=dtype, quantization=quantization)


FAMILY = register(Family(name="deepseek_v3", model_types=("deepseek_v3", "deepseek_v2"),
                         architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"), options=options,
                         load_model=load_model))
