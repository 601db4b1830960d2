"""Hugging Face checkpoint directories: config.json + *.safetensors + tokenizer.json -> models.GPT.

    model, tokenizer = models.hf.load("path/to/Qwen2.5-0.5B-Instruct", dtype=jnp.bfloat16)

Supported `model_type`s (config.json): those of the family modules in `models.families`, one module per
family, registered by model_type and architectures (llama: Llama 2/3, Mistral, Qwen2, Qwen3; gemma2; mixtral:
Mixtral, Qwen3-MoE; gpt_oss). This module reads what every family shares (sizes, RoPE, quantization, layer
types, the safetensors files) and asks the family for its variant's options and tensor names. Anything else,
and any option of these families that the model does not implement, is refused with a ValueError naming it.

Quantized checkpoints (a `quantization_config`: compressed-tensors FP8 (tensor / channel / block) /
int8 / pack-quantized int4, the older "fp8" layout, per tensor or block-wise, AutoAWQ GEMM, GPTQ) are
read as stored and kept quantized on the device (`quant_scheme`, `_quant_entry`; the embeddings and an
unquantized head stay dense), or dequantized on the host with quantization="none".

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
from jpa.models.families import CheckpointError, family_of, supported_model_types
from jpa.models.families.base import LLAMA_LAYER_NAMES, Sizes, refuse as _refuse

# The model types of the registered families (models.families: one module per family).
SUPPORTED_MODEL_TYPES = supported_model_types()
# safetensors dtype -> NumPy dtype name (bfloat16 comes from ml_dtypes, which JAX imports).
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors a checkpoint may carry that the model does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def config_from_hf(cfg: dict, *, where: str = "config.json", bos_token_id: int = 0,
                   eos_token_id: int = 0) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json dict: the sizes, RoPE, quantization and layer types every
    family shares are read here, the variant's options by its family module (`models.families`).

    Args:
      cfg: config.json's contents.
      where: how to name the file in errors.
      bos_token_id, eos_token_id: the tokenizer's special ids (stored in the ModelConfig).

    Raises:
      CheckpointError (a ValueError): unsupported model_type or option, naming it.
    """
    family, model_type = family_of(cfg, where)
    cfg = {**cfg, "model_type": model_type}
    try:
        d, n = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers, vocab, ffn = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]), int(cfg["intermediate_size"])
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0]!r} is missing") from e
    head_dim = int(cfg.get("head_dim") or d // n)
    _refuse(cfg, where, "use_bidirectional_attention", (None, False), "jpa's attention is causal")
    quant_scheme(cfg, where)  # an unsupported quantization_config is refused here, before any tensor is read
    base, scaling = _rope(cfg, where)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown or len(layer_types) != layers:
            raise CheckpointError(f"{where}: layer_types must be {layers} entries of 'full_attention' / "
                                  f"'sliding_attention'; got {layer_types!r}")
    kw = dict(ffn_dim=ffn)
    kw.update(family.options(cfg, where, Sizes(d_model=d, num_heads=n, num_layers=layers, head_dim=head_dim,
                                               ffn_dim=ffn)))
    try:
        return ModelConfig(
            family="llama", vocab_size=vocab, d_model=d, num_layers=layers, num_q_heads=n,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n), head_dim=head_dim,
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)), rope_base=base,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", family.tie_default)),
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, rope_scaling=scaling, **kw)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints (issue 35). A linear layer's tensors (module prefix P, e.g.
# model.layers.0.self_attn.q_proj) in each layout jpa reads, kept in their storage type on the device:
#   "scaled"  FP8 / int8, one scale per tensor or output channel: P.weight F8_E4M3 or I8 [out, in],
#             P.weight_scale [] / [1] / [out] / [out, 1] (P.input_scale, a static activation scale, is
#             not used: jpa keeps activations in the compute dtype, a W8A16 matmul). compressed-tensors
#             "float-quantized" (strategy tensor / channel), "naive-quantized" / "int-quantized" int8, and
#             the older quant_method "fp8" layout (per-tensor weight_scale). Stored as models.gpt's int8 /
#             fp8 weights: q [in, out] with an f32 scale per output channel (a per-tensor scale repeated).
#   "block"   block-wise FP8: P.weight F8_E4M3 [out, in] and one scale per [bo, bi] block,
#             P.weight_scale_inv (quant_method "fp8" with weight_block_size: DeepSeek-V3, Qwen3-*-FP8) or
#             P.weight_scale (compressed-tensors float-quantized strategy "block", block_structure), F32 /
#             BF16 [ceil(out / bo), ceil(in / bi)] (jpa.core.quant.fp8_block): a models.gpt.PackedWeight
#             of the fp8 codes and the block scales per output channel, dequantized inside the matmul.
#   "awq"     AutoAWQ GEMM: P.qweight, P.qzeros, P.scales (jpa.core.quant.awq_int4).
#   "gptq"    GPTQ: P.qweight, P.qzeros, P.scales, P.g_idx (jpa.core.quant.gptq_int4; v1 / v2 zero points;
#             act order: rows sorted by group and an input permutation, jpa.core.quant.gptq_act_order).
#   "packed"  compressed-tensors "pack-quantized" int4: P.weight_packed, P.weight_scale,
#             P.weight_zero_point (asymmetric), P.weight_shape (jpa.core.quant.pack_quantized_int4).
# The int4 layouts become models.gpt.PackedWeight (4-bit codes, group scales [and minimums]). vLLM reads
# the same layouts: vllm/model_executor/layers/quantization/{fp8,awq,gptq}.py and compressed_tensors/.
INT4_ROLES = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
              "packed": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
