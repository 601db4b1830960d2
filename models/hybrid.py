"""Hybrid linear-attention models: Qwen3.5 (text) and Qwen3-Next, Gated DeltaNet layers beside gated full attention.

Three of every four layers are Gated DeltaNet (GDN, `jpa.ops.gdn`): a per-sequence recurrent state f32[value
heads, value dim, key dim] (transformers' [key dim, value dim] transposed, `jpa.ops.gdn`) and the causal
conv's last kernel - 1 inputs, kept in the engine's state slots
(the `RecurrentState` group of `cache_spec()`). The fourth is full attention with an output gate (q_proj
yields a query and a sigmoid gate per head), q / k RMSNorm and partial RoPE (the first 25% of each head),
over the paged KV cache with the project's attention ops (`jpa.ragged_paged_attention`, `jpa.paged_decode`),
so the kernels serve it. The MLP is a SwiGLU (Qwen3.5) or, in Qwen3-Next, a sparse MoE (`models.moe`) plus
a shared expert scaled by sigmoid(x @ w); `mlp_only_layers` keep a dense MLP. RMSNorms are (1 + w) x / rms,
the GDN output norm is w * x / rms * silu(z) (transformers' Qwen3NextRMSNorm, Qwen3NextRMSNormGated).

`HybridModel` satisfies `jpa.engine.EngineModel` with the recurrent-state contract: `ragged`, `ragged_hidden`
and `decode` take `states` (`{"linear": {"conv": f32[G, slots, conv_dim, kernel - 1], "ssm": f32[G, slots,
Hv, Dv, Dk]}}`, G the GDN layers in model order) and `state_slots` (i32 per sequence entry, -1 padding) and
return the updated states as a third value. An entry whose first row has position 0 (decode: seq_lens == 1)
starts from a zero state; otherwise from its slot. The paged pool (`jpa.KVCache`) holds the full-attention
layers only, pool layer j being the j-th of them in model order.

Layers run as a `lax.scan` over repeats of the smallest period of the layer pattern (GDN x 3, attention for
Qwen3.5; plus the MLP kind), each period position's parameters stacked over the repeats.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpa.kv.cache import CacheConfig, KVCache, write_kv
from jpa.kv.spec import CacheGroup, CacheSpec, FullAttention, RecurrentState
from jpa.models import moe
from jpa.ops import gdn
from jpa.ops.decode import paged_decode
from jpa.ops.ragged import ragged_paged_attention

LINEAR, FULL = "linear_attention", "full_attention"
STATE_GROUP = "linear"  # the name of the RecurrentState group (and the key of `states`)


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """A Qwen3-Next / Qwen3.5 text model's sizes (frozen, hashable).

    The first seven fields are what the engine reads (`jpa.engine.ModelSizes`); num_q_heads / num_kv_heads /
    head_dim are the full-attention layers'. The GDN layers have lin_k_heads query/key heads of lin_k_dim and
    lin_v_heads value heads of lin_v_dim (each key head serves lin_v_heads / lin_k_heads value heads).
    """
    vocab_size: int
    d_model: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    ffn_dim: int
    layer_types: tuple
    rotary_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    lin_k_heads: int = 1
    lin_v_heads: int = 1
    lin_k_dim: int = 1
    lin_v_dim: int = 1
    conv_kernel: int = 4
    moe_layers: tuple = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 0
    swiglu_clamp = ()  # models.moe reads it: plain silu(g) * u

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "max_seq_len",
                     "ffn_dim", "lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim", "conv_kernel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"HybridConfig.{name} must be an int >= 1; got {v!r}")
        if (not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers
                or any(t not in (LINEAR, FULL) for t in self.layer_types)):
            raise ValueError(f"HybridConfig.layer_types must be {self.num_layers} entries of {LINEAR!r} / {FULL!r}; "
                             f"got {self.layer_types!r}")
        if LINEAR not in self.layer_types or FULL not in self.layer_types:
            raise ValueError(f"HybridConfig.layer_types must hold both {LINEAR!r} and {FULL!r} layers; got "
                             f"{self.layer_types!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"HybridConfig.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.lin_v_heads % self.lin_k_heads:
            raise ValueError(f"HybridConfig.lin_v_heads ({self.lin_v_heads}) must be a multiple of lin_k_heads "
                             f"({self.lin_k_heads})")
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"HybridConfig.rotary_dim must be even and in [2, head_dim = {self.head_dim}]; got "
                             f"{self.rotary_dim}")
        if self.moe_layers and not (self.num_experts >= 1 and 1 <= self.experts_per_token <= self.num_experts
                                    and self.moe_ffn_dim >= 1):
            raise ValueError(f"HybridConfig: MoE layers need num_experts >= 1, 1 <= experts_per_token <= num_experts "
                             f"and moe_ffn_dim >= 1; got {self.num_experts}, {self.experts_per_token}, "
                             f"{self.moe_ffn_dim}")

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv: q, k (lin_k_heads x lin_k_dim each) and v (lin_v_heads x lin_v_dim)."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def kind(self, i: int) -> tuple:
        """(mixer, mlp) of layer i: mixer "linear" / "full", mlp "moe" / "dense"."""
        return ("linear" if self.layer_types[i] == LINEAR else "full",
                "moe" if i in self.moe_layers else "dense")

    @property
    def period(self) -> int:
        """The smallest p dividing num_layers with layer i of the same kind as layer i % p."""
        kinds = [self.kind(i) for i in range(self.num_layers)]
        return next(p for p in range(1, self.num_layers + 1)
                    if self.num_layers % p == 0 and all(kinds[i] == kinds[i % p] for i in range(self.num_layers)))

    def layers_of(self, mixer: str) -> tuple:
        """Model layer indices of the "linear" or "full" layers, in increasing order."""
        return tuple(i for i in range(self.num_layers) if self.kind(i)[0] == mixer)


def cache_spec(c: HybridConfig) -> CacheSpec:
    """The FullAttention group over the gated-attention layers and the RecurrentState group over the GDN layers."""
    state = RecurrentState((("conv", (c.conv_dim, c.conv_kernel - 1), "float32"),
                            ("ssm", (c.lin_v_heads, c.lin_v_dim, c.lin_k_dim), "float32")))
    return CacheSpec((CacheGroup("full", c.layers_of("full"), FullAttention(c.num_kv_heads, c.head_dim)),
                      CacheGroup(STATE_GROUP, c.layers_of("linear"), state)))


def init_states(spec: CacheSpec, num_slots: int) -> dict:
    """{group: {state: zeros [len(group.layers), num_slots, *shape]}} for the spec's recurrent groups (the
    contract's `CacheSpec.init_states`, which the engine side adds to jpa/kv/spec.py)."""
    return {g.name: {n: jnp.zeros((len(g.layers), num_slots, *shape), dtype) for n, shape, dtype in g.layout.shapes}
            for g in spec.groups if not g.paged}


