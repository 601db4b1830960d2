"""Hybrid linear-attention families (models.hybrid): Qwen3-Next (`qwen3_next`), Qwen3.5 text (`qwen3_5_text`,
Qwen3_5ForCausalLM; `qwen3_5`, Qwen3_5ForConditionalGeneration, whose text_config and model.language_model.*
tensors are read and whose vision tower is ignored) and Qwen3.5-MoE the same way (`qwen3_5_moe_text`,
`qwen3_5_moe`: every layer a sparse MoE with a gated shared expert, the chosen experts' weights renormalized). Not the models.GPT stack: the family's `load_model` builds
a `models.hybrid.HybridModel`.

Checkpoint layouts read:
  Qwen3.5:    linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (q, k, v channels in that order).
  Qwen3-Next: linear_attn.in_proj_qkvz / in_proj_ba, grouped per key head ([q, k, v, z] and [b, a] of each key
              head's value heads back to back), rearranged here into the Qwen3.5 layout; mlp.experts.{j}.* and
              mlp.shared_expert.* / mlp.shared_expert_gate on the sparse layers.
Multi-token-prediction weights (mtp.*) are not used by jpa: they are ignored with a one-line notice.
"""

import pathlib
import sys

import numpy as np

from jpa.models.families import Family, register
from jpa.models.families.base import CheckpointError, check_activation, refuse

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
WRAPPED = ("qwen3_5", "qwen3_5_moe")  # ConditionalGeneration: text_config, tensors under model.language_model.


def options(cfg, where, sizes):
    """Never asked (models.hf.config_from_hf refuses a family with load_model first); the field is required."""
    raise CheckpointError(f"{where}: {cfg.get('model_type')} is not a models.GPT: its family's load_model builds it")


