"""Model configuration: one frozen, hashable dataclass for both decoder families, and named presets."""

import dataclasses
import math

FAMILIES = ("gpt2", "llama")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
EXPERT_FORMATS = ("float", "mxfp4")
# rope_type -> number of parameters after it (yarn: factor, beta_fast, beta_slow,
# original_max_position_embeddings, attention_factor, truncate (1.0 / 0.0)).
ROPE_SCALINGS = {"linear": 1, "llama3": 4, "yarn": 6}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (hashable; usable as a static jit argument).

    Attributes:
      family: "gpt2" (LayerNorm, learned positions, multi-head attention, GELU MLP, biases) or
        "llama" (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases).
      vocab_size: tokens in the vocabulary.
      d_model: width of the residual stream.
      num_layers: decoder blocks.
      num_q_heads, num_kv_heads: query and key/value heads (N, K); N must be a multiple of K.
        gpt2 is multi-head attention, so it needs N == K.
      head_dim: H; the attention width is N * H (need not equal d_model).
      ffn_dim: hidden width of the MLP.
      max_seq_len: gpt2: rows of the learned position table; llama: the longest sequence the
        model is meant for (a limit, RoPE itself has none).
      rope_base: RoPE frequency base (llama only).
      norm_eps: epsilon of LayerNorm/RMSNorm.
      tie_embeddings: the output head is the transposed token embedding.
      bos_token_id, eos_token_id: special tokens, in [0, vocab_size).

    Llama-family variants (the Hugging Face architectures models.hf loads); the defaults are plain
    Llama, and gpt2 must keep them:
      qkv_bias: biases on the q/k/v projections (Qwen2).
      qk_norm: RMSNorm over head_dim on each q and k head before RoPE (Qwen3).
      rope_scaling: () for none; ("linear", factor), ("llama3", factor, low_freq_factor,
        high_freq_factor, original_max_position_embeddings) or ("yarn", factor, beta_fast, beta_slow,
        original_max_position_embeddings, attention_factor, truncate (1.0 or 0.0)) as in
        transformers' rope_scaling (YaRN, gpt-oss: cos and sin are multiplied by attention_factor).
      mlp_activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
      norm_weight_offset: RMSNorm multiplies by (offset + weight); Gemma stores weight - 1 (1.0).
      embed_scale: the token embedding is multiplied by this (Gemma: sqrt(d_model), rounded to
        the parameter dtype as transformers does).
      post_norms: RMSNorm on the attention and MLP outputs before each residual add (Gemma-2).
      attn_scale: softmax scale; None means head_dim ** -0.5 (Gemma-2: query_pre_attn_scalar ** -0.5).
      attn_soft_cap: attention logits become cap * tanh(logits / cap) (Gemma-2).
      final_soft_cap: the same on the output logits (Gemma-2).
      sliding_window: window of the layers in sliding_window_layers: a token attends to the
        last `sliding_window` positions including its own.
      sliding_window_layers: indices of the layers that use sliding_window (Gemma-2: even layers;
        Mistral: all).

    Mixture of experts (Mixtral, Qwen3-MoE; models.moe): with num_experts > 0 every layer's MLP is
    num_experts SwiGLU experts of width ffn_dim and a linear router; each token goes through the
    experts_per_token experts of highest router probability (softmax over all experts), weighted
    by those probabilities, renormalized to sum to 1 when norm_topk_prob (Mixtral's "softmax over
    the chosen logits" is exactly that).
      num_experts: experts per layer (0: a dense MLP).
      experts_per_token: experts each token is routed to (k of top-k).
      norm_topk_prob: renormalize the chosen probabilities.

    gpt-oss (transformers' GptOss):
      o_bias: a bias on the attention output projection (with qkv_bias: biases on q/k/v/o).
      attn_sinks: a learned logit per q head per layer joins every attention softmax (`sinks`).
      router_bias: the router has a bias [E].
      expert_bias: the experts' gate/up/down projections have biases.
      swiglu_clamp: () for the plain SwiGLU experts silu(g) * u, or (alpha, limit) for gpt-oss's
        g = min(g, limit), u = clip(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
      expert_format: "float" (the experts' weights in the parameter dtype) or "mxfp4" (gpt-oss's
        released checkpoints: FP4 e2m1 codes in blocks of 32 along the `in` axis, each block with a
        power-of-two scale; models.moe.dequantize_mxfp4, inside the expert matmuls).
    """
    family: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple = ()
    mlp_activation: str = "silu"
    norm_weight_offset: float = 0.0
    embed_scale: float = 1.0
    post_norms: bool = False
    attn_scale: float | None = None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    sliding_window: int | None = None
    sliding_window_layers: tuple = ()
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True
    o_bias: bool = False
    attn_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_clamp: tuple = ()
    expert_format: str = "float"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {FAMILIES}; got {self.family!r}")
        for name in ("vocab_size", "d_model", "num_layers", "num_q_heads", "num_kv_heads",
                     "head_dim", "ffn_dim", "max_seq_len"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"ModelConfig.{name} must be an int >= 1; got {val!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_q_heads ({self.num_q_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.family == "gpt2" and self.num_q_heads != self.num_kv_heads:
            raise ValueError(f"ModelConfig: gpt2 is multi-head attention, so num_kv_heads must equal "
                             f"num_q_heads ({self.num_q_heads}); got {self.num_kv_heads}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE (llama); got {self.head_dim}")
        for name in ("rope_base", "norm_eps"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or not val > 0:
                raise ValueError(f"ModelConfig.{name} must be a number > 0; got {val!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool; got {self.tie_embeddings!r}")
        for name in ("bos_token_id", "eos_token_id"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < self.vocab_size:
                raise ValueError(f"ModelConfig.{name} must be an int in [0, vocab_size = "
                                 f"{self.vocab_size}); got {val!r}")
        self._check_variants()

    def _check_variants(self):
        for name in ("qkv_bias", "qk_norm", "post_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool; got {getattr(self, name)!r}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ModelConfig.mlp_activation must be one of {MLP_ACTIVATIONS}; got "
                             f"{self.mlp_activation!r}")
        rs = self.rope_scaling
        if not isinstance(rs, tuple) or (rs and (rs[0] not in ROPE_SCALINGS
                                                 or len(rs) != 1 + ROPE_SCALINGS[rs[0]])):
            raise ValueError(f"ModelConfig.rope_scaling must be (), ('linear', factor), ('llama3', factor, "
                             f"low_freq_factor, high_freq_factor, original_max_position_embeddings) or "
                             f"('yarn', factor, beta_fast, beta_slow, original_max_position_embeddings, "
                             f"attention_factor, truncate); "
                             f"got {rs!r}")
        if rs and not all(_is_number(x) and (x > 0 or (rs[0] == "yarn" and i == 5 and x == 0))
                          for i, x in enumerate(rs[1:])):
            raise ValueError(f"ModelConfig.rope_scaling's parameters must be numbers > 0; got {rs!r}")
        if rs and rs[0] == "llama3" and not rs[3] > rs[2]:
            raise ValueError(f"ModelConfig.rope_scaling: llama3 needs high_freq_factor > low_freq_factor; "
                             f"got {rs!r}")
        for name in ("norm_weight_offset", "embed_scale"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"ModelConfig.{name} must be a number; got {getattr(self, name)!r}")
        if not self.embed_scale > 0:
            raise ValueError(f"ModelConfig.embed_scale must be > 0; got {self.embed_scale!r}")
        for name in ("attn_scale", "attn_soft_cap", "final_soft_cap"):
            val = getattr(self, name)
            if val is not None and not (_is_number(val) and val > 0):
                raise ValueError(f"ModelConfig.{name} must be a number > 0 or None; got {val!r}")
        w, layers = self.sliding_window, self.sliding_window_layers
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"ModelConfig.sliding_window must be an int >= 1 or None; got {w!r}")
        if not isinstance(layers, tuple) or any(
                not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"ModelConfig.sliding_window_layers must be a tuple of layer indices in "
                             f"[0, num_layers = {self.num_layers}); got {layers!r}")
        if bool(layers) != (w is not None):
            raise ValueError(f"ModelConfig.sliding_window ({w!r}) and sliding_window_layers ({layers!r}) "
                             f"must be set together")
        e, k = self.num_experts, self.experts_per_token
        for name, val in (("num_experts", e), ("experts_per_token", k)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"ModelConfig.{name} must be an int >= 0; got {val!r}")
        if (e > 0) != (k > 0) or k > e:
            raise ValueError(f"ModelConfig.experts_per_token must be in [1, num_experts = {e}] for a mixture "
                             f"of experts and 0 without one; got {k!r}")
        for name in ("norm_topk_prob", "o_bias", "attn_sinks", "router_bias", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool; got {getattr(self, name)!r}")
        sc = self.swiglu_clamp
        if not isinstance(sc, tuple) or (sc and (len(sc) != 2 or not all(_is_number(x) and x > 0 for x in sc))):
            raise ValueError(f"ModelConfig.swiglu_clamp must be () or (alpha, limit), numbers > 0; got {sc!r}")
        if not e and (self.router_bias or self.expert_bias or sc or self.expert_format != "float"):
            raise ValueError("ModelConfig: router_bias, expert_bias, swiglu_clamp and expert_format are "
                             "mixture-of-experts options (num_experts > 0)")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"ModelConfig.expert_format must be one of {EXPERT_FORMATS}; got {self.expert_format!r}")
        if self.expert_format == "mxfp4" and (self.d_model % 32 or self.ffn_dim % 32):
            raise ValueError(f"ModelConfig: expert_format 'mxfp4' needs d_model ({self.d_model}) and ffn_dim "
                             f"({self.ffn_dim}) to be multiples of its 32-value blocks")
        if self.family == "gpt2":
            changed = [f.name for f in dataclasses.fields(self) if f.name in _VARIANT_FIELDS
                       and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"ModelConfig: {changed} are llama-family options; gpt2 must leave them "
                                 f"at their defaults")

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        return self.sliding_window if layer in self.sliding_window_layers else None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_VARIANT_FIELDS = ("qkv_bias", "qk_norm", "rope_scaling", "mlp_activation", "norm_weight_offset",
                   "embed_scale", "post_norms", "attn_scale", "attn_soft_cap", "final_soft_cap",
                   "sliding_window", "sliding_window_layers", "num_experts", "experts_per_token",
                   "norm_topk_prob", "o_bias", "attn_sinks", "router_bias", "expert_bias", "swiglu_clamp",
                   "expert_format")


# The tiny presets are random-init models for tests and demos. Their vocabulary of 512 holds the
# byte tokenizer's 256 bytes and its special tokens; bos/eos follow models.tokenizer.ByteTokenizer.
PRESETS = {
    "tiny-gpt2": ModelConfig(
        family="gpt2", vocab_size=512, d_model=64, num_layers=2, num_q_heads=4, num_kv_heads=4,
        head_dim=16, ffn_dim=256, max_seq_len=512, norm_eps=1e-5, tie_embeddings=False,
        bos_token_id=256, eos_token_id=257),
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=512, d_model=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
        head_dim=16, ffn_dim=192, max_seq_len=2048, rope_base=10000.0, norm_eps=1e-5,
        tie_embeddings=True, bos_token_id=256, eos_token_id=257),
    "smollm2-135m": ModelConfig(
        family="llama", vocab_size=49152, d_model=576, num_layers=30, num_q_heads=9, num_kv_heads=3,
        head_dim=64, ffn_dim=1536, max_seq_len=8192, rope_base=100000.0, norm_eps=1e-5,
        tie_embeddings=True, bos_token_id=1, eos_token_id=2),
}