def param_shapes(c: HybridConfig) -> dict:
    """{name: shape} of one layer's parameters by kind ("linear", "full", "dense", "moe") and the top level
    ("top"), in the x @ W ([in, out]) convention."""
    d, n, k, h = c.d_model, c.num_q_heads, c.num_kv_heads, c.head_dim
    vd = c.lin_v_heads * c.lin_v_dim
    shapes = {
        "top": {"embed": (c.vocab_size, d), "final_norm": (d,),
                **({} if c.tie_embeddings else {"head": (d, c.vocab_size)})},
        "full": {"attn_norm": (d,), "wq": (d, n * h * 2), "wk": (d, k * h), "wv": (d, k * h), "wo": (n * h, d),
                 "q_norm": (h,), "k_norm": (h,)},
        "linear": {"attn_norm": (d,), "in_qkv": (d, c.conv_dim), "in_z": (d, vd), "in_b": (d, c.lin_v_heads),
                   "in_a": (d, c.lin_v_heads), "conv_w": (c.conv_dim, c.conv_kernel), "a_log": (c.lin_v_heads,),
                   "dt_bias": (c.lin_v_heads,), "gnorm": (c.lin_v_dim,), "out": (vd, d)},
        "dense": {"ffn_norm": (d,), "w_gate": (d, c.ffn_dim), "w_up": (d, c.ffn_dim), "w_down": (c.ffn_dim, d)},
        "moe": {"ffn_norm": (d,), "router": (d, c.num_experts), "experts_gate": (c.num_experts, d, c.moe_ffn_dim),
                "experts_up": (c.num_experts, d, c.moe_ffn_dim), "experts_down": (c.num_experts, c.moe_ffn_dim, d),
                "shared_gate": (d, c.shared_ffn_dim), "shared_up": (d, c.shared_ffn_dim),
                "shared_down": (c.shared_ffn_dim, d), "shared_router": (d, 1)},
    }
    return shapes


