"""Speculative decoding: the configuration, the device-side n-gram proposer and the verifier.

The engine's decode loop is a loop of verify steps (`jpa.engine.verify.VerifyLoop`): each active
sequence feeds its pending token plus up to k draft tokens as one entry of the ragged pass, the
target model scores every row, and the sequence keeps the longest prefix of drafts the target
itself would have produced, plus the target's own next token.

Verification is exact for sampling too. Every row is sampled with the request's own key for the
token index it would have without speculation (`fold_in(key(seed), num_generated)`, as
`jpa.engine.sampling` does), after the same logit controls and filters; draft j is accepted when
the row's sampled token equals it. For a deterministic proposal (the n-gram lookup, or a draft
model's greedy token) this IS Leviathan et al.'s rejection sampling: the draft's proposal
distribution q is a point mass, so draft d is accepted with probability p(d) = min(1, p(d)/q(d)),
and on rejection the emitted token follows p restricted to tokens other than d, renormalised
(max(0, p - q) normalised).

Proposers (`make_proposer`): the verify loop asks one object for drafts, so plain decoding is the
loop with `NoDraft` (k = 0: one row per sequence, nothing to verify), and n-gram lookup
(`NgramProposer`) and a draft model (`DraftModelProposer`) are the two ways to fill the rows.
A proposer has two device hooks: `propose` at look-ahead (before the step's pages are reserved:
drafts and how many) and `draft` inside the step (after the reservation: a draft model runs its
passes there), plus `target_hidden`, the target's pass over the verify rows. Sharing the key makes it stronger than equal in distribution: a
seeded request emits exactly the tokens it emits without speculation, with the same
log-probabilities, whatever was drafted, so outputs stay reproducible and independent of the
batch, of preemption and of whether speculation switched itself off.

Rows are a budget (`SpeculativeConfig.verify_rows`, fixed at compile time): each active sequence
takes one row for its pending token, and the rows left are shared equally among them for
drafts. With every slot busy and verify_rows == max_seqs no row is left, so speculation switches
itself off under load and a verify step costs what a decode step costs; `disable_by_batch_size`
(vLLM's name) switches it off from a number of running sequences on.
"""

import dataclasses
import json

from jpa.kv.cache import CacheConfig
from jpa.engine.model import cache_spec_of, check_model
from jpa.engine.states import call_model

