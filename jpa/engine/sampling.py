"""Sampling parameters (host) and the on-device sampler used inside the jitted decode loop.

Every request samples with its own key, derived from its seed and the index of the token being
sampled: `fold_in(key(seed), num_generated)`. A request's output therefore does not depend on
which other requests share its batch, on its slot, or on preemption and recompute.

Compiled for a GPU, `sample_with_logprobs` is `_sample_candidates`: the same tokens and
log-probabilities in two passes over the [rows, vocab] logits (thresholds from each row's 4096
candidates, a whole-row search only for rows they cannot serve); the CPU program is the dense
formulation (tests/test_sampling_controls.py forces the GPU one on the CPU and compares).
"""

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa.engine.structured import StructuredOutputs
from jpa.ops.dispatch import current_target

# Far above any useful temperature, far below float32's range: logits / temperature stay finite and a
# grammar mask (-inf) survives the division (1e38, and past float32's max, broke sampling).
MAX_TEMPERATURE = 100.0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 (or greedy=True) means greedy. top_k 0, top_p 1.0 and min_p 0 disable those
    filters. Stop strings are matched on the decoded text; the completion is cut before the stop
    string. The logit controls follow vLLM's sampling parameters and run on the device, in the
    order penalties -> logit_bias -> min_tokens -> temperature -> top-k/top-p/min-p:
    - repetition_penalty (> 0, 1 = off): logits of tokens in the prompt or the output so far are
      divided by it where positive and multiplied where negative;
    - presence_penalty, frequency_penalty (in [-2, 2], 0 = off): subtract penalty x (token was
      generated) and penalty x (times it was generated), over the output so far;
    - logit_bias: {token id: bias in [-100, 100]}, at most 300 entries, added to the logits;
    - min_tokens: the stop tokens (EOS and stop_token_ids) cannot be drawn before this many tokens;
    - stop_token_ids: more token ids that finish the request (finish_reason "stop"; like EOS the
      token is kept in token_ids and left out of the text), even with ignore_eos.
    top_logprobs (<= 20): with each output token, the most likely tokens and log-probabilities of
    the distribution its own log-probability is taken under (see `sample_with_logprobs`).
    prompt_logprobs (None = off, else k in [0, 20]): for each prompt token after the first, its
    log-probability given the tokens before it, its rank, and the k most likely tokens there
    (`RequestOutput.prompt_logprobs`), from the model's raw distribution (vLLM's; no temperature
    or controls). Computed on the device in the ragged pass, only in rounds that need it; such a
    request does not read the prefix cache (cached prompt tokens have no logits; as vLLM v1).
    Text (vLLM's detokenization options):
    - include_stop_str_in_output: a stop string that ends the request stays in the text (and, as
      in vLLM, so does a final stop token's text: EOS or a stop_token_id);
    - skip_special_tokens (default True): False keeps special tokens (e.g. "<|im_end|>") in the text;
    - spaces_between_special_tokens: accepted for vLLM compatibility; the project's tokenizers
      (Hugging Face `tokenizers`, byte-level) decode special tokens without added spaces either
      way, as vLLM does with a fast tokenizer.
    structured (None = off): a `jpa.engine.structured.StructuredOutputs` (or a dict of its fields):
    the output must match a JSON schema, a regex, a choice or a grammar. The grammar's mask applies
    after the logit controls and before temperature and the filters; logprobs are under the masked
    distribution (see `jpa.engine.structured`).
    vLLM's names are accepted too: `max_tokens` for max_new_tokens and `logprobs` for top_logprobs
    (given alone, or equal to jpa's); they are folded into jpa's fields, which hold the value.
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple = ()            # ((token id, bias), ...); a dict is accepted and sorted
    min_tokens: int = 0
    stop_token_ids: tuple = ()
    top_logprobs: int = 0             # also return this many most likely tokens per output token
    prompt_logprobs: int | None = None  # None = off; k: the prompt tokens' logprobs and k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: StructuredOutputs | None = None
    max_tokens: int | None = None     # vLLM's name of max_new_tokens (folded into it; reads None)
    logprobs: int | None = None       # vLLM's name of top_logprobs (folded into it; reads None)

    def __post_init__(self):
        for alias, name, default in (("max_tokens", "max_new_tokens", 64), ("logprobs", "top_logprobs", 0)):
            given, own = getattr(self, alias), getattr(self, name)
            if given is not None:
                if own != default and own != given:
                    raise ValueError(f"{alias} ({given!r}) and {name} ({own!r}) name the same value; give one")
                object.__setattr__(self, name, given)
            object.__setattr__(self, alias, None)  # folded: one field holds the value (replace() stays safe)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a finite number >= 0 and <= {MAX_TEMPERATURE:g}; got "
                             f"{self.temperature!r}")
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
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        if not (num(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off); got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (num(v) and -2 <= v <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off); got {v!r}")
        if not (num(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off); got {self.min_p!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t) if isinstance(t, str) and t.strip().isdigit() else t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to biases; got {self.logit_bias!r}") from None
        if len(bias) > MAX_LOGIT_BIAS or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or
                                             not num(b) or not -100 <= b <= 100 for t, b in bias):
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids (ints >= 0) to biases in "
                             f"[-100, 100]; got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", bias)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not (
                0 <= self.min_tokens <= self.max_new_tokens):
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens = {self.max_new_tokens}]; "
                             f"got {self.min_tokens!r}")
        ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else tuple(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids (ints >= 0); "
                             f"got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or not (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}]; got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None (off) or an int in [0, {MAX_TOP_LOGPROBS}]; "
                             f"got {self.prompt_logprobs!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool; got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings; got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "structured", StructuredOutputs.of(self.structured))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def token_ids_used(self) -> tuple:
        """Token ids the parameters name (logit_bias, stop_token_ids): the engine checks them
        against the vocabulary."""
        return tuple(t for t, _ in self.logit_bias) + self.stop_token_ids


MAX_LOGIT_BIAS = 300      # entries of logit_bias (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 8    # stop_token_ids per request (a fixed width on the device)
MAX_TOP_LOGPROBS = 20     # top_logprobs per token (OpenAI's limit)


def _column(dtype, pad, width=None):
    """A SlotParams field: its dtype, the value of a padding (unused) row, and the width of a 2-D
    column ([n, width]; None: [n])."""
    return flax.struct.field(metadata={"dtype": dtype, "pad": pad, "width": width})


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
    min_p: jax.Array = _column(np.float32, 0.0)         # f32: 0 = off
    repetition_penalty: jax.Array = _column(np.float32, 1.0)  # f32: 1 = off
    presence_penalty: jax.Array = _column(np.float32, 0.0)    # f32: 0 = off
    frequency_penalty: jax.Array = _column(np.float32, 0.0)   # f32: 0 = off
    min_tokens: jax.Array = _column(np.int32, 0)        # i32: stop tokens barred before this many tokens
    prompt_len: jax.Array = _column(np.int32, 0)        # i32: the request's prompt tokens (its history
                                                        #   splits there into prompt and output)
    bias_ids: jax.Array = _column(np.int32, -1, MAX_LOGIT_BIAS)         # i32[n, 300]: -1 = none
    bias_values: jax.Array = _column(np.float32, 0.0, MAX_LOGIT_BIAS)   # f32[n, 300]
    stop_token_ids: jax.Array = _column(np.int32, -1, MAX_STOP_TOKEN_IDS)  # i32[n, 8]: -1 = none
    top_logprobs: jax.Array = _column(np.int32, 0)      # i32: top tokens wanted per output token
    constrained: jax.Array = _column(np.bool_, False)   # bool: structured outputs (samples only in the
                                                        #   ragged step, under the host's grammar mask)
    lora: jax.Array = _column(np.int32, -1)             # i32: the slot's LoRA adapter slot (jpa.engine.lora);
                                                        #   -1 = the base model

    @staticmethod
    def row(params: SamplingParams, max_len: int, prompt_len: int = 0, lora: int = -1) -> dict:
        """One request's values (a dict of the fields); lora: its adapter's device slot (-1: none)."""
        bias = params.logit_bias
        return dict(temperature=0.0 if params.is_greedy else float(params.temperature), top_k=params.top_k,
                    top_p=float(params.top_p), seed=params.seed, max_new=params.max_new_tokens, max_len=max_len,
                    ignore_eos=params.ignore_eos, min_p=float(params.min_p),
                    repetition_penalty=float(params.repetition_penalty),
                    presence_penalty=float(params.presence_penalty),
                    frequency_penalty=float(params.frequency_penalty), min_tokens=params.min_tokens,
                    prompt_len=prompt_len, bias_ids=[t for t, _ in bias], bias_values=[float(b) for _, b in bias],
                    stop_token_ids=list(params.stop_token_ids), top_logprobs=params.top_logprobs,
                    constrained=params.structured is not None, lora=lora)

    @classmethod
    def from_rows(cls, rows, n: int) -> "SlotParams":
        """Host (numpy) columns of n rows: rows[i] (a `row` dict) or padding where rows[i] is None."""
        cols = {}
        for f in dataclasses.fields(cls):
            width = f.metadata["width"]
            col = np.full((n,) if width is None else (n, width), f.metadata["pad"], f.metadata["dtype"])
            for i, r in enumerate(rows):
                if r is not None:
                    if width is None:
                        col[i] = r[f.name]
                    else:
                        col[i, : len(r[f.name])] = r[f.name]
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


def _key_compare(p, t, op):
    """`op(_order_key(p), t)` (op: jnp.greater or jnp.greater_equal) for p in [+0, 1] (a
    probability; never -0 or NaN), on the floats: key(p) is 2**31 + bits(p), so it holds exactly
    when t < 2**31 or op(p, the float whose bits are t - 2**31) (a NaN there, past 1: false both
    ways). Exact unless p or that float is subnormal where XLA flushes subnormals to zero (a
    softmax's outputs are flushed there too). Broadcasts p f32 against t u32."""
    thr = lax.bitcast_convert_type(t - jnp.uint32(0x80000000), jnp.float32)
    return (t < jnp.uint32(0x80000000)) | op(p, thr)


def _bisect(pred, num_rows, ways: int = 2):
    """Per row, the smallest u32 t with pred(t) True (0xFFFFFFFF when none is); pred must be
    monotone (False..., True...).

    ways=2: a binary search, 32 steps of pred(t) over t u32[num_rows] -> bool[num_rows].
    ways=2**b (b in 2, 4, 8): a search of 32 / b steps, each asking pred at ways - 1 thresholds per
    row at once, t u32[num_rows, ways - 1] -> bool[num_rows, ways - 1] (one read of the data for
    them all: a quarter of the passes at 16). Both find the same t.
    """
    if ways == 2:
        def step(_, lohi):
            lo, hi = lohi
            mid = lo + (hi - lo) // 2
            ok = pred(mid)
            return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

        lo = jnp.zeros((num_rows,), jnp.uint32)
        hi = jnp.full((num_rows,), 0xFFFFFFFF, jnp.uint32)
        return lax.fori_loop(0, 32, step, (lo, hi))[1]
    bits = {4: 2, 16: 4, 256: 8}.get(ways)
    if bits is None:
        raise ValueError(f"ways must be 2, 4, 16 or 256; got {ways}")
    j = jnp.arange(1, ways, dtype=jnp.uint32)[None, :]

    def step(i, base):
        # The answer lies in [base, base + 2**width - 1] and pred holds at that range's top (or
        # holds nowhere). Ask pred at the top of each of its first ways - 1 sub-ranges of
        # 2**(width - bits); the first where it holds (else the last sub-range) is the next range.
        shift = (32 - bits * (i + 1)).astype(jnp.uint32)
        tops = base[:, None] + (j << shift) - jnp.uint32(1)
        ok = pred(tops)
        first = jnp.sum(~ok, axis=-1, dtype=jnp.uint32)   # monotone: the False ones come first
        return base + (first << shift)

    return lax.fori_loop(0, 32 // bits, step, jnp.zeros((num_rows,), jnp.uint32))


# Thresholds asked per pass over the logits by the top-k / top-p search on a GPU (`_bisect`'s
# ways): 8 passes over the [rows, vocab] keys instead of 32. On a GPU the search is memory-bound (a
# pass reads the keys once for all 15 thresholds); on a CPU it is compute-bound and stays binary.
GPU_SEARCH_WAYS = 16


def search_ways() -> int:
    """`_bisect`'s ways for the device the sampler is compiled for: GPU_SEARCH_WAYS on a GPU, 2
    elsewhere (the CPU program is the binary search)."""
    return GPU_SEARCH_WAYS if current_target().platform == "gpu" else 2


def controls_active(params: SlotParams):
    """bool[]: some row uses a logit control (penalties, logit_bias, min_tokens)."""
    return jnp.any((params.repetition_penalty != 1) | (params.presence_penalty != 0) | (params.frequency_penalty != 0)
                   | (params.min_tokens > 0) | jnp.any(params.bias_ids >= 0, axis=-1))


def apply_controls(logits, params: SlotParams, history, num_cached, counters, stop_ids, sparse=None):
    """The logit controls of SamplingParams, before temperature and the filters (vLLM's order).

    Args:
      logits: f32[n, vocab].
      params: SlotParams [n].
      history: i32[n, L]; the row's tokens by position (prompt, then output); positions >=
        num_cached are ignored.
      num_cached: i32[n]; tokens of the history that count (the prompt and the output so far).
      counters: i32[n]; tokens generated before the one being sampled (for min_tokens).
      stop_ids: i32[m]; the engine's stop tokens (EOS), barred with stop_token_ids under min_tokens.
      sparse: how the penalties find each token's counts: True sorts each row's history (work
        O(L log L) a row, the logits read and written only at the tokens seen: no [n, vocab]
        temporary), False counts into [n, vocab] arrays; None: sparse on a GPU when L <= vocab /
        SPARSE_HISTORY_RATIO, else dense (the CPU program is the dense one). The same arithmetic
        per token; XLA may fuse it differently (within an ulp), and a token the history lacks keeps
        its logit either way.

    Returns:
      f32[n, vocab].
    """
    n, vocab = logits.shape
    pos = jnp.arange(history.shape[1], dtype=jnp.int32)[None, :]
    seen = pos < num_cached[:, None]  # bool[n, L]
    is_out = seen & (pos >= params.prompt_len[:, None])
    tok = jnp.clip(history, 0, vocab - 1)
    rp = params.repetition_penalty[:, None]
    if sparse is None:
        sparse = current_target().platform == "gpu" and history.shape[1] * SPARSE_HISTORY_RATIO <= vocab
    if sparse:
        logits = _penalties_sparse(logits, params, tok, seen, is_out)
    else:
        rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], history.shape)
        counts = jnp.zeros((n, vocab), jnp.float32).at[rows, tok].add(is_out.astype(jnp.float32))  # output counts
        anywhere = jnp.zeros((n, vocab), bool).at[rows, tok].max(seen)  # in the prompt or the output
        logits = jnp.where(anywhere, jnp.where(logits > 0, logits / rp, logits * rp), logits)
        logits = (logits - params.presence_penalty[:, None] * (counts > 0)
                  - params.frequency_penalty[:, None] * counts)
    bias_rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], params.bias_ids.shape)
    bias_ids = jnp.where(params.bias_ids >= 0, params.bias_ids, vocab)  # out of range: dropped
    logits = logits.at[bias_rows, bias_ids].add(params.bias_values, mode="drop")
    barred = jnp.concatenate([jnp.broadcast_to(stop_ids[None, :], (n, stop_ids.shape[0])), params.stop_token_ids], 1)
    barred = jnp.where((counters < params.min_tokens)[:, None] & (barred >= 0), barred, vocab)
    stop_rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], barred.shape)
    return logits.at[stop_rows, barred].set(-jnp.inf, mode="drop")


