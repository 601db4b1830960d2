"""A decoder-only transformer in Flax NNX that reads and writes a paged KV cache.

Two families share one module: "gpt2" (LayerNorm, learned positions, multi-head attention,
tanh-GELU MLP, biases, tied or untied head) and "llama" (RMSNorm, RoPE in the Hugging Face
rotate_half convention, grouped-query attention, SwiGLU, tied or untied head). The llama family's
config-driven variants cover the Hugging Face architectures `models.hf` loads: Llama-3 RoPE scaling,
Qwen2's q/k/v biases, Qwen3's q/k RMSNorm, and Gemma-2's embedding scale, GeGLU, (1 + w) norms,
post-norms, query scale, attention and final logit soft caps and sliding window on some layers,
and the mixtures of experts' MLP (models.moe; gpt-oss: q/k/v/o biases, YaRN RoPE and a learned
attention sink per layer and head, `Block.sinks`). The attention options go through
`jpa.paged_decode` / `jpa.paged_prefill` / `jpa.ragged_paged_attention` (`soft_cap=`,
`sliding_window=`, `scale=`, and each layer's `sinks=` from the scan over layers).

Entry points are plain functions of (model, cache, arrays) so that an engine can jit them with
the cache donated (`graphdef, params = nnx.split(model)`, then `nnx.merge` inside the jit):

- `prefill(model, cache, tokens, start, chunk_lens, slot_mapping, block_tables)`: a right-padded
  chunk of prompt tokens per sequence; writes their K/V and attends causally over the cache
  (`jpa.paged_prefill`).
- `decode(model, cache, tokens, seq_lens, slot_mapping, block_tables)`: one new token per
  sequence; writes its K/V, then `jpa.paged_decode`.
- `ragged(model, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
  num_seqs)`: a ragged batch of prefill chunks and decode tokens back to back in one token
  budget; writes their K/V, then `jpa.ragged_paged_attention` (the engine's unified step).
- `forward_dense(model, tokens)`: the same network without a cache (plain causal attention), the
  oracle for the two above.

Precision: parameters are stored in `dtype` (float32 or bfloat16); matmuls take inputs in
`dtype` and accumulate in float32; the residual stream, norms, RoPE and softmax are float32.
Compiled for a GPU, the layers' matmuls over bfloat16 weights write bfloat16 results
(`matmul_out_dtype`; the head's logits stay float32).

Layers are a `jax.lax.scan` (issue 24: the compiled program holds one layer body, not 30 or 80, so
compile time does not grow with depth). The layer parameters are stacked (`model.layers` is one
`Block` whose every parameter has a leading num_layers axis), and the scan carries the stacked KV
pools (`jpa.KVCache`, `[num_layers, K, P, S_p, H]`): each layer writes and attends through
`layer=` with the WHOLE pool, never a per-layer slice (which XLA would copy every layer of every
step). Per-layer attention options (Gemma-2's sliding window on alternate layers) are static, so
the scan body holds one period of the layer pattern (`GPT.layer_period`: 1 for most models, 2 for
Gemma-2) and steps over groups of that many layers.

Einsum letters: B num_seqs, T query tokens, S key tokens, N q heads, K kv heads, G q_per_kv,
H head_dim.
"""

import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpa.kv.cache import CacheConfig, KVCache, write_kv
from jpa.kv.spec import CacheSpec
from jpa.ops.decode import paged_decode
from jpa.ops.dispatch import current_target
from jpa.ops.qmatmul import mosaic_serves_target
from jpa.ops.prefill import paged_prefill
from jpa.ops.ragged import ragged_paged_attention
from jpa.core.quant import check_weight_quantization, dequantize_blocks, quantize_weight, super_scaled
from jpa.core.sharding import HEADS, HEADS_T, REPLICATED, STACKED_POOL, TP, head_parallel
from jpa.models.config import ModelConfig
from jpa.models.linear import (DENSE, MXFP4, QUANT_AXIS, SCALED, Packed, _v, format_of, formats, set_format,
                               unpermute_rows)
from jpa.models.lora import DEFAULT_METHOD, lora_delta, lora_rows
from jpa.models.moe import moe_ffn
from jpa.models.partition import RULES

PARAM_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))
SINKS = jax.sharding.PartitionSpec(TP)  # a layer's f32[num_q_heads] attention sinks, split by head like q
INIT_STD = 0.02  # GPT-2's initializer range
# Weight-only quantization (jpa.core.quant): the parameters that may be stored quantized are
# models.linear.QUANT_AXIS's; each weight's format (Dense, Scaled, Packed) is recorded where it is set.


def _param(rngs, shape, dtype, std=INIT_STD):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


def matmul_out_dtype(dtype):
    """The dtype the layers' matmuls write their results in: bfloat16 for bfloat16 weights compiled
    for a GPU (cuBLAS accumulates in float32 and rounds once on the way out; half the activation
    bytes written and read back per step, issue 34), float32 elsewhere (the CPU program and its
    outputs unchanged). The head's logits, the norms, RoPE, softmax and the residual stream stay
    float32 everywhere."""
    gpu = np.dtype(dtype) == np.dtype(jnp.bfloat16) and current_target().platform == "gpu"
    return jnp.bfloat16 if gpu else jnp.float32


def _record_dense(module):
    """Records every QUANT_AXIS weight `module` has as Dense (models.linear: its constructor's float weights)."""
    module.weight_formats = tuple((name, DENSE) for name in QUANT_AXIS if name in vars(module))


