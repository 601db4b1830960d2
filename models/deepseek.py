"""DeepSeek-V3 (model_type deepseek_v3: V3, V3.1) and DeepSeek-V2 (deepseek_v2, with its routers): multi-head
latent attention over a paged latent cache, and DeepSeek's mixture of experts. Its own model class
(`DeepSeekForEngine`), not the models.GPT stack; it satisfies `jpa.engine.EngineModel`.

MLA (transformers' DeepseekV3Attention), per layer, for a token x [D]:

    q      = q_b(rms(q_a(x)))          (q_lora_rank None: q_proj(x))       -> N heads of [q_nope Hn, q_rope Dr]
    kv     = kv_a_proj_with_mqa(x)     -> [c R, k_rope Dr];  c = rms(c) (kv_a_layernorm)
    k_rope, q_rope rotated by RoPE (DeepSeek's interleaved pairs with rope_interleave; YaRN with its mscale)
    kv_b(c) = per head [k_nope Hn, v Hv]: W_UK [N, Hn, R], W_UV [N, Hv, R]

The cache keeps one latent per token for all heads, `[c, k_rope]` (R + Dr values; `LatentAttention`).
Attention runs in the absorbed form in prefill and decode alike: head n's query is `[q_nope_n @ W_UK_n,
q_rope_n]` (R + Dr wide), its score against a token is that query dot the token's latent (`q_nope . k_nope`
equals `(q_nope @ W_UK) . c`), its output the softmax-weighted sum of the tokens' c, mapped by W_UV_n after
(`jpa.ops.mla`). Nothing but the latent is ever stored or read.

The MLP: the first `first_k_dense_replace` layers are dense SwiGLU; the others are DeepSeek's MoE (transformers'
DeepseekV3MoE): sigmoid scores, `e_score_correction_bias` added for the choice only, experts in `n_group`
groups of which the `topk_group` best (by the sum of their two best biased scores) are eligible, the top
`num_experts_per_tok` of those chosen, weighted by their unbiased scores (normalized with norm_topk_prob) times
`routed_scaling_factor`, plus the shared experts (one SwiGLU of n_shared_experts * moe_intermediate_size) on
every token. The routed experts run as models.moe's grouped matmuls.

Parameters are a plain pytree: `{"embed", "final_norm", "head"?, "dense": {...}, "moe": {...}}`, each layer group
stacked on a leading axis and scanned, the layer index into the cache being the group's offset plus the scan
step. Multi-token-prediction layers (`model.layers.{num_hidden_layers + i}`, DeepSeek-V3's MTP module) are
recognized and not loaded, with one notice.

Einsum letters: T tokens, N q heads, H a head's nope width, V a head's value width, R kv_lora_rank.
"""

import collections
import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa.kv.spec import CacheGroup, CacheSpec, LatentAttention
from jpa.ops.mla import mla_paged_decode, mla_ragged_attention

log = logging.getLogger(__name__)

