"""Hugging Face checkpoint directories: config.json + *.safetensors + tokenizer.json -> models.GPT.

    model, tokenizer = models.hf.load("path/to/Qwen2.5-0.5B-Instruct", dtype=jnp.bfloat16)

Supported `model_type`s (config.json), each a config-driven variant of the llama family of
models.GPT (see ModelConfig): "llama" (Llama 2/3, Llama-3 `rope_scaling`, tied or untied head),
"mistral" (sliding window on every layer when set), "qwen2" (q/k/v biases), "qwen3" (q/k
RMSNorm) and "gemma2" (embedding scale, GeGLU, (1 + w) RMSNorm, post-norms, query scale from
query_pre_attn_scalar, attention and final logit soft caps, sliding window on the layers
`layer_types` names, by default every other one), and the mixtures of experts (models.moe)
"mixtral" (per-expert w1/w3/w2 tensors under block_sparse_moe), "qwen3_moe" (per-expert
gate/up/down_proj under mlp, q/k RMSNorm; every layer sparse), whose experts' tensors are stacked
on an expert axis as they are read, and "gpt_oss" (transformers' GptOss: the experts stacked in the
checkpoint, gate and up interleaved in gate_up_proj [E, D, 2F] (gate the even columns), router,
expert and q/k/v/o biases, clamped SwiGLU, attention sinks, sliding window on the layers
`layer_types` names (by default the even ones), YaRN RoPE). Anything else, and any option of these
families that the model does not implement, is refused with a ValueError naming it.

Loading is two passes. The first reads only metadata: config.json, the safetensors headers (the
index file when there is one), and checks every tensor the model needs for presence, shape and
dtype, and every file for being whole. Only then are tensors read, one at a time through a fresh
memory map that is closed after each, converted to the requested dtype (and transposed to x @ W's
[in, out] layout) and placed on the device. So a bad checkpoint fails before anything is loaded,
and the host holds the loaded parameters plus about one tensor's worth of copies at a time
(BENCHMARKS.md: peak RSS about 1.1x the checkpoint's size).
"""

import json
import math
import pathlib

import numpy as np

from jpa.models.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mixtral", "qwen3_moe", "gpt_oss")
# safetensors dtype -> NumPy dtype name (bfloat16 comes from ml_dtypes, which JAX imports).
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors a checkpoint may carry that the model does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, inconsistent or damaged."""


def _read_json(path: pathlib.Path, required: bool):
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} is missing (a Hugging Face checkpoint directory needs it)")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


# transformers' GptOssConfig defaults (a config.json without rope parameters gets them).
GPT_OSS_ROPE = {"rope_theta": 150000.0, "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _rope(cfg: dict, where: str):
    """(rope_base, rope_scaling tuple) from the old (rope_theta / rope_scaling) or transformers-5
    (rope_parameters) config layout."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    if cfg.get("model_type") == "gpt_oss":
        defaults = {"rope_theta": GPT_OSS_ROPE["rope_theta"]} if params else GPT_OSS_ROPE
        params = {**defaults, **({"rope_theta": cfg["rope_theta"]} if "rope_theta" in cfg else {}), **params}
    base = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return float(base), ()
    if kind == "linear":
        return float(base), ("linear", float(params["factor"]))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        missing = [k for k in keys if k not in params]
        if missing:
            raise CheckpointError(f"{where}: llama3 rope scaling needs {missing}")
        old = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        return float(base), ("llama3", *(float(params[k]) for k in keys), int(old))
    if kind == "yarn":
        return float(base), _yarn(params, cfg, where)
    raise CheckpointError(f"{where}: RoPE type {kind!r} is not supported (supported: default, linear, llama3, "
                          f"yarn)")


def _yarn(params: dict, cfg: dict, where: str) -> tuple:
    """The ("yarn", ...) rope_scaling tuple of transformers' _compute_yarn_parameters."""
    old = params.get("original_max_position_embeddings")
    if old is None:
        raise CheckpointError(f"{where}: yarn rope scaling needs original_max_position_embeddings")
    factor = params.get("factor") or cfg.get("max_position_embeddings", 2048) / old
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return ("yarn", float(factor), float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
            int(old), float(attn), 1.0 if params.get("truncate", True) else 0.0)


def _refuse(cfg: dict, where: str, key: str, allowed, what: str):
    val = cfg.get(key)
    if val not in allowed:
        raise CheckpointError(f"{where}: {key} = {val!r} is not supported ({what})")