SCALED_DTYPES = {"F8_E4M3": "float8_e4m3fn", "I8": "int8"}
SCALE_DTYPES = ("F32", "F16", "BF16")


def quant_scheme(cfg: dict, where: str = "config.json"):
    """The quantization of a config.json's `quantization_config`: None (none), or a dict with
    "method" (the quant_method: "fp8", "awq", "gptq", "compressed-tensors"), "layout" ("scaled",
    "block", "awq", "gptq" or "packed"), "group_size" (int4; None: per channel) and "v2" (GPTQ v2 zero points).

    Raises CheckpointError naming what is not supported (an unknown method, bits other than 4 for
    AWQ / GPTQ, AWQ without zero points or other than GEMM, a bad FP8 block size, a KV-cache scheme).
    Block-wise FP8 ("layout" "block") adds "block" (bo, bi) and "scale_role" (the scales' tensor name:
    "weight_scale_inv" for quant_method "fp8", "weight_scale" for compressed-tensors)."""
    from jpa.core.quant import check_fp8_block

    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4" and cfg.get("model_type") == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts: the family's own expert format (config_from_hf's expert_format)

    def refuse(why):
        raise CheckpointError(f"{where}: quantization_config ({method!r}) {why}")

    def block_of(b, what):
        try:
            return check_fp8_block(b, what)
        except ValueError as e:
            refuse(str(e))

    if method == "fp8":
        if q.get("weight_block_size") is not None:  # DeepSeek-V3 / Qwen3-*-FP8: P.weight_scale_inv per block
            if q.get("activation_scheme", "dynamic") != "dynamic":
                refuse(f"has activation_scheme {q['activation_scheme']!r} with block-wise scales: vLLM and jpa read "
                       f"block-wise FP8 with dynamic activations only")
            return dict(method=method, layout="block", block=block_of(q["weight_block_size"], "weight_block_size"),
                        scale_role="weight_scale_inv", group_size=None, v2=False)
        return dict(method=method, layout="scaled", group_size=None, v2=False)
    if method in ("awq", "gptq"):
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            refuse(f"has bits {bits!r}: jpa loads 4-bit {method.upper()} checkpoints")
        g = q.get("group_size", q.get("q_group_size"))
        if not isinstance(g, int) or not (g == -1 or (g > 0 and g % 32 == 0)):
            refuse(f"has group_size {g!r}: jpa needs -1 or a multiple of 32")
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                refuse(f"has version {version!r}: jpa reads AutoAWQ's GEMM packing")
            if not q.get("zero_point", True):
                refuse("has zero_point false: jpa reads AWQ checkpoints with zero points")
            return dict(method=method, layout="awq", group_size=None if g == -1 else g, v2=False)
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            refuse(f"has checkpoint_format {fmt!r}: jpa reads 'gptq' (v1) and 'gptq_v2'")
        # desc_act (act order): read from the g_idx tensors themselves (jpa.core.quant.gptq_act_order).
        return dict(method=method, layout="gptq", group_size=None if g == -1 else g, v2=fmt == "gptq_v2")
    if method == "compressed-tensors":
        if q.get("kv_cache_scheme"):
            refuse("has a kv_cache_scheme: jpa quantizes its KV cache itself (--kv-cache-dtype)")
        if q.get("sparsity_config"):
            refuse("has a sparsity_config: sparse compressed-tensors checkpoints are not supported")
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            refuse("has no config_groups")
        schemes = set()
        for gname, grp in groups.items():
            w = (grp or {}).get("weights") or {}
            fmt = grp.get("format") or q.get("format")
            key = (w.get("type"), w.get("num_bits"), w.get("strategy"))
            if key in (("float", 8, "tensor"), ("float", 8, "channel")) and fmt in ("float-quantized",
                                                                                  "naive-quantized"):
                schemes.add(("scaled", None))
            elif key == ("float", 8, "block") and fmt == "float-quantized":
                schemes.add(("block", block_of(w.get("block_structure"), f"group {gname!r} block_structure")))
            elif key in (("int", 8, "tensor"), ("int", 8, "channel")) and w.get("symmetric", True) and fmt in (
                    "naive-quantized", "int-quantized"):
                schemes.add(("scaled", None))
            elif key[:2] == ("int", 4) and key[2] in ("group", "channel") and fmt == "pack-quantized":
                g = w.get("group_size") if key[2] == "group" else None
                if g is not None and (not isinstance(g, int) or g % 32):
                    refuse(f"group {gname!r} has group_size {g!r}: jpa needs a multiple of 32")
                schemes.add(("packed", g))
            else:
                refuse(f"group {gname!r} has weights {dict(type=key[0], num_bits=key[1], strategy=key[2])} in format "
                       f"{fmt!r}: jpa loads float-quantized FP8 (tensor / channel / block), int8 (naive / "
                       f"int-quantized) and pack-quantized int4 (group / channel)")
        if len(schemes) != 1:
            refuse(f"mixes schemes {sorted(schemes, key=str)}: jpa stacks the layers and needs one per checkpoint")
        layout, g = schemes.pop()
        if layout == "block":
            return dict(method=method, layout=layout, block=g, scale_role="weight_scale", group_size=None, v2=False)
        return dict(method=method, layout=layout, group_size=g, v2=False)
    raise CheckpointError(f"{where}: quantization_config ({method!r}) is not supported: jpa loads float16/bfloat16/"
                          f"float32 weights and the fp8, awq, gptq and compressed-tensors quantizations")