# `apply_controls` sorts the history (instead of counting into [n, vocab] arrays) when it holds at
# most vocab / SPARSE_HISTORY_RATIO tokens a row.
SPARSE_HISTORY_RATIO = 4


def _penalties_sparse(logits, params: SlotParams, tok, seen, is_out):
    """The repetition, presence and frequency penalties at the tokens of each row's history only:
    each row's (token, is output) pairs sorted by token, one entry per distinct token seen with its
    output count, the same arithmetic as the dense path on that token's logit, scattered back.
    No [n, vocab] temporary; the logits of tokens never seen are untouched."""
    n, vocab = logits.shape
    L = tok.shape[1]
    key = jnp.where(seen, tok, vocab)  # unseen positions sort last
    key, out = lax.sort((key, is_out.astype(jnp.int32)), dimension=1, num_keys=1)  # [n, L] each
    idx = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (n, L))
    first = jnp.concatenate([jnp.ones((n, 1), bool), key[:, 1:] != key[:, :-1]], axis=1)  # a token's first entry
    # The entry after each one's run of equal tokens: the next first entry (L when none).
    nxt = lax.cummin(jnp.concatenate([jnp.where(first, idx, L)[:, 1:], jnp.full((n, 1), L, jnp.int32)], axis=1),
                     axis=1, reverse=True)
    csum = jnp.cumsum(out, axis=1)  # i32[n, L], inclusive
    counts = (jnp.take_along_axis(csum, nxt - 1, axis=1) - csum + out).astype(jnp.float32)  # outputs of the token
    live = first & (key < vocab)
    t = jnp.minimum(key, vocab - 1)
    v = jnp.take_along_axis(logits, t, axis=1)  # f32[n, L]
    rp = params.repetition_penalty[:, None]
    v = jnp.where(v > 0, v / rp, v * rp)
    v = v - params.presence_penalty[:, None] * (counts > 0) - params.frequency_penalty[:, None] * counts
    rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, L))
    return logits.at[rows, jnp.where(live, t, vocab)].set(v, mode="drop")


