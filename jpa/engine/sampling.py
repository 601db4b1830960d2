"""Sampling parameters (host) and the on-device sampler used inside the jitted decode loop.

Every request samples with its own key, derived from its seed and the index of the token being
sampled: `fold_in(key(seed), num_generated)`. A request's output therefore does not depend on
which other requests share its batch, on its slot, or on preemption and recompute.
"""

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
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
    n: int = 1

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
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an int >= 1; got {self.n!r}")
        if self.seed + self.n - 1 >= 2 ** 31:
            raise ValueError(f"seed + n - 1 must be < 2**31 (sample i uses seed + i); got seed {self.seed}, n {self.n}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings; got {self.stop!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def _column(dtype, pad):
    """A SlotParams field: its dtype and the value of a padding (unused) row."""
    return flax.struct.field(metadata={"dtype": dtype, "pad": pad})


@flax.struct.dataclass
class SlotParams:
    """Per-slot sampling and stopping parameters as columns (each array [n]): the one schema the
    scheduler's plan fills (`from_rows`), the runner keeps per slot (`Slots.params`) and the
    sampler reads (`sample_slots`). A new per-request control is one field here plus its value
    in `row`."""
    temperature: jax.Array = _column(np.float32, 0.0)   # f32: 0 = greedy
    top_k: jax.Array = _column(np.int32, 0)             # i32: 0 = off
    top_p: jax.Array = _column(np.float32, 1.0)         # f32: 1 = off
    seed: jax.Array = _column(np.int32, 0)              # i32
    max_new: jax.Array = _column(np.int32, 0)           # i32: the request's max_new_tokens
    max_len: jax.Array = _column(np.int32, 0)           # i32: longest sequence (prompt + generated) it may reach
    ignore_eos: jax.Array = _column(np.bool_, False)    # bool

    @staticmethod
    def row(params: SamplingParams, max_len: int) -> dict:
        """One request's values (a dict of the fields)."""
        return dict(temperature=0.0 if params.is_greedy else float(params.temperature), top_k=params.top_k,
                    top_p=float(params.top_p), seed=params.seed, max_new=params.max_new_tokens, max_len=max_len,
                    ignore_eos=params.ignore_eos)

    @classmethod
    def from_rows(cls, rows, n: int) -> "SlotParams":
        """Host (numpy) columns of n rows: rows[i] (a `row` dict) or padding where rows[i] is None."""
        cols = {}
        for f in dataclasses.fields(cls):
            col = np.full((n,), f.metadata["pad"], f.metadata["dtype"])
            for i, r in enumerate(rows):
                if r is not None:
                    col[i] = r[f.name]
            cols[f.name] = col
        return cls(**cols)

    @classmethod
    def empty(cls, n: int) -> "SlotParams":
        """Device columns of n padding rows."""
        return jax.tree_util.tree_map(jnp.asarray, cls.from_rows((), n))


def _order_key(x):
    """f32 -> u32 keys with the same order (IEEE trick: flip negatives, set the sign bit of positives)."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _bisect(pred, num_rows):
    """Per row, the smallest u32 t with pred(t) True; pred must be monotone (False..., True...)."""
    def step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo = jnp.zeros((num_rows,), jnp.uint32)
    hi = jnp.full((num_rows,), 0xFFFFFFFF, jnp.uint32)
    return lax.fori_loop(0, 32, step, (lo, hi))[1]


def sample_slots(logits, params: SlotParams, counters):
    """`sample_with_logprobs` with each row's parameters from SlotParams columns."""
    return sample_with_logprobs(logits, params.temperature, params.top_k, params.top_p, params.seed, counters)


def sample(logits, temperature, top_k, top_p, seeds, counters):
    """Picks one token per row (`sample_with_logprobs` without the log-probabilities)."""
    return sample_with_logprobs(logits, temperature, top_k, top_p, seeds, counters)[0]


def sample_with_logprobs(logits, temperature, top_k, top_p, seeds, counters):
    """Picks one token per row and returns its log-probability.

    The log-probability is taken under the distribution the token was drawn from:
    softmax(logits / temperature) restricted by top-k/top-p. A greedy row has no such
    distribution (it is a point mass), so its token's log-probability is the model's own,
    log_softmax(logits) (temperature 1, no filter), as OpenAI and vLLM report for greedy decoding.

    Args:
      logits: f32[num_seqs, vocab].
      temperature: f32[num_seqs]; 0 = greedy.
      top_k: i32[num_seqs]; 0 = off.
      top_p: f32[num_seqs]; 1 = off.
      seeds: i32[num_seqs] per-request seeds.
      counters: i32[num_seqs] index of the token being sampled within its request.

    Returns:
      (i32[num_seqs] token ids, f32[num_seqs] their log-probabilities).
    """
    logits = logits.astype(jnp.float32)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def filtered(x):
        # Both filters are thresholds found by bisection on order-preserving integer keys of the
        # values (32 exact steps, O(vocab) each), not a sort of the vocabulary: on a CPU a
        # per-row sort of 49k logits costs more than the whole model step.
        key = _order_key(x)  # u32[B, V]
        # top-k: keep values >= the k-th largest (ties with it are kept too).
        t_k = _bisect(lambda t: jnp.sum(key >= t[:, None], axis=-1) < top_k, x.shape[0])
        t_k = jnp.where(t_k > 0, t_k - 1, 0)  # top_k >= vocab keeps everything (no wrap-around)
        keep = jnp.where(top_k[:, None] > 0, key >= t_k[:, None], True)
        probs = jax.nn.softmax(jnp.where(keep, x, -jnp.inf), axis=-1)
        # top-p: keep a token when the mass of the tokens above it is < top_p (the smallest set
        # of top tokens reaching top_p; the most likely token always stays).
        pkey = _order_key(probs)
        t_p = _bisect(lambda t: jnp.sum(jnp.where(pkey > t[:, None], probs, 0.0), axis=-1) < top_p,
                      x.shape[0])
        keep = keep & jnp.where(top_p[:, None] < 1.0, pkey >= t_p[:, None], True)
        return jnp.where(keep, x, -jnp.inf)

    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = lax.cond(needs_filter, filtered, lambda x: x, scaled)

    def draw(x):
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
        return jax.vmap(lambda k, r: jax.random.categorical(k, r))(keys, x).astype(jnp.int32)

    # Drawing noise for a whole vocabulary costs as much as the LM head on a CPU: skip it when
    # every row is greedy.
    drawn = lax.cond(jnp.any(temperature > 0), draw, lambda x: greedy_tok, scaled)
    tok = jnp.where(temperature > 0, drawn, greedy_tok)  # i32[B]
    dist = jnp.where((temperature > 0)[:, None], scaled, logits)  # f32[B, V]; -inf = filtered out
    picked = jnp.take_along_axis(dist, tok[:, None], axis=-1)[:, 0]
    return tok, picked - jax.nn.logsumexp(dist, axis=-1)