def hf_names(c: ModelConfig, model_type: str) -> dict:
    """{our parameter path: (checkpoint tensor name, transpose[, part])} for a config.

    Paths are "tok_embeddings", "norm", "output", "layers.{i}.{name}" (models.gpt.expected_shapes);
    transpose means the checkpoint holds torch's [out, in] and the model x @ W's [in, out]; part
    (gpt-oss's gate_up_proj) 0 or 1: the tensor's last axis interleaves two parameters, ours is
    [..., part::2]; or for MXFP4 experts ("blocks" | "scales", 0 / 1 / None): u8 [E, out, ...] with
    gate and up interleaved on the out axis (rows p::2), blocks [E, O, I/32, 16] read as [E, O, I/2].
    """
    from jpa.models.gpt import expected_shapes

    family, model_type = family_of({"model_type": model_type})
    layer = {**LLAMA_LAYER_NAMES, **family.layer_names(c, model_type)}
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


# The parameters a checkpoint may hold quantized (models.gpt.QUANT_AXIS less the embedding table).
QUANTIZABLE = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "output")


class QuantTensor(tuple):
    """A quantized linear in the plan: (layout, {role: (file, tensor name)}, in, out)."""

    layout = property(lambda self: self[0])
    tensors = property(lambda self: self[1])