def sample_slots(logits, params: SlotParams, counters, history_fn=None, num_cached=None, stop_ids=None,
                 allowed=None):
    """`sample_with_logprobs` with each row's parameters from SlotParams columns. With history_fn
    (() -> i32[n, L], see `apply_controls`) the logit controls run first, only when some row uses
    one (the history is gathered inside that branch). allowed (bool[n, vocab], structured outputs)
    then sets the logits of disallowed tokens to -inf, before temperature and the filters: the
    token and its logprobs come from the masked distribution."""
    logits = logits.astype(jnp.float32)
    if history_fn is not None:
        logits = lax.cond(controls_active(params),
                          lambda x: apply_controls(x, params, history_fn(), num_cached, counters, stop_ids),
                          lambda x: x, logits)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    return sample_with_logprobs(logits, params.temperature, params.top_k, params.top_p, params.seed, counters,
                                min_p=params.min_p, top_n=MAX_TOP_LOGPROBS, want_top=params.top_logprobs > 0)


# The verify pass samples its rows in chunks of at most this many logits (rows x vocab: 32 MiB of
# float32), so the sampler's [rows, vocab] temporaries (keys, probabilities, the filtered and
# scaled logits, the draw's noise) do not scale with verify_rows x vocab (320 x 128256 for
# Llama-3 at 64 sequences, k = 4: a 164 MB array each, a chunk of 64 rows: 33 MB).
SAMPLE_LOGITS_ELEMENTS = 1 << 23