def config_from_hf(cfg: dict, *, where: str = "config.json", bos_token_id: int = 0,
                   eos_token_id: int = 0) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json dict.

    Args:
      cfg: config.json's contents.
      where: how to name the file in errors.
      bos_token_id, eos_token_id: the tokenizer's special ids (stored in the ModelConfig).

    Raises:
      CheckpointError (a ValueError): unsupported model_type or option, naming it.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported; jpa loads "
                              f"{list(SUPPORTED_MODEL_TYPES)}")
    try:
        d, n = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers, vocab, ffn = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]), int(cfg["intermediate_size"])
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0]!r} is missing") from e
    head_dim = cfg.get("head_dim") or d // n
    gemma = model_type == "gemma2"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") if gemma else cfg.get("hidden_act", "silu")
    want_act = "gelu_pytorch_tanh" if gemma else "silu"
    if act != want_act:
        raise CheckpointError(f"{where}: activation {act!r} is not supported for {model_type} (expected "
                              f"{want_act!r})")
    for key in ("attention_bias", "mlp_bias"):
        if model_type not in ("qwen2", "gpt_oss"):
            _refuse(cfg, where, key, (None, False), "the model has no biases besides Qwen2's q/k/v and gpt-oss's")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        _refuse(cfg, where, "use_sliding_window", (None, False), "Qwen sliding-window layers")
    _refuse(cfg, where, "use_bidirectional_attention", (None, False), "jpa's attention is causal")
    quant = cfg.get("quantization_config")
    mxfp4 = model_type == "gpt_oss" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    if quant is not None and not mxfp4:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise CheckpointError(f"{where}: quantization_config ({method!r}) is not supported: jpa loads "
                              f"float16/bfloat16/float32 weights")
    base, scaling = _rope(cfg, where)
    window, window_layers = None, ()
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown or len(layer_types) != layers:
            raise CheckpointError(f"{where}: layer_types must be {layers} entries of 'full_attention' / "
                                  f"'sliding_attention'; got {layer_types!r}")
    gpt_oss = model_type == "gpt_oss"
    if gemma or gpt_oss or model_type in ("mistral", "mixtral"):
        window = cfg.get("sliding_window", 128 if gpt_oss else None)
        if window is not None:
            if layer_types is None:  # transformers' defaults: Gemma-2 and gpt-oss even layers, Mistral all
                layer_types = (["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
                               if gemma or gpt_oss else ["sliding_attention"] * layers)
            window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
            window = int(window) if window_layers else None
    elif layer_types is not None and "sliding_attention" in layer_types:
        raise CheckpointError(f"{where}: sliding_attention layers are not supported for {model_type}")
    tie_default = gemma  # transformers' default per family
    kw = _moe_options(cfg, model_type, layers, where)
    if mxfp4:  # gpt-oss's released checkpoints: the experts in MXFP4 (models.moe.dequantize_mxfp4)
        kw["expert_format"] = "mxfp4"
    if model_type == "qwen3_moe":
        ffn = int(cfg.get("moe_intermediate_size") or 0) or ffn
    if gemma:
        kw.update(mlp_activation="gelu_tanh", norm_weight_offset=1.0, embed_scale=math.sqrt(d),
                  post_norms=True, attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                  attn_soft_cap=cfg.get("attn_logit_softcapping"),
                  final_soft_cap=cfg.get("final_logit_softcapping"))
    try:
        return ModelConfig(
            family="llama", vocab_size=vocab, d_model=d, num_layers=layers, num_q_heads=n,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n), head_dim=int(head_dim), ffn_dim=ffn,
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)), rope_base=base,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
            bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            qkv_bias=model_type == "qwen2" or (gpt_oss and bool(cfg.get("attention_bias", True))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"), rope_scaling=scaling, sliding_window=window,
            sliding_window_layers=window_layers, **kw)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def _moe_options(cfg: dict, model_type: str, layers: int, where: str) -> dict:
    """The ModelConfig mixture-of-experts fields of a mixtral / qwen3_moe config ({} otherwise).
    Every layer must be a MoE layer: a Qwen3-MoE config with dense layers (mlp_only_layers, or
    decoder_sparse_step > 1) is refused (the scanned layers hold one parameter set)."""
    if model_type not in ("mixtral", "qwen3_moe", "gpt_oss"):
        return {}
    experts = cfg.get("num_local_experts") if model_type != "qwen3_moe" else cfg.get(
        "num_experts", cfg.get("num_local_experts"))
    k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token") if model_type == "gpt_oss" else None)
    if experts is None or k is None:
        raise CheckpointError(f"{where}: {model_type} needs num_experts (num_local_experts) and num_experts_per_tok")
    if model_type == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
        moe = [i for i in range(layers) if i not in dense and int(experts) > 0 and (i + 1) % int(step) == 0]
        if len(moe) != layers:
            raise CheckpointError(f"{where}: layers {sorted(set(range(layers)) - set(moe))} are dense MLP layers "
                                  f"(mlp_only_layers={dense!r}, decoder_sparse_step={step!r}); jpa's scanned "
                                  f"layers need every layer to be a mixture-of-experts layer")
        norm = bool(cfg.get("norm_topk_prob", False))
    else:
        norm = True  # Mixtral, gpt-oss: softmax over the chosen experts' logits
    out = dict(num_experts=int(experts), experts_per_token=int(k), norm_topk_prob=norm)
    if model_type == "gpt_oss":  # transformers' GptOss: biases, clamped SwiGLU, sinks
        out.update(router_bias=True, expert_bias=True, attn_sinks=True,
                   o_bias=bool(cfg.get("attention_bias", True)),
                   swiglu_clamp=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))))
    return out


