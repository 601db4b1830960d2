"""What the engine needs from a model: a small protocol, so `jpa.engine` never imports `models`.

Any object with these attributes can be served; `models.GPTForEngine(gpt)` adapts the project's
Flax GPT. The engine traces `ragged` and `decode` into its one compiled step with `params` passed
as an argument (not closed over, so weights are not baked into the executable as constants) and
the cache donated.
"""

from typing import Any, Protocol, runtime_checkable

from jpa.kv.spec import CacheSpec

SIZE_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size", "max_seq_len")


@runtime_checkable
class ModelSizes(Protocol):
    """The sizes the engine reads off a model's config (all ints >= 1)."""
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int      # longest sequence (prompt + completion) the model is meant for


@runtime_checkable
class EngineModel(Protocol):
    """A decoder the engine can run over its paged KV cache.

    Attributes:
      config: a ModelSizes.
      dtype: dtype of the parameters; the KV cache defaults to it.
      params: the parameter pytree handed to ragged/decode.

    Both functions must be pure and traceable under `jax.jit` (the engine traces them once, into
    its unified step), read and write `cache` (a `jpa.KVCache` of `config.num_layers` layers) and return
    (logits, cache).

    Optional, for `EngineConfig(tensor_parallel=N)`: `shard(mesh) -> EngineModel`, the model on
    a `jax.sharding.Mesh` with a "tp" axis: params placed on it, attention run per device on its
    kv heads (`jpa.core.sharding.head_parallel`), and `config.num_kv_heads` the head count the pool
    must hold (a multiple of N). The engine shards the pool on that head axis and replicates
    everything else. `models.GPTForEngine` has it.

    Optional: `cache_spec() -> jpa.kv.spec.CacheSpec`, the cache the model's layers keep, per group of
    layers (full attention, sliding window, latent, recurrent state). The engine sizes and reports the
    pool from it (`cache_spec_of`); without it a model is one group of full attention over
    `config.num_layers` layers of `config.num_kv_heads` x `config.head_dim`. `models.GPTForEngine` has it.

    Recurrent state (a spec with a `RecurrentState` group, `CacheSpec.has_recurrent`; `jpa.engine.states`):
    the pool holds the paged groups' layers only (pool layer j = model layer `spec.paged_layers()[j]`), and the
    engine allocates `spec.init_states(max_seqs)` = {group: {state: [group layers, max_seqs, *shape]}} (slot s =
    the engine's sequence slot). It then calls ragged / ragged_hidden / decode with two more keyword arguments,
    `states` and `state_slots` (i32[entries]: ragged, one per sequence entry b like cu_q_lens[1:]; decode, one
    per row; -1 = padding, neither read nor written), and gets `(out, cache, states)` back. The model
    implements the reset rule: an entry whose first row is at position 0 (decode: seq_lens == 1) starts from
    zero states, else from `states[...][:, slot]`; an entry with no rows leaves its slot as it is; after the
    call the slot holds the state after the entry's last row. A prompt cut into chunks anywhere must give the
    same result as one piece. Without a recurrent group the three are called as above.

    Optional, for `SamplingParams.prompt_logprobs` (and the server's `echo`): the pair
    `ragged_hidden(params, cache, <ragged's arguments>) -> (hidden f32[T, d_model], cache)`, the
    final hidden row of EVERY token row, and `head(params, hidden f32[..., d_model]) -> f32[...,
    vocab]`, so that `head(hidden[last rows])` is what `ragged` returns. With the pair the engine
    runs the ragged step through it (the head over the last rows, as `ragged` does) and takes the
    head over prompt rows only in rounds where a request asks for prompt logprobs. A model without
    it serves everything else; a request for prompt logprobs then fails with an error naming the
    pair. `models.GPTForEngine` has it.

    Optional, for `EngineConfig(enable_lora=True)` (`jpa.engine.lora`): the pair `lora_slots(max_loras,
    max_lora_rank)` -> the device's stacked adapter slots (a pytree of arrays with a leading max_loras axis,
    all empty) and `read_lora(path, max_lora_rank)` -> one adapter's host arrays (that pytree without the
    leading axis; ValueError for an adapter it cannot serve), and a keyword `lora=(slots, index)` on
    `decode`, `ragged` and `ragged_hidden`: index i32[num_seqs] / i32[num_tokens] each row's slot (-1: no
    adapter). The engine passes `lora=` only when LoRA is on. `models.GPTForEngine` has them.

    Optional, for `LLMEngine.update_weights`: `complete_params(params) -> params`, the new weights with
    those the model derives from others made from them (GPTForEngine's dense head on a CPU: the copy of
    the new tied table); the engine calls it before swapping the weights in.
    """
    config: ModelSizes
    dtype: Any
    params: Any

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto"):
        """One new token per sequence: write its K/V first, then attend over seq_lens tokens.

        Args:
          params: the parameter pytree.
          cache: jpa.KVCache.
          tokens: i32[num_seqs]; the new token of each sequence.
          seq_lens: i32[num_seqs]; tokens in the cache including the new one (0 = idle slot).
          slot_mapping: i32[num_seqs]; cache slot of the new token (-1 = idle slot).
          block_tables: i32[num_seqs, pages_per_seq].
          impl: the `jpa.paged_decode` implementation to use ("auto", "xla", "triton", "mosaic").

        Returns:
          (f32[num_seqs, vocab_size] logits, the updated cache).
        """

    def ragged(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs,
               *, impl="auto"):
        """A ragged batch: prefill chunks and decode tokens back to back (the unified step).

        Write every row's K/V at its slot first, then attend as `jpa.ragged_paged_attention` does.

        Args:
          params: the parameter pytree.
          cache: jpa.KVCache.
          tokens: i32[num_tokens]; rows of sequence i are cu_q_lens[i]:cu_q_lens[i + 1].
          positions: i32[num_tokens]; each row's position in its sequence.
          slot_mapping: i32[num_tokens]; cache slot of each row (-1 = padding).
          block_tables: i32[max_num_seqs, pages_per_seq].
          seq_lens: i32[max_num_seqs]; tokens cached per sequence after this call's writes.
          cu_q_lens: i32[max_num_seqs + 1].
          num_seqs: i32[]; live sequences (rows past cu_q_lens[num_seqs] are padding).
          impl: the `jpa.ragged_paged_attention` implementation.

        Returns:
          (f32[max_num_seqs, vocab_size] logits at each sequence's last row, the updated cache).
        """