def sample_rows(logits, params: SlotParams, counters, history_fn=None, num_cached=None, stop_ids=None,
                max_elements: int = SAMPLE_LOGITS_ELEMENTS):
    """`sample_slots` over rows of `logits` f32[n, vocab] in chunks of at most max_elements logits
    (a `lax.map` over chunks of equal size; the last one overlaps the one before rather than
    padding, its shared rows sampled twice, identically). Each row is sampled exactly as
    `sample_slots` samples it (by its own key, counter and parameters); n x vocab <= max_elements
    is `sample_slots` itself, and so is every n on a GPU (`gpu_sampler`: its temporaries are
    [n, 4096] candidates and whole rows GPU_FALLBACK_ROWS at a time, never [n, vocab]; chunks would
    only copy the logits). history_fn: () -> i32[n, L], sliced per chunk inside the controls'
    branch."""
    n, vocab = logits.shape
    per = max(1, max_elements // vocab)
    if n <= per or gpu_sampler():   # the GPU sampler's temporaries are [n, 4096] and [8, vocab]
        return sample_slots(logits, params, counters, history_fn, num_cached, stop_ids)
    chunks = -(-n // per)
    size = -(-n // chunks)
    starts = jnp.minimum(jnp.arange(chunks, dtype=jnp.int32) * size, n - size)

    def one(start):
        cut = lambda a: lax.dynamic_slice_in_dim(a, start, size, 0)  # noqa: E731
        hist = None if history_fn is None else (lambda: cut(history_fn()))
        return sample_slots(cut(logits), jax.tree_util.tree_map(cut, params), cut(counters), hist,
                            None if num_cached is None else cut(num_cached), stop_ids)

    out = lax.map(one, starts)   # each [chunks, size, ...]
    row = jnp.arange(n, dtype=jnp.int32)
    c = jnp.minimum(row // size, chunks - 1)
    return tuple(a[c, row - starts[c]] for a in out)


def logsumexp_at(x, amax):
    """`jax.nn.logsumexp(x, axis=-1)` given each row's max amax f32[B] (the same operations, one
    pass over x instead of two)."""
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    return jnp.log(jnp.abs(jnp.sum(jnp.exp(x - amax[:, None]), axis=-1))) + amax


def sample(logits, temperature, top_k, top_p, seeds, counters):
    """Picks one token per row (`sample_with_logprobs` without the log-probabilities)."""
    return sample_with_logprobs(logits, temperature, top_k, top_p, seeds, counters)[0]


def _filtered(x, top_tok, top_k, top_p, min_p):
    """x f32[B, V] with the tokens that top-k, top-p and min-p drop set to -inf (`sample_with_logprobs`;
    top_tok: i32[B] the index of each row's largest entry, which every filter keeps)."""
    return jnp.where(_keep(x, top_tok, top_k, top_p, min_p), x, -jnp.inf)


def _keep(x, top_tok, top_k, top_p, min_p):
    """bool[B, V]: the tokens of x f32[B, V] that top-k, top-p and min-p keep (`_filtered`)."""
    # Both filters are thresholds found by bisection on order-preserving integer keys of the
    # values (32 exact steps, O(vocab) each), not a sort of the vocabulary: on a CPU a
    # per-row sort of 49k logits costs more than the whole model step.
    key = _order_key(x)  # u32[B, V]
    ways = search_ways()
    if ways == 2:
        # top-k: keep values >= the k-th largest (ties with it are kept too).
        t_k = _bisect(lambda t: jnp.sum(key >= t[:, None], axis=-1) < top_k, x.shape[0])
    else:   # t: [B, ways - 1] thresholds, counted over the vocabulary in one pass
        t_k = _bisect(lambda t: jnp.sum(key[:, :, None] >= t[:, None, :], axis=1) < top_k[:, None],
                      x.shape[0], ways)
    t_k = jnp.where(t_k > 0, t_k - 1, 0)  # top_k >= vocab keeps everything (no wrap-around)
    keep = jnp.where(top_k[:, None] > 0, key >= t_k[:, None], True)
    # softmax(where(keep, x, -inf)) (jax.nn.softmax's operations) with its max known: x at the
    # argmax, which top-k keeps; two passes over the vocabulary instead of three.
    e = jnp.exp(jnp.where(keep, x, -jnp.inf) - jnp.take_along_axis(x, top_tok[:, None], axis=-1))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    # top-p: keep a token when the mass of the tokens above it is < top_p (the smallest set
    # of top tokens reaching top_p; the most likely token always stays).
    if ways == 2:
        pkey = _order_key(probs)
        t_p = _bisect(lambda t: jnp.sum(jnp.where(pkey > t[:, None], probs, 0.0), axis=-1) < top_p,
                      x.shape[0])
        keep = keep & jnp.where(top_p[:, None] < 1.0, pkey >= t_p[:, None], True)
    else:
        # The keys' comparisons made on the probabilities themselves (`_key_compare`): no key
        # array written and read back each pass.
        cmp = lambda t, op: _key_compare(probs[:, :, None], t[:, None, :], op)  # noqa: E731
        t_p = _bisect(lambda t: jnp.sum(jnp.where(cmp(t, jnp.greater), probs[:, :, None], 0.0), axis=1)
                      < top_p[:, None], x.shape[0], ways)
        keep = keep & jnp.where(top_p[:, None] < 1.0, cmp(t_p[:, None], jnp.greater_equal)[:, :, 0], True)
    if min_p is not None:
        # The largest probability is the most likely token's (probs rise with x): a gather,
        # not a pass over the vocabulary.
        p_max = jnp.take_along_axis(probs, top_tok[:, None], axis=-1)
        keep = keep & (probs >= min_p[:, None] * p_max)
    return keep


def _top_logprobs(d, lse, top_n):
    """The top_n of the distribution d f32[B, V] (log-normalizer lse f32[B]) as (log-probabilities, ids)."""
    if current_target().platform == "gpu":
        # The top_n of d, then minus lse: no [B, V] array of d - lse written for the selection.
        # The same log-probabilities; ids of entries whose values tie only after the
        # subtraction come in d's order (the CPU program: by index).
        vals, ids = lax.top_k(d, top_n)
        return vals - lse[:, None], ids
    return tuple(lax.top_k(d - lse[:, None], top_n))


def sample_with_logprobs(logits, temperature, top_k, top_p, seeds, counters, *, min_p=None, top_n=None,
                         want_top=None):
    """Picks one token per row and returns its log-probability.

    The log-probability is taken under the distribution the token was drawn from:
    softmax(logits / temperature) restricted by top-k/top-p/min-p. A greedy row has no such
    distribution (it is a point mass), so its token's log-probability is the model's own,
    log_softmax(logits) (temperature 1, no filter), as OpenAI and vLLM report for greedy decoding.

    Args:
      logits: f32[num_seqs, vocab].
      temperature: f32[num_seqs]; 0 = greedy.
      top_k: i32[num_seqs]; 0 = off.
      top_p: f32[num_seqs]; 1 = off.
      seeds: i32[num_seqs] per-request seeds.
      min_p: f32[num_seqs] or None; keep tokens whose probability is >= min_p x the top one's
        (after top-k/top-p); 0 = off.
      top_n: with it, also the top_n tokens of the distribution each log-probability is taken under
        (computed only when some row of want_top, bool[num_seqs], is True).
      counters: i32[num_seqs] index of the token being sampled within its request.

    Returns:
      (i32[num_seqs] token ids, f32[num_seqs] their log-probabilities), and with top_n
      (i32[num_seqs, top_n] top token ids, f32[num_seqs, top_n] their log-probabilities; -1 / -inf
      when no row wants them).
    """
    logits = logits.astype(jnp.float32)
    if gpu_sampler():
        return _sample_candidates(logits, temperature, top_k, top_p, seeds, counters, min_p=min_p, top_n=top_n,
                                  want_top=want_top)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    sampled = temperature > 0
    # A greedy row's distribution is the model's own: logits / 1 (bit for bit the logits), no
    # filter. So every row's distribution is `scaled` (no [rows, vocab] select between two arrays).
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    # x / t rounds monotonically in x (t > 0): scaled's largest entry is at the logits' argmax, a
    # token every filter keeps.
    top_tok = greedy_tok
    top_k = jnp.where(sampled, top_k, 0)
    top_p = jnp.where(sampled, top_p, 1.0)
    if min_p is not None:
        min_p = jnp.where(sampled, min_p, 0.0)

    def filtered(x):
        return _filtered(x, top_tok, top_k, top_p, min_p)

    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0) | (False if min_p is None else jnp.any(min_p > 0)))
    scaled = lax.cond(needs_filter, filtered, lambda x: x, scaled)

    def draw(x):
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
        return jax.vmap(lambda k, r: jax.random.categorical(k, r))(keys, x).astype(jnp.int32)

    # Drawing noise for a whole vocabulary costs as much as the LM head on a CPU: skip it when
    # every row is greedy.
    drawn = lax.cond(jnp.any(temperature > 0), draw, lambda x: greedy_tok, scaled)
    tok = jnp.where(sampled, drawn, greedy_tok)  # i32[B]
    dist = scaled  # f32[B, V]; -inf = filtered out (sampled rows only)
    lse = logsumexp_at(dist, jnp.take_along_axis(dist, top_tok[:, None], axis=-1)[:, 0])
    picked = jnp.take_along_axis(dist, tok[:, None], axis=-1)[:, 0]
    if top_n is None:
        return tok, picked - lse

    top_n = min(top_n, vocab)

    def top(d):
        return _top_logprobs(d, lse, top_n)

    empty = lambda d: (jnp.full((d.shape[0], top_n), -jnp.inf, jnp.float32),  # noqa: E731
                       jnp.full((d.shape[0], top_n), -1, jnp.int32))
    top_lps, top_ids = lax.cond(jnp.any(want_top), top, empty, dist)
    return tok, picked - lse, top_ids.astype(jnp.int32), top_lps


# ---------------------------------------------------------------- the GPU sampler: two passes over the logits

# The GPU sampler (`_sample_candidates`) keeps, per row, the GPU_CANDIDATE_BLOCKS blocks of
# GPU_CANDIDATE_BLOCK logits with the largest maxima (4096 candidates): every token larger than the
# smallest of those maxima is among them, so the filters' thresholds and the top log-probabilities
# come from the candidates whenever they lie above it. Rows where they do not (a top-p or min-p that
# keeps a flat tail, a top_k past the candidates) are searched over their whole row,
# GPU_FALLBACK_ROWS rows at a time (fewer in a batch of fewer than 64 rows: an eighth of it).
GPU_CANDIDATE_BLOCK = 128
GPU_CANDIDATE_BLOCKS = 32
GPU_FALLBACK_ROWS = 8


def gpu_sampler() -> bool:
    """True when the sampler is compiled for a GPU: `sample_with_logprobs` is `_sample_candidates`
    there (two passes over the logits); the CPU program is the dense formulation."""
    return current_target().platform == "gpu"


def _block_stats(x, block: int):
    """(max, sum(exp(x - max))) of each block of `block` entries of x f32[B, V] (the last block
    padded with -inf): f32[B, ceil(V / block)] each, one variadic reduction (one pass over x)."""
    n, vocab = x.shape
    nb = -(-vocab // block)
    if nb * block != vocab:
        x = jnp.pad(x, ((0, 0), (0, nb * block - vocab)), constant_values=-jnp.inf)
    x = x.reshape(n, nb, block)

    def combine(a, b):
        (m1, s1), (m2, s2) = a, b
        m = jnp.maximum(m1, m2)
        ref = jnp.where(m == -jnp.inf, 0.0, m)
        return m, s1 * jnp.exp(m1 - ref) + s2 * jnp.exp(m2 - ref)

    return lax.reduce((x, jnp.ones_like(x)), (jnp.float32(-jnp.inf), jnp.float32(0.0)), combine, (2,))


def _candidate_thresholds(logits, t, top_k, top_p, min_p, top_n, want):
    """Pass 1 and the candidates of `_sample_candidates` (its arguments, the filters already off
    for greedy rows; t: the rows' temperatures, 1 for greedy ones). Returns dict(k_row u32[B]
    (each row's key threshold: its filtered distribution is where(key >= k_row, x, -inf)), need
    bool[B] (rows the candidates cannot serve: k_row, or the top entries they want, not exact),
    top_vals, top_ids ([B, top_n], or None without top_n), m f32[B] (the row's max), greedy_tok,
    filt bool[B] (a filter is on))."""
    n, vocab = logits.shape
    block = min(GPU_CANDIDATE_BLOCK, vocab)
    nb = -(-vocab // block)
    count = min(GPU_CANDIDATE_BLOCKS, nb)
    complete = count * block >= vocab and count == nb   # every token a candidate
    scaled = lambda a: a / t[:, None]  # noqa: E731  (the dense program's `scaled`, bit for bit)
    # Pass 1.
    bmax, bsum = _block_stats(scaled(logits), block)
    m = jnp.max(bmax, axis=-1)  # the row's max (scaled at the logits' argmax)
    ref = jnp.where(jnp.isfinite(m), m, 0.0)
    z = jnp.sum(bsum * jnp.exp(bmax - ref[:, None]), axis=-1)  # sum(exp(x - m)) over the row
    bv, bi = lax.top_k(bmax, count)
    ids = (bi[:, :, None] * block + jnp.arange(block, dtype=jnp.int32)[None, None, :]).reshape(n, count * block)
    vals = scaled(jnp.take_along_axis(logits, jnp.minimum(ids, vocab - 1), axis=-1))
    vals = jnp.where(ids < vocab, vals, -jnp.inf)
    key = _order_key(vals)
    nkey, ids, vals = lax.sort((~key, ids, vals), dimension=1, num_keys=2)  # key descending, then id
    key = ~nkey
    size = key.shape[1]
    # Tokens with a key above kb are all candidates (complete: every token is).
    kb = _order_key(bv[:, -1])
    above = (lambda k: jnp.ones(k.shape, bool)) if complete else (lambda k: k > kb.reshape(kb.shape + (1,) * (k.ndim - 1)))
    greedy_tok = ids[:, 0]  # the largest key, lowest id first: argmax of the logits
    # top-k: the k-th largest key (top_k >= vocab keeps all).
    k_on = (top_k > 0) & (top_k < vocab)
    t_k = jnp.take_along_axis(key, jnp.clip(top_k - 1, 0, size - 1)[:, None], axis=1)[:, 0]
    k_exact = (top_k <= size) & above(t_k)
    keep = jnp.where(k_on[:, None], key >= t_k[:, None], True)
    e = jnp.exp(jnp.where(keep, vals, -jnp.inf) - m[:, None])
    zk = jnp.where(k_on, jnp.sum(e, axis=-1), z)
    probs = e / zk[:, None]
    # top-p: a token stays when the mass of the tokens above it (strictly) is < top_p.
    p_on = top_p < 1.0
    first = jnp.concatenate([jnp.ones((n, 1), bool), key[:, 1:] != key[:, :-1]], axis=1)
    pos = jnp.arange(size, dtype=jnp.int32)[None, :]
    group = lax.cummax(jnp.where(first, pos, 0), axis=1)
    before = jnp.cumsum(probs, axis=1) - probs  # exclusive
    mass_above = jnp.take_along_axis(before, group, axis=1)
    keep = keep & jnp.where(p_on[:, None], mass_above < top_p[:, None], True)
    p_exact = jnp.sum(jnp.where(above(key), probs, 0.0), axis=-1) >= top_p
    # min-p: probs >= min_p x the largest probability (1 / zk, the dense program's probs at the argmax).
    m_on = min_p > 0
    p_max = 1.0 / zk
    keep = keep & jnp.where(m_on[:, None], probs >= (min_p * p_max)[:, None], True)
    p_beta = jnp.exp(bv[:, -1] - m) / zk
    m_exact = p_beta * (1 + 1e-5) < min_p * p_max
    filt = k_on | p_on | m_on
    confined = complete | jnp.where(k_on, k_exact, (p_on & p_exact) | (m_on & m_exact))
    k_row = jnp.where(filt, jnp.min(jnp.where(keep, key, jnp.uint32(0xFFFFFFFF)), axis=-1), jnp.uint32(0))
    need = filt & ~confined
    if top_n is not None:
        kept = key >= k_row[:, None]
        top_vals = jnp.where(kept, vals, -jnp.inf)[:, :top_n]
        top_ids = ids[:, :top_n]
        # Exact from the candidates when the row's kept set is (confined filters) or its top_n-th
        # kept key lies above beta.
        top_ok = filt & confined
        if size >= top_n:
            top_ok = top_ok | above(jnp.where(kept[:, top_n - 1], key[:, top_n - 1], jnp.uint32(0)))
        else:   # fewer candidates than top_n (a tiny block setting): not complete, so only confined rows
            top_vals = jnp.pad(top_vals, ((0, 0), (0, top_n - size)), constant_values=-jnp.inf)
            top_ids = jnp.pad(top_ids, ((0, 0), (0, top_n - size)))
        need = need | (want & ~top_ok)
    else:
        top_vals = top_ids = None
    return dict(k_row=k_row, need=need, top_vals=top_vals, top_ids=top_ids, m=m, greedy_tok=greedy_tok, filt=filt)


def _sample_candidates(logits, temperature, top_k, top_p, seeds, counters, *, min_p=None, top_n=None,
                       want_top=None):
    """`sample_with_logprobs` as compiled for a GPU: the same tokens (the same draw: categorical over
    the filtered distribution with the request's key), log-probabilities within float rounding (sums
    taken in another order), the same top log-probabilities (ids of -inf entries aside), in two
    passes over the [B, V] logits instead of about 25.

    Pass 1 (`_block_stats`): each block's max and sum of exponentials. From them: each row's max
    and normalizer, and the candidates: the GPU_CANDIDATE_BLOCKS blocks with the largest maxima,
    gathered and sorted (key descending, id ascending: [B, 4096]). Every token above beta (the
    smallest chosen block max) is a candidate, so a threshold above beta is exact from the
    candidates: top-k's k-th largest, top-p's mass above each token (normalized by the row's sum,
    or the top-k set's), min-p's cut. The kept set of every filter is an up-set in the order of
    the values, so each row's filtered distribution is where(key >= K, x, -inf) for one u32 K
    (0: every token). A row whose kept set can reach below beta is searched over its whole row
    (`_keep`, GPU_FALLBACK_ROWS rows an iteration of a loop that runs only for such rows).
    Pass 2: the draw (jax.random.categorical, as the dense program) and the log-normalizer over
    where(key >= K, x, -inf), fused into one pass over x."""
    n, vocab = logits.shape
    sampled = temperature > 0
    t = jnp.where(sampled, temperature, 1.0)
    scaled = lambda a: a / t[:, None]  # noqa: E731  (the dense program's `scaled`, bit for bit)
    top_k = jnp.where(sampled, top_k, 0)
    top_p = jnp.where(sampled, top_p, 1.0)
    min_p = jnp.zeros_like(top_p) if min_p is None else jnp.where(sampled, min_p, 0.0)
    top_n = None if top_n is None else min(top_n, vocab)
    want = None if top_n is None else (jnp.ones((n,), bool) if want_top is None else want_top)
    c = _candidate_thresholds(logits, t, top_k, top_p, min_p, top_n, want)
    k_row, need, top_vals, top_ids, m, greedy_tok, filt = (c[k] for k in (
        "k_row", "need", "top_vals", "top_ids", "m", "greedy_tok", "filt"))

    # Rows the candidates cannot serve: their whole row, GPU_FALLBACK_ROWS at a time (an eighth of
    # the batch when that is fewer, at least one): an iteration reads at most 1/8 of the logits.
    rows = max(1, min(GPU_FALLBACK_ROWS, n // 8))

    def fallback(c):
        k_row, top_vals, top_ids, need = c
        idx = jnp.argsort(~need, stable=True)[:rows].astype(jnp.int32)
        live = need[idx]
        x = logits[idx] / t[idx][:, None]   # the rows of `scaled`
        kf = _keep(x, greedy_tok[idx], top_k[idx], top_p[idx], min_p[idx])
        xkey = _order_key(x)
        kr = jnp.where(filt[idx], jnp.min(jnp.where(kf, xkey, jnp.uint32(0xFFFFFFFF)), axis=-1), jnp.uint32(0))
        k_row = k_row.at[idx].set(jnp.where(live, kr, k_row[idx]))
        if top_vals is not None:
            tv, ti = lax.top_k(jnp.where(xkey >= kr[:, None], x, -jnp.inf), top_n)
            top_vals = top_vals.at[idx].set(jnp.where(live[:, None], tv, top_vals[idx]))
            top_ids = top_ids.at[idx].set(jnp.where(live[:, None], ti.astype(jnp.int32), top_ids[idx]))
        return k_row, top_vals, top_ids, need.at[idx].set(False)

    k_row, top_vals, top_ids, _ = lax.while_loop(lambda c: jnp.any(c[3]), fallback, (k_row, top_vals, top_ids, need))

    # Pass 2: the filtered distribution where(key >= K, x, -inf), drawn from and normalized. Each
    # consumer recomputes it from the logits (the draw's branch too: an operand of the conditional
    # would be written out).
    def filtered_dist(a, k_row):
        x = scaled(a)
        return jnp.where(_order_key(x) >= k_row[:, None], x, -jnp.inf)

    # The log-normalizer in each branch: with the draw, XLA reads the logits once for both.
    def draw(a, k_row):
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
        d = filtered_dist(a, k_row)
        return jax.vmap(lambda k, r: jax.random.categorical(k, r))(keys, d).astype(jnp.int32), logsumexp_at(d, m)

    drawn, lse = lax.cond(jnp.any(sampled), draw,
                          lambda a, k_row: (greedy_tok, logsumexp_at(filtered_dist(a, k_row), m)), logits, k_row)
    tok = jnp.where(sampled, drawn, greedy_tok)
    picked = scaled(jnp.take_along_axis(logits, tok[:, None], axis=-1))[:, 0]
    if top_n is None:
        return tok, picked - lse
    # Entries past the kept tokens (-inf) name the lowest ids outside them, as lax.top_k over the
    # whole row does: among the first 2 x top_n ids at least top_n are outside a set of < top_n.
    w = min(vocab, 2 * top_n)
    head = scaled(logits[:, :w])
    out = ~(_order_key(head) >= k_row[:, None]) | (head == -jnp.inf)
    _, spare = lax.sort((~out, jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (n, w))), dimension=1, num_keys=2)
    finite = jnp.sum(top_vals > -jnp.inf, axis=-1, dtype=jnp.int32)
    at = jnp.clip(jnp.arange(top_n, dtype=jnp.int32)[None, :] - finite[:, None], 0, w - 1)
    top_ids = jnp.where(top_vals > -jnp.inf, top_ids, jnp.take_along_axis(spare, at, axis=1))
    any_top = jnp.any(want)
    top_lps = jnp.where(any_top, top_vals - lse[:, None], -jnp.inf)
    top_ids = jnp.where(any_top, top_ids, -1)
    return tok, picked - lse, top_ids.astype(jnp.int32), top_lps