def stack_params(c: HybridConfig, top: dict, layers: list) -> dict:
    """The model's parameter pytree from the top-level arrays and one dict per model layer: {"top": top,
    "layers": [period position j: {name: array [num_layers / period, ...]}]}."""
    p = c.period
    stacked = []
    for j in range(p):
        members = [layers[i] for i in range(j, c.num_layers, p)]
        stacked.append({name: jnp.stack([m[name] for m in members]) for name in members[0]})
    return {"top": dict(top), "layers": stacked}


def abstract_params(c: HybridConfig, dtype) -> dict:
    """The parameter pytree of `stack_params` as jax.ShapeDtypeStruct leaves (deviceless compiles, traffic)."""
    shapes = param_shapes(c)
    spec = lambda shape: jax.ShapeDtypeStruct(shape, np.dtype(dtype))
    repeats = c.num_layers // c.period
    layers = [{n: spec((repeats, *shape)) for n, shape in {**shapes[c.kind(j)[0]], **shapes[c.kind(j)[1]]}.items()}
              for j in range(c.period)]
    return {"top": {n: spec(shape) for n, shape in shapes["top"].items()}, "layers": layers}


# Qwen3.5-27B's text shapes: 64 layers (GDN x 3, gated attention) x 16, d_model 5120, SwiGLU 17408, attention 24 q /
# 4 kv heads of 256 (RoPE on 64), vocab 248320. The GDN heads (16 key / 48 value heads of 128) are assumed, not read
# from the released config.
QWEN35_27B_SHAPED = HybridConfig(
    vocab_size=248320, d_model=5120, num_layers=64, num_q_heads=24, num_kv_heads=4, head_dim=256, max_seq_len=262144,
    ffn_dim=17408, layer_types=tuple(LINEAR if (i + 1) % 4 else FULL for i in range(64)), rotary_dim=64,
    rope_base=1e7, lin_k_heads=16, lin_v_heads=48, lin_k_dim=128, lin_v_dim=128, conv_kernel=4, tie_embeddings=False)


def _mm(x, w):
    """x @ w in w's dtype, accumulated in f32."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _rms_norm(x, w, eps):
    """Qwen3-Next's RMSNorm: x / rms(x) * (1 + w), in f32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(jnp.float32))


def _partial_rope(x, positions, rotary_dim, base):
    """RoPE (rotate_half convention) on the first rotary_dim of each head: x f32[T, heads, H], positions i32[T]."""
    inv = 1.0 / (base ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))  # [R/2]
    ang = positions.astype(jnp.float32)[:, None, None] * inv  # [T, 1, R/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