def hf_names(c: ModelConfig, model_type: str) -> dict:
    """{our parameter path: (checkpoint tensor name, transpose[, part])} for a config.

    Paths are "tok_embeddings", "norm", "output", "layers.{i}.{name}" (models.gpt.expected_shapes);
    transpose means the checkpoint holds torch's [out, in] and the model x @ W's [in, out]; part
    (gpt-oss's gate_up_proj) 0 or 1: the tensor's last axis interleaves two parameters, ours is
    [..., part::2]; or for MXFP4 experts ("blocks" | "scales", 0 / 1 / None): u8 [E, out, ...] with
    gate and up interleaved on the out axis (rows p::2), blocks [E, O, I/32, 16] read as [E, O, I/2].
    """
    from jpa.models.gpt import expected_shapes

    pre_ffn = "pre_feedforward_layernorm" if model_type == "gemma2" else "post_attention_layernorm"
    layer = {
        "attn_norm": ("input_layernorm.weight", False), "wq": ("self_attn.q_proj.weight", True),
        "wk": ("self_attn.k_proj.weight", True), "wv": ("self_attn.v_proj.weight", True),
        "wo": ("self_attn.o_proj.weight", True), "ffn_norm": (f"{pre_ffn}.weight", False),
        "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
        "w_down": ("mlp.down_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
        "bk": ("self_attn.k_proj.bias", False), "bv": ("self_attn.v_proj.bias", False),
        "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
        "post_attn_norm": ("post_attention_layernorm.weight", False),
        "post_ffn_norm": ("post_feedforward_layernorm.weight", False),
    }
    moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    layer["router"] = (f"{moe}.gate.weight", True)
    if model_type == "gpt_oss":  # experts stacked in the checkpoint as [E, in, out]; gate and up interleaved
        layer.update(router=("mlp.router.weight", True), router_bias=("mlp.router.bias", False),
                     experts_gate=("mlp.experts.gate_up_proj", False, 0),
                     experts_up=("mlp.experts.gate_up_proj", False, 1),
                     experts_down=("mlp.experts.down_proj", False),
                     experts_gate_bias=("mlp.experts.gate_up_proj_bias", False, 0),
                     experts_up_bias=("mlp.experts.gate_up_proj_bias", False, 1),
                     experts_down_bias=("mlp.experts.down_proj_bias", False),
                     bo=("self_attn.o_proj.bias", False), sinks=("self_attn.sinks", False))
        if c.expert_format == "mxfp4":  # *_blocks [E, out, in / 32, 16] and *_scales [E, out, in / 32], u8
            for ours, theirs, p in (("experts_gate", "gate_up_proj", 0), ("experts_up", "gate_up_proj", 1),
                                    ("experts_down", "down_proj", None)):
                layer[ours] = (f"mlp.experts.{theirs}_blocks", False, ("blocks", p))
                layer[ours + "_scales"] = (f"mlp.experts.{theirs}_scales", False, ("scales", p))
    # An expert parameter [E, ...] is E checkpoint tensors: the name holds "{j}" for the expert.
    expert = {"mixtral": ("w1", "w3", "w2")}.get(model_type, ("gate_proj", "up_proj", "down_proj"))
    for ours, theirs in zip(("experts_gate", "experts_up", "experts_down"), expert):
        layer.setdefault(ours, (f"{moe}.experts.{{j}}.{theirs}.weight", True))
    shapes = expected_shapes(c)
    out = {"tok_embeddings": ("model.embed_tokens.weight", False), "norm": ("model.norm.weight", False)}
    if not c.tie_embeddings:
        out["output"] = ("lm_head.weight", True)
    for i in range(c.num_layers):
        for name in shapes["layers"]:
            hf, *rest = layer[name]
            out[f"layers.{i}.{name}"] = (f"model.layers.{i}.{hf}", *rest)
    return out


def _tensor_index(path: pathlib.Path) -> dict:
    """{tensor name: (file, safetensors dtype, shape)} over the checkpoint's safetensors files,
    from their headers only. Raises CheckpointError / FileNotFoundError naming the file."""
    from safetensors import SafetensorError, safe_open

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = (_read_json(index_file, True) or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors file (jpa reads safetensors checkpoints "
                                    f"only, not pytorch_model.bin)")
    index = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing (listed in {index_file.name})")
        try:
            # safe_open checks that the header's extents match the file's size: a truncated or
            # padded file fails here, before any tensor is read.
            with safe_open(file, framework="numpy") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    index[key] = (file, sl.get_dtype(), tuple(int(x) for x in sl.get_shape()))
        except SafetensorError as e:
            raise CheckpointError(f"{file} is not a whole safetensors file ({e}); it is probably truncated "
                                  f"or damaged: download it again") from e
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in index or index[key][0].name != name:
                raise CheckpointError(f"{index_file.name} puts {key} in {name}, but that file does not hold it")
    return index


def _plan(c: ModelConfig, model_type: str, index: dict, path: pathlib.Path) -> dict:
    """Checks presence, shape and dtype of every tensor the model needs, and that the checkpoint
    holds nothing else; returns {our path: (file, name, transpose, stored dtype)}."""
    from jpa.models.gpt import expected_shapes

    shapes = expected_shapes(c)
    plan = {}
    for ours, (name, transpose, *part) in hf_names(c, model_type).items():
        want = shapes[ours] if "." not in ours else shapes["layers"][ours.rsplit(".", 1)[1]]
        if "{j}" in name:  # an expert parameter [E, ...]: one checkpoint tensor per expert, stacked
            parts = [_check_tensor(name.format(j=j), want[1:], transpose, index, path, model_type)
                     for j in range(want[0])]
            plan[ours] = (tuple(p[0] for p in parts), tuple(p[1] for p in parts), transpose, parts[0][3])
            continue
        plan[ours] = _check_tensor(name, want, transpose, index, path, model_type, *part)
    used = {n for _, name, *_ in plan.values() for n in (name if isinstance(name, tuple) else (name,))}
    extra = sorted(k for k in index if k not in used and not k.endswith(IGNORED_SUFFIXES)
                   and not (k == "lm_head.weight" and c.tie_embeddings))
    if extra:
        raise CheckpointError(f"{path}: the checkpoint has tensors this {model_type} config does not use: "
                              f"{extra[:5]}{' ...' if len(extra) > 5 else ''} (a different architecture?)")
    return plan


def _check_tensor(name, want, transpose, index, path, model_type, part=None):
    """(file, name, transpose, stored dtype[, part]) of a tensor the model needs, after checking it
    (part: the tensor interleaves two parameters on its last axis, ours is [..., part::2])."""
    stored = tuple(reversed(want)) if transpose else want
    if isinstance(part, tuple):  # MXFP4 codes / scales [E, out, ...]: gate and up interleaved on the out axis
        kind, p = part
        stored = (stored[0], stored[1] * (1 if p is None else 2), *stored[2:])
        stored = (*stored[:2], stored[2] // 16, 16) if kind == "blocks" else stored
    elif part is not None:
        stored = (*stored[:-1], 2 * stored[-1])
    if name not in index:
        raise CheckpointError(f"{path}: tensor {name} is missing (needed for {model_type} with this "
                              f"config.json)")
    file, dtype, shape = index[name]
    if shape != stored:
        raise CheckpointError(f"{file}: tensor {name} has shape {list(shape)}; config.json implies "
                              f"{list(stored)}")
    if isinstance(part, tuple):
        if dtype != "U8":
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; MXFP4 blocks and scales are U8")
    elif dtype not in STORED_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}; jpa loads {sorted(STORED_DTYPES)}")
    return (file, name, transpose, dtype) + (() if part is None else (part,))


def _read(file, name, transpose, np_dtype, part=None):
    """One tensor as a C-contiguous NumPy array in np_dtype, through a memory map closed on return
    (file and name tuples: the experts' tensors, stacked on a new leading axis; part: [..., part::2])."""
    from safetensors import safe_open

    if isinstance(name, tuple):
        return np.stack([_read(f, n, transpose, np_dtype) for f, n in zip(file, name)])
    with safe_open(file, framework="numpy") as f:
        a = f.get_tensor(name)
    if transpose:
        a = a.T
    if isinstance(part, tuple):  # MXFP4: rows p::2 of the out axis; blocks [E, O, I/32, 16] -> codes [E, O, I/2]
        kind, p = part
        a = a if p is None else a[:, p::2]
        a = a.reshape(*a.shape[:2], -1) if kind == "blocks" else a
        return np.ascontiguousarray(a, dtype=np.uint8)
    if part is not None:
        a = a[..., part::2]
    return np.ascontiguousarray(a, dtype=np_dtype)


def load(path, dtype=None, quantization=None):
    """Loads a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json, *.safetensors (with or without
        model.safetensors.index.json), tokenizer.json and optionally tokenizer_config.json,
        chat_template.jinja and generation_config.json.
      dtype: parameter dtype, float32 or bfloat16; default bfloat16 on a GPU, float32 otherwise.
      quantization: None, or "int8" / "fp8": weight-only, per output channel, quantized on the host
        tensor group by tensor group as they are read (models.gpt.set_weight).

    Returns:
      (model: models.GPT, tokenizer: models.tokenizer.HFTokenizer).

    Raises:
      FileNotFoundError: a required file is missing.
      CheckpointError (a ValueError): unsupported model_type/option, a tensor missing or of the
        wrong shape or dtype, a truncated or damaged file. Nothing is loaded in these cases.
      ValueError: an unsupported `dtype`.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jpa.core.quant import check_weight_quantization
    from jpa.models.gpt import GPT, PARAM_DTYPES, expected_shapes, set_weight
    from jpa.models.tokenizer import HFTokenizer

    if dtype is None:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype must be float32 or bfloat16; got {dtype!r}") from e
    if np_dtype not in PARAM_DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16; got {np_dtype.name}")
    check_weight_quantization(quantization)
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory (models.load takes a preset name or a Hugging "
                                f"Face checkpoint directory)")
    cfg = _read_json(path / "config.json", True)
    gen = _read_json(path / "generation_config.json", False)
    tokenizer = HFTokenizer.from_dir(path, generation_config=gen, model_config=cfg)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    config = config_from_hf(cfg, where=str(path / "config.json"), bos_token_id=int(bos),
                            eos_token_id=tokenizer.eos_token_id)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer.json has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {config.vocab_size}")
    plan = _plan(config, cfg["model_type"], _tensor_index(path), path)

    model = nnx.eval_shape(lambda: GPT(config, dtype=np_dtype, rngs=nnx.Rngs(0), quantization=quantization))
    shapes_layers = expected_shapes(config)["layers"]
    # A layer parameter is stacked over the layers ([num_layers, ...]): its tensors are read as a group,
    # {parameter: [our paths, in layer order]}.
    groups = {}
    for ours in plan:
        groups.setdefault(ours.rsplit(".", 1)[-1], []).append(ours)
    owner = lambda param: model.layers if param in shapes_layers else model
    var = lambda param: getattr(owner(param), param)
    # Largest tensors first: their transient copies then come while little else is resident.
    for param in sorted(groups, key=lambda p: -math.prod(var(p).shape)):
        members = sorted(groups[param], key=lambda k: int(k.split(".")[1]) if k.startswith("layers.") else 0)
        values = [_read(*plan[m][:3], np_dtype, *plan[m][4:]) for m in members]
        value = np.stack(values) if param in shapes_layers else values[0]
        if quantization is None:
            var(param).set_value(jnp.asarray(value))
        else:
            set_weight(owner(param), param, value, np_dtype, quantization)
    return model, tokenizer
