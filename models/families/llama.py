"""The Llama family: Llama 2/3 (Llama-3 RoPE scaling, tied or untied head), Mistral (a sliding window on every
layer when set), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm). RMSNorm, RoPE, grouped-query attention, SwiGLU."""

from jpa.models.families import Family, register
from jpa.models.families.base import check_activation, no_sliding_layers, refuse, refuse_biases, sliding_windows


def options(cfg: dict, where: str, sizes) -> dict:
    model_type = cfg["model_type"]
    check_activation(cfg, where, model_type, "silu")
    if model_type != "qwen2":
        refuse_biases(cfg, where)
    if model_type in ("qwen2", "qwen3"):
        refuse(cfg, where, "use_sliding_window", (None, False), "Qwen sliding-window layers")
    if model_type == "mistral":
        windows = sliding_windows(cfg, sizes.num_layers, every_layer=True)
    else:
        no_sliding_layers(cfg, where, model_type)
        windows = {}
    return dict(qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3", **windows)


FAMILY = register(Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"),
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    options=options))