import jax.numpy as jnp
from jax import lax

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` (the fields jpa implements), plus the verify pass's rows.

    Attributes:
      method: "ngram" (prompt lookup: drafts copied from the sequence's own history, proposed on
        the device inside the jitted step) or "draft_model" (a smaller model with the same
        vocabulary proposes greedily; `model` names it).
      num_speculative_tokens: k, drafts per sequence per verify step (1..16).
      prompt_lookup_min, prompt_lookup_max: n-gram lengths to match (vLLM's defaults: with neither
        given both are 5; with one given the other takes its value).
      model: the draft model (method "draft_model"): a name `models.load` knows.
      disable_by_batch_size: no drafts while this many or more sequences are running (None = off).
      verify_rows: rows of the verify pass (>= max_seqs; None: max_seqs * (k + 1) on a GPU, where a
        decode step is memory-bound and extra rows are nearly free, max_seqs + k on a CPU, where
        every row costs compute).
    """
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    verify_rows: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}; got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an int in [1, 16]; got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64):
                raise ValueError(f"{name} must be an int in [1, 64]; got {v!r}")
        if self.method == "ngram":
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise ValueError("speculative 'model' is for method 'draft_model'; method 'ngram' takes none")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft model's name")
        for name in ("disable_by_batch_size", "verify_rows"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or null; got {v!r}")

    @classmethod
    def parse(cls, spec) -> "SpeculativeConfig":
        """From a dict or a JSON string (the `--speculative-config` of generate and serve, as vLLM
        spells it). Unknown keys are errors: a typo must not silently turn speculation off."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative config must be a JSON object; got {type(spec).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {unknown}; known: {sorted(known)}")
        if "method" not in spec:
            raise ValueError(f"speculative config needs 'method' (one of {METHODS})")
        return cls(**spec)

    def rows(self, max_seqs: int, backend: str) -> int:
        """The verify pass's rows for max_seqs slots on `backend` ("cpu", "gpu", ...)."""
        k = self.num_speculative_tokens
        if self.verify_rows is not None:
            if self.verify_rows < max_seqs:
                raise ValueError(f"verify_rows ({self.verify_rows}) must be >= max_seqs ({max_seqs}): every "
                                 f"running sequence takes one row")
            return self.verify_rows
        return max_seqs + k if backend == "cpu" else max_seqs * (k + 1)


def propose_ngram(history, length, k: int, n_min: int, n_max: int):
    """Prompt-lookup drafts for every row, on the device (vLLM's n-gram rule, vectorized).

    For each sequence, the tokens history[b, :length[b]]: find the longest n in [n_min, n_max]
    such that the last n tokens occur earlier (the occurrence ending before the last token), take
    the earliest such occurrence, and propose the (up to k) tokens that followed it.

    Args:
      history: i32[B, L]; each sequence's tokens by position (entries at >= length are ignored).
      length: i32[B]; tokens that count (0 = nothing to propose).
      k, n_min, n_max: static.

    Returns:
      (drafts i32[B, k], num i32[B] in [0, k]); drafts past num are 0.
    """
    b, size = history.shape
    end = jnp.arange(size, dtype=jnp.int32)[None, :]  # an occurrence's end (exclusive)
    last = length[:, None] - 1                       # position of the last token
    run = jnp.ones((b, size), bool)
    match_len = jnp.zeros((b, size), jnp.int32)
    for j in range(n_max):
        # Token j back from the occurrence's end against token j back from the sequence's end.
        pos = end - 1 - j
        here = jnp.take_along_axis(history, jnp.clip(pos, 0, size - 1), axis=1)
        tail = jnp.take_along_axis(history, jnp.clip(last - j, 0, size - 1), axis=1)
        run = run & (pos >= 0) & (last - j >= 0) & (here == tail)
        match_len = match_len + run.astype(jnp.int32)
    valid = (end >= 1) & (end <= last)  # ends before the last token: not the suffix itself
    match_len = jnp.where(valid, match_len, 0)
    best = jnp.max(match_len, axis=1)  # i32[B]
    found = best >= n_min
    start = jnp.argmax(match_len == best[:, None], axis=1).astype(jnp.int32)  # earliest (argmax: first)
    num = jnp.where(found, jnp.clip(length - start, 0, k), 0)
    idx = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, size - 1)
    drafts = jnp.where(jnp.arange(k)[None, :] < num[:, None], jnp.take_along_axis(history, idx, axis=1), 0)
    return drafts.astype(jnp.int32), num.astype(jnp.int32)


def accepted_prefix(target, drafts, num):
    """i32[B]: leading drafts equal to the target's own tokens (drafts[b, j] accepted when
    target[b, j] == drafts[b, j] for every j up to it, j < num[b]).

    Args: target i32[B, >= k] (row j: the target's token after the pending token and j drafts);
      drafts i32[B, k]; num i32[B].
    """
    k = drafts.shape[1]
    ok = (target[:, :k] == drafts) & (jnp.arange(k)[None, :] < num[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


class DraftPair:
    """The EngineModel the runner drives with a draft model: params (target's, draft's), cache
    (target's jpa.KVCache, draft's), both indexed by the same pages. Every pass of the ragged step
    and the plain decode pass runs both models, so the draft's cache holds every token the target's
    does (prompts, recomputed prefixes, copies on write); the logits are the target's. The verify
    steps call `target` and `draft` separately (`DraftModelProposer`)."""

    def __init__(self, target, draft):
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) must be the target's "
                             f"({target.config.vocab_size}): drafts are token ids of the target")
        self.target, self.draft = target, draft
        self.config, self.dtype = target.config, target.dtype
        self.params = (target.params, draft.params)

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto", **lora):
        logits, tc = self.target.decode(params[0], cache[0], tokens, seq_lens, slot_mapping, block_tables, impl=impl,
                                        **lora)
        _, dc = self.draft.decode(params[1], cache[1], tokens, seq_lens, slot_mapping, block_tables, impl=impl)
        return logits, (tc, dc)

    def ragged(self, params, cache, *args, impl="auto", **lora):
        logits, tc = self.target.ragged(params[0], cache[0], *args, impl=impl, **lora)
        _, dc = self.draft.ragged(params[1], cache[1], *args, impl=impl)
        return logits, (tc, dc)

    def ragged_hidden(self, params, cache, *args, impl="auto", **lora):
        hidden, tc = self.target.ragged_hidden(params[0], cache[0], *args, impl=impl, **lora)   # the draft: the base
        _, dc = self.draft.ragged(params[1], cache[1], *args, impl=impl)
        return hidden, (tc, dc)

    def head(self, params, hidden):
        return self.target.head(params[0], hidden)


class NoDraft:
    """Plain decoding: the verify loop with no drafts (k = 0, one row per sequence)."""
    k = 0

    def propose(self, ps, slots, lens, cap):
        b = lens.shape[0]
        return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32)

    def draft(self, params, cache, ps, slots, lens, num, drafts):
        return cache, drafts

    def target_hidden(self, model, params, cache, args, impl, state_slots=None, **lora):
        """(hidden, cache) of the target's ragged_hidden over args; state_slots: each entry's state slot (a
        model with recurrent state, `jpa.engine.states`); lora: the LoRA adapters (`lora=`), if any."""
        return call_model(model.ragged_hidden, params, cache, *args, impl=impl, state_slots=state_slots, **lora)


class NgramProposer(NoDraft):
    """Prompt lookup on the device (`propose_ngram`), from each sequence's own history."""

    def __init__(self, spec: SpeculativeConfig):
        self.k, self.n_min, self.n_max = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, ps, slots, lens, cap):
        act = slots.active
        none = (jnp.zeros((lens.shape[0], self.k), jnp.int32), jnp.zeros((lens.shape[0],), jnp.int32))

        def lookup(_):
            hist = slots.history(ps.block_tables)
            hist = jnp.where(jnp.arange(hist.shape[1])[None, :] == lens[:, None], slots.tokens[:, None], hist)
            return propose_ngram(hist, jnp.where(act, lens + 1, 0), self.k, self.n_min, self.n_max)

        # A full batch leaves no row for drafts: no lookup either.
        return lax.cond(jnp.any(cap > 0), lookup, lambda _: none, None)


class DraftModelProposer(NoDraft):
    """A draft model (`DraftPair.draft`) proposes greedily inside the step, once its rows are
    reserved; the target's passes read `params[0]` / `cache[0]` of the pair."""

    def __init__(self, spec: SpeculativeConfig, draft, page_size: int, impl: str):
        self.k, self.model, self.page_size, self.impl = spec.num_speculative_tokens, draft, page_size, impl

    def propose(self, ps, slots, lens, cap):
        return jnp.zeros((lens.shape[0], self.k), jnp.int32), jnp.full((lens.shape[0],), self.k, jnp.int32)

    def draft(self, params, cache, ps, slots, lens, num, drafts):
        """The draft model's greedy drafts: passes j = 0..max(num) feed the pending token, then
        draft j - 1, at position lens + j (writing the draft's cache there, so it holds every
        token the target may accept) and take draft j as the argmax."""
        act, k, ps_ = slots.active, self.k, self.page_size

        def body(c):
            j, dc, tok, drafts = c
            feed = act & (j <= num)
            pos = lens + j
            page = jnp.take_along_axis(ps.block_tables, (pos // ps_)[:, None], axis=1, mode="clip")[:, 0]
            logits, dc = self.model.decode(params[1], dc, tok, jnp.where(feed, pos + 1, 0),
                                           jnp.where(feed, page * ps_ + pos % ps_, -1), ps.block_tables,
                                           impl=self.impl)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            drafts = jnp.where((jnp.arange(k)[None, :] == j) & (feed & (j < num))[:, None], nxt[:, None], drafts)
            return j + 1, dc, jnp.where(feed, nxt, tok), drafts

        init = (jnp.int32(0), cache[1], slots.tokens, jnp.zeros((lens.shape[0], k), jnp.int32))
        last = jnp.where(jnp.any(num > 0), jnp.max(jnp.where(act, num, -1)), -1)  # no drafts: no pass
        _, dc, _, drafts = lax.while_loop(lambda c: c[0] <= last, body, init)
        return (cache[0], dc), drafts

    def target_hidden(self, model, params, cache, args, impl, state_slots=None, **lora):
        # The draft passes have written the draft's cache for these rows.
        hidden, tc = model.target.ragged_hidden(params[0], cache[0], *args, impl=impl, **lora)
        return hidden, (tc, cache[1])


def make_proposer(spec: SpeculativeConfig | None, model, page_size: int, impl: str):
    """The proposer of a runner's verify loop: NoDraft without speculation."""
    if spec is None:
        return NoDraft()
    if isinstance(model, DraftPair):
        return DraftModelProposer(spec, model.draft, page_size, impl)
    return NgramProposer(spec)


# ---------------------------------------------------------------------- host side: pool and statistics

def draft_cache_config(draft_model, page_size: int, dtype: str) -> CacheConfig | None:
    """The draft model's cache per page (1 page; the engine sets the pool's page count): its own
    cache over the same pages, so a page costs the target's bytes + the draft's. None without one."""
    if draft_model is None:
        return None
    check_model(draft_model)
    spec = cache_spec_of(draft_model)
    if spec.has_recurrent:
        raise ValueError(f"the draft model's cache has a recurrent group "
                         f"({', '.join(g.name for g in spec.recurrent_groups())}): a draft model must keep paged "
                         f"attention only")
    num_kv_heads, head_dim = spec.check_served()
    return CacheConfig(spec.num_layers, num_kv_heads, head_dim, 1, page_size, dtype)


def record_spec_counts(stats, counts) -> None:
    """Adds a round's `SpecCounts` to the engine's running sums (`EngineStats.spec_*`)."""
    stats.spec_draft_tokens += int(counts.drafted.sum())
    stats.spec_accepted_tokens += int(counts.accepted.sum())
    stats.spec_drafts += int(counts.steps.sum())
    per_pos = [int(x) for x in counts.accepted_per_pos]
    stats.spec_accepted_per_pos = [a + b for a, b in zip(stats.spec_accepted_per_pos or [0] * len(per_pos), per_pos)]


def spec_summary(spec: SpeculativeConfig | None, s, verify_rows) -> dict | None:
    """Speculative decoding's figures (None when it is off): vLLM's counters, the acceptance
    rate (accepted / drafted) and the mean accepted length (tokens per verify step that had
    drafts: accepted drafts + the target's own token)."""
    if spec is None:
        return None
    return {
        "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
        "verify_rows": verify_rows, "num_drafts": s.spec_drafts,
        "num_draft_tokens": s.spec_draft_tokens, "num_accepted_tokens": s.spec_accepted_tokens,
        # None, not NaN, before any draft: this dict is nested in --json's summary line.
        "acceptance_rate": s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else None,
        "mean_accepted_length": 1 + s.spec_accepted_tokens / s.spec_drafts if s.spec_drafts else None,
        "accepted_per_pos": list(s.spec_accepted_per_pos),
    }
