"""Model configuration: one frozen, hashable dataclass for both decoder families, and named presets."""

import dataclasses

FAMILIES = ("gpt2", "llama")


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

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads


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
