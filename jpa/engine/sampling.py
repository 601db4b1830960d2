"""Sampling parameters (host) and the on-device sampler used inside the jitted decode loop.

Every request samples with its own key, derived from its seed and the index of the token being
sampled: `fold_in(key(seed), num_generated)`. A request's output therefore does not depend on
which other requests share its batch, on its slot, or on preemption and recompute.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 (or greedy=True) means greedy. top_k 0 and top_p 1.0 disable those filters.
    Stop strings are matched on the decoded text; the completion is cut before the stop string.
    """
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    greedy: bool = False
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off); got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off); got {self.top_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 31:
            raise ValueError(f"seed must be an int in [0, 2**31); got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings; got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def sample(logits, temperature, top_k, top_p, seeds, counters):
    """Picks one token per row.

    Args:
      logits: f32[num_seqs, vocab].
      temperature: f32[num_seqs]; 0 = greedy.
      top_k: i32[num_seqs]; 0 = off.
      top_p: f32[num_seqs]; 1 = off.
      seeds: i32[num_seqs] per-request seeds.
      counters: i32[num_seqs] index of the token being sampled within its request.

    Returns:
      i32[num_seqs] token ids.
    """
    logits = logits.astype(jnp.float32)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def filtered(x):
        # One descending sort serves both filters; skipped entirely when no row asks for them.
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        rank = jnp.arange(vocab)[None, :]
        keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
        probs = jax.nn.softmax(jnp.where(keep, sorted_x, -jnp.inf), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep & (before < top_p[:, None])
        sorted_x = jnp.where(keep, sorted_x, -jnp.inf)
        return jnp.full_like(x, -jnp.inf).at[jnp.arange(x.shape[0])[:, None], order].set(sorted_x)

    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = lax.cond(needs_filter, filtered, lambda x: x, scaled)

    def draw(x):
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
        return jax.vmap(lambda k, r: jax.random.categorical(k, r))(keys, x).astype(jnp.int32)

    # Drawing noise for a whole vocabulary costs as much as the LM head on a CPU: skip it when
    # every row is greedy.
    drawn = lax.cond(jnp.any(temperature > 0), draw, lambda x: greedy_tok, scaled)
    return jnp.where(temperature > 0, drawn, greedy_tok)
