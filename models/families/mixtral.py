"""Mixtures of experts over Llama attention (models.moe): Mixtral (per-expert w1/w3/w2 under block_sparse_moe,
softmax over the chosen experts' logits, a sliding window when set) and Qwen3-MoE (per-expert
gate/up/down_proj under mlp, q/k RMSNorm, every layer sparse). The experts' tensors are stacked on an expert
axis as they are read."""

from jpa.models.families import Family, register
from jpa.models.families.base import CheckpointError, check_activation, no_sliding_layers, refuse, refuse_biases, \
    sliding_windows


def experts(cfg: dict, where: str, model_type: str, num_layers: int) -> dict:
    """ModelConfig's num_experts / experts_per_token / norm_topk_prob. Every layer must be a MoE layer: a
    Qwen3-MoE config with dense layers (mlp_only_layers, or decoder_sparse_step > 1) is refused (the scanned
    layers hold one parameter set)."""
    n = cfg.get("num_local_experts") if model_type != "qwen3_moe" else cfg.get(
        "num_experts", cfg.get("num_local_experts"))
    k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token") if model_type == "gpt_oss" else None)
    if n is None or k is None:
        raise CheckpointError(f"{where}: {model_type} needs num_experts (num_local_experts) and num_experts_per_tok")
    if model_type == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        moe = [i for i in range(num_layers) if i not in dense and int(n) > 0 and (i + 1) % int(step) == 0]
        if len(moe) != num_layers:
            raise CheckpointError(f"{where}: layers {sorted(set(range(num_layers)) - set(moe))} are dense MLP layers "
                                  f"(mlp_only_layers={dense!r}, decoder_sparse_step={step!r}); jpa's scanned "
                                  f"layers need every layer to be a mixture-of-experts layer")
        norm = bool(cfg.get("norm_topk_prob", False))
    else:
        norm = True  # Mixtral, gpt-oss: softmax over the chosen experts' logits
    return dict(num_experts=int(n), experts_per_token=int(k), norm_topk_prob=norm)


def options(cfg: dict, where: str, sizes) -> dict:
    model_type = cfg["model_type"]
    check_activation(cfg, where, model_type, "silu")
    refuse_biases(cfg, where)
    kw = experts(cfg, where, model_type, sizes.num_layers)
    if model_type == "qwen3_moe":
        refuse(cfg, where, "use_sliding_window", (None, False), "Qwen sliding-window layers")
        no_sliding_layers(cfg, where, model_type)
        return dict(kw, qk_norm=True, ffn_dim=int(cfg.get("moe_intermediate_size") or 0) or sizes.ffn_dim)
    return dict(kw, **sliding_windows(cfg, sizes.num_layers, every_layer=True))


def layer_names(config, model_type) -> dict:
    if model_type != "mixtral":
        return {}
    out = {"router": ("block_sparse_moe.gate.weight", True)}
    for ours, theirs in zip(("experts_gate", "experts_up", "experts_down"), ("w1", "w3", "w2")):
        out[ours] = (f"block_sparse_moe.experts.{{j}}.{theirs}.weight", True)
    return out


FAMILY = register(Family(name="mixtral", model_types=("mixtral", "qwen3_moe"),
                         architectures=("MixtralForCausalLM", "Qwen3MoeForCausalLM"), options=options,
                         layer_names=layer_names))
