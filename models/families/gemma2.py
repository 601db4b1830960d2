"""Gemma-2: embedding scale sqrt(d_model), GeGLU, (1 + w) RMSNorm, post-norms around attention and MLP, the query
scale from query_pre_attn_scalar, attention and final logit soft caps, and a sliding window on the layers
`layer_types` names (by default every other one)."""

import math

from jpa.models.families import Family, register
from jpa.models.families.base import check_activation, refuse_biases, sliding_windows


def options(cfg: dict, where: str, sizes) -> dict:
    check_activation(cfg, where, "gemma2", "gelu_pytorch_tanh", keys=("hidden_activation", "hidden_act"),
                     default=None)
    refuse_biases(cfg, where)
    return dict(mlp_activation="gelu_tanh", norm_weight_offset=1.0, embed_scale=math.sqrt(sizes.d_model),
                post_norms=True, attn_scale=float(cfg.get("query_pre_attn_scalar", sizes.head_dim)) ** -0.5,
                attn_soft_cap=cfg.get("attn_logit_softcapping"), final_soft_cap=cfg.get("final_logit_softcapping"),
                **sliding_windows(cfg, sizes.num_layers, every_layer=False))


def layer_names(config, model_type) -> dict:
    return {"ffn_norm": ("pre_feedforward_layernorm.weight", False)}


FAMILY = register(Family(name="gemma2", model_types=("gemma2",), architectures=("Gemma2ForCausalLM",),
                         options=options, layer_names=layer_names, tie_default=True))
