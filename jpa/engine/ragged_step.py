"""The ragged half of the unified step: page work, then one ragged pass over the round's entries.

The round's releases come first (`release_slots`: the slots the host finished or preempted since
the last device call, `StepBatch.pages.release`; what `ModelRunner.retire` does as a call of its
own when the host cannot wait for the next round). Then page work, all or nothing (`page_work`):
evict (`pages.uncache`), share prefix-cache hits into empty slots (`pages.share`), reserve every
entry's rows (`pages.reserve`) and fork parallel samples' slots from their leader (`pages.fork`).
If any of it fails (`ok` False) the page state is put back as it was (after the releases, which
stand) and nothing else runs: the round changed nothing else.

The ragged pass (`RaggedStep.__call__`) then writes the entries' K/V, attends with
`jpa.ragged_paged_attention` through the model's `ragged` (or `ragged_hidden` + `head`), and
samples only where an entry is a decode row or a final chunk (resumed requests take their
pending token instead). It is a while_loop of 0 or 1 iterations rather than a lax.cond, so the
cache is carried in place.

Prompt logprobs (SamplingParams.prompt_logprobs): with the model's optional ragged_hidden/head
pair, the ragged pass keeps every row's hidden state; rows the plan gives a target (the next
prompt token) get log_softmax of the head, the target's logprob and rank and a top-20, under a
lax.cond that rounds without such rows skip (`_prompt_logprobs`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jpa.kv import pages
from jpa.engine.batch import PromptLogprobs, Sampled, StepBatch
from jpa.engine.device import copy_on_write, finished, select
from jpa.engine.model import has_hidden
from jpa.engine.sampling import MAX_TOP_LOGPROBS, logsumexp_at, sample_slots
from jpa.engine.states import call_model, fork_states
from jpa.engine.structured import allowed_rows


class RowLayout(NamedTuple):
    """Where each entry's rows are in the budget (traced, from batch.rows)."""
    ids: jax.Array       # i32[B]: each entry's slot (-1 = padding)
    live: jax.Array      # bool[B]
    safe: jax.Array      # i32[B]: ids with padding at slot 0
    q_lens: jax.Array    # i32[B]
    cu: jax.Array        # i32[B + 1]: row offsets
    row: jax.Array       # i32[T]
    entry: jax.Array     # i32[T]: each row's entry
    row_live: jax.Array  # bool[T]
    sib: jax.Array       # bool[B]: a parallel sample forking its leader
    lead: jax.Array      # i32[B]: its leader's entry

    @classmethod
    def of(cls, batch: StepBatch) -> "RowLayout":
        r = batch.rows
        ids = r.seq_ids
        num_tokens, num_entries = r.tokens.shape[0], ids.shape[0]
        live = ids >= 0
        q_lens = jnp.where(live, r.q_lens, 0)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])  # i32[B + 1]
        row = jnp.arange(num_tokens, dtype=jnp.int32)
        entry = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, num_entries - 1)  # i32[T]
        return cls(ids, live, jnp.where(live, ids, 0), q_lens, cu, row, entry, row < cu[-1],
                   live & (r.fork_from >= 0), jnp.clip(r.fork_from, 0, num_entries - 1))


class PageWork(NamedTuple):
    """The outcome of the round's page work."""
    ok: jax.Array        # bool[]: all of it succeeded (else the page state is as it was)
    old: jax.Array       # i32[B]: tokens cached per entry before its rows (hits included)
    new: jax.Array       # i32[B]: after them (a forked sample: its leader's)
    cow: object          # CopyOnWrite of the reservation


def release_slots(page_state, slots, seq_ids):
    """(page_state, slots) with slots seq_ids (i32[n], -1 = padding) released: their page references
    dropped (`pages.release`) and their slots no longer decoding."""
    page_state = pages.release(page_state, seq_ids)
    idx = jnp.where(seq_ids >= 0, seq_ids, slots.active.shape[0])
    return page_state, slots.replace(active=slots.active.at[idx].set(False, mode="drop"))