class HybridModel:
    """A Qwen3.5 / Qwen3-Next text model for the engine (`jpa.engine.EngineModel` with a recurrent-state group).

    Args:
      config: HybridConfig.
      params: the pytree of `stack_params`.
      dtype: the parameters' dtype.
    """

    def __init__(self, config: HybridConfig, params: dict, dtype):
        self.config = config
        self.params = params
        self.dtype = np.dtype(dtype)
        self.quantization = None
        self._spec = cache_spec(config)
        self.paged_layers = config.layers_of("full")  # pool layer j = the j-th full-attention layer

    # --- what the engine reads ------------------------------------------------------------------

    def cache_spec(self) -> CacheSpec:
        return self._spec

    def cache_config(self, num_pages: int, page_size: int = 16, dtype=None) -> CacheConfig:
        """The CacheConfig of a paged pool of the full-attention layers only (dtype: the model's by default)."""
        c = self.config
        return CacheConfig(num_layers=len(self.paged_layers), num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                           num_pages=num_pages, page_size=page_size,
                           dtype=self.dtype.name if dtype is None else np.dtype(dtype).name)

    def init_states(self, num_slots: int) -> dict:
        """Zero states for num_slots sequence slots (`init_states(self.cache_spec(), num_slots)`)."""
        return init_states(self._spec, num_slots)

    def head(self, params, hidden):
        """hidden f32[..., d_model] -> logits f32[..., vocab] (final norm and output layer)."""
        c = self.config
        x = _rms_norm(hidden, params["top"]["final_norm"], c.norm_eps)
        w = params["top"]["embed"].T if c.tie_embeddings else params["top"]["head"]
        return _mm(x, w)

    def ragged(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs,
               *, impl="auto", states=None, state_slots=None):
        """A ragged batch (`jpa.engine.EngineModel.ragged`) with the recurrent states.

        Returns:
          (logits f32[max_num_seqs, vocab] at each entry's last row, the updated cache, the updated states).
        """
        x, cache, states = self.ragged_hidden(params, cache, tokens, positions, slot_mapping, block_tables, seq_lens,
                                              cu_q_lens, num_seqs, impl=impl, states=states, state_slots=state_slots)
        last = jnp.clip(cu_q_lens[1:] - 1, 0, x.shape[0] - 1)
        return self.head(params, x[last]), cache, states

    def ragged_hidden(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                      num_seqs, *, impl="auto", states=None, state_slots=None):
        """`ragged` without the head: (hidden f32[T, d_model] of every row, cache, states).

        Args (beyond `jpa.engine.EngineModel.ragged`'s):
          states: {"linear": {"conv": f32[G, slots, conv_dim, kernel - 1], "ssm": f32[G, slots, Hv, Dv, Dk]}}.
          state_slots: i32[max_num_seqs], the slot entry i reads and writes (-1: none).
        """
        num_tokens = self._check(cache, tokens, "i32[num_tokens]", states, state_slots, seq_lens.shape[0])
        for name, a in (("positions", positions), ("slot_mapping", slot_mapping)):
            if tuple(a.shape) != (num_tokens,):
                raise ValueError(f"{name} must have shape i32[num_tokens = {num_tokens}]; got {tuple(a.shape)}")
        batch = seq_lens.shape[0]
        if tuple(cu_q_lens.shape) != (batch + 1,):
            raise ValueError(f"cu_q_lens must have shape i32[max_num_seqs + 1 = {batch + 1}]; got "
                             f"{tuple(cu_q_lens.shape)}")
        num_seqs = jnp.asarray(num_seqs, jnp.int32)
        live = jnp.arange(batch) < num_seqs
        q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
        fresh = positions[jnp.clip(cu_q_lens[:-1], 0, num_tokens - 1)] == 0  # the reset rule
        write = live & (q_lens > 0)
        scale = self.config.head_dim ** -0.5

        def attend(layer, q, k, v, pools):
            pools = _write(pools, k, v, slot_mapping, layer)
            kp, vp, ks, vs = pools
            out = ragged_paged_attention(q.astype(self.dtype), kp, vp, block_tables, seq_lens, cu_q_lens, num_seqs,
                                         k_scales=ks, v_scales=vs, impl=impl, layer=layer, scale=scale)
            return out, pools

        def mix(mixed, weight, conv0):
            return gdn.conv_ragged(mixed, weight, conv0, cu_q_lens, num_seqs)

        def rule(q, k, v, g, beta, s0):
            return gdn.gdn_ragged(q, k, v, g, beta, s0, cu_q_lens, num_seqs)

        x, cache, states = self._run(params, cache, tokens, positions, attend, mix, rule, states, state_slots, fresh,
                                     write)
        return x, cache, states

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto", states=None,
               state_slots=None):
        """One new token per row (`jpa.engine.EngineModel.decode`), the GDN layers in their recurrent form.

        Returns:
          (logits f32[num_seqs, vocab], the updated cache, the updated states).
        """
        batch = self._check(cache, tokens, "i32[num_seqs]", states, state_slots, tokens.shape[0])
        for name, a in (("seq_lens", seq_lens), ("slot_mapping", slot_mapping)):
            if tuple(a.shape) != (batch,):
                raise ValueError(f"{name} must have shape i32[num_seqs = {batch}]; got {tuple(a.shape)}")
        positions = jnp.maximum(seq_lens - 1, 0)
        scale = self.config.head_dim ** -0.5

        def attend(layer, q, k, v, pools):
            pools = _write(pools, k, v, slot_mapping, layer)
            kp, vp, ks, vs = pools
            out = paged_decode(q.astype(self.dtype), kp, vp, block_tables, seq_lens, k_scales=ks, v_scales=vs,
                               impl=impl, layer=layer, scale=scale)
            return out, pools

        x, cache, states = self._run(params, cache, tokens, positions, attend, gdn.conv_step, gdn.gdn_step, states,
                                     state_slots, seq_lens == 1, seq_lens > 0)
        return self.head(params, x), cache, states

    # --- the layers ---------------------------------------------------------------------------------

    def _check(self, cache, tokens, doc, states, state_slots, entries) -> int:
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a jpa.KVCache; got {type(cache).__name__}")
        if cache.num_layers != len(self.paged_layers):
            raise ValueError(f"cache must hold the {len(self.paged_layers)} full-attention layers "
                             f"{self.paged_layers} (the paged group of cache_spec()); got {cache.num_layers} layers")
        if getattr(tokens, "ndim", None) != 1:
            raise ValueError(f"tokens must have shape {doc}; got {getattr(tokens, 'shape', None)}")
        if states is None or state_slots is None:
            raise ValueError(f"states and state_slots are required: {type(self).__name__} keeps recurrent states "
                             f"(cache_spec() group {STATE_GROUP!r}); build them with init_states(num_slots)")
        want = self.init_states(1)
        got = states.get(STATE_GROUP) if isinstance(states, dict) else None
        if not isinstance(got, dict) or set(got) != set(want[STATE_GROUP]) or any(
                tuple(got[n].shape[:1]) + tuple(got[n].shape[2:]) != tuple(w.shape[:1]) + tuple(w.shape[2:])
                for n, w in want[STATE_GROUP].items()):
            shapes = {n: ["layers", "num_slots", *w.shape[2:]] for n, w in want[STATE_GROUP].items()}
            layers = want[STATE_GROUP]["ssm"].shape[0]
            raise ValueError(f"states must be {{{STATE_GROUP!r}: {shapes}}} with layers = {layers} "
                             f"(init_states(num_slots)); got {jax.tree.map(lambda a: tuple(a.shape), states)}")
        if tuple(state_slots.shape) != (entries,):
            raise ValueError(f"state_slots must have shape i32[{entries}] (one slot per sequence entry); got "
                             f"{tuple(state_slots.shape)}")
        return tokens.shape[0]

    def _run(self, params, cache, tokens, positions, attend, mix, rule, states, state_slots, fresh, write):
        c = self.config
        p = c.period
        kinds = [c.kind(j) for j in range(p)]
        n_full = sum(k[0] == "full" for k in kinds)  # per period
        n_lin = p - n_full
        repeats = c.num_layers // p
        group = states[STATE_GROUP]
        x = params["top"]["embed"][tokens].astype(jnp.float32)  # [T, D]

        # The state arrays ride in the scan's carry: GDN layer gi gathers its entries' slots of layer gi
        # (one gather reading B states) and scatters the new ones back in place, so a decode step reads and
        # writes each live state about once (a gather of every layer's states before the scan and a scatter after
        # it would move each state three times more).
        def body(carry, xs):
            x, pools, conv_all, ssm_all = carry
            layer_params, r = xs
            a = g = 0
            for j, (mixer, mlp) in enumerate(kinds):
                lp = layer_params[j]
                h = _rms_norm(x, lp["attn_norm"], c.norm_eps)
                if mixer == "full":
                    out, pools = self._attention(lp, h, positions, lambda *qkv: attend(r * n_full + a, *qkv, pools))
                    a += 1
                else:
                    gi = r * n_lin + g
                    conv0 = gdn.read_slots(conv_all, state_slots, fresh, layer=gi)
                    ssm0 = gdn.read_slots(ssm_all, state_slots, fresh, layer=gi)
                    out, conv1, ssm1 = self._gdn(lp, h, conv0, ssm0, mix, rule)
                    conv_all = gdn.write_slots(conv_all, state_slots, conv1, write, layer=gi)
                    ssm_all = gdn.write_slots(ssm_all, state_slots, ssm1, write, layer=gi)
                    g += 1
                x = x + out
                h = _rms_norm(x, lp["ffn_norm"], c.norm_eps)
                x = x + (self._moe(lp, h) if mlp == "moe" else _swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"]))
            return (x, pools, conv_all, ssm_all), None

        xs = (params["layers"], jnp.arange(repeats, dtype=jnp.int32))
        (x, pools, conv_all, ssm_all), _ = jax.lax.scan(body, (x, cache.pools(), group["conv"], group["ssm"]), xs)
        new = {"conv": conv_all, "ssm": ssm_all}
        return x, cache.replace_pools(*pools), {**states, STATE_GROUP: new}

    def _attention(self, lp, h, positions, attend):
        """Gated full attention: q and a gate per head from wq, q / k RMSNorm, partial RoPE, then `attend`
        (write K/V, paged attention) and o_proj of attn * sigmoid(gate). -> (f32[T, D], pools)."""
        c = self.config
        t = h.shape[0]
        qg = _mm(h, lp["wq"]).reshape(t, c.num_q_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(t, -1)
        k = _mm(h, lp["wk"]).reshape(t, c.num_kv_heads, c.head_dim)
        v = _mm(h, lp["wv"]).reshape(t, c.num_kv_heads, c.head_dim)
        q = _partial_rope(_rms_norm(q, lp["q_norm"], c.norm_eps), positions, c.rotary_dim, c.rope_base)
        k = _partial_rope(_rms_norm(k, lp["k_norm"], c.norm_eps), positions, c.rotary_dim, c.rope_base)
        out, pools = attend(q, k.astype(self.dtype), v.astype(self.dtype))  # [T, N, H]
        out = out.reshape(t, -1).astype(jnp.float32) * jax.nn.sigmoid(gate)
        return _mm(out, lp["wo"]), pools

    def _gdn(self, lp, h, conv0, ssm0, mix, rule):
        """A Gated DeltaNet layer: projections, the causal conv (`mix`), the gated delta rule (`rule`), the gated
        RMSNorm and out_proj. -> (f32[T, D], conv state, ssm state)."""
        c = self.config
        t = h.shape[0]
        kd = c.lin_k_heads * c.lin_k_dim
        mixed = _mm(h, lp["in_qkv"])  # [T, conv_dim]: q, k, v
        z = _mm(h, lp["in_z"]).reshape(t, c.lin_v_heads, c.lin_v_dim)
        beta = jax.nn.sigmoid(_mm(h, lp["in_b"]))  # [T, Hv]
        a = _mm(h, lp["in_a"])
        g = -jnp.exp(lp["a_log"].astype(jnp.float32)) * jax.nn.softplus(a + lp["dt_bias"].astype(jnp.float32))
        y, conv1 = mix(mixed, lp["conv_w"], conv0)  # silu(conv) f32[T, conv_dim]
        rep = c.lin_v_heads // c.lin_k_heads  # each key head serves `rep` consecutive value heads
        q = jnp.repeat(y[:, :kd].reshape(t, c.lin_k_heads, c.lin_k_dim), rep, axis=1)
        k = jnp.repeat(y[:, kd:2 * kd].reshape(t, c.lin_k_heads, c.lin_k_dim), rep, axis=1)
        v = y[:, 2 * kd:].reshape(t, c.lin_v_heads, c.lin_v_dim)
        q = gdn.l2norm(q) * c.lin_k_dim ** -0.5
        k = gdn.l2norm(k)
        o, ssm1 = rule(q, k, v, g, beta, ssm0)  # [T, Hv, Dv]
        o = gdn.gated_rms_norm(o, z, lp["gnorm"], c.norm_eps).reshape(t, -1)
        return _mm(o, lp["out"]), conv1, ssm1

    def _moe(self, lp, h):
        """Sparse MoE plus the shared expert scaled by sigmoid(h @ shared_router) (Qwen3NextSparseMoeBlock)."""
        routed = moe.moe_ffn(h, lp["router"], lp["experts_gate"], lp["experts_up"], lp["experts_down"], self.config,
                             self.dtype)
        shared = _swiglu(h, lp["shared_gate"], lp["shared_up"], lp["shared_down"])
        return routed + jax.nn.sigmoid(_mm(h, lp["shared_router"])) * shared


def _swiglu(h, w_gate, w_up, w_down):
    return _mm(jax.nn.silu(_mm(h, w_gate)) * _mm(h, w_up), w_down)


def _write(pools, k, v, slot_mapping, layer):
    """The stacked (k_pages, v_pages, k_scales, v_scales) after writing k, v [T, K, H] of pool `layer`."""
    kp, vp, ks, vs = pools
    out = write_kv(kp, vp, k, v, slot_mapping, k_scales=ks, v_scales=vs, layer=layer)
    return out if len(out) == 4 else (*out, None, None)


__all__ = ["HybridConfig", "HybridModel", "QWEN35_27B_SHAPED", "abstract_params", "cache_spec", "init_states",
           "param_shapes", "stack_params"]
