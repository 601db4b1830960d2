"""What every family module shares: the checkpoint error, the sizes read before the family is asked, Llama's
layer tensor names, and the checks families make alike (activation, biases, sliding-window layers)."""

import dataclasses


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, inconsistent or damaged."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes models.hf reads from every config.json before asking the family."""
    d_model: int
    num_heads: int
    num_layers: int
    head_dim: int
    ffn_dim: int


# Llama's layer tensors, after "model.layers.{i}.": {parameter: (name, transpose)}; transpose means the
# checkpoint holds torch's [out, in] and the model x @ W's [in, out].
LLAMA_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False), "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True), "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True), "ffn_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False), "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "post_ffn_norm": ("post_feedforward_layernorm.weight", False),
    "router": ("mlp.gate.weight", True),
    # An expert parameter [E, ...] is E checkpoint tensors: the name holds "{j}" for the expert.
    "experts_gate": ("mlp.experts.{j}.gate_proj.weight", True), "experts_up": ("mlp.experts.{j}.up_proj.weight", True),
    "experts_down": ("mlp.experts.{j}.down_proj.weight", True),
}


def refuse(cfg: dict, where: str, key: str, allowed, what: str):
    """Raises CheckpointError when cfg[key] is not one of `allowed`."""
    val = cfg.get(key)
    if val not in allowed:
        raise CheckpointError(f"{where}: {key} = {val!r} is not supported ({what})")


def check_activation(cfg: dict, where: str, model_type: str, want: str, keys=("hidden_act",), default="silu"):
    """Raises CheckpointError unless the first of `keys` that is set (else `default`) is `want`."""
    act = next((cfg[k] for k in keys if cfg.get(k)), default)
    if act != want:
        raise CheckpointError(f"{where}: activation {act!r} is not supported for {model_type} (expected {want!r})")


def refuse_biases(cfg: dict, where: str):
    """Attention and MLP biases, which only Qwen2's q/k/v and gpt-oss's families read."""
    for key in ("attention_bias", "mlp_bias"):
        refuse(cfg, where, key, (None, False), "the model has no biases besides Qwen2's q/k/v and gpt-oss's")


def sliding_windows(cfg: dict, num_layers: int, *, every_layer: bool, default_window=None) -> dict:
    """ModelConfig's sliding_window / sliding_window_layers from `sliding_window` and `layer_types` (validated
    by models.hf): without layer_types transformers' default, every layer (every_layer: Mistral, Mixtral) or
    the even ones (Gemma-2, gpt-oss). {} when the config sets no window or no layer slides."""
    window = cfg.get("sliding_window", default_window)
    if window is None:
        return {}
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        layer_types = (["sliding_attention"] * num_layers if every_layer else
                       ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)])
    layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    return dict(sliding_window=int(window), sliding_window_layers=layers) if layers else {}


def no_sliding_layers(cfg: dict, where: str, model_type: str):
    """Raises CheckpointError when layer_types names sliding_attention layers in a family without them."""
    if "sliding_attention" in (cfg.get("layer_types") or ()):
        raise CheckpointError(f"{where}: sliding_attention layers are not supported for {model_type}")