def own_pages(page_state):
    """(own i32[max_seqs], shared bool[max_seqs]) of `batch.DeviceCounts`: per slot, the pages only
    it references (refcount 1: releasing the slot alone frees them), and whether it references an
    uncached page another slot references too. Releasing a set of slots frees exactly the sum of
    their `own` when at most one of them is `shared` (a page freed by the release that no `own`
    counts is referenced by two released slots, both `shared`)."""
    ps = page_state
    held = pages.pages_for_tokens(ps.seq_lens, ps.page_size)  # i32[max_seqs]
    mine = jnp.arange(ps.block_tables.shape[1], dtype=jnp.int32)[None, :] < held[:, None]
    ref, cached = ps.refcounts[ps.block_tables], ps.cached[ps.block_tables]  # [max_seqs, pages_per_seq]
    own = jnp.sum(mine & (ref == 1), axis=1, dtype=jnp.int32)
    return own, jnp.any(mine & ~cached & (ref >= 2), axis=1)


def page_work(page_state, batch: StepBatch, lay: RowLayout):
    """(page_state, PageWork): evict, share hits, reserve the rows, fork samples; all or nothing."""
    po, ids, live = batch.pages, lay.ids, lay.live
    hit = live & (po.hit_tokens > 0)
    ps = pages.uncache(page_state, po.evict)
    ps, shared = pages.share(ps, jnp.where(hit, ids, -1), po.hit_tables, jnp.where(hit, po.hit_tokens, 0))
    old = jnp.where(live, ps.seq_lens[lay.safe], 0)  # i32[B] tokens cached before the rows (hits included)
    new = old + lay.q_lens
    ps, reserved, cow = pages.reserve(ps, jnp.where(live & (lay.q_lens > 0), ids, -1), new, return_cow=True)
    # Parallel samples: each sibling slot (empty) forks its leader's whole prompt (refcounts;
    # the shared partly filled last page is copied on the first write).
    ps, forked = pages.fork(ps, jnp.where(lay.sib, ids[lay.lead], 0), jnp.where(lay.sib, ids, -1))
    ok = shared & reserved & forked
    return select(ok, ps, page_state), PageWork(ok, old, jnp.where(lay.sib, new[lay.lead], new), cow)


class RaggedOut(NamedTuple):
    """What the ragged pass returns besides the state."""
    first: Sampled          # [B]: each entry's token
    tables: jax.Array       # i32[B, pages_per_seq]: block-table rows once prompt pages are cached
    copies: jax.Array       # i32[]: pages copied on write
    prompt: PromptLogprobs  # [T]


class RaggedCarry(NamedTuple):
    """The carry of the ragged pass's 0-or-1-iteration loop."""
    i: jax.Array
    cache: object
    ps: object
    slots: object
    out: RaggedOut


class BlockCarry(NamedTuple):
    """The carry of the loop over the ragged batch's blocks of rows."""
    j: jax.Array            # i32[]: blocks run
    cache: object
    logits: jax.Array       # f32[B, vocab]: at each entry's last row
    prompt: PromptLogprobs  # [R]


