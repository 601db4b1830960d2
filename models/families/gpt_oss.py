"""gpt-oss (transformers' GptOss): the experts stacked in the checkpoint, gate and up interleaved in gate_up_proj
[E, D, 2F] (gate the even columns), router, expert and q/k/v/o biases, clamped SwiGLU, attention sinks, a
sliding window on the layers `layer_types` names (by default the even ones), YaRN RoPE (models.hf's GPT_OSS_ROPE
defaults), and the released checkpoints' MXFP4 experts (models.moe.dequantize_mxfp4)."""

from jpa.models.families import Family, register
from jpa.models.families.base import check_activation, sliding_windows
from jpa.models.families.mixtral import experts


def options(cfg: dict, where: str, sizes) -> dict:
    check_activation(cfg, where, "gpt_oss", "silu")
    quant = cfg.get("quantization_config")
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    bias = bool(cfg.get("attention_bias", True))
    return dict(experts(cfg, where, "gpt_oss", sizes.num_layers), router_bias=True, expert_bias=True,
                attn_sinks=True, o_bias=bias, qkv_bias=bias,
                swiglu_clamp=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
                **({"expert_format": "mxfp4"} if mxfp4 else {}),
                **sliding_windows(cfg, sizes.num_layers, every_layer=False, default_window=128))


def layer_names(config, model_type) -> dict:
    out = dict(router=("mlp.router.weight", True), router_bias=("mlp.router.bias", False),
               experts_gate=("mlp.experts.gate_up_proj", False, 0), experts_up=("mlp.experts.gate_up_proj", False, 1),
               experts_down=("mlp.experts.down_proj", False),
               experts_gate_bias=("mlp.experts.gate_up_proj_bias", False, 0),
               experts_up_bias=("mlp.experts.gate_up_proj_bias", False, 1),
               experts_down_bias=("mlp.experts.down_proj_bias", False),
               bo=("self_attn.o_proj.bias", False), sinks=("self_attn.sinks", False))
    if config.expert_format == "mxfp4":  # *_blocks [E, out, in / 32, 16] and *_scales [E, out, in / 32], u8
        for ours, theirs, p in (("experts_gate", "gate_up_proj", 0), ("experts_up", "gate_up_proj", 1),
                                ("experts_down", "down_proj", None)):
            out[ours] = (f"mlp.experts.{theirs}_blocks", False, ("blocks", p))
            out[ours + "_scales"] = (f"mlp.experts.{theirs}_scales", False, ("scales", p))
    return out


FAMILY = register(Family(name="gpt_oss", model_types=("gpt_oss",), architectures=("GptOssForCausalLM",),
                         options=options, layer_names=layer_names))