def _quant_entry(name, want, index, path, scheme):
    """The QuantTensor of linear `name` (P.weight; our shape want = [in, out]) when the checkpoint holds
    it quantized in the scheme's layout, None when it holds P.weight in a float dtype. Checks every
    tensor's shape and dtype from the headers, raising CheckpointError naming the tensor and type."""
    prefix = name.removesuffix(".weight")
    k, n = want
    layout = scheme["layout"] if scheme else None
    if name in index and index[name][1] in STORED_DTYPES:
        return None
    if layout is None or (layout not in ("scaled", "block") and prefix + "." + INT4_ROLES[layout][0] not in index):
        return None  # _check_tensor names what is missing or of an unsupported dtype
    g = k if layout in ("scaled", "block") or scheme["group_size"] is None else scheme["group_size"]
    if k % g:
        raise CheckpointError(f"{path}: tensor {prefix} has {k} input features, not a multiple of the group size {g}")
    ng = k // g
    specs = {  # role: (allowed dtypes, allowed shapes, required)
        "scaled": {"weight": (tuple(SCALED_DTYPES), [(n, k)], True),
                   "weight_scale": (SCALE_DTYPES, [(), (1,), (n,), (n, 1)], True),
                   "input_scale": (SCALE_DTYPES, [(), (1,)], False)},
        "block": {"weight": (("F8_E4M3",), [(n, k)], True),
                  **({scheme["scale_role"]: (SCALE_DTYPES, [tuple(-(-x // b) for x, b in zip((n, k), scheme["block"]))],
                                             True)} if layout == "block" else {}),
                  "input_scale": (SCALE_DTYPES, [(), (1,)], False)},
        "awq": {"qweight": (("I32",), [(k, n // 8)], True), "qzeros": (("I32",), [(ng, n // 8)], True),
                "scales": (SCALE_DTYPES, [(ng, n)], True)},
        "gptq": {"qweight": (("I32",), [(k // 8, n)], True), "qzeros": (("I32",), [(ng, n // 8)], True),
                 "scales": (SCALE_DTYPES, [(ng, n)], True), "g_idx": (("I32", "I64"), [(k,)], False)},
        "packed": {"weight_packed": (("I32",), [(n, k // 8)], True), "weight_scale": (SCALE_DTYPES, [(n, ng)], True),
                   "weight_zero_point": (("I32",), [(n // 8, ng)], False),
                   "weight_shape": (("I32", "I64"), [(2,)], False)},
    }[layout]
    tensors = {}
    for role, (dtypes, shapes_ok, required) in specs.items():
        tname = f"{prefix}.{role}"
        if tname not in index:
            if required:
                raise CheckpointError(f"{path}: tensor {tname} is missing (a {scheme['method']} {layout} linear "
                                      f"needs it)")
            continue
        file, dtype, shape = index[tname]
        if dtype not in dtypes or shape not in shapes_ok:
            raise CheckpointError(f"{file}: tensor {tname} is {dtype} {list(shape)}; the {scheme['method']} "
                                  f"{layout} layout with config.json implies {' or '.join(dtypes)} "
                                  f"{' or '.join(str(list(x)) for x in shapes_ok)}")
        tensors[role] = (file, tname)
    return QuantTensor((layout, tensors, k, n))


def _plan(c: ModelConfig, model_type: str, index: dict, path: pathlib.Path, scheme=None, mixed=False) -> dict:
    """Checks presence, shape and dtype of every tensor the model needs, and that the checkpoint
    holds nothing else; returns {our path: (file, name, transpose, stored dtype)}, or a QuantTensor
    for a linear the checkpoint holds quantized (`quant_scheme`). Unless `mixed` (the weights are
    dequantized at load), every layer must store a stacked weight the same way."""
    from jpa.models.gpt import expected_shapes

    shapes = expected_shapes(c)
    plan = {}
    for ours, (name, transpose, *part) in hf_names(c, model_type).items():
        want = shapes[ours] if "." not in ours else shapes["layers"][ours.rsplit(".", 1)[1]]
        if ours.rsplit(".", 1)[-1] in QUANTIZABLE and transpose and "{j}" not in name:
            entry = _quant_entry(name, want, index, path, scheme)
            if entry is not None:
                plan[ours] = entry
                continue
        if "{j}" in name:  # an expert parameter [E, ...]: one checkpoint tensor per expert, stacked
            parts = [_check_tensor(name.format(j=j), want[1:], transpose, index, path, model_type)
                     for j in range(want[0])]
            plan[ours] = (tuple(p[0] for p in parts), tuple(p[1] for p in parts), transpose, parts[0][3])
            continue
        plan[ours] = _check_tensor(name, want, transpose, index, path, model_type, *part)
    used = set()
    for entry in plan.values():
        if isinstance(entry, QuantTensor):
            used.update(t for _, t in entry.tensors.values())
        else:
            used.update(entry[1] if isinstance(entry[1], tuple) else (entry[1],))
    kinds = {}  # a stacked parameter needs one storage for all its layers
    for ours, entry in plan.items() if not mixed else ():  # mixed: all dequantized at load
        kind = entry.layout if isinstance(entry, QuantTensor) else "dense"
        first = kinds.setdefault(ours.rsplit(".", 1)[-1], (ours, kind))
        if first[1] != kind:
            raise CheckpointError(f"{path}: {first[0]} is stored {first[1]} but {ours} is stored {kind}; jpa stacks "
                                  f"the layers and needs one storage per weight (load with quantization 'none')")
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


def _read_raw(file, name):
    """One tensor read through its safetensors header (NumPy lacks float8, which safetensors' numpy
    reader refuses): F8_E4M3 as ml_dtypes float8_e4m3fn, other dtypes as their NumPy types."""
    import ml_dtypes

    types = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "I8": np.int8, "I32": np.int32, "I64": np.int64, "F32": np.float32,
             "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))[name]
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        data = f.read(end - start)
    dt = np.dtype(types[meta["dtype"]])
    shape = tuple(meta["shape"])
    if len(data) != math.prod(shape) * dt.itemsize:
        raise CheckpointError(f"{file}: tensor {name} ({meta['dtype']} {list(shape)}) holds {len(data)} bytes: "
                              f"truncated")
    return np.frombuffer(data, dt).reshape(shape)


def _read_quant(entry: QuantTensor, scheme: dict):
    """A quantized linear read and converted on the host: ("scaled", q [in, out] int8 / float8, f32 scale
    [out]) or ("packed", models.gpt.PackedWeight). Raises CheckpointError naming the tensor on bad values."""
    from jpa.core import quant
    from jpa.models.gpt import PackedWeight

    t = {role: _read_raw(*ft) for role, ft in entry.tensors.items()}
    k, n = entry[2], entry[3]
    prefix = next(iter(entry.tensors.values()))[1].rsplit(".", 1)[0]
    try:
        if entry.layout == "scaled":
            scale = np.broadcast_to(t["weight_scale"].astype(np.float32).reshape(-1), (n,)).copy()
            if not (np.isfinite(scale).all() and (scale > 0).all()):
                raise ValueError(f"tensor {prefix}.weight_scale has non-finite or non-positive scales: corrupt")
            q = t["weight"]
            if q.dtype != np.int8 and not np.isfinite(q.astype(np.float32)).all():
                raise ValueError(f"tensor {prefix}.weight ({q.dtype}) holds NaN codes: corrupt")
            return "scaled", np.ascontiguousarray(q.T), scale
        if entry.layout == "block":
            codes, d = quant.fp8_block(t["weight"], t[scheme["scale_role"]], scheme["block"], name=prefix)
            return "packed", PackedWeight(codes, d, None, -2)
        if entry.layout == "awq":
            blocks = quant.awq_int4(t["qweight"], t["qzeros"], t["scales"], name=prefix)
        elif entry.layout == "gptq":
            perm = None
            if "g_idx" in t:  # act order (desc_act): rows sorted by group, activations gathered
                perm = quant.gptq_act_order(t["g_idx"], k, k // t["scales"].shape[0], name=prefix)
            blocks = quant.gptq_int4(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), scheme["v2"], name=prefix,
                                     perm=perm)
            return "packed", PackedWeight(*blocks, -2, perm=perm)
        else:
            if "weight_shape" in t and [int(x) for x in t["weight_shape"]] != [n, k]:
                raise ValueError(f"tensor {prefix}.weight_shape is {t['weight_shape'].tolist()}; config.json implies "
                                 f"{[n, k]}")
            blocks = quant.pack_quantized_int4(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                               name=prefix)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    return "packed", PackedWeight(*blocks, -2)


def load(path, dtype=None, quantization=None):
    """Loads a Hugging Face checkpoint directory.

    Args:
      path: directory with config.json, *.safetensors (with or without
        model.safetensors.index.json), tokenizer.json and optionally tokenizer_config.json,
        chat_template.jinja and generation_config.json.
      dtype: parameter dtype, float32 or bfloat16; default bfloat16 on a GPU, float32 otherwise.
      quantization: None, or "int8" / "fp8": weight-only, per output channel, quantized on the host
        tensor group by tensor group as they are read (models.gpt.set_weight). A quantized checkpoint
        (`quant_scheme`: FP8, AWQ, GPTQ, compressed-tensors) is kept as stored with None (the model's
        `quantization` is then its quant_method; also when `quantization` names that method, as for
        an "fp8" checkpoint), dequantized on the host at load with "none", and refused otherwise.

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
    from jpa.models.gpt import GPT, PARAM_DTYPES, PackedWeight, expected_shapes, set_packed, set_scaled, set_weight
    from jpa.models.tokenizer import HFTokenizer

    if dtype is None:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype must be float32 or bfloat16; got {dtype!r}") from e
    if np_dtype not in PARAM_DTYPES:
        raise ValueError(f"dtype must be float32 or bfloat16; got {np_dtype.name}")
    check_weight_quantization(None if quantization == "none" else quantization)
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory (models.load takes a preset name or a Hugging "
                                f"Face checkpoint directory)")
    cfg = _read_json(path / "config.json", True)
    gen = _read_json(path / "generation_config.json", False)
    tokenizer = HFTokenizer.from_dir(path, generation_config=gen, model_config=cfg)
    family, model_type = family_of(cfg, str(path / "config.json"))
    if family.load_model is not None:   # a family with its own model class (not the GPT stack)
        return family.load_model(path, cfg, model_type, dtype=dtype, quantization=quantization), tokenizer
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    config = config_from_hf(cfg, where=str(path / "config.json"), bos_token_id=int(bos),
                            eos_token_id=tokenizer.eos_token_id)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer.json has {tokenizer.vocab_size} tokens but the model's "
                              f"vocab_size is {config.vocab_size}")
    scheme = quant_scheme(cfg, str(path / "config.json"))
    dequantize = quantization == "none"
    quantization = None if dequantize else quantization
    if scheme is not None and quantization not in (None, scheme["method"]):
        raise CheckpointError(f"{path} is already quantized ({scheme['method']}); load it as stored (no quantization) "
                              f"or dequantized ('none'), not requantized to {quantization!r}")
    if scheme is not None:
        quantization = None  # as stored (quantization naming the checkpoint's own method, as vLLM allows)
    plan = _plan(config, cfg["model_type"], _tensor_index(path), path, scheme, mixed=dequantize)

    model = nnx.eval_shape(lambda: GPT(config, dtype=np_dtype, rngs=nnx.Rngs(0), quantization=quantization))
    shapes_layers = expected_shapes(config)["layers"]
    # A layer parameter is stacked over the layers ([num_layers, ...]): its tensors are read as a group,
    # {parameter: [our paths, in layer order]}.
    groups = {}
    for ours in plan:
        groups.setdefault(ours.rsplit(".", 1)[-1], []).append(ours)
    owner = lambda param: model.layers if param in shapes_layers else model
    var = lambda param: getattr(owner(param), param)
    quantized = False
    # Largest tensors first: their transient copies then come while little else is resident.
    for param in sorted(groups, key=lambda p: -math.prod(var(p).shape)):
        members = sorted(groups[param], key=lambda k: int(k.split(".")[1]) if k.startswith("layers.") else 0)
        if dequantize and any(isinstance(plan[m], QuantTensor) for m in members):
            # the float weights, quantized ones dequantized on the host: the dense path below
            values = []
            for m in members:
                if not isinstance(plan[m], QuantTensor):
                    values.append(_read(*plan[m][:3], np_dtype, *plan[m][4:]))
                    continue
                r = _read_quant(plan[m], scheme)
                values.append(r[1].dequantize() if r[0] == "packed" else r[1].astype(np.float32) * r[2])
        elif isinstance(plan[members[0]], QuantTensor):
            read = [_read_quant(plan[m], scheme) for m in members]
            stacked = param in shapes_layers
            if read[0][0] == "packed":
                set_packed(owner(param), param, PackedWeight.stack([r[1] for r in read]) if stacked else read[0][1])
                quantized = True
                continue
            else:
                q = np.stack([r[1] for r in read]) if stacked else read[0][1]
                set_scaled(owner(param), param, q, np.stack([r[2] for r in read]) if stacked else read[0][2])
                quantized = True
                continue
        else:
            values = [_read(*plan[m][:3], np_dtype, *plan[m][4:]) for m in members]
        value = np.stack(values) if param in shapes_layers else values[0]
        if quantization is None:
            # MXFP4 codes (u8) stay as stored
            var(param).set_value(jnp.asarray(value, dtype=None if value.dtype == np.uint8 else np_dtype))
        else:
            set_weight(owner(param), param, value, np_dtype, quantization)
    if quantized:
        model.quantization = scheme["method"]
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# Weight updates (`LLMEngine.update_weights`, RL rollouts): Hugging Face tensor names -> the served
# model's parameter pytree, with this loader's name map (`hf_names`) and quantization (`set_weight`'s).


def read_tensors(path) -> dict:
    """{tensor name: NumPy array} of a safetensors file, or of every safetensors file of a directory
    (with or without its index), in the stored dtypes (bfloat16 and float8 as ml_dtypes')."""
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    if path.is_dir():
        return {name: _read_raw(file, name) for name, (file, _, _) in _tensor_index(path).items()}
    if not path.is_file():
        raise FileNotFoundError(f"{path} is neither a safetensors file nor a directory of them")
    try:
        with safe_open(path, framework="numpy") as f:
            names = list(f.keys())
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a whole safetensors file ({e})") from e
    return {name: _read_raw(path, name) for name in names}


def _served_model_type(c: ModelConfig, names) -> str:
    """The `hf_names` model type whose tensor names a served model's config takes."""
    if c.family != "llama":
        raise ValueError(f"update_weights with Hugging Face names serves llama-family models; this one is {c.family!r} "
                         f"(pass the model's parameter pytree)")
    if c.attn_sinks:
        raise ValueError("update_weights with Hugging Face names does not read gpt-oss's interleaved gate_up_proj "
                         "(pass the model's parameter pytree)")
    if c.post_norms:
        return "gemma2"
    if c.num_experts:
        return "mixtral" if any(".block_sparse_moe." in n for n in names) else "qwen3_moe"
    return "llama"


def params_from_hf(served, weights):
    """The served model's parameter pytree with Hugging Face tensors in place (a weight update).

    Args:
      served: the model being served (`models.GPTForEngine`: config, dtype, quantization, params).
      weights: {Hugging Face tensor name: float array (NumPy or JAX)}, or a safetensors file or
        directory (`read_tensors`). Tensors not named keep their served values (a partial update).
        Each is transposed to x @ W's layout as `load` does, cast to the served dtype, or quantized
        per output channel when the model is served "int8" / "fp8" on the fly (`set_weight`'s rule).

    Returns:
      A pytree of `served.params`' structure: NumPy arrays where a tensor was given, the served
      arrays elsewhere (the engine places them: `ModelRunner.set_params`).

    Raises:
      ValueError: an unknown tensor name, a wrong shape or a non-float dtype, naming the tensor, or a
        model served from quantized blocks (GGUF, AWQ, GPTQ, FP8 checkpoints): nothing is changed.
    """
    import jax
    import jax.numpy as jnp

    from jpa.core.quant import quantize_weight
    from jpa.models.gpt import QUANT_AXIS, expected_shapes

    if isinstance(weights, (str, bytes)) or hasattr(weights, "__fspath__"):
        weights = read_tensors(weights)
    c, quant = served.config, getattr(served, "quantization", None)
    if quant not in (None, "int8", "fp8"):
        raise ValueError(f"update_weights with Hugging Face names needs dense weights or int8 / fp8 quantized on the "
                         f"fly; this model holds {quant!r} blocks as stored (load it with quantization 'none')")
    model_type = _served_model_type(c, weights)
    shapes = expected_shapes(c)
    where = {}   # HF name -> (our parameter, layer or None, expert or None, transpose, stored shape)
    for ours, (name, transpose, *_) in hf_names(c, model_type).items():
        param, layer = (ours.split(".")[2], int(ours.split(".")[1])) if ours.startswith("layers.") else (ours, None)
        want = shapes["layers"][param] if layer is not None else shapes[param]
        experts = range(want[0]) if "{j}" in name else (None,)
        for j in experts:
            w = want[1:] if j is not None else want
            where[name.format(j=j) if j is not None else name] = (param, layer, j, transpose,
                                                                   tuple(reversed(w)) if transpose else tuple(w))
    groups = {}
    for name, a in weights.items():
        if name not in where:
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and c.tie_embeddings):
                continue
            raise ValueError(f"weights: tensor {name!r} is not a parameter of this {model_type} model (names as in "
                             f"its Hugging Face checkpoint, e.g. {next(iter(where))!r})")
        param, layer, j, transpose, stored = where[name]
        shape, dtype = tuple(getattr(a, "shape", ())), getattr(a, "dtype", None)
        if shape != stored:
            raise ValueError(f"weights: tensor {name} must have shape {list(stored)}; got {list(shape)}")
        try:
            floating = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"weights: tensor {name} must hold floats; got {dtype}")
        groups.setdefault(param, {})[(layer, j)] = (a, transpose)

    flat, treedef = jax.tree_util.tree_flatten_with_path(served.params)
    index = {tuple(getattr(k, "key") for k in path if isinstance(k, jax.tree_util.DictKey)): i
             for i, (path, _) in enumerate(flat)}
    leaves = [leaf for _, leaf in flat]

    def leaf(param, suffix=""):
        key = ("layers", param + suffix) if param in shapes["layers"] else (param + suffix,)
        return index[key]

    for param, given in groups.items():
        stacked = param in shapes["layers"]
        want = shapes["layers"][param] if stacked else shapes[param]
        slots = [(i, j) for i in (range(c.num_layers) if stacked else (None,))
                 for j in (range(want[0]) if (stacked and c.num_experts and param.startswith("experts")) else (None,))]
        quantized = quant is not None and param in QUANT_AXIS
        targets = [leaf(param)] + ([leaf(param, "_scale")] if quantized else [])
        full = all(s in given for s in slots)
        outs = [np.empty(leaves[t].shape, leaves[t].dtype) if full else np.array(jax.device_get(leaves[t]))
                for t in targets]
        columns = not stacked and param == "tok_embeddings" and outs[0].shape == tuple(reversed(want))
        for (i, j), (a, transpose) in given.items():
            x = np.asarray(jax.device_get(a), np.float32)
            x = x.T if transpose else x
            at = tuple(k for k in (i, j) if k is not None)
            if quantized:
                q, scale = quantize_weight(x, quant, QUANT_AXIS[param])
                outs[0][at] = q.T if columns else q
                outs[1][at] = scale
            else:
                outs[0][at] = x.T if columns else x
        for t, out in zip(targets, outs):
            leaves[t] = out
    return jax.tree_util.tree_unflatten(treedef, leaves)