def hybrid_config(cfg: dict, where: str, model_type: str):
    """The models.hybrid.HybridConfig of a config.json dict (qwen3_5: its text_config). Raises CheckpointError
    naming an unsupported option."""
    from jpa.models.hybrid import FULL, LINEAR, HybridConfig

    if model_type in WRAPPED:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: a {model_type} config needs a text_config")
        cfg = {**text, **({"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {})}
        where = f"{where} (text_config)"
    check_activation(cfg, where, model_type, "silu")
    refuse(cfg, where, "attention_bias", (None, False), "Qwen3-Next / Qwen3.5 attention has no biases")
    try:
        d, n, layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0]!r} is missing") from e
    head_dim = int(cfg.get("head_dim") or d // n)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"{where}: RoPE type {kind!r} is not supported for {model_type} (default only)")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = int(cfg.get("full_attention_interval", 4))
        layer_types = [LINEAR if (i + 1) % every else FULL for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {LINEAR, FULL}:
        raise CheckpointError(f"{where}: layer_types must be {layers} entries of {LINEAR!r} / {FULL!r}; got "
                              f"{layer_types!r}")
    moe = {}
    if model_type in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe") and int(cfg.get("num_experts") or 0) > 0:
        # Qwen3.5-MoE: every layer sparse, the chosen weights always renormalized (Qwen3_5MoeTopKRouter)
        try:
            step, dense = int(cfg.get("decoder_sparse_step", 1)), cfg.get("mlp_only_layers") or []
            moe = dict(moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
                       num_experts=int(cfg["num_experts"]), experts_per_token=int(cfg["num_experts_per_tok"]),
                       moe_ffn_dim=int(cfg["moe_intermediate_size"]),
                       shared_ffn_dim=int(cfg["shared_expert_intermediate_size"]),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        except KeyError as e:
            raise CheckpointError(f"{where}: {e.args[0]!r} is missing (a mixture-of-experts config)") from e
        if not moe["shared_ffn_dim"]:
            raise CheckpointError(f"{where}: shared_expert_intermediate_size 0 is not supported")
    try:
        return HybridConfig(
            vocab_size=vocab, d_model=d, num_layers=layers, num_q_heads=n,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n), head_dim=head_dim,
            max_seq_len=int(cfg.get("max_position_embeddings", 32768)),
            ffn_dim=int(cfg.get("intermediate_size") or moe.get("moe_ffn_dim") or 0),  # Qwen3.5-MoE: no dense MLP
            layer_types=tuple(layer_types), rotary_dim=int(head_dim * partial),
            rope_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            lin_k_heads=int(cfg.get("linear_num_key_heads", 16)),
            lin_v_heads=int(cfg.get("linear_num_value_heads", 32)),
            lin_k_dim=int(cfg.get("linear_key_head_dim", 128)), lin_v_dim=int(cfg.get("linear_value_head_dim", 128)),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            bos_token_id=int(cfg.get("bos_token_id") or 0), eos_token_id=int(_first(cfg.get("eos_token_id")) or 0),
            **moe)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


def _names(c, model_type: str, i: int) -> dict:
    """{our parameter: (checkpoint name after the layer prefix, transpose)} of layer i (the grouped Qwen3-Next
    projections are "qkvz" / "ba" and split after reading)."""
    mixer, mlp = c.kind(i)
    out = {"attn_norm": ("input_layernorm.weight", False), "ffn_norm": ("post_attention_layernorm.weight", False)}
    if mixer == "full":
        out.update(wq=("self_attn.q_proj.weight", True), wk=("self_attn.k_proj.weight", True),
                   wv=("self_attn.v_proj.weight", True), wo=("self_attn.o_proj.weight", True),
                   q_norm=("self_attn.q_norm.weight", False), k_norm=("self_attn.k_norm.weight", False))
    else:
        out.update(conv_w=("linear_attn.conv1d.weight", False), a_log=("linear_attn.A_log", False),
                   dt_bias=("linear_attn.dt_bias", False), gnorm=("linear_attn.norm.weight", False),
                   out=("linear_attn.out_proj.weight", True))
        if model_type == "qwen3_next":
            out.update(qkvz=("linear_attn.in_proj_qkvz.weight", True), ba=("linear_attn.in_proj_ba.weight", True))
        else:
            out.update(in_qkv=("linear_attn.in_proj_qkv.weight", True), in_z=("linear_attn.in_proj_z.weight", True),
                       in_b=("linear_attn.in_proj_b.weight", True), in_a=("linear_attn.in_proj_a.weight", True))
    if mlp == "moe":
        out.update(router=("mlp.gate.weight", True), shared_gate=("mlp.shared_expert.gate_proj.weight", True),
                   shared_up=("mlp.shared_expert.up_proj.weight", True),
                   shared_down=("mlp.shared_expert.down_proj.weight", True),
                   shared_router=("mlp.shared_expert_gate.weight", True))
        for ours, theirs in (("experts_gate", "gate_proj"), ("experts_up", "up_proj"), ("experts_down", "down_proj")):
            out[ours] = (tuple(f"mlp.experts.{j}.{theirs}.weight" for j in range(c.num_experts)), True)
    else:
        out.update(w_gate=("mlp.gate_proj.weight", True), w_up=("mlp.up_proj.weight", True),
                   w_down=("mlp.down_proj.weight", True))
    return out


def _ungroup(c, qkvz, ba):
    """Qwen3-Next's grouped [in, Hk * (2 Dk + 2 r Dv)] / [in, Hk * 2r] projections (r = Hv / Hk) -> the Qwen3.5
    layout: in_qkv [in, 2 Hk Dk + Hv Dv] (all q, all k, all v), in_z [in, Hv Dv], in_b, in_a [in, Hv]."""
    d = qkvz.shape[0]
    hk, dk, dv, r = c.lin_k_heads, c.lin_k_dim, c.lin_v_dim, c.lin_v_heads // c.lin_k_heads
    g = qkvz.reshape(d, hk, 2 * dk + 2 * r * dv)
    q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    flat = lambda a: a.reshape(d, -1)
    b, a = np.split(ba.reshape(d, hk, 2 * r), [r], axis=-1)
    return dict(in_qkv=np.concatenate([flat(q), flat(k), flat(v)], axis=-1), in_z=flat(z), in_b=flat(b), in_a=flat(a))


def load_model(path: pathlib.Path, cfg: dict, model_type: str, *, dtype, quantization):
    """The `Family.load_model` hook: a models.hybrid.HybridModel of the checkpoint directory `path`.

    Every tensor the model needs is checked for presence and shape (from the safetensors headers) before any
    is read; tensors the model does not use are refused, except mtp.* (multi-token prediction, ignored with a
    notice) and, for qwen3_5, the vision tower (model.visual.*).
    """
    import jax.numpy as jnp

    from jpa.models.hf import _read_raw, _tensor_index
    from jpa.models.hybrid import HybridModel, param_shapes, stack_params

    if quantization not in (None, "none"):
        raise ValueError(f"quantization {quantization!r} is not supported for {model_type} (hybrid models load "
                         f"dense weights: None or 'none')")
    where = str(path / "config.json")
    if cfg.get("quantization_config"):
        raise CheckpointError(f"{where}: quantized {model_type} checkpoints are not supported")
    c = hybrid_config(cfg, where, model_type)
    prefix = "model.language_model." if model_type in WRAPPED else "model."
    index = _tensor_index(path)
    shapes = param_shapes(c)

    def need(name, want, transpose):
        names = name if isinstance(name, tuple) else (name,)
        for n in names:
            if n not in index:
                raise CheckpointError(f"{path}: tensor {n} is missing (needed for {model_type} with this config.json)")
        shape = index[names[0]][2]
        got = (len(names), *reversed(shape)) if isinstance(name, tuple) and transpose else (
            tuple(reversed(shape)) if transpose else shape)
        if want is not None and tuple(got) != tuple(want):
            stored = list(reversed(want[-2:])) if transpose else list(want[-len(shape):])
            raise CheckpointError(f"{index[names[0]][0]}: tensor {names[0]} has shape {list(shape)}; config.json "
                                  f"implies {stored}")
        return names

    plan = {"embed": (prefix + "embed_tokens.weight", False), "final_norm": (prefix + "norm.weight", False)}
    if not c.tie_embeddings:
        plan["head"] = ("lm_head.weight", True)
    layer_plans = []
    for i in range(c.num_layers):
        lp = {}
        for ours, (name, transpose) in _names(c, model_type, i).items():
            full = tuple(f"{prefix}layers.{i}.{n}" for n in name) if isinstance(name, tuple) else \
                f"{prefix}layers.{i}.{name}"
            lp[ours] = (full, transpose)
        layer_plans.append(lp)
    kinds = {"full": shapes["full"], "linear": shapes["linear"], "dense": shapes["dense"], "moe": shapes["moe"]}
    used = set()
    for ours, (name, transpose) in plan.items():
        used.update(need(name, shapes["top"][ours], transpose))
    for i, lp in enumerate(layer_plans):
        mixer, mlp = c.kind(i)
        want = {**kinds[mixer], **kinds[mlp]}
        for ours, (name, transpose) in lp.items():
            w = want.get(ours)
            if ours == "conv_w":
                w = (c.conv_dim, 1, c.conv_kernel)
            elif ours in ("qkvz", "ba"):
                per = 2 * c.lin_k_dim + 2 * c.lin_v_dim * c.lin_v_heads // c.lin_k_heads if ours == "qkvz" else \
                    2 * c.lin_v_heads // c.lin_k_heads
                w = (c.d_model, c.lin_k_heads * per)
            used.update(need(name, w, transpose))
    ignored = sorted(k for k in index if k.startswith("mtp."))
    vision = sorted(k for k in index if model_type in WRAPPED and k.startswith("model.visual."))
    extra = sorted(k for k in index if k not in used and k not in ignored and k not in vision
                   and not (k == "lm_head.weight" and c.tie_embeddings) and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"{path}: the checkpoint has tensors this {model_type} config does not use: "
                              f"{extra[:5]}{' ...' if len(extra) > 5 else ''} (a different architecture?)")
    if ignored:
        print(f"[jpa] {path.name}: {len(ignored)} multi-token-prediction tensors (mtp.*) loaded and ignored: "
              f"jpa does not use MTP", file=sys.stderr)
    if vision:
        print(f"[jpa] {path.name}: the vision tower ({len(vision)} model.visual.* tensors) is ignored: jpa serves the "
              f"text model", file=sys.stderr)

    np_dtype = np.dtype(dtype)

    def read(name, transpose):
        if isinstance(name, tuple):
            return np.stack([read(n, transpose) for n in name])
        a = _read_raw(index[name][0], name).astype(np.float32)
        return a.T if transpose else a

    put = lambda a: jnp.asarray(np.ascontiguousarray(a), dtype=np_dtype)
    top = {ours: put(read(*entry)) for ours, entry in plan.items()}
    layers = []
    for lp in layer_plans:
        vals = {ours: read(*entry) for ours, entry in lp.items()}
        if "qkvz" in vals:
            vals.update(_ungroup(c, vals.pop("qkvz"), vals.pop("ba")))
        if "conv_w" in vals:
            vals["conv_w"] = vals["conv_w"][:, 0, :]
        layers.append({ours: put(v) for ours, v in vals.items()})
    return HybridModel(c, stack_params(c, top, layers), np_dtype)


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) and x else x


FAMILY = register(Family(name="qwen3_next", model_types=MODEL_TYPES, architectures=ARCHITECTURES, options=options,
                         load_model=load_model))