# models.gpt.rope_inv_freq reads (rope_scaling, head_dim, rope_base) off a hashable config: the rope part's.
_RopeDims = collections.namedtuple("_RopeDims", "rope_scaling head_dim rope_base")
# The routers: DeepSeek-V3's (topk_method noaux_tc: sigmoid scores, a correction bias, groups by their two best),
# DeepSeek-V2's (softmax scores; "greedy": the top k; "group_limited_greedy": groups by their best score).
ROUTERS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """A DeepSeek-V3 model's sizes and options (hashable). The engine's `ModelSizes` view: the pool holds one
    kv head (`num_kv_heads` 1) of `head_dim` = latent_dim = kv_lora_rank + qk_rope_head_dim."""
    vocab_size: int
    d_model: int
    num_layers: int
    num_q_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_dim: int
    moe_ffn_dim: int
    num_experts: int
    experts_per_token: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense: int
    max_seq_len: int
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_scaling: tuple = ()
    rope_interleave: bool = True
    softmax_scale: float = 0.0     # 0: qk_head_dim ** -0.5
    tie_embeddings: bool = False
    router: str = "noaux_tc"       # V3's; DeepSeek-V2's "greedy" / "group_limited_greedy" (softmax scores)
    swiglu_clamp = None            # models.moe's experts read it (DeepSeek's SwiGLU is unclamped)

    num_kv_heads = property(lambda self: 1)
    latent_dim = property(lambda self: self.kv_lora_rank + self.qk_rope_head_dim)
    head_dim = property(lambda self: self.latent_dim)
    qk_head_dim = property(lambda self: self.qk_nope_head_dim + self.qk_rope_head_dim)

    def __post_init__(self):
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepSeekConfig.qk_rope_head_dim must be even; got {self.qk_rope_head_dim}")
        if self.num_experts and (self.num_experts % self.n_group or self.num_experts // self.n_group < 2
                                 or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"DeepSeekConfig: n_routed_experts ({self.num_experts}) must split into n_group "
                             f"({self.n_group}) groups of >= 2 experts, with 1 <= topk_group ({self.topk_group}) "
                             f"<= n_group")
        if self.router not in ROUTERS:
            raise ValueError(f"DeepSeekConfig.router must be one of {ROUTERS}; got {self.router!r}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"DeepSeekConfig.first_k_dense must be in [0, num_layers]; got {self.first_k_dense}")

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim ** -0.5


# Published sizes (config.json of deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite), for sizing and traffic
# estimates without a checkpoint (`published`).
PUBLISHED = {
    "deepseek-v3": dict(vocab_size=129280, d_model=7168, num_layers=61, num_q_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_dim=18432,
                        moe_ffn_dim=2048, num_experts=256, experts_per_token=8, n_shared_experts=1, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense=3,
                        max_seq_len=163840),
    "deepseek-v2-lite": dict(vocab_size=102400, d_model=2048, num_layers=27, num_q_heads=16, q_lora_rank=None,
                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             ffn_dim=10944, moe_ffn_dim=1408, num_experts=64, experts_per_token=6, n_shared_experts=2,
                             n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                             first_k_dense=1, max_seq_len=163840, router="greedy"),
}


def published(name: str) -> "DeepSeekConfig":
    """The DeepSeekConfig of a published model's sizes (a key of PUBLISHED)."""
    if name not in PUBLISHED:
        raise ValueError(f"name must be one of {sorted(PUBLISHED)}; got {name!r}")
    return DeepSeekConfig(**PUBLISHED[name])


# ----------------------------------------------------------------------------------------- the layers

def _mm(x, w):
    """x @ w with w's dtype as the inputs' and float32 accumulation."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _rms(x, w, eps):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def rope_tables(config: DeepSeekConfig):
    """(inv_freq f32[Dr/2], attention_factor) of the RoPE part (YaRN: transformers' _compute_yarn_parameters)."""
    from jpa.models.gpt import rope_attention_factor, rope_inv_freq

    dims = _RopeDims(config.rope_scaling, config.qk_rope_head_dim, config.rope_base)
    inv = rope_inv_freq(dims)
    if inv is None:
        d = config.qk_rope_head_dim
        inv = (1.0 / (np.float32(config.rope_base) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))))
    return np.asarray(inv, np.float32), rope_attention_factor(dims)