def _quantize_params(module, quantization):
    """Replaces each float weight of `module` (its recorded formats) by its quantized values and adds
    `<name>_scale` (jpa.core.quant.quantize_weight): Scaled."""
    for name in [n for n in formats(module) if n in QUANT_AXIS]:
        q, scale = quantize_weight(getattr(module, name)[...], quantization, QUANT_AXIS[name])
        set_scaled(module, name, q, scale)


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight kept as blocks (jpa.core.quant: GGUF Q8_0 / Q4_0 / Q4_1, and Hugging Face AWQ / GPTQ /
    compressed-tensors int4 repacked into the Q4 forms) in jpa's layout: codes (int8, or uint8 holding
    two 4-bit codes), block scales d (f16, or f32) and minimums m (Q4_1 form; else None), the groups
    along `axis` (-2: the `in` axis of an [in, out] weight; -1: an embedding row) of K / d.shape[axis]
    values (GGUF: 32; int4 checkpoints: their group size). A model holding them has quantization "gguf"
    (or the checkpoint's quant_method): parameter `name` holds the codes, `name_bscale` d and
    `name_bmin` m, dequantized inside the matmul that reads them."""
    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    axis: int
    # K-quants (jpa.core.quant.unpack_k_blocks): d / m hold integer sub-block scales / minimums and these
    # the f16 super-block scales / negated minimums (`name_bscale2`, `name_bmin2`); None otherwise.
    d2: np.ndarray | None = None
    m2: np.ndarray | None = None
    # An act-order GPTQ weight (jpa.core.quant.gptq_act_order): the stored rows are W[perm] (int32 [in]),
    # and the matmul reads x[..., perm] (`name_perm`); None otherwise.
    perm: np.ndarray | None = None

    @property
    def shape(self) -> tuple:
        """The float weight's shape."""
        shape = list(self.codes.shape)
        shape[self.axis] *= 2 if self.codes.dtype == np.uint8 else 1   # uint8: two 4-bit codes a byte
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.d, self.m, self.d2, self.m2, self.perm) if a is not None)

    @staticmethod
    def stack(ws: list) -> "PackedWeight":
        """The layers' weights stacked on a new leading axis (one format for all)."""
        if ws[0].codes.dtype == np.uint8 and len({w.m is None for w in ws}) > 1:
            # Q4_0 and Q4_1 forms mixed (an int4 checkpoint whose zero points are all 8 in some layers):
            # (q - 8) * d is q * d + m with m = -8 d, exact in f32.
            ws = [w if w.m is not None else dataclasses.replace(w, m=-8 * w.d.astype(np.float32)) for w in ws]
        form = lambda w: (w.codes.dtype, w.d.dtype, w.m is None, w.d.shape, w.d2 is None, w.m2 is None)
        if len({form(w) for w in ws}) > 1 and len({w.axis for w in ws}) == 1:
            ws = PackedWeight._common_form(ws)
        fmts = {(*form(w), w.axis, w.codes.shape) for w in ws}
        if len(fmts) != 1:
            raise ValueError("the layers' copies of a weight are in different GGUF formats; jpa stacks the "
                             "layers, so it needs one format per weight (load with the weights dequantized)")
        if any(w.perm is not None for w in ws):  # act order in some layers: the identity in the others
            k = ws[0].shape[ws[0].axis]
            ws = [w if w.perm is not None else dataclasses.replace(w, perm=np.arange(k, dtype=np.int32)) for w in ws]
        st = lambda f: None if getattr(ws[0], f) is None else np.stack([getattr(w, f) for w in ws])
        axis = ws[0].axis if ws[0].axis < 0 else ws[0].axis + 1
        return PackedWeight(st("codes"), st("d"), st("m"), axis, st("d2"), st("m2"), st("perm"))

    @staticmethod
    def _common_form(ws: list) -> list:
        """Layers in different block formats (a GGUF Q4_K_M file: Q6_K ffn_down in some layers, Q4_K in
        others) in one form: int8 codes v (a Q4 code q becomes q, or q - 8 in the Q4_0 form), w = v * d + m
        with groups of the smallest size (scales repeated) and m = 0 where a layer had none; exact."""
        import math

        axis = ws[0].axis
        out = []
        groups = [w.shape[axis] // w.d.shape[axis] for w in ws]
        g = math.gcd(*groups)
        for w, gi in zip(ws, groups):
            if w.d2 is not None:  # K-quant sub-block scales: their f32 values
                w = dataclasses.replace(w, d=super_scaled(w.d, w.d2, axis), d2=None, m2=None,
                                        m=None if w.m is None else super_scaled(w.m, w.m2, axis))
            v = w.codes
            if v.dtype == np.uint8:
                p = np.moveaxis(v, axis, -1)
                p = p.reshape(p.shape[:-1] + (-1, 16))
                v = np.concatenate([p & 15, p >> 4], axis=-1).reshape(p.shape[:-2] + (-1,)).astype(np.int8)
                v = np.moveaxis(v - 8 if w.m is None else v, -1, axis)
            rep = lambda a: np.repeat(np.asarray(a, np.float32), gi // g, axis=axis)
            m = np.zeros(w.d.shape, np.float32) if w.m is None else w.m
            out.append(PackedWeight(np.ascontiguousarray(v, np.int8), rep(w.d), rep(m), axis, perm=w.perm))
        return out

    def dequantize(self) -> np.ndarray:
        """The float32 weight (NumPy, on the host)."""
        w = dequantize_blocks(np.asarray(self.codes), np.asarray(self.d), self.m, self.axis, np.float32,
                              self.d2, self.m2)
        return w if self.perm is None else unpermute_rows(w, self.perm)


def set_packed(owner, name, w: PackedWeight):
    """Replaces float parameter `name` of `owner` by GGUF blocks (`PackedWeight`) and records its format
    (models.linear.Packed with the parts w has)."""
    if QUANT_AXIS.get(name) not in (w.axis, w.axis - w.codes.ndim):
        raise ValueError(f"weight {name} must be packed with its blocks on axis {QUANT_AXIS.get(name)}; got {w.axis}")
    fmt = Packed.of(w)
    arrays = {"": w.codes, "_bscale": w.d, "_bmin": w.m, "_bscale2": w.d2, "_bmin2": w.m2, "_perm": w.perm}
    for suffix in fmt.parts:
        setattr(owner, name + suffix, nnx.Param(jnp.asarray(arrays[suffix])))
    set_format(owner, name, fmt)


def set_scaled(owner, name, q, scale):
    """Replaces float parameter `name` of `owner` by stored int8 / float8 values q and their f32
    per-output-channel scales (a checkpoint quantized that way: models.hf's FP8 layouts); records Scaled."""
    setattr(owner, name, nnx.Param(jnp.asarray(q)))
    setattr(owner, name + "_scale", nnx.Param(jnp.asarray(scale, jnp.float32)))
    set_format(owner, name, SCALED)


def set_weight(owner, name, w, dtype, quantization=None):
    """Sets parameter `name` of `owner` (a GPT, or its stacked `layers`) from a float NumPy array:
    cast to `dtype`, or, when `quantization` is set and `name` is in QUANT_AXIS, quantized on the
    host (so no float copy of it reaches the device) with `<name>_scale` set beside it."""
    if quantization is not None and name in QUANT_AXIS:
        set_scaled(owner, name, *quantize_weight(np.asarray(w, np.float32), quantization, QUANT_AXIS[name]))
    elif np.asarray(w).dtype == np.uint8:  # MXFP4 expert codes and scales (models.moe) stay as they are
        getattr(owner, name).set_value(jnp.asarray(w))
    else:
        getattr(owner, name).set_value(jnp.asarray(np.asarray(w, np.float32), dtype=dtype))


def _layer_norm(x, scale, bias, eps):
    scale, bias = _v(scale), _v(bias)
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


def _rms_norm(x, scale, eps, offset=0.0):
    """RMSNorm over the last axis, times (offset + scale) (Gemma's weights are stored minus 1)."""
    scale = _v(scale).astype(jnp.float32)
    if offset:
        scale = offset + scale
    x = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x * inv_rms * scale


def _soft_cap(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)


@functools.lru_cache(maxsize=64)
def rope_inv_freq(config: ModelConfig):
    """RoPE inverse frequencies f32[H/2] of a config with rope_scaling (transformers' formulas,
    computed in float32 as transformers does); None without scaling (rope() computes them)."""
    if not config.rope_scaling:
        return None
    h = config.head_dim
    inv = (1.0 / (np.float32(config.rope_base) ** (np.arange(0, h, 2).astype(np.float32) / np.float32(h))))
    inv = inv.astype(np.float32)  # [H/2]
    kind, factor, *rest = config.rope_scaling
    if kind == "linear":
        return (inv / np.float32(factor)).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(config, inv)
    low, high, old_len = rest  # llama3: keep high frequencies, divide low ones, blend between
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * np.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(config: ModelConfig, inv):
    """YaRN inverse frequencies (transformers' _compute_yarn_parameters, in float32 as it computes
    them): interpolated (divided by factor) below a linear ramp between the dims of beta_fast and
    beta_slow rotations over the original context, extrapolated (unchanged) above it."""
    _, factor, beta_fast, beta_slow, old_len, _, truncate = config.rope_scaling
    h, base = config.head_dim, config.rope_base
    dim = lambda rot: (h * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = dim(beta_fast), dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, h - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(h // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    pos_freqs = (np.float32(base) ** (np.arange(0, h, 2).astype(np.float32) / np.float32(h))).astype(np.float32)
    interp = (np.float32(1) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (interp * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor RoPE's cos and sin are multiplied by (YaRN's attention_factor; 1.0 otherwise)."""
    rs = config.rope_scaling
    return float(rs[5]) if rs and rs[0] == "yarn" else 1.0


def rope(x, positions, base, inv_freq=None, attention_factor=1.0):
    """Rotary embedding, Hugging Face rotate_half convention (halves, not interleaved pairs).

    Args:
      x: [B, T, heads, H].
      positions: i32[B, T].
      base: frequency base.
      inv_freq: f32[H/2] inverse frequencies (rope_inv_freq: scaled RoPE); default from `base`.
      attention_factor: cos and sin are multiplied by it (YaRN; transformers' attention_scaling).

    Returns:
      f32[B, T, heads, H].
    """
    head_dim = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    x = x.astype(jnp.float32)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    # (x1, x2) * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    """One decoder block: pre-norm attention and pre-norm MLP, each with a residual."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, quantization=None):
        c = config
        self.config = c
        self.dtype = np.dtype(dtype)  # the compute dtype of the matmuls (a quantized weight's dequantized dtype)
        d, q_dim, kv_dim = c.d_model, c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
        gpt2 = c.family == "gpt2"
        # Gemma's norms hold (scale - 1): a fresh model starts at scale 1 either way.
        ones = lambda n: nnx.Param(jnp.full((n,), 1.0 - c.norm_weight_offset, dtype))
        zeros = lambda n: nnx.Param(jnp.zeros((n,), dtype))
        self.attn_norm = ones(d)
        self.wq = _param(rngs, (d, q_dim), dtype)  # [d_model, N * H]
        self.wk = _param(rngs, (d, kv_dim), dtype)  # [d_model, K * H]
        self.wv = _param(rngs, (d, kv_dim), dtype)  # [d_model, K * H]
        self.wo = _param(rngs, (q_dim, d), dtype)  # [N * H, d_model]
        self.ffn_norm = ones(d)
        if c.num_experts:  # models.moe: a router and the experts' SwiGLU weights, stacked on an expert axis
            e, f = c.num_experts, c.ffn_dim
            self.router = _param(rngs, (d, e), dtype)  # [d_model, E]
            self.experts_gate = _param(rngs, (e, d, f), dtype)  # [E, d_model, ffn_dim]
            self.experts_up = _param(rngs, (e, d, f), dtype)  # [E, d_model, ffn_dim]
            self.experts_down = _param(rngs, (e, f, d), dtype)  # [E, ffn_dim, d_model]
            if c.expert_format == "mxfp4":  # codes u8[E, out, in / 2] + block scales u8[E, out, in / 32] (models.moe)
                for name, (o, i) in (("experts_gate", (f, d)), ("experts_up", (f, d)), ("experts_down", (d, f))):
                    setattr(self, name, nnx.Param(jnp.zeros((e, o, i // 2), jnp.uint8)))
                    setattr(self, name + "_scales", nnx.Param(jnp.full((e, o, i // 32), 127, jnp.uint8)))
            if c.router_bias:
                self.router_bias = zeros(e)
            if c.expert_bias:  # gpt-oss
                self.experts_gate_bias = nnx.Param(jnp.zeros((e, f), dtype))
                self.experts_up_bias = nnx.Param(jnp.zeros((e, f), dtype))
                self.experts_down_bias = nnx.Param(jnp.zeros((e, d), dtype))
        else:
            self.w_up = _param(rngs, (d, c.ffn_dim), dtype)  # [d_model, ffn_dim]
            self.w_down = _param(rngs, (c.ffn_dim, d), dtype)  # [ffn_dim, d_model]
        if gpt2:
            self.attn_norm_bias, self.ffn_norm_bias = zeros(d), zeros(d)
            self.bq, self.bk, self.bv, self.bo = zeros(q_dim), zeros(kv_dim), zeros(kv_dim), zeros(d)
            self.b_up, self.b_down = zeros(c.ffn_dim), zeros(d)
        elif not c.num_experts:
            self.w_gate = _param(rngs, (d, c.ffn_dim), dtype)  # [d_model, ffn_dim]
        if c.qkv_bias:
            self.bq, self.bk, self.bv = zeros(q_dim), zeros(kv_dim), zeros(kv_dim)
        if c.o_bias:
            self.bo = zeros(d)
        if c.attn_sinks:  # gpt-oss: one logit per q head joins every softmax
            self.sinks = zeros(c.num_q_heads)
        if c.qk_norm:
            self.q_norm, self.k_norm = ones(c.head_dim), ones(c.head_dim)
        if c.post_norms:
            self.post_attn_norm, self.post_ffn_norm = ones(d), ones(d)
        _record_dense(self)
        for name in ("experts_gate", "experts_up", "experts_down") if c.num_experts else ():
            set_format(self, name, MXFP4 if c.expert_format == "mxfp4" else DENSE)
        if quantization is not None:
            _quantize_params(self, quantization)

    def _linear(self, x, name, bias=None, layer=None, mesh=None, lora=None):
        """x @ self.<name> (+ self.<bias> when the model has it) in the weight's recorded format
        (models.linear). layer: the layer index when `_run` kept this block's quantized weights stacked
        (`stacked_packed`: those whose codes here still have the layer axis): they are read by the Mosaic
        matmul (`jpa.ops.qmatmul`) from the stack. mesh: the tensor-parallel mesh those stacked weights are
        sharded on (`models.linear.tp_matmul`: each device's shard), or None. lora: None, or (the adapter slots
        of every layer, this layer's index, the rows' `models.lora.LoraRows` in B x T order, method): the rows'
        LoRA term is added (`models.lora.lora_delta`, which slices this layer's A and B where it runs)."""
        kernel = layer is not None and getattr(self, name).get_value().ndim == 3
        y = format_of(self, name).apply(self, name, x, None if bias is None else self._bias(bias),
                                        dtype=self.dtype, out_dtype=matmul_out_dtype(self.dtype),
                                        kernel=kernel, layer=layer, mesh=mesh)
        if lora is not None and name in lora[0]:
            slots, layer_index, rows, method = lora
            w = slots[name]
            delta = lora_delta(x.reshape(-1, x.shape[-1]), rows, w["a"], w["b"], method, layer_index)
            y = y + delta.reshape(y.shape)
        return y

    def _norm(self, x, scale, bias_name=None):
        if self.config.family == "gpt2":
            return _layer_norm(x, scale, getattr(self, bias_name), self.config.norm_eps)
        return _rms_norm(x, scale, self.config.norm_eps, self.config.norm_weight_offset)

    def _bias(self, name):
        return getattr(self, name, None)

    def qkv(self, x, positions, layer=None, mesh=None, lora=None):
        """x f32[B, T, d_model], positions i32[B, T] -> q f32[B, T, N, H], k, v f32[B, T, K, H].
        layer: i32[] this block's layer when its packed weights are kept stacked (`_linear`); mesh: the
        tensor-parallel mesh they are sharded on, or None. lora: as `_linear`."""
        c = self.config
        batch, num_tokens, _ = x.shape
        h = self._norm(x, self.attn_norm, "attn_norm_bias")
        q = self._linear(h, "wq", "bq", layer, mesh, lora).reshape(batch, num_tokens, c.num_q_heads, c.head_dim)
        k = self._linear(h, "wk", "bk", layer, mesh, lora).reshape(batch, num_tokens, c.num_kv_heads, c.head_dim)
        v = self._linear(h, "wv", "bv", layer, mesh, lora).reshape(batch, num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        if c.family == "llama":
            inv_freq, factor = rope_inv_freq(c), rope_attention_factor(c)
            q = rope(q, positions, c.rope_base, inv_freq, factor)
            k = rope(k, positions, c.rope_base, inv_freq, factor)
        return q, k, v

    def attn_sinks(self):
        """f32[N] attention sinks of this layer (gpt-oss), or None."""
        return self.sinks[...].astype(jnp.float32) if self.config.attn_sinks else None

    def finish(self, x, attn, layer=None, experts=None, mesh=None, lora=None):
        """x f32[B, T, d_model], attn [B, T, N, H] -> x f32[B, T, d_model] after both residuals.
        layer, mesh, lora: as `qkv`. experts: None, or (mesh, layout) of a tensor-parallel mixture of experts
        (models.moe.expert_parallel)."""
        c = self.config
        batch, num_tokens = attn.shape[:2]
        attn = attn.reshape(batch, num_tokens, c.num_q_heads * c.head_dim)  # [B, T, N * H]
        h = self._linear(attn, "wo", "bo", layer, mesh, lora)
        x = x + (self._norm(h, self.post_attn_norm) if c.post_norms else h)
        h = self._norm(x, self.ffn_norm, "ffn_norm_bias")
        if c.num_experts:
            flat = h.reshape(batch * num_tokens, c.d_model)
            biases = (tuple(getattr(self, f"experts_{n}_bias")[...] for n in ("gate", "up", "down"))
                      if c.expert_bias else None)
            w = lambda n: format_of(self, n).operand(self, n)  # MXFP4: (codes, scales)
            h = moe_ffn(flat, self.router[...], w("experts_gate"), w("experts_up"), w("experts_down"), c, self.dtype,
                        router_bias=self.router_bias[...] if c.router_bias else None,
                        biases=biases, parallel=experts).reshape(batch, num_tokens, c.d_model)
            return x + (self._norm(h, self.post_ffn_norm) if c.post_norms else h)
        lin = lambda h, name, bias=None: self._linear(h, name, bias, layer, mesh, lora)
        if c.family == "gpt2":
            h = jax.nn.gelu(lin(h, "w_up", "b_up"), approximate=True)
        elif c.mlp_activation == "gelu_tanh":
            h = jax.nn.gelu(lin(h, "w_gate"), approximate=True) * lin(h, "w_up")
        else:
            h = jax.nn.silu(lin(h, "w_gate")) * lin(h, "w_up")
        h = lin(h, "w_down", "b_down")
        return x + (self._norm(h, self.post_ffn_norm) if c.post_norms else h)


def cache_spec(config: ModelConfig) -> CacheSpec:
    """The cache a model of `config` keeps (jpa.kv.spec): full attention in every layer, except the layers of
    `sliding_window_layers`, a sliding-window group of `sliding_window` (Gemma-2, gpt-oss, Mistral)."""
    return CacheSpec.attention(config.num_layers, config.num_kv_heads, config.head_dim,
                               window=config.sliding_window, window_layers=config.sliding_window_layers)


def layer_period(config: ModelConfig) -> int:
    """The smallest p dividing num_layers such that layer i has layer i % p's attention options
    (sliding window): the layers one scan step runs (1 unless layers alternate, e.g. Gemma-2's 2)."""
    n = config.num_layers
    return next(p for p in range(1, n + 1) if n % p == 0 and all(
        config.layer_window(i) == config.layer_window(i % p) for i in range(n)))


def stack_blocks(blocks: list) -> Block:
    """One Block whose parameters are the given blocks' stacked on a new leading axis (a scan's xs)."""
    graphdef = nnx.graphdef(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
    return nnx.merge(graphdef, stacked)


class GPT(nnx.Module):
    """Decoder-only transformer (gpt2 or llama family) with parameters in `dtype`.

    quantization: None, or "int8" / "fp8" (weight-only, per output channel; jpa.core.quant): the
    linear weights, the output head and the token embeddings are stored in int8 / float8_e4m3fn
    with f32 scales (`<name>_scale`, QUANT_AXIS) and dequantized inside each matmul; `dtype` stays
    the compute dtype (activations, norms and the KV cache). Not for a mixture of experts (the
    experts' weights are not quantized yet): ValueError.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, quantization=None):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a models.ModelConfig; got {type(config).__name__}")
        dtype = np.dtype(dtype)
        if dtype not in PARAM_DTYPES:
            raise ValueError(f"dtype must be one of (float32, bfloat16); got {dtype.name}")
        c = config
        self.config = c
        self.dtype = dtype
        self.quantization = check_weight_quantization(quantization)
        # A mixture of experts under tensor parallelism: "experts" or "ffn" (models.moe.EXPERT_LAYOUTS),
        # set by models.sharding.shard; None on one device.
        self.expert_layout = None
        # Under tensor parallelism, the embeddings' and head's layout models.sharding.shard gave them: "vocab"
        # (split on the vocabulary) or "replicated"; None on one device.
        self.embeddings_layout = None
        if quantization is not None and c.num_experts:
            raise ValueError(f"quantization={quantization!r} is not supported for a mixture-of-experts model "
                             f"(num_experts={c.num_experts}): jpa does not quantize the experts' weights yet; "
                             f"load it unquantized")
        self.tok_embeddings = _param(rngs, (c.vocab_size, c.d_model), dtype)  # [vocab, d_model]
        if c.family == "gpt2":
            self.pos_embeddings = _param(rngs, (c.max_seq_len, c.d_model), dtype, std=0.01)
        # The embedding table's layout: False, [vocab, d_model] (rows, for the lookup); True, [d_model, vocab]
        # (`set_embeddings_layout`: a tied quantized head the Mosaic matmul reads as stored, [in, out]).
        self.embeddings_columns = False
        # True: a quantized tied head is also kept as one float [d_model, vocab] `output` (`set_dense_head`: a
        # CPU's head, where XLA would dequantize the whole table in every compiled step).
        self.head_dense = False
        # Built one by one (the same random draws as a list of blocks), then stacked on a leading axis.
        self.layers = stack_blocks([Block(c, dtype=dtype, rngs=rngs, quantization=quantization)
                                    for _ in range(c.num_layers)])
        self.norm = nnx.Param(jnp.full((c.d_model,), 1.0 - c.norm_weight_offset, dtype))
        if c.family == "gpt2":
            self.norm_bias = nnx.Param(jnp.zeros((c.d_model,), dtype))
        if not c.tie_embeddings:
            self.output = _param(rngs, (c.d_model, c.vocab_size), dtype)  # [d_model, vocab]
        # `weight_formats` (models.linear): each weight's format, static; set_packed / set_scaled change it
        _record_dense(self)
        if quantization is not None:
            _quantize_params(self, quantization)

    def embed(self, tokens, positions):
        """tokens, positions i32[B, T] -> f32[B, T, d_model]."""
        x = format_of(self, "tok_embeddings").embed(self, "tok_embeddings", tokens, self.embeddings_columns)
        if self.config.embed_scale != 1.0:
            # transformers (Gemma) rounds the scale to the activation dtype before multiplying.
            x = x * jnp.asarray(self.config.embed_scale, self.dtype).astype(jnp.float32)
        if self.config.family == "gpt2":
            # Positions past the table (padding rows) are clipped; their outputs are never used.
            x = x + jnp.take(self.pos_embeddings[...], positions, axis=0, mode="clip").astype(jnp.float32)
        return x

    def logits(self, x, mesh=None):
        """x f32[..., d_model] -> f32[..., vocab] (final norm, then the head). mesh: the tensor-parallel mesh
        the model is sharded on, or None: a quantized head split on the vocabulary (`embeddings_layout`
        "vocab") then runs the Mosaic matmul on each device's columns (`models.linear.tp_matmul`)."""
        if self.config.family == "gpt2":
            h = _layer_norm(x, self.norm, self.norm_bias, self.config.norm_eps)
        else:
            h = _rms_norm(x, self.norm, self.config.norm_eps, self.config.norm_weight_offset)
        rows = int(np.prod(h.shape[:-1]))
        # A head split on the vocabulary (models.sharding's "vocab" layout): the kernel on each device's columns.
        head_mesh = mesh if mesh is not None and self.embeddings_layout == "vocab" else None
        tp = 1 if head_mesh is None else head_mesh.shape[TP]

        def local(var):  # one device's shard of a head array ([..., vocab]: the columns), shape and dtype only
            v = var.get_value()
            return jax.ShapeDtypeStruct(v.shape[:-1] + (v.shape[-1] // tp,), v.dtype)

        if self.config.tie_embeddings and not self.head_dense:
            # the table kept [d_model, vocab] (`set_embeddings_layout`): the head's [in, out] codes, read as
            # stored by the Mosaic matmul where it serves (else dequantized where the dot reads them); kept
            # [vocab, d_model]: x @ its transpose, the rows' scales the head's per-output-channel scales
            out = format_of(self, "tok_embeddings").apply(self, "tok_embeddings", h, dtype=self.dtype,
                                                          transpose=not self.embeddings_columns,
                                                          kernel=self.embeddings_columns, stacked=False)
        else:
            # (`head_dense`: the float [d_model, vocab] copy of a tied head, a Dense `output`, read by one dot)
            # a quantized head on a GPU the Mosaic kernel serves (GGUF's Q6_K / Q8_0 / Q4 output, int8 / fp8):
            # it reads the stored codes (XLA, under the engine's cuBLAS options, would write a dense bf16 copy of
            # the head every step); else dequantized where the dot reads it
            fmt = format_of(self, "output")
            kernel = bool(fmt.kernel_parts) and fmt.unsupported_reason(
                rows, {sx: local(getattr(self, "output" + sx)) for sx in fmt.kernel_parts}, self.dtype) is None
            out = fmt.apply(self, "output", h, dtype=self.dtype, kernel=kernel, mesh=head_mesh, stacked=False)
        return _soft_cap(out, self.config.final_soft_cap)

    def layer_period(self) -> int:
        """Layers one step of the scan over layers runs (`layer_period(config)`)."""
        return layer_period(self.config)

    def layer_params(self, i: int) -> dict:
        """{name: array} of layer i (slices of the stacked parameters; for inspection and tests)."""
        return {name: var[...][i] for name, var in vars(self.layers).items() if isinstance(var, nnx.Param)}

    def weight_bytes(self) -> int:
        """Bytes of every parameter (quantized values and their scales included) as stored."""
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def quantized(self, quantization: str) -> "GPT":
        """This float model with its QUANT_AXIS weights quantized ("int8" / "fp8", per output
        channel) on the device where they are; an abstract model (nnx.eval_shape) stays abstract."""
        if self.quantization is not None:
            raise ValueError(f"the model is already quantized ({self.quantization}); quantize a float model")
        check_weight_quantization(quantization)
        model = nnx.eval_shape(lambda: GPT(self.config, dtype=self.dtype, rngs=nnx.Rngs(0),
                                           quantization=quantization))
        for owner, new in ((self, model), (self.layers, model.layers)):
            for name, var in vars(owner).items():
                if not isinstance(var, nnx.Param):
                    continue
                x = var.get_value()
                if isinstance(x, jax.ShapeDtypeStruct):  # abstract: the new model's shapes already hold
                    continue
                if name in QUANT_AXIS:
                    set_scaled(new, name, *quantize_weight(x, quantization, QUANT_AXIS[name]))
                else:
                    getattr(new, name).set_value(x)
        return model

    def dequantized(self) -> "GPT":
        """This model with every quantized weight replaced by its float value q * scale in `dtype`
        (the dense model a quantized one approximates; itself when not quantized)."""
        if self.quantization is None:
            return self
        model = nnx.eval_shape(lambda: GPT(self.config, dtype=self.dtype, rngs=nnx.Rngs(0)))
        for owner, new in ((self, model), (self.layers, model.layers)):
            for name, var in vars(new).items():
                if not isinstance(var, nnx.Param) or (owner is self and name == "layers"):
                    continue
                if owner is self and name == "tok_embeddings" and self.embeddings_columns:
                    var.set_value(_embedding_rows(self).astype(self.dtype))
                    continue
                fmt = formats(owner).get(name) if name in QUANT_AXIS else None
                x = getattr(owner, name)[...] if fmt is None else fmt.dequantize(owner, name)
                var.set_value(x.astype(self.dtype))
        return model

    def attention_options(self, layer: int) -> dict:
        """Keyword options of jpa.paged_decode / paged_prefill for `layer`: scale, soft_cap,
        sliding_window (None where the config does not set them)."""
        c = self.config
        return dict(scale=c.attn_scale, soft_cap=c.attn_soft_cap, sliding_window=c.layer_window(layer))

    def cache_spec(self) -> CacheSpec:
        """The cache this model's layers keep, per group (`cache_spec(config)`)."""
        return cache_spec(self.config)

    def cache_config(self, num_pages: int, page_size: int = 16, dtype=None) -> CacheConfig:
        """The CacheConfig of a paged cache for this model (dtype defaults to the model's)."""
        c = self.config
        dtype = self.dtype.name if dtype is None else np.dtype(dtype).name
        return CacheConfig(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                           num_pages=num_pages, page_size=page_size, dtype=dtype)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict, dtype=jnp.float32, quantization=None) -> "GPT":
        """Builds a llama-family model from a dict of float arrays in the x @ W ([in, out]) convention.

        Args:
          config: a llama-family ModelConfig.
          weights: {"tok_embeddings": [vocab, d_model], "norm": [d_model], "output": [d_model, vocab]
            (only when config.tie_embeddings is False), "layers": num_layers dicts of
            {"attn_norm": [d], "wq": [d, N*H], "wk": [d, K*H], "wv": [d, K*H], "wo": [N*H, d],
            "ffn_norm": [d], "w_gate": [d, ffn], "w_up": [d, ffn], "w_down": [ffn, d]} plus the
            config's variant tensors (expected_shapes: bq/bk/bv, q_norm/k_norm, post_attn_norm/
            post_ffn_norm)}.
            Q/K must already be in the rotate_half RoPE convention.
          dtype: parameter dtype (float32 or bfloat16).
          quantization: None, "int8" or "fp8": the weights are quantized on the host (`set_weight`),
            so no float copy of them reaches the device.

        Returns:
          The model. Raises ValueError naming the tensor when a shape or key does not match.
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a models.ModelConfig; got {type(config).__name__}")
        if config.family != "llama":
            raise ValueError(f"from_weights reads llama-family weights; config.family is {config.family!r}")
        expected = expected_shapes(config)
        _check_weights(weights, expected, config)
        check_weight_quantization(quantization)
        packed = any(isinstance(w, PackedWeight) for w in [*weights.values(), *(
            w for lw in weights["layers"] for w in lw.values())])
        if packed and quantization is not None:
            raise ValueError(f"weights holds GGUF blocks (PackedWeight) and quantization={quantization!r}: pass "
                             f"float weights to quantize, or the blocks alone")
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0), quantization=quantization))

        def put(owner, name, w):
            if isinstance(w, PackedWeight):
                set_packed(owner, name, w)
            else:
                set_weight(owner, name, w, dtype, quantization)

        for name in ("tok_embeddings", "norm") + (() if config.tie_embeddings else ("output",)):
            put(model, name, weights[name])
        for name in expected["layers"]:
            ws = [lw[name] for lw in weights["layers"]]
            if any(isinstance(w, PackedWeight) for w in ws):
                put(model.layers, name, PackedWeight.stack(ws))
            else:
                put(model.layers, name, np.stack([np.asarray(w, np.float32) for w in ws]))
        if packed:
            model.quantization = "gguf"
        return model


def expected_shapes(c: ModelConfig) -> dict:
    """Parameter shapes of a llama-family model: {name: shape, ..., "layers": {name: shape}}."""
    d, q_dim, kv_dim = c.d_model, c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    top = {"tok_embeddings": (c.vocab_size, d), "norm": (d,)}
    if not c.tie_embeddings:
        top["output"] = (d, c.vocab_size)
    layer = {"attn_norm": (d,), "wq": (d, q_dim), "wk": (d, kv_dim), "wv": (d, kv_dim),
             "wo": (q_dim, d), "ffn_norm": (d,)}
    if c.num_experts:
        e, f = c.num_experts, c.ffn_dim
        layer.update(router=(d, e), experts_gate=(e, d, f), experts_up=(e, d, f), experts_down=(e, f, d))
        if c.expert_format == "mxfp4":  # models.moe.dequantize_mxfp4's codes and scales
            for name, (o, i) in (("experts_gate", (f, d)), ("experts_up", (f, d)), ("experts_down", (d, f))):
                layer.update({name: (e, o, i // 2), name + "_scales": (e, o, i // 32)})
    else:
        layer.update(w_gate=(d, c.ffn_dim), w_up=(d, c.ffn_dim), w_down=(c.ffn_dim, d))
    if c.router_bias:
        layer.update(router_bias=(c.num_experts,))
    if c.expert_bias:
        e, f = c.num_experts, c.ffn_dim
        layer.update(experts_gate_bias=(e, f), experts_up_bias=(e, f), experts_down_bias=(e, d))
    if c.qkv_bias:
        layer.update(bq=(q_dim,), bk=(kv_dim,), bv=(kv_dim,))
    if c.o_bias:
        layer.update(bo=(d,))
    if c.attn_sinks:
        layer.update(sinks=(c.num_q_heads,))
    if c.qk_norm:
        layer.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    if c.post_norms:
        layer.update(post_attn_norm=(d,), post_ffn_norm=(d,))
    return {**top, "layers": layer}


def _check_weights(weights, expected, config):
    if not isinstance(weights, dict):
        raise ValueError(f"weights must be a dict; got {type(weights).__name__}")
    wanted = set(expected)
    if "output" in weights and config.tie_embeddings:
        raise ValueError("weights has 'output' but config.tie_embeddings is True (the head is the "
                         "transposed tok_embeddings); drop it or use an untied config")
    missing, extra = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    if missing or extra:
        raise ValueError(f"weights must have exactly the keys {sorted(wanted)}; missing {missing}, "
                         f"unexpected {extra}")

    def check(name, w, shape):
        got = getattr(w, "shape", None)
        if got is None or tuple(got) != shape:
            raise ValueError(f"weights[{name}] must have shape {list(shape)}; got "
                             f"{list(got) if got is not None else type(w).__name__}")

    for name, shape in expected.items():
        if name != "layers":
            check(f"'{name}'", weights[name], shape)
    layers = weights["layers"]
    if not isinstance(layers, (list, tuple)) or len(layers) != config.num_layers:
        got = len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__
        raise ValueError(f"weights['layers'] must be a list of num_layers = {config.num_layers} dicts; "
                         f"got {got}")
    for i, lw in enumerate(layers):
        names = set(expected["layers"])
        if not isinstance(lw, dict) or set(lw) != names:
            keys = sorted(lw) if isinstance(lw, dict) else type(lw).__name__
            raise ValueError(f"weights['layers'][{i}] must have exactly the keys {sorted(names)}; "
                             f"got {keys}")
        for name, shape in expected["layers"].items():
            check(f"'layers'][{i}]['{name}'", lw[name], shape)


def stacked_packed(model: GPT, rows: int, mesh=None) -> tuple:
    """Names of the layers' packed 4-bit weights (Q4_0 / Q4_1 forms: GGUF, AWQ, GPTQ,
    compressed-tensors; GGUF Q4_K: integer sub-block scales with f16 super-block ones), packed 8-bit
    ones with group scales (GGUF Q8_0, Q5_K, Q6_K, block-wise FP8) and int8 / fp8 per-channel ones
    that the Mosaic GPU dequantizing matmul serves for `rows` tokens on the device being compiled for
    (`jpa.ops.qmatmul.kernel_serves`: any number of rows, so the decode step, the ragged prompt pass and the
    verify pass alike): those `qmatmul_plan` gives no reason against. `_run` keeps them stacked through the
    scan: the kernel reads a layer of the stack by its index, so no layer's codes are sliced into a copy and no
    dense float weight is written. Under a tensor-parallel mesh each device runs it on its shard
    (`models.linear.tp_matmul`)."""
    return tuple(name for name, why in qmatmul_plan(model, rows, mesh).items() if why is None)


def _local_shape(shape, spec, tp: int) -> tuple:
    """One device's shard of an array of `shape` placed with PartitionSpec `spec` over a "tp" axis of tp."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(n // tp if a == TP else n for n, a in zip(shape, spec))


def qmatmul_plan(model: GPT, rows: int, mesh=None) -> dict:
    """{name: None where the Mosaic dequantizing matmul serves the quantized layer linear `name` for `rows`
    tokens on the device being compiled for, else why not} (`jpa.ops.qmatmul.unsupported_reason`), over the
    model's stacked quantized layer linears (packed blocks or int8 / fp8 per channel).

    mesh: a tensor-parallel mesh: the kernel runs on each device's shard (`models.linear.tp_matmul`), placed as
    models.sharding's RULES place it: a column-parallel weight (wq, wk, wv, w_gate, w_up) split on its output
    columns N (its scales with them), a row-parallel one (wo, w_down) on its input rows K (block scales and
    minimums along K with them; per-channel scales whole). The decision is the kernel's on that shard: a
    row-parallel split must leave each device whole groups (K / tp a multiple of the group, K-quants' 256-value
    super-blocks too) and K / tp a multiple of the kernel's K step (64); a column-parallel one N / tp a
    multiple of its 64-column tile. A weight refused keeps today's path (XLA dequantizes each layer's slice),
    with the reason here."""
    tp = 1 if mesh is None else mesh.shape[TP]
    layers, recorded, out = model.layers, formats(model.layers), {}
    for name in QUANT_AXIS:
        fmt = recorded.get(name)
        if fmt is None or not fmt.kernel_parts or getattr(layers, name).get_value().ndim != 3:
            continue  # not a layer weight, a float one, or not stacked
        arrays = {sx: getattr(layers, name + sx).get_value() for sx in fmt.kernel_parts}
        full = {sx: jax.ShapeDtypeStruct(a.shape, a.dtype) for sx, a in arrays.items()}
        local, uneven = {}, []
        for sx, a in arrays.items():
            spec = jax.sharding.PartitionSpec(None, *RULES[name + sx])
            local[sx] = jax.ShapeDtypeStruct(_local_shape(a.shape, spec, tp), a.dtype)
            if any(n % tp for n, ax in zip(a.shape, tuple(spec) + (None,) * a.ndim) if ax == TP):
                uneven.append(f"{name}{sx} {list(a.shape)}")
        codes = arrays[""]
        per = 2 if codes.dtype == jnp.uint8 else 1  # uint8: two 4-bit codes a byte
        k, n = local[""].shape[1] * per, local[""].shape[2]
        where = ""
        if tp > 1:
            kind = "row" if RULES[name] == RULES["wo"] else "column"
            where = (f" (each of {tp} devices' shard of the {kind}-parallel {name}: [{k}, {n}] of "
                     f"[{codes.shape[1] * per}, {codes.shape[2]}])")
        if uneven:
            out[name] = f"{', '.join(uneven)} do not split into {tp} equal shards" + where
            continue
        why = fmt.unsupported_reason(rows, local, model.dtype, full, tp)
        out[name] = None if why is None else why + where
    return out


def tied_head_served(model: GPT, rows: int = 1) -> bool:
    """Whether the Mosaic dequantizing matmul (`jpa.ops.qmatmul`) serves `model`'s tied head for `rows` tokens
    on the device being compiled for once its quantized table is kept [d_model, vocab]: the head's [in, out]
    codes, the same bytes (GGUF blocks run along d_model, so the transposed blocks are `qmatmul_grouped`'s /
    `qmatmul`'s [K, N] codes with [K / G, N] scales; an int8 / fp8 table's row scales are per-output-channel
    scales). False for an untied head, a float table, or where the kernel does not serve (a CPU, K = d_model
    not a multiple of 64; SmolLM2's 576 is served, walked 64 values a step)."""
    if not model.config.tie_embeddings or not mosaic_serves_target():   # a CPU's Q4_1 loop is for layers
        return False
    fmt = format_of(model, "tok_embeddings")
    if not fmt.kernel_parts:
        return False
    flip = 1 if model.embeddings_columns else -1  # as the head reads them: [K(/ 2), N], scales [K / G, N]
    shapes = {sx: jax.ShapeDtypeStruct((v := getattr(model, "tok_embeddings" + sx).get_value()).shape[::flip],
                                       v.dtype) for sx in fmt.kernel_parts}
    return fmt.unsupported_reason(rows, shapes, model.dtype) is None


def set_embeddings_layout(model: GPT, columns: bool) -> GPT:
    """Keeps `model`'s embedding table (a tied head's weight) [d_model, vocab] (columns=True: the layout the
    Mosaic matmul reads a tied quantized head in; `GPT.embed` gathers the tokens' columns) or [vocab, d_model]
    (False: the lookup's rows, what every loader, `models.sharding` and the CPU path use). In place: the
    transposed arrays replace the old ones, which are freed when nothing else holds them (the model keeps one
    table; the transpose itself holds two for a moment). Works on an abstract model (nnx.eval_shape). Returns
    model."""
    if model.embeddings_columns == columns:
        return model
    fmt = format_of(model, "tok_embeddings")
    if columns and not fmt.kernel_parts:
        raise ValueError("set_embeddings_layout: columns=True wants a quantized embedding table (GGUF blocks or "
                         "int8 / fp8 with row scales), the tied head the Mosaic matmul reads; this table is "
                         f"{np.dtype(model.tok_embeddings.get_value().dtype).name} without scales")
    for suffix in fmt.parts:
        var = getattr(model, "tok_embeddings" + suffix)
        x = var.get_value()
        if len(x.shape) != 2:  # an int8 / fp8 table's f32[vocab] row scales stay as they are
            continue
        if isinstance(x, jax.ShapeDtypeStruct):
            x = jax.ShapeDtypeStruct(x.shape[::-1], x.dtype)
        else:
            x = jnp.transpose(x)
        var.set_value(x)
    model.embeddings_columns = columns
    return model


def dense_head_wanted(model: GPT) -> bool:
    """Whether `set_dense_head` pays on the device being compiled for: a CPU, a tied quantized table (GGUF
    blocks, int8 / fp8) kept in rows. There XLA dequantizes the whole [vocab, d_model] table inside every
    compiled step before its dot (SmolLM2-135M's Q8_0 table: 113 MB of f32 written and read a step, and
    held as each compiled shape's temporary) and the dot reads it transposed; one float [d_model, vocab]
    copy read by a plain dot costs 3 ms a token instead of about 60 (BENCHMARKS.md, "The CPU path for
    one user"). Not for an abstract model (nnx.eval_shape: deviceless compiles keep the step as stored)."""
    return (model.config.tie_embeddings and not model.embeddings_columns and not model.head_dense
            and bool(format_of(model, "tok_embeddings").kernel_parts) and current_target().platform == "cpu"
            and not isinstance(model.tok_embeddings.get_value(), jax.ShapeDtypeStruct))


def set_dense_head(model: GPT, dense: bool = True) -> GPT:
    """Keeps (dense=True) one float copy of `model`'s tied quantized head, `output` [d_model, vocab] in the
    model's dtype (the table's values dequantized once, in f32, then rounded as the per-step dequantization
    rounds them), which `GPT.logits` then reads with one dot; the table stays as stored for the embedding
    lookup. dense=False drops the copy (`models.sharding.shard` plans the tied table, not a copy). In place;
    returns model. Every compiled step reads the same copy (it is a parameter, not a temporary)."""
    if model.head_dense == dense:
        return model
    if dense:
        if not (model.config.tie_embeddings and not model.embeddings_columns
                and format_of(model, "tok_embeddings").kernel_parts):
            raise ValueError("set_dense_head wants a tied quantized embedding table kept in rows (GGUF blocks or "
                             "int8 / fp8 with row scales)")
        model.output = nnx.Param(dense_head_of(format_of(model, "tok_embeddings"), model, model.dtype))
        set_format(model, "output", DENSE)
    else:
        del model.output
        model.weight_formats = tuple((n, f) for n, f in model.weight_formats if n != "output")
    model.head_dense = dense
    return model


def dense_head_of(fmt, owner, dtype):
    """dtype [d_model, vocab]: the tied head of the quantized table `owner.tok_embeddings*` (kept in rows, in
    format `fmt`; owner: a GPT, or anything holding those arrays as attributes), dequantized in f32 then
    rounded to dtype as the step's own dequantization rounds it, transposed. One jitted pass (0.1 s for
    SmolLM2's table here, where op-by-op it took 0.5-0.75 s of the engine's start)."""
    parts = {sx: getattr(owner, "tok_embeddings" + sx)[...] for sx in fmt.parts}
    return _dense_head(fmt, jnp.dtype(dtype), parts)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _dense_head(fmt, dtype, parts):
    table = types.SimpleNamespace(**{"tok_embeddings" + sx: a for sx, a in parts.items()})
    return jnp.transpose(fmt.dequantize(table, "tok_embeddings")).astype(dtype)


def _embedding_rows(model: GPT):
    """The float32 [vocab, d_model] table of a model whose table is kept [d_model, vocab]."""
    return format_of(model, "tok_embeddings").dequantize(model, "tok_embeddings", axis=-2).T.astype(jnp.float32)


def _check_lora(lora, index_shape):
    """The (slots, index, method) `_run` takes from a public entry point's lora=(slots, index) (None: None)."""
    if lora is None:
        return None
    if not isinstance(lora, tuple) or len(lora) not in (2, 3):
        raise ValueError("lora must be None or (slots, index[, method]): the adapter slots of models.lora.empty_slots "
                         f"and each row's slot index (-1: none); got {type(lora).__name__}")
    slots, index, *method = lora
    shape = tuple(getattr(index, "shape", ()))
    if shape not in (tuple(index_shape), (int(np.prod(index_shape)),)):
        raise ValueError(f"lora's index must have shape i32{list(index_shape)} (one slot per row); got {list(shape)}")
    max_loras = jax.tree_util.tree_leaves(slots)[0].shape[0]
    return slots, lora_rows(index, max_loras), method[0] if method else DEFAULT_METHOD


def _run(model: GPT, tokens, positions, attend, state, mesh=None, stack_packed: bool = False, lora=None):
    """Embeds, runs every block in a scan over the layers, returns (x, state).

    attend(r, layer, q, k, v, state, sinks) -> (attn, state): r the static position of the layer in
    its period (its attention options are `model.attention_options(r)`), layer the traced i32[]
    layer index, sinks the layer's f32[N] attention sinks or None. `state` (the KV pools) is the
    scan's carry: every layer updates it whole. mesh: the tensor-parallel mesh (a mixture of experts
    runs its experts in the layout models.sharding gave them, `GPT.expert_layout`), or None.
    stack_packed: the packed weights of `stacked_packed` stay out of the scanned slices and each
    layer reads them stacked (the engine's steps; under a tensor-parallel mesh each device's shard,
    `models.linear.tp_matmul`); False: every weight is sliced per layer. lora: None, or (slots, index
    LoraRows, method) (`_check_lora`: the rows' grouping computed once for every layer): each layer adds its
    rows' LoRA terms (`Block._linear`).
    """
    c = model.config
    layout = getattr(model, "expert_layout", None)  # None on one device (and on a 1-device mesh)
    experts = (mesh, layout) if mesh is not None and c.num_experts and layout is not None else None
    x = model.embed(tokens, positions)  # f32[B, T, d_model]
    graphdef, params = nnx.split(model.layers)
    names = stacked_packed(model, tokens.size, mesh) if stack_packed else ()
    kept = {n + sx: params[n + sx] for n in names for sx in format_of(model.layers, n).kernel_parts}
    if kept:
        params = nnx.State({k: v for k, v in params.items() if k not in kept})
    period = model.layer_period()
    groups = c.num_layers // period
    # Period 1 scans the stacked parameters as they are (each step's slice is one layer's).
    grouped = params if period == 1 else jax.tree.map(lambda a: a.reshape(groups, period, *a.shape[1:]), params)

    def body(carry, xs):
        x, state = carry
        group, g = xs
        for r in range(period):
            p = group if period == 1 else jax.tree.map(lambda a: a[r], group)
            block = nnx.merge(graphdef, nnx.State({**p, **kept}) if kept else p)
            layer = g * period + r if kept else None
            lo = None if lora is None else (lora[0], g * period + r, lora[1], lora[2])
            q, k, v = block.qkv(x, positions, layer, mesh, lo)
            attn, state = attend(r, g * period + r, q, k, v, state, block.attn_sinks())
            x = block.finish(x, attn, layer, experts, mesh, lo)
        return (x, state), None

    (x, state), _ = jax.lax.scan(body, (x, state), (grouped, jnp.arange(groups, dtype=jnp.int32)))
    return x, state


def _check_cache(model: GPT, cache: KVCache):
    c = model.config
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a jpa.KVCache; got {type(cache).__name__}")
    if cache.num_layers != c.num_layers:
        raise ValueError(f"cache must have num_layers = {c.num_layers} layers; got {cache.num_layers}")
    shape = tuple(cache.k.shape)
    if shape[1] != c.num_kv_heads or shape[4] != c.head_dim:
        raise ValueError(f"cache pools must have shape [num_layers, num_kv_heads = {c.num_kv_heads}, num_pages, "
                         f"page_size, head_dim = {c.head_dim}]; got {list(shape)}")


def _check_ndim(name, x, ndim, doc):
    if getattr(x, "ndim", None) != ndim:
        raise ValueError(f"{name} must have shape {doc}; got {getattr(x, 'shape', type(x).__name__)}")


def _check_int(name, x, shape, doc):
    if getattr(x, "ndim", None) != len(shape) or tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {doc} = {list(shape)}; got "
                         f"{list(getattr(x, 'shape', ())) or type(x).__name__}")
    if np.dtype(x.dtype) != np.int32:
        raise ValueError(f"{name} must have dtype int32; got {np.dtype(x.dtype).name}")


def forward_dense(model: GPT, tokens, lora=None):
    """The network without a cache: causal attention over `tokens`, positions 0..T-1.

    Args:
      model: the GPT.
      tokens: i32[B, T].
      lora: None, or (slots, index i32[B, T][, method]): LoRA adapters (models.lora.empty_slots) and each
        row's slot (-1: the base model).

    Returns:
      f32[B, T, vocab] logits at every position (right padding does not change earlier positions).
    """
    c = model.config
    _check_ndim("tokens", tokens, 2, "i32[num_seqs, num_tokens]")
    batch, num_tokens = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch, num_tokens))
    t = jnp.arange(num_tokens)
    causal = t[None, :] <= t[:, None]  # [T, S]

    def attend(r, layer, q, k, v, state, sinks):
        opts = model.attention_options(r)
        qg = q.reshape(batch, num_tokens, c.num_kv_heads, c.q_per_kv, c.head_dim)
        # Round q/k/v as the cache path does (q in the model dtype, k/v in the cache dtype).
        qg, k, v = (a.astype(model.dtype).astype(jnp.float32) for a in (qg, k, v))
        scale = c.head_dim ** -0.5 if opts["scale"] is None else opts["scale"]
        s = _soft_cap(jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * scale, opts["soft_cap"])
        mask = causal
        if opts["sliding_window"] is not None:
            mask = mask & (t[None, :] > t[:, None] - opts["sliding_window"])
        s = jnp.where(mask, s, -jnp.inf)
        if sinks is None:
            p = jax.nn.softmax(s, axis=-1)
        else:  # one more column of logit sinks[h] with no value (dropped after the softmax)
            col = jnp.broadcast_to(sinks.reshape(1, c.num_kv_heads, c.q_per_kv, 1, 1), s.shape[:-1] + (1,))
            p = jax.nn.softmax(jnp.concatenate([s, col], axis=-1), axis=-1)[..., :-1]
        out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v)
        return out.reshape(batch, num_tokens, c.num_q_heads, c.head_dim).astype(model.dtype), state

    x, _ = _run(model, tokens, positions, attend, None, lora=_check_lora(lora, tokens.shape))
    return model.logits(x)


def _write(pools, k, v, slot_mapping, layer):
    """The stacked (k_pages, v_pages, k_scales, v_scales) after writing k, v [T, K, H] of `layer` at slot_mapping."""
    kp, vp, ks, vs = pools
    out = write_kv(kp, vp, k, v, slot_mapping, k_scales=ks, v_scales=vs, layer=layer)
    return out if len(out) == 4 else (*out, None, None)


def prefill(model: GPT, cache: KVCache, tokens, start, chunk_lens, slot_mapping, block_tables, *,
            mesh=None):
    """Runs a right-padded chunk of prompt tokens per sequence through the model and the cache.

    Args:
      model: the GPT.
      cache: its KVCache (`KVCache.create(model.cache_config(...))`).
      tokens: i32[B, T] prompt chunks, right-padded.
      start: i32[B] tokens of each sequence already cached before this chunk (0 for a fresh prompt).
      chunk_lens: i32[B] valid tokens of each row (0 = empty row).
      slot_mapping: i32[B, T] cache slot of each chunk token (-1 for padding).
      block_tables: i32[B, pages_per_seq].
      mesh: a Mesh with a "tp" axis for tensor parallelism (params and cache sharded as
        models.sharding places them): each layer's cache write and attention run per device on
        its heads (`jpa.core.sharding.head_parallel`). None: one device.

    Returns:
      (logits f32[B, vocab] at each row's last valid token (finite garbage for empty rows),
       the updated cache).
    """
    _check_cache(model, cache)
    _check_ndim("tokens", tokens, 2, "i32[num_seqs, num_tokens]")
    batch, num_tokens = tokens.shape
    _check_int("tokens", tokens, (batch, num_tokens), "i32[num_seqs, num_tokens]")
    _check_int("start", start, (batch,), "i32[num_seqs]")
    _check_int("chunk_lens", chunk_lens, (batch,), "i32[num_seqs]")
    _check_int("slot_mapping", slot_mapping, (batch, num_tokens), "i32[num_seqs, num_tokens]")
    if getattr(block_tables, "ndim", None) != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape i32[num_seqs = {batch}, pages_per_seq]; "
                         f"got {getattr(block_tables, 'shape', None)}")
    c = model.config
    positions = start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)  # i32[B, T]
    slots = slot_mapping.reshape(batch * num_tokens)  # i32[B * T]

    def layer_step(pools, q, k, v, slots, block_tables, start, chunk_lens, layer, sinks, *, opts):  # per device
        pools = _write(pools, k, v, slots, layer)
        kp, vp, ks, vs = pools
        out = paged_prefill(q, kp, vp, block_tables, start, chunk_lens, k_scales=ks, v_scales=vs, layer=layer,
                            sinks=sinks, **opts)
        return out, pools  # [B, T, N, H]

    def attend(r, layer, q, k, v, pools, sinks):
        flat = lambda a: a.reshape(batch * num_tokens, c.num_kv_heads, c.head_dim)  # [B * T, K, H]
        step = head_parallel(functools.partial(layer_step, opts=model.attention_options(r)), mesh,
                             (STACKED_POOL, HEADS_T, HEADS, HEADS) + (REPLICATED,) * 5 + (SINKS,),
                             (HEADS_T, STACKED_POOL))
        return step(pools, q.astype(model.dtype), flat(k), flat(v), slots, block_tables, start, chunk_lens, layer,
                    sinks)

    x, pools = _run(model, tokens, positions, attend, cache.pools(), mesh, stack_packed=True)
    cache = cache.replace_pools(*pools)
    last = jnp.maximum(chunk_lens - 1, 0)  # i32[B]
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # f32[B, d_model]
    return model.logits(x_last, mesh), cache


def decode(model: GPT, cache: KVCache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto",
           mesh=None, lora=None):
    """One decode step: a new token per sequence, its K/V written first, then paged attention.

    Args:
      model: the GPT.
      cache: its KVCache.
      tokens: i32[B], the new token of each sequence.
      seq_lens: i32[B] tokens in the cache including the new one (0 = inactive slot); the new
        token's position is seq_lens - 1.
      slot_mapping: i32[B] cache slot of the new token (-1 for inactive slots).
      block_tables: i32[B, pages_per_seq].
      impl: the `jpa.paged_decode` implementation ("auto", "xla", "triton", "mosaic"); the engine
        passes its `attention_impl` as given. With "auto", `jpa.paged_decode` picks the kernel while
        this step is traced, for the device it is compiled for and these exact shapes.
      mesh: as `prefill` (tensor parallelism; the kernel then runs on each device's heads).
      lora: None, or (slots, index i32[B][, method]): LoRA adapter slots (models.lora) and each sequence's.

    Returns:
      (logits f32[B, vocab] (finite garbage for inactive slots), the updated cache).
    """
    _check_cache(model, cache)
    _check_ndim("tokens", tokens, 1, "i32[num_seqs]")
    batch = tokens.shape[0]
    _check_int("tokens", tokens, (batch,), "i32[num_seqs]")
    _check_int("seq_lens", seq_lens, (batch,), "i32[num_seqs]")
    _check_int("slot_mapping", slot_mapping, (batch,), "i32[num_seqs]")
    if getattr(block_tables, "ndim", None) != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape i32[num_seqs = {batch}, pages_per_seq]; "
                         f"got {getattr(block_tables, 'shape', None)}")
    positions = jnp.maximum(seq_lens - 1, 0)[:, None]  # i32[B, 1]

    def layer_step(pools, q, k, v, slot_mapping, block_tables, seq_lens, layer, sinks, *, opts):  # per device
        pools = _write(pools, k, v, slot_mapping, layer)
        kp, vp, ks, vs = pools
        out = paged_decode(q, kp, vp, block_tables, seq_lens, k_scales=ks, v_scales=vs, impl=impl, layer=layer,
                           sinks=sinks, **opts)
        return out, pools  # [B, N, H]

    def attend(r, layer, q, k, v, pools, sinks):
        step = head_parallel(functools.partial(layer_step, opts=model.attention_options(r)), mesh,
                             (STACKED_POOL, HEADS, HEADS, HEADS) + (REPLICATED,) * 4 + (SINKS,),
                             (HEADS, STACKED_POOL))
        out, pools = step(pools, q[:, 0].astype(model.dtype), k[:, 0], v[:, 0], slot_mapping, block_tables,
                          seq_lens, layer, sinks)
        return out[:, None], pools

    x, pools = _run(model, tokens[:, None], positions, attend, cache.pools(), mesh, stack_packed=True,
                    lora=_check_lora(lora, (batch, 1)))
    cache = cache.replace_pools(*pools)
    return model.logits(x[:, 0], mesh), cache


def ragged(model: GPT, cache: KVCache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
           num_seqs, *, impl="auto", mesh=None, lora=None):
    """A ragged batch (prefill chunks and decode tokens back to back) through the model and the cache.

    `ragged_hidden` (same arguments), then the head at each sequence's last row.

    Returns:
      (logits f32[max_num_seqs, vocab] at each sequence's last row (finite garbage for i >=
       num_seqs and for empty sequences), the updated cache).
    """
    x, cache = ragged_hidden(model, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                             num_seqs, impl=impl, mesh=mesh, lora=lora)
    last = jnp.clip(cu_q_lens[1:] - 1, 0, x.shape[0] - 1)  # i32[max_num_seqs]
    return model.logits(x[last], mesh), cache


def ragged_hidden(model: GPT, cache: KVCache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                  num_seqs, *, impl="auto", mesh=None, lora=None):
    """`ragged` without the head: the final hidden rows of every token (`model.logits` of a row is
    its logits; prompt logprobs need them at every prompt row, not only the last).

    Sequence i < num_seqs owns token rows cu_q_lens[i]:cu_q_lens[i + 1], the last q_len_i of its
    seq_lens[i] cached tokens (`jpa.ragged_paged_attention`'s legend). Each row's K/V is written at
    its slot first, then every row attends causally to its sequence's cache.

    Args:
      model: the GPT.
      cache: its KVCache.
      tokens: i32[T] token ids, T the static token budget; padding rows hold any valid id.
      positions: i32[T] position of each row (seq_lens[i] - q_len_i + t for row cu_q_lens[i] + t).
      slot_mapping: i32[T] cache slot of each row (-1 for padding).
      block_tables: i32[max_num_seqs, pages_per_seq].
      seq_lens: i32[max_num_seqs] tokens cached after this call's writes.
      cu_q_lens: i32[max_num_seqs + 1] row offsets (cu_q_lens[0] = 0, non-decreasing).
      num_seqs: i32[] live sequences; rows past cu_q_lens[num_seqs] are padding.
      impl: the `jpa.ragged_paged_attention` implementation ("auto", "xla", "triton", "mosaic").
      mesh: as `prefill` (tensor parallelism).
      lora: None, or (slots, index i32[T][, method]): LoRA adapter slots (models.lora) and each row's slot
        (-1: the base model).

    Returns:
      (hidden f32[T, d_model] of every row before the final norm (finite garbage for padding
       rows), the updated cache).
    """
    _check_cache(model, cache)
    _check_ndim("tokens", tokens, 1, "i32[num_tokens]")
    num_tokens = tokens.shape[0]
    for name, x in (("tokens", tokens), ("positions", positions), ("slot_mapping", slot_mapping)):
        _check_int(name, x, (num_tokens,), "i32[num_tokens]")
    _check_ndim("seq_lens", seq_lens, 1, "i32[max_num_seqs]")
    batch = seq_lens.shape[0]
    _check_int("seq_lens", seq_lens, (batch,), "i32[max_num_seqs]")
    _check_int("cu_q_lens", cu_q_lens, (batch + 1,), "i32[max_num_seqs + 1]")
    if getattr(block_tables, "ndim", None) != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have shape i32[max_num_seqs = {batch}, pages_per_seq]; "
                         f"got {getattr(block_tables, 'shape', None)}")
    num_seqs = jnp.asarray(num_seqs, jnp.int32)

    def layer_step(pools, q, k, v, slots, block_tables, seq_lens, cu_q_lens, num_seqs, layer, sinks, *, opts):
        pools = _write(pools, k, v, slots, layer)
        kp, vp, ks, vs = pools
        out = ragged_paged_attention(q, kp, vp, block_tables, seq_lens, cu_q_lens, num_seqs, k_scales=ks,
                                     v_scales=vs, impl=impl, layer=layer, sinks=sinks, **opts)
        return out, pools  # [T, N, H]

    def attend(r, layer, q, k, v, pools, sinks):
        step = head_parallel(functools.partial(layer_step, opts=model.attention_options(r)), mesh,
                             (STACKED_POOL, HEADS, HEADS, HEADS) + (REPLICATED,) * 6 + (SINKS,),
                             (HEADS, STACKED_POOL))
        out, pools = step(pools, q[0].astype(model.dtype), k[0], v[0], slot_mapping, block_tables, seq_lens,
                          cu_q_lens, num_seqs, layer, sinks)
        return out[None], pools

    x, pools = _run(model, tokens[None], positions[None], attend, cache.pools(), mesh, stack_packed=True,
                    lora=_check_lora(lora, (1, num_tokens)))
    return x[0], cache.replace_pools(*pools)