def cache_spec_of(model) -> CacheSpec:
    """The model's declared `cache_spec()`, or one full-attention group over its config's layers. Raises
    ValueError when the declared spec's layers do not match `config.num_layers`."""
    c = model.config
    declare = getattr(model, "cache_spec", None)
    if not callable(declare):
        return CacheSpec.attention(c.num_layers, c.num_kv_heads, c.head_dim)
    spec = declare()
    if not isinstance(spec, CacheSpec):
        raise ValueError(f"{type(model).__name__}.cache_spec() must return a jpa.kv.spec.CacheSpec; got "
                         f"{type(spec).__name__}")
    if spec.num_layers != c.num_layers:
        raise ValueError(f"{type(model).__name__}.cache_spec() covers {spec.num_layers} layers; the model's config "
                         f"has num_layers = {c.num_layers}")
    return spec


def has_hidden(model) -> bool:
    """True when `model` has EngineModel's optional ragged_hidden/head pair (prompt logprobs)."""
    return callable(getattr(model, "ragged_hidden", None)) and callable(getattr(model, "head", None))


def check_model(model) -> None:
    """Raises TypeError naming what `model` lacks to satisfy EngineModel."""
    missing = [a for a in ("config", "dtype", "params") if not hasattr(model, a)]
    missing += [f"{a}()" for a in ("ragged", "decode") if not callable(getattr(model, a, None))]
    config = getattr(model, "config", None)
    if config is not None:
        for name in SIZE_FIELDS:
            v = getattr(config, name, None)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                missing.append(f"config.{name} (an int >= 1; got {v!r})")
    if missing:
        raise TypeError(f"model must satisfy jpa.engine.EngineModel (wrap a models.GPT with "
                        f"models.GPTForEngine(gpt)); {type(model).__name__} lacks: {', '.join(missing)}")
