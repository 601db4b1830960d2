"""Device state of the engine and the small pure functions every part of the step shares.

`Slots` is the per-slot decode state (pending token, counters, `SlotParams`, and the token held at
each cache slot). `copy_on_write`, `tally`, `finished` and `select` are used by both halves of
the unified step (the ragged step, `jpa.engine.ragged_step`, and the verify loop,
`jpa.engine.verify`).
"""

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jpa.kv.cache import copy_pages
from jpa.engine.sampling import SlotParams
from jpa.engine.states import StateCache


@flax.struct.dataclass
class Slots:
    """Per-slot decode state, arrays [max_seqs], and the token id held at each cache slot."""
    tokens: jax.Array         # i32: the pending token (sampled, not yet in the cache)
    active: jax.Array         # bool: slot is decoding
    num_generated: jax.Array  # i32: tokens generated so far (pending one included)
    params: SlotParams        # the request's sampling and stopping parameters
    # i32[num_pages, page_size]: the token whose K/V each cache slot holds, written with it. It
    # lives with the pages, so prefix-cache hits and forks share a sequence's history for free;
    # the logit controls (penalties) read a sequence's tokens through its block table.
    page_tokens: jax.Array

    @classmethod
    def empty(cls, max_seqs: int, num_pages: int, page_size: int) -> "Slots":
        z = lambda dt: jnp.zeros((max_seqs,), dt)  # noqa: E731
        return cls(z(jnp.int32), z(bool), z(jnp.int32), SlotParams.empty(max_seqs),
                   jnp.zeros((num_pages, page_size), jnp.int32))

    def write_tokens(self, tokens, slot_mapping) -> "Slots":
        """Records tokens i32[T] at cache slots i32[T] (-1 = padding, not written)."""
        flat = self.page_tokens.reshape(-1)
        flat = flat.at[jnp.where(slot_mapping >= 0, slot_mapping, flat.shape[0])].set(tokens, mode="drop")
        return self.replace(page_tokens=flat.reshape(self.page_tokens.shape))

    def rows(self, idx) -> "Slots":
        """The per-slot state of slots idx i32[n] (page_tokens stays whole: it is per page)."""
        return jax.tree_util.tree_map(lambda a: a[idx], self.replace(page_tokens=None)).replace(
            page_tokens=self.page_tokens)

    def history(self, block_tables):
        """i32[B, pages_per_seq * page_size]: each table's tokens by position."""
        return self.page_tokens[block_tables].reshape(block_tables.shape[0], -1)


# Copy-on-write pairs applied per iteration of `copy_on_write`'s loop: a step copies the live pairs
# only, COW_BATCH at a time (a fork's first step copies 1 page, not max_seqs).
COW_BATCH = 8


def copy_on_write(cache, slots, cow):
    """(cache and slots with pages cow.src copied to cow.dst (`jpa.copy_pages`, and their token
    ids), pages copied). The live pairs (dst >= 0) are gathered to the front and copied COW_BATCH at
    a time in a while_loop of ceil(live / COW_BATCH) iterations: a step without a fork costs no
    copy pass, one with f forks copies f pages rounded up to the batch (not max_seqs), and the
    cache is carried in place."""
    live = cow.dst >= 0
    n = jnp.sum(live, dtype=jnp.int32)
    size = min(COW_BATCH, live.shape[0])
    order = jnp.argsort(~live, stable=True)
    pad = -live.shape[0] % size
    src = jnp.pad(jnp.where(live, cow.src, 0)[order], (0, pad))
    dst = jnp.pad(jnp.where(live, cow.dst, -1)[order], (0, pad), constant_values=-1)

    def copy(c):
        i, cache, slots = c
        s, d = (lax.dynamic_slice_in_dim(a, i * size, size) for a in (src, dst))
        toks = slots.page_tokens
        toks = toks.at[jnp.where(d >= 0, d, toks.shape[0])].set(toks[jnp.maximum(s, 0)], mode="drop")
        if isinstance(cache, StateCache):   # the pool's pages (recurrent states are per slot, not per page)
            cache = cache.replace(pool=copy_pages(cache.pool, s, d))
        else:
            cache = (tuple(copy_pages(c, s, d) for c in cache) if isinstance(cache, tuple)
                     else copy_pages(cache, s, d))   # a draft model's cache too (DraftPair)
        return i + 1, cache, slots.replace(page_tokens=toks)

    _, cache, slots = lax.while_loop(lambda c: c[0] * size < n, copy, (jnp.int32(0), cache, slots))
    return cache, slots, n


class Usage(NamedTuple):
    """Page figures carried through a round: pages copied on write, the most pages in use, and
    the tokens cached at that moment (i32[] each)."""
    copies: jax.Array
    peak: jax.Array
    tokens: jax.Array

    @classmethod
    def zero(cls) -> "Usage":
        return cls(jnp.int32(0), jnp.int32(0), jnp.int32(0))


def tally(acc: Usage, copies, ps) -> Usage:
    """acc after one more step that copied `copies` pages and runs on page state ps. A page is in
    use when a sequence holds it (refcount above the prefix cache's own reference): the round's
    peak, which the host cannot see (sequences that finish inside the call release their pages
    before it returns). Tokens count once per page: a page that k sequences share (a cached
    prefix, a parallel sample's prompt) is taken as full, so (k - 1) x page_size come off the sum
    of sequence lengths (a forked sample's shared last page may be partly filled: that round
    counts low)."""
    held = ps.refcounts - ps.cached.astype(ps.refcounts.dtype)
    now = jnp.sum(held > 0, dtype=jnp.int32)
    stored = jnp.sum(ps.seq_lens, dtype=jnp.int32) - ps.page_size * jnp.sum(jnp.maximum(held - 1, 0), dtype=jnp.int32)
    more = now > acc.peak
    return Usage(acc.copies + copies, jnp.where(more, now, acc.peak), jnp.where(more, jnp.maximum(stored, 0), acc.tokens))


def finished(slots, next_tok, seq_lens, stop_ids):
    """bool[B]: which slots stop after emitting next_tok (their cache holds seq_lens tokens)."""
    p = slots.params
    is_stop = (jnp.any(next_tok[:, None] == stop_ids[None, :], axis=-1) & ~p.ignore_eos) | jnp.any(
        next_tok[:, None] == p.stop_token_ids, axis=-1)
    # The next token would go to position seq_lens; it must stay below max_len to be fed back.
    return is_stop | (slots.num_generated >= p.max_new) | (seq_lens + 1 >= p.max_len)


def select(ok, new, old):
    """new where ok (a bool[] scalar) else old, leaf by leaf (the page state is small: no cache here)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)


def slot_mapping_at(block_tables, pos, page_size, live):
    """i32[n]: the cache slot of position pos[i] in table block_tables[i] (-1 where not live)."""
    page = jnp.take_along_axis(block_tables, (pos // page_size)[:, None], axis=1, mode="clip")[:, 0]
    return jnp.where(live, page * page_size + pos % page_size, -1)