class RaggedStep:
    """The ragged pass of one round (static configuration; `__call__` is traced in the step).

    Args: model (EngineModel), shapes (EngineShapes), stop_ids i32[n], impl (attention),
      block_tokens (rows per model pass), prompt_chunk (rows per head pass of prompt logprobs).
    """

    def __init__(self, model, shapes, stop_ids, impl, block_tokens, prompt_chunk):
        self.model, self.shapes, self.stop_ids, self.impl = model, shapes, stop_ids, impl
        self.block_tokens, self.prompt_chunk = block_tokens, prompt_chunk
        self.tn = min(MAX_TOP_LOGPROBS, shapes.vocab_size)

    def empty(self, num_tokens: int, num_entries: int) -> RaggedOut:
        tn = self.tn
        prompt = PromptLogprobs(jnp.full((num_tokens,), jnp.nan, jnp.float32), jnp.zeros((num_tokens,), jnp.int32),
                                jnp.full((num_tokens, tn), -1, jnp.int32),
                                jnp.full((num_tokens, tn), -jnp.inf, jnp.float32))
        first = Sampled(jnp.zeros((num_entries,), jnp.int32), jnp.full((num_entries,), jnp.nan, jnp.float32),
                        jnp.full((num_entries, tn), -1, jnp.int32), jnp.full((num_entries, tn), -jnp.inf, jnp.float32))
        return RaggedOut(first, jnp.zeros((num_entries, self.shapes.pages_per_seq), jnp.int32), jnp.int32(0), prompt)

    def __call__(self, params, cache, page_state, slots, batch: StepBatch, lay: RowLayout, work: PageWork, lora=None):
        """(cache, page_state, slots, RaggedOut): the pass when batch.run_ragged and work.ok, else nothing.
        lora: the LoRA adapter slots (`jpa.engine.lora`), or None."""
        def body(c: RaggedCarry) -> RaggedCarry:
            return RaggedCarry(c.i + 1, *self._pass(params, c.cache, c.ps, c.slots, batch, lay, work, lora))

        init = RaggedCarry(jnp.int32(0), cache, page_state, slots,
                           self.empty(batch.rows.tokens.shape[0], lay.ids.shape[0]))
        c = lax.while_loop(lambda c: c.i < batch.run_ragged * work.ok.astype(jnp.int32), body, init)
        return c.cache, c.ps, c.slots, c.out

    def _pass(self, params, cache, ps, slots, batch, lay, work, lora=None):
        ps_, entry, safe = self.shapes.page_size, lay.entry, lay.safe
        cache, slots, copies = copy_on_write(cache, slots, work.cow)  # a forked sample's first token: its own last page
        pos = work.old[entry] + lay.row - lay.cu[entry]  # i32[T]
        page = jnp.take_along_axis(ps.block_tables[safe[entry]], (pos // ps_)[:, None], axis=1,
                                   mode="clip")[:, 0]
        slot_mapping = jnp.where(lay.row_live, page * ps_ + pos % ps_, -1)  # i32[T]
        tokens = jnp.where(batch.rows.decode_row[entry], slots.tokens[safe[entry]], batch.rows.tokens)
        logits, cache, prompt = self._blocks(params, cache, tokens, jnp.where(lay.row_live, pos, 0), slot_mapping,
                                             ps.block_tables[safe], work.old, lay.cu, entry, lay.cu[-1],
                                             jnp.where(lay.row_live, batch.prompt.targets, -1), lay.ids,
                                             None if lora is None else (lora, jnp.where(lay.row_live,
                                                                                        batch.rows.lora[entry], -1)))
        # Parallel samples: each sibling's slot takes its leader's recurrent states after the leader's final chunk.
        cache = fork_states(cache, jnp.where(lay.sib, lay.ids[lay.lead], -1), jnp.where(lay.sib, lay.ids, -1))
        slots = slots.write_tokens(tokens, slot_mapping)
        logits = jnp.where(lay.sib[:, None], logits[lay.lead], logits)  # a sample draws from its leader's logits
        first, slots, done = self._sample(logits, ps, slots, batch, lay, work)
        final = lay.live & batch.rows.final
        ps = pages.cache(ps, jnp.where(final, lay.ids, -1), batch.pages.cache_upto)
        tables = ps.block_tables[safe]  # i32[B, pages_per_seq], before the finished are released
        ps = pages.release(ps, jnp.where(done, lay.ids, -1))
        return cache, ps, slots, RaggedOut(first, tables, copies, prompt)

    def _sample(self, logits, ps, slots, batch, lay, work):
        """(Sampled [B], slots, done bool[B]): final chunks install their request's sampling state
        in the slot, then decode rows and final chunks sample (resumed requests keep their token)."""
        ids, live, safe, rows, sampling = lay.ids, lay.live, lay.safe, batch.rows, batch.sampling

        def put(a, v, where):  # a[ids[e]] = v[e] where where[e]
            return a.at[jnp.where(where, ids, self.shapes.max_seqs)].set(v.astype(a.dtype), mode="drop")

        start = live & rows.final
        slots = slots.replace(
            num_generated=put(slots.num_generated, sampling.num_generated, start),
            params=jax.tree_util.tree_map(lambda a, v: put(a, v, start), slots.params, sampling.params))
        row_slots = slots.rows(safe)
        # Structured outputs: the host's grammar mask of each constrained row (else all allowed).
        allowed = allowed_rows(batch.structured, logits.shape[-1])  # bool[B, vocab]
        sampled, sampled_lp, top_ids, top_lps = sample_slots(
            logits, row_slots.params, row_slots.num_generated, lambda: slots.history(ps.block_tables[safe]),
            work.new, self.stop_ids, allowed=allowed)
        emits = live & (rows.decode_row | rows.final)
        fresh = rows.decode_row | (sampling.resume_token < 0)
        tok = jnp.where(fresh, sampled, sampling.resume_token)
        lp = jnp.where(fresh, sampled_lp, jnp.nan)
        top_ids = jnp.where(fresh[:, None], top_ids, -1)   # a resumed token's were recorded before
        row_slots = row_slots.replace(num_generated=row_slots.num_generated + fresh.astype(jnp.int32))
        done = emits & fresh & finished(row_slots, tok, work.new, self.stop_ids)
        slots = slots.replace(tokens=put(slots.tokens, tok, emits),
                              num_generated=put(slots.num_generated, row_slots.num_generated, emits),
                              active=put(slots.active, ~done, emits))
        return Sampled(tok, lp, top_ids, top_lps), slots, done

    def _prompt_logprobs(self, params, hidden, targets, b0, acc: PromptLogprobs) -> PromptLogprobs:
        """Prompt logprobs of one block's rows, written into acc at rows b0.. (see StepResult).

        The head runs over `prompt_chunk` rows at a time, and only over chunks where some row asks
        (targets >= 0), under lax.cond: a round without prompt logprobs pays for the test alone.

        Args: hidden f32[tb, d_model]; targets i32[tb] (the next prompt token, -1 = not asked); b0
          i32[] the block's first row; acc [R] over R >= b0 + tb + prompt_chunk rows.
        """
        c = self.prompt_chunk
        num_chunks = -(-hidden.shape[0] // c)
        pad = num_chunks * c - hidden.shape[0]
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))  # [num_chunks * c, d_model]
        targets = jnp.pad(targets, (0, pad), constant_values=-1)
        tn = acc.top_ids.shape[1]

        def chunk(i, acc):
            r0 = i * c
            t = lax.dynamic_slice_in_dim(targets, r0, c)  # i32[c]

            def compute(acc):
                logits = self.model.head(params, lax.dynamic_slice_in_dim(hidden, r0, c)).astype(jnp.float32)
                # log_softmax as the sampler takes a greedy token's logprob (`sample_with_logprobs`): the
                # same operations, so a scoring pass gives the sampler's bits (batch-invariant mode)
                lsm = logits - logsumexp_at(logits, jnp.max(logits, axis=-1))[:, None]  # f32[c, vocab]
                lp = jnp.take_along_axis(lsm, jnp.maximum(t, 0)[:, None], axis=1)[:, 0]
                rank = jnp.sum(lsm >= lp[:, None], axis=-1, dtype=jnp.int32)  # vLLM's rank: 1 = the top
                top_lps, top_ids = lax.top_k(lsm, tn)
                want = t >= 0

                def put(a, v):  # rows that asked take v; the others keep what they hold
                    old = lax.dynamic_slice_in_dim(a, b0 + r0, c)
                    w = want.reshape((c,) + (1,) * (v.ndim - 1))
                    return lax.dynamic_update_slice_in_dim(a, jnp.where(w, v.astype(a.dtype), old), b0 + r0, 0)

                return PromptLogprobs(put(acc.logprobs, lp), put(acc.ranks, rank), put(acc.top_ids, top_ids),
                                      put(acc.top_logprobs, top_lps))

            return lax.cond(jnp.any(t >= 0), compute, lambda a: a, acc)

        return lax.fori_loop(0, num_chunks, chunk, acc)

    def _blocks(self, params, cache, tokens, positions, slot_mapping, tables, old, cu, entry, num_rows, targets, ids,
                lora=None):
        """The model over the ragged batch's first num_rows rows, `block_tokens` rows at a time.

        A while_loop over the live blocks only, so a round costs its live rows rounded up to a
        block, not the whole budget (on a CPU, where padding rows cost as much as real ones).
        Blocks run in row order; a sequence cut by a block boundary is a chunk ending mid-way
        in the first block and a chunk after a cached prefix in the next, exactly what
        `ragged_paged_attention` serves. Each block is re-based so its sequences are entries
        0..n_b - 1 (no live sequence without rows).

        With the model's ragged_hidden/head pair (EngineModel), each block's hidden rows give the
        last rows' logits through the head, and the prompt logprobs of rows that ask
        (`_prompt_logprobs`); without it, `ragged` gives the logits and no row can ask.

        Args: tokens, positions, slot_mapping i32[T]; tables i32[B, pages_per_seq] per entry; old
          i32[B] tokens cached per entry before the step; cu i32[B + 1] row offsets; entry i32[T]
          the entry of each row; targets i32[T] each row's next prompt token where it asks for
          prompt logprobs (-1 elsewhere); ids i32[B] each entry's slot (-1 = padding), the state slot a
          model with recurrent state reads and writes (`jpa.engine.states`; -1 for entries without rows in
          the block); lora None, or (the LoRA adapter slots, i32[T] each row's slot).

        Returns (logits f32[B, vocab] at each entry's last row, cache, PromptLogprobs [T]).
        """
        tb, num_entries, num_tokens = self.block_tokens, old.shape[0], tokens.shape[0]
        pad = lambda a, v: jnp.pad(a, (0, tb), constant_values=v)  # noqa: E731  (whole-block slices)
        tokens, positions, slot_mapping = pad(tokens, 0), pad(positions, 0), pad(slot_mapping, -1)
        entry, targets = pad(entry, num_entries - 1), pad(targets, -1)
        row_lora = None if lora is None else pad(lora[1], -1)
        k = jnp.arange(num_entries + 1, dtype=jnp.int32)
        hidden_pair = has_hidden(self.model)
        prompt = self.empty(num_tokens + tb + self.prompt_chunk, 1).prompt  # every chunk write of every block fits

        def block(carry: BlockCarry) -> BlockCarry:
            j, cache, logits, prompt = carry
            b0 = j * tb
            b1 = jnp.minimum(b0 + tb, num_rows)
            e0, e1 = entry[b0], entry[b1 - 1]  # the block's entries: e0..e1
            e = jnp.minimum(e0 + k, num_entries)  # i32[B + 1] block entry -> step entry
            cu_b = jnp.clip(cu[e], b0, b1) - b0  # i32[B + 1]
            e = e[:-1]
            in_block = k[:-1] <= e1 - e0
            seq_b = jnp.where(in_block, old[jnp.minimum(e, num_entries - 1)] + jnp.clip(cu[e + 1], b0, b1) - cu[e], 0)
            sl = lambda a: lax.dynamic_slice_in_dim(a, b0, tb)  # noqa: E731
            args = (sl(tokens), sl(positions), sl(slot_mapping), tables[jnp.minimum(e, num_entries - 1)], seq_b,
                    cu_b, e1 - e0 + 1)
            state_slots = jnp.where(in_block & (cu_b[1:] > cu_b[:-1]), ids[jnp.minimum(e, num_entries - 1)], -1)
            kw = {} if lora is None else dict(lora=(lora[0], sl(row_lora)))
            if hidden_pair:
                hidden, cache = call_model(self.model.ragged_hidden, params, cache, *args, impl=self.impl,
                                           state_slots=state_slots, **kw)
                out = self.model.head(params, hidden[jnp.clip(cu_b[1:] - 1, 0, tb - 1)])  # as `ragged` does
                prompt = self._prompt_logprobs(params, hidden, sl(targets), b0, prompt)
            else:
                out, cache = call_model(self.model.ragged, params, cache, *args, impl=self.impl,
                                        state_slots=state_slots, **kw)
            # Entries whose last row is in this block take their logits from it.
            ends = in_block & (cu[e + 1] <= b1) & (cu[e + 1] > cu[e])
            logits = logits.at[jnp.where(ends, e, num_entries)].set(out, mode="drop")
            return BlockCarry(j + 1, cache, logits, prompt)

        init = BlockCarry(jnp.int32(0), cache, jnp.zeros((num_entries, self.shapes.vocab_size), jnp.float32), prompt)
        _, cache, logits, prompt = lax.while_loop(lambda c: c.j * tb < num_rows, block, init)
        return logits, cache, jax.tree_util.tree_map(lambda a: a[:num_tokens], prompt)