def apply_rope(x, positions, inv_freq, factor, interleave: bool):
    """x f32[T, heads, Dr] rotated at positions i32[T]. interleave: DeepSeek's pairs (x0, x1), (x2, x3), ...
    each rotated by one frequency, returned as [evens, odds] halves (transformers'
    apply_rotary_pos_emb_interleave; q and k permuted alike, so their dot products are unchanged); else
    rotate_half's halves."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, Dr/2]
    cos, sin = (jnp.cos(angles) * factor)[:, None, :], (jnp.sin(angles) * factor)[:, None, :]  # [T, 1, Dr/2]
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mla_queries_and_latents(p, h, positions, config: DeepSeekConfig, rope):
    """The absorbed queries f32[T, N, latent_dim] and the latents f32[T, latent_dim] of normed tokens h [T, D]."""
    c = config
    if c.q_lora_rank is None:
        q = _mm(h, p["wq"])
    else:
        q = _mm(_rms(_mm(h, p["wq_a"]), p["q_norm"], c.rms_eps), p["wq_b"])
    q = q.reshape(h.shape[0], c.num_q_heads, c.qk_head_dim)  # [T, N, Hn + Dr]
    kv = _mm(h, p["wkv_a"])  # [T, R + Dr]
    latent_c = _rms(kv[:, :c.kv_lora_rank], p["kv_norm"], c.rms_eps)  # [T, R]
    inv_freq, factor = rope
    k_rope = apply_rope(kv[:, None, c.kv_lora_rank:], positions, inv_freq, factor, c.rope_interleave)[:, 0]
    q_rope = apply_rope(q[..., c.qk_nope_head_dim:], positions, inv_freq, factor, c.rope_interleave)  # [T, N, Dr]
    q_lat = jnp.einsum("TNH,NHR->TNR", q[..., :c.qk_nope_head_dim], p["w_uk"].astype(jnp.float32))
    return jnp.concatenate([q_lat, q_rope], axis=-1), jnp.concatenate([latent_c, k_rope], axis=-1)


def _swiglu(h, gate, up, down):
    return _mm(jax.nn.silu(_mm(h, gate)) * _mm(h, up), down)


def route(h, router, bias, config: DeepSeekConfig):
    """The router for tokens h [T, D]: (experts i32[T, k], weights f32[T, k]). V3 (noaux_tc; transformers'
    DeepseekV3TopkRouter) as the module docstring says; V2 (transformers' DeepseekV2TopkRouter): softmax scores,
    the top k of all ("greedy") or of the topk_group groups with the best single score ("group_limited_greedy"),
    weighted by their scores times routed_scaling_factor."""
    c = config
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32))  # [T, E]
    if c.router != "noaux_tc":
        scores = jax.nn.softmax(logits, axis=-1)
        if c.router == "group_limited_greedy":
            best = lax.top_k(jnp.max(scores.reshape(h.shape[0], c.n_group, -1), axis=-1), c.topk_group)[1]
            keep = jnp.any(best[:, :, None] == jnp.arange(c.n_group)[None, None, :], axis=1)  # [T, G]
            scores = jnp.where(jnp.repeat(keep, c.num_experts // c.n_group, axis=1), scores, 0.0)
        weights, experts = lax.top_k(scores, c.experts_per_token)
        return experts.astype(jnp.int32), weights * c.routed_scaling_factor
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)
    groups = choice.reshape(h.shape[0], c.n_group, c.num_experts // c.n_group)  # [T, G, E/G]
    group_scores = jnp.sum(lax.top_k(groups, 2)[0], axis=-1)  # [T, G]: each group's two best
    _, best = lax.top_k(group_scores, c.topk_group)  # [T, topk_group]
    keep = jnp.any(best[:, :, None] == jnp.arange(c.n_group)[None, None, :], axis=1)  # [T, G]
    choice = jnp.where(jnp.repeat(keep, c.num_experts // c.n_group, axis=1), choice, -jnp.inf)
    _, experts = lax.top_k(choice, c.experts_per_token)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * c.routed_scaling_factor


def _moe(p, h, config: DeepSeekConfig, dtype):
    from jpa.models.moe import _experts

    experts, weights = route(h, p["router"], p.get("router_bias"), config)
    routed = _experts(h, experts, weights, None, p["experts_gate"], p["experts_up"], p["experts_down"],
                      (None, None, None), config, dtype)
    return routed + _swiglu(h, p["shared_gate"], p["shared_up"], p["shared_down"])


def _run(params, config: DeepSeekConfig, dtype, cache, tokens, positions, slot_mapping, attend):
    """The layers over tokens i32[T] at positions i32[T]: each writes its tokens' latents at slot_mapping, then
    attend(q f32[T, N, latent_dim], cache, layer) -> f32[T, N, R]. Returns (hidden f32[T, D] before the final
    norm, cache)."""
    c = config
    rope = rope_tables(c)
    x = jnp.take(params["embed"], tokens, axis=0).astype(jnp.float32)  # [T, D]

    def layer(carry, xs, mlp):
        x, cache = carry
        p, i = xs
        h = _rms(x, p["attn_norm"], c.rms_eps)
        q, latent = mla_queries_and_latents(p, h, positions, c, rope)
        cache = cache.write_latent(i, latent.astype(cache.k.dtype), slot_mapping)
        o = attend(q, cache, i)  # [T, N, R]
        o = jnp.einsum("TNR,NVR->TNV", o.astype(jnp.float32), p["w_uv"].astype(jnp.float32))
        x = x + _mm(o.reshape(x.shape[0], c.num_q_heads * c.v_head_dim), p["wo"])
        h = _rms(x, p["ffn_norm"], c.rms_eps)
        return (x + mlp(p, h), cache), None

    dense = lambda p, h: _swiglu(h, p["w_gate"], p["w_up"], p["w_down"])  # noqa: E731
    moe = lambda p, h: _moe(p, h, c, dtype)  # noqa: E731
    offset = 0
    for name, mlp in (("dense", dense), ("moe", moe)):
        if name not in params:
            continue
        n = jax.tree_util.tree_leaves(params[name])[0].shape[0]
        ids = jnp.arange(offset, offset + n, dtype=jnp.int32)
        (x, cache), _ = lax.scan(lambda carry, xs: layer(carry, xs, mlp), (x, cache), (params[name], ids))
        offset += n
    return x, cache


def head(params, config: DeepSeekConfig, hidden):
    """hidden f32[..., D] -> logits f32[..., vocab] (the final norm and the output layer)."""
    h = _rms(hidden, params["final_norm"], config.rms_eps)
    w = params["head"] if "head" in params else params["embed"].T
    return _mm(h, w)


def cache_spec(config: DeepSeekConfig) -> CacheSpec:
    """One latent group over every layer: kv_lora_rank + qk_rope_head_dim values per token and layer."""
    return CacheSpec((CacheGroup("latent", tuple(range(config.num_layers)), LatentAttention(config.latent_dim)),))


def _check_impl(impl):
    if impl not in ("auto", "xla"):
        raise ValueError(f"impl must be 'auto' or 'xla' for MLA (its attention is plain JAX, jpa.ops.mla); "
                         f"got {impl!r}")


class DeepSeekForEngine:
    """A DeepSeek-V3 model as `jpa.engine.EngineModel`: config (DeepSeekConfig), dtype, params, decode, ragged,
    the ragged_hidden/head pair (prompt logprobs), and cache_spec (one latent group over every layer)."""

    def __init__(self, config: DeepSeekConfig, params, dtype):
        self.config, self.params, self.dtype = config, params, np.dtype(dtype)
        self.quantization = None

    def cache_spec(self) -> CacheSpec:
        return cache_spec(self.config)

    def ragged_hidden(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                      num_seqs, *, impl="auto"):
        _check_impl(impl)
        c = self.config
        attend = lambda q, cache, i: mla_ragged_attention(  # noqa: E731
            q, cache.k, block_tables, seq_lens, cu_q_lens, num_seqs, kv_lora_rank=c.kv_lora_rank, scale=c.scale,
            layer=i)
        return _run(params, c, self.dtype, cache, tokens, positions, slot_mapping, attend)

    def head(self, params, hidden):
        return head(params, self.config, hidden)

    def ragged(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs,
               *, impl="auto"):
        hidden, cache = self.ragged_hidden(params, cache, tokens, positions, slot_mapping, block_tables, seq_lens,
                                           cu_q_lens, num_seqs, impl=impl)
        last = jnp.clip(cu_q_lens[1:] - 1, 0, tokens.shape[0] - 1)  # each sequence's last row
        return self.head(params, hidden[last]), cache

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto"):
        _check_impl(impl)
        c = self.config
        attend = lambda q, cache, i: mla_paged_decode(  # noqa: E731
            q, cache.k, block_tables, seq_lens, kv_lora_rank=c.kv_lora_rank, scale=c.scale, layer=i)
        positions = jnp.maximum(seq_lens - 1, 0)
        hidden, cache = _run(params, c, self.dtype, cache, tokens, positions, slot_mapping, attend)
        return self.head(params, hidden), cache


# ----------------------------------------------------------------------------------------- loading

def config_from_hf(cfg: dict, where: str = "config.json") -> DeepSeekConfig:
    """The DeepSeekConfig of a deepseek_v3 config.json dict. Raises CheckpointError naming what is not supported."""
    from jpa.models.families.base import CheckpointError, check_activation, refuse
    from jpa.models.hf import _rope

    v2 = cfg.get("model_type") == "deepseek_v2"
    check_activation(cfg, where, cfg.get("model_type"), "silu")
    refuse(cfg, where, "attention_bias", (None, False), "DeepSeek's projections have no biases")
    refuse(cfg, where, "mlp_bias", (None, False), "DeepSeek's MLPs have no biases")
    if v2:
        refuse(cfg, where, "topk_method", ("greedy", "group_limited_greedy"), "DeepSeek-V2's routers")
        refuse(cfg, where, "scoring_func", (None, "softmax"), "DeepSeek-V2's router scores with a softmax")
        refuse(cfg, where, "norm_topk_prob", (None, False), "transformers' DeepSeek-V2 router ignores it while "
                                                          "DeepSeek's own code normalizes: ambiguous")
    else:
        refuse(cfg, where, "topk_method", (None, "noaux_tc"), "DeepSeek-V3's router is noaux_tc")
        refuse(cfg, where, "scoring_func", (None, "sigmoid"), "DeepSeek-V3's router scores with a sigmoid")
    refuse(cfg, where, "quantization_config", (None,), "quantized DeepSeek checkpoints (block FP8) are not read yet; "
                                                      "use a bf16 conversion")
    try:
        get = lambda k, d=None: cfg[k] if d is None else cfg.get(k, d)  # noqa: E731
        base, scaling = _rope(cfg, where)
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        qk = int(get("qk_nope_head_dim")) + int(get("qk_rope_head_dim"))
        scale = qk ** -0.5
        if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
            m = 0.1 * float(params["mscale_all_dim"]) * math.log(float(params["factor"])) + 1.0
            scale = scale * (m * m if float(params["factor"]) > 1 else 1.0)
        q_lora = cfg.get("q_lora_rank")
        n_exp = int(cfg.get("n_routed_experts") or 0)
        return DeepSeekConfig(
            vocab_size=int(get("vocab_size")), d_model=int(get("hidden_size")),
            num_layers=int(get("num_hidden_layers")), num_q_heads=int(get("num_attention_heads")),
            q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")), ffn_dim=int(get("intermediate_size")),
            moe_ffn_dim=int(get("moe_intermediate_size", 0)), num_experts=n_exp,
            experts_per_token=int(get("num_experts_per_tok", 0) or 0),
            n_shared_experts=int(get("n_shared_experts", 0) or 0),
            n_group=int(get("n_group", 1) or 1), topk_group=int(get("topk_group", 1) or 1),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            first_k_dense=min(int(get("first_k_dense_replace", 0)), int(get("num_hidden_layers"))) if n_exp
            else int(get("num_hidden_layers")),
            max_seq_len=int(get("max_position_embeddings", 4096)), rms_eps=float(get("rms_norm_eps", 1e-6)),
            rope_base=float(base), rope_scaling=scaling, rope_interleave=bool(get("rope_interleave", True)),
            softmax_scale=float(scale), tie_embeddings=bool(get("tie_word_embeddings", False)),
            router=str(cfg.get("topk_method") or "greedy") if v2 else "noaux_tc")
    except KeyError as e:
        raise CheckpointError(f"{where}: {e.args[0]!r} is missing") from e
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def _names(c: DeepSeekConfig, i: int, moe: bool) -> dict:
    """{parameter: (checkpoint name or tuple of expert names, transpose)} of layer i."""
    a = f"model.layers.{i}."
    out = {"attn_norm": (a + "input_layernorm.weight", False),
           "ffn_norm": (a + "post_attention_layernorm.weight", False),
           "wkv_a": (a + "self_attn.kv_a_proj_with_mqa.weight", True),
           "kv_norm": (a + "self_attn.kv_a_layernorm.weight", False), "wo": (a + "self_attn.o_proj.weight", True)}
    if c.q_lora_rank is None:
        out["wq"] = (a + "self_attn.q_proj.weight", True)
    else:
        out.update(wq_a=(a + "self_attn.q_a_proj.weight", True), q_norm=(a + "self_attn.q_a_layernorm.weight", False),
                   wq_b=(a + "self_attn.q_b_proj.weight", True))
    if not moe:
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[ours] = (f"{a}mlp.{theirs}.weight", True)
        return out
    out["router"] = (a + "mlp.gate.weight", True)
    if c.router == "noaux_tc":
        out["router_bias"] = (a + "mlp.gate.e_score_correction_bias", False)
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        out[f"experts_{ours}"] = (tuple(f"{a}mlp.experts.{j}.{theirs}.weight" for j in range(c.num_experts)), True)
        out[f"shared_{ours}"] = (f"{a}mlp.shared_experts.{theirs}.weight", True)
    return out


def load_model(path, cfg: dict, model_type: str, *, dtype, quantization) -> DeepSeekForEngine:
    """`models.families.Family.load_model` of deepseek_v3: the checkpoint directory's tensors into a
    DeepSeekForEngine. dtype: float32 or bfloat16 (None: bfloat16 on a GPU, else float32). quantization: None
    or "none" (weights as stored; on-the-fly int8/fp8 is not built for this family)."""
    from jpa.models.families.base import CheckpointError
    from jpa.models.hf import _read, _tensor_index

    if quantization not in (None, "none"):
        raise ValueError(f"quantization {quantization!r} is not supported for {model_type} (its weights are served "
                         f"as stored: None)")
    if dtype is None:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    np_dtype = np.dtype(dtype)
    if np_dtype not in (np.dtype(np.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16; got {np_dtype.name}")
    where = f"{path}/config.json"
    c = config_from_hf(cfg, where)
    index = _tensor_index(path)

    def read(name, transpose):
        names = name if isinstance(name, tuple) else (name,)
        for n in names:
            if n not in index:
                raise CheckpointError(f"{path}: tensor {n} is missing")
        if isinstance(name, tuple):
            return _read(tuple(index[n][0] for n in name), name, transpose, np.float32)
        return _read(index[name][0], name, transpose, np.float32)

    groups = {"dense": range(c.first_k_dense), "moe": range(c.first_k_dense, c.num_layers)}
    params = {}
    used = set()
    for group, layers in groups.items():
        if not len(layers):
            continue
        stacked = {}
        for i in layers:
            for ours, (name, transpose) in _names(c, i, group == "moe").items():
                stacked.setdefault(ours, []).append(read(name, transpose))
                used.update(name if isinstance(name, tuple) else (name,))
            kvb = f"model.layers.{i}.self_attn.kv_b_proj.weight"
            w = read(kvb, False).reshape(c.num_q_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            stacked.setdefault("w_uk", []).append(w[:, :c.qk_nope_head_dim])  # [N, Hn, R]
            stacked.setdefault("w_uv", []).append(w[:, c.qk_nope_head_dim:])  # [N, Hv, R]
            used.add(kvb)
        # transformers keeps the router's correction bias in float32 (_keep_in_fp32_modules_strict)
        params[group] = {k: jnp.asarray(np.stack(v), np.float32 if k == "router_bias" else np_dtype)
                         for k, v in stacked.items()}
    params["embed"] = jnp.asarray(read("model.embed_tokens.weight", False), np_dtype)
    params["final_norm"] = jnp.asarray(read("model.norm.weight", False), np_dtype)
    used.update(("model.embed_tokens.weight", "model.norm.weight"))
    if not c.tie_embeddings:
        params["head"] = jnp.asarray(read("lm_head.weight", True), np_dtype)
        used.add("lm_head.weight")
    mtp = sorted(n for n in index if n.startswith("model.layers.") and int(n.split(".")[2]) >= c.num_layers)
    if mtp:
        layers = sorted({int(n.split(".")[2]) for n in mtp})
        log.warning("%s: multi-token-prediction layers %s (%d tensors) are in the checkpoint and not used (jpa "
                    "does not speculate with them)", path, layers, len(mtp))
    rest = sorted(set(index) - used - set(mtp) - {n for n in index if n.endswith("rotary_emb.inv_freq")})
    if rest:
        raise CheckpointError(f"{path}: tensors jpa does not read for {model_type}: {rest[:5]}"
                              f"{' ...' if len(rest) > 5 else ''}")
    return DeepSeekForEngine(c, params, np_dtype)
