"""The verify loop: the engine's decode steps, with plain decoding as the no-draft case.

Up to `max_steps` steps inside one `lax.while_loop`. Each step every active slot feeds its pending
token and num[b] <= k drafts from the proposer (`jpa.engine.speculative`: `NoDraft` k = 0,
`NgramProposer`, `DraftModelProposer`); every row is sampled exactly as plain decoding samples it
(the request's key for that token index, controls and filters), and the slot emits its rows'
tokens up to and including the first that differs from its draft (or the first that stops it).
With k = 0 that is one token per active slot: plain decoding, the same code.

The page work of step i+1 is computed at the end of step i (`Lookahead`), so the loop condition
can stop before a step the pool cannot serve, with no lax.cond around the model (a conditional
would have to carry the whole cache through both branches). Plain decoding appends one token per
active slot (`jpa.kv.pages.append`); with drafts the rows are reserved (`jpa.kv.pages.reserve`) and
rejected drafts are rolled back by `jpa.kv.pages.truncate` in the step. Parallel samples forked from
one prompt share its partly filled last page: the first write of each copies it (copy-on-write)
first. Stop checks (EOS, max_new_tokens, length limit) run on the device and finished slots
release their pages inside the loop. A step where no slot has a draft runs the plain decode pass
over max_seqs rows (no extra rows computed).

A model with recurrent state (`jpa.engine.states`): a verify pass advances each slot's states through
all its rows, drafts included, so a slot that rejected some drafts gets its states from before the
pass back and runs its kept rows again (`replay`, under a 0-or-1 loop: steps with no rejection pay
nothing).

Outputs: `Sampled` with `width` = k + 1 rows per step (row i * width + j: a slot's j-th token of
step i, -1 past what it emitted), the steps run, the page `Usage`, and `SpecCounts`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jpa.kv import pages
from jpa.ops.dispatch import current_target
from jpa.ops.ragged import query_rows_at_most
from jpa.engine.batch import Sampled, SpecCounts
from jpa.engine.device import Usage, copy_on_write, finished, slot_mapping_at, tally
from jpa.engine.sampling import MAX_TOP_LOGPROBS, sample_rows, sample_slots
from jpa.engine.speculative import accepted_prefix
from jpa.engine.states import StateCache, call_model, copy_slots


class Lookahead(NamedTuple):
    """The next step's inputs, computed at the end of the previous one."""
    lens: jax.Array      # i32[B]: tokens cached per slot (the pending one is not; 0 when idle)
    drafts: jax.Array    # i32[B, k]
    num: jax.Array       # i32[B]: drafts each slot verifies
    ps: object           # PageState with the step's rows reserved
    ok: jax.Array        # bool[]: the reservation succeeded (else the loop stops before the step)
    cow: object          # CopyOnWrite of the reservation


class LoopCarry(NamedTuple):
    """The verify loop's carry."""
    i: jax.Array         # i32[]: steps run
    cache: object
    ps: object           # the committed PageState
    slots: object
    out: Sampled         # [steps_per_call * width, B]
    nxt: Lookahead
    usage: Usage
    counts: SpecCounts


class VerifyLoop:
    """The decode steps of a round (static configuration; `__call__` is traced in the step).

    Args:
      model: the EngineModel (a `DraftPair` with a draft model).
      shapes: EngineShapes.
      stop_ids: i32[n] engine stop tokens.
      impl: attention implementation.
      proposer: a proposer of `jpa.engine.speculative` (NoDraft for plain decoding).
      spec: the SpeculativeConfig (None without speculation); verify_rows: rows of a verify pass.
    """

    def __init__(self, model, shapes, stop_ids, impl, proposer, spec=None, verify_rows=None):
        self.model, self.shapes, self.stop_ids, self.impl = model, shapes, stop_ids, impl
        self.proposer, self.spec, self.verify_rows = proposer, spec, verify_rows
        self.k = proposer.k
        self.width = self.k + 1

    # ------------------------------------------------------------------ look-ahead

    def _cap(self, slots, lens):
        """i32[B]: drafts each slot may verify. Never past what the request may still emit
        (max_new_tokens, its length limit); the rows left after one per active slot are shared
        equally."""
        act, p, spec = slots.active, slots.params, self.spec
        room = jnp.minimum(p.max_new - slots.num_generated - 1, p.max_len - lens - 2)
        n_act = jnp.sum(act, dtype=jnp.int32)
        share = (self.verify_rows - n_act) // jnp.maximum(n_act, 1)
        if spec.disable_by_batch_size is not None:
            share = jnp.where(n_act >= spec.disable_by_batch_size, 0, share)
        return jnp.where(act, jnp.clip(jnp.minimum(room, share), 0, self.k), 0)

    def lookahead(self, ps, slots) -> Lookahead:
        act = slots.active
        lens = jnp.where(act, ps.seq_lens, 0)  # tokens cached (the pending one is not)
        num_seqs = act.shape[0]
        if self.k == 0:   # plain decoding: one token per active slot
            ps1, _, ok, cow = pages.append(ps, act)
            return Lookahead(lens, jnp.zeros((num_seqs, 0), jnp.int32), jnp.zeros((num_seqs,), jnp.int32), ps1, ok,
                             cow)
        cap = self._cap(slots, lens)
        drafts, num = self.proposer.propose(ps, slots, lens, cap)
        num = jnp.minimum(num, cap)
        ids = jnp.where(act, jnp.arange(num_seqs, dtype=jnp.int32), -1)
        plain = lambda: pages.reserve(ps, ids, jnp.where(act, lens + 1, 0), return_cow=True)  # noqa: E731
        ps1, ok1, cow1 = pages.reserve(ps, ids, jnp.where(act, lens + 1 + num, 0), return_cow=True)
        # Pages too short for the drafts: the plain step (one token each) may still fit.
        retry = ~ok1 & jnp.any(num > 0)
        ps1, ok1, cow1 = lax.cond(retry, lambda _: plain(), lambda _: (ps1, ok1, cow1), None)
        return Lookahead(lens, drafts, jnp.where(retry, 0, num), ps1, ok1, cow1)

    # ------------------------------------------------------------------ the passes

    def decode_pass(self, params, cache, ps, slots, lens, state_slots, lora=None):
        """The plain decode pass over max_seqs rows: per slot [num_seqs, width] (tokens, logprobs,
        top ids, top logprobs), the row repeated. state_slots i32[num_seqs]: each row's engine slot (the
        state slot of a model with recurrent state; idle rows read and write none). lora: the LoRA adapter
        slots, or None (each slot runs its own adapter, `SlotParams.lora`)."""
        act = slots.active
        slot_mapping = slot_mapping_at(ps.block_tables, lens, self.shapes.page_size, act)
        seq_lens = jnp.where(act, lens + 1, 0)
        inputs = (slots.tokens, seq_lens, slot_mapping, ps.block_tables, jnp.where(act, state_slots, -1),
                  slots.params.lora)
        pad = decode_pad_rows(act.shape[0])
        if pad:   # idle rows: no context, nothing written
            inputs = tuple(jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], v, a.dtype)])
                           for a, v in zip(inputs, (0, 0, -1, 0, -1)))
        *inputs, row_states, row_lora = inputs
        kw = {} if lora is None else dict(lora=(lora, row_lora))
        logits, cache = call_model(self.model.decode, params, cache, *inputs, impl=self.impl, state_slots=row_states,
                                   **kw)
        logits = logits[: act.shape[0]]
        slots = slots.write_tokens(slots.tokens, slot_mapping)
        y = sample_slots(logits, slots.params, slots.num_generated, lambda: slots.history(ps.block_tables),
                         seq_lens, self.stop_ids)
        return cache, slots, tuple(jnp.repeat(a[:, None], self.width, axis=1) for a in y)

    def _rows(self, ps, slots, lens, drafts, q):
        """The ragged pass of q[b] rows of slot b (its pending token, then its drafts), slots with rows first:
        (the model's ragged arguments, order i32[B] (entry -> slot), cu i32[B + 1], each row's slot s and
        index j in its slot's rows, i32[verify_rows])."""
        k, rows, ps_ = self.k, self.verify_rows, self.shapes.page_size
        num_seqs = q.shape[0]
        order = jnp.argsort(q <= 0, stable=True).astype(jnp.int32)  # entries: slots with rows first
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q[order], dtype=jnp.int32)])
        row = jnp.arange(rows, dtype=jnp.int32)
        e = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, num_seqs - 1).astype(jnp.int32)
        s, j = order[e], row - cu[e]
        live = row < cu[-1]
        tok = jnp.where(j == 0, slots.tokens[s], jnp.take_along_axis(drafts[s], jnp.clip(j - 1, 0, k - 1)[:, None],
                                                                      axis=1)[:, 0])
        tok = jnp.where(live, tok, 0)
        pos = jnp.where(live, lens[s] + j, 0)
        slot_mapping = slot_mapping_at(ps.block_tables[s], pos, ps_, live)
        seq = jnp.where(q > 0, lens + q, 0)[order]
        args = (tok, pos, slot_mapping, ps.block_tables[order], seq, cu, jnp.sum(q > 0, dtype=jnp.int32))
        return args, order, cu, s, j

    def verify_pass(self, params, cache, ps, slots, lens, drafts, num, state_slots, lora=None):
        """Every active slot's pending token and drafts as one entry of a ragged pass of
        `verify_rows` rows: per slot [num_seqs, width] of rows 0..num. state_slots: each slot's
        state slot (a model with recurrent state); lora: the LoRA adapter slots, or None."""
        act, rows = slots.active, self.verify_rows
        args, order, cu, s, j = self._rows(ps, slots, lens, drafts, jnp.where(act, 1 + num, 0))
        tok, slot_mapping = args[0], args[2]
        # At most width rows a sequence: the model's attention may read each sequence's KV once
        # for all of them (`jpa.ops.ragged.query_rows_at_most`: one kernel call on Hopper).
        with query_rows_at_most(self.width):
            live = jnp.arange(rows, dtype=jnp.int32) < cu[-1]
            kw = {} if lora is None else dict(lora=(lora, jnp.where(live, slots.params.lora[s], -1)))
            hidden, cache = self.proposer.target_hidden(self.model, params, cache, args, self.impl,
                                                        state_slots=jnp.where(act, state_slots, -1)[order], **kw)
        slots = slots.write_tokens(tok, slot_mapping)
        rs = slots.rows(s)
        # `sample_rows`: its temporaries do not scale with rows x vocab (chunks of rows on a CPU; on a
        # GPU the sampler reads the logits twice and keeps [rows, 4096] candidates).
        y = sample_rows(self.model.head(params, hidden), rs.params, rs.num_generated + j,
                        lambda: slots.history(ps.block_tables[s]), lens[s] + 1 + j, self.stop_ids)
        start = cu[jnp.argsort(order)]  # i32[num_seqs]: each slot's first row
        ridx = jnp.clip(start[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None, :], 0, rows - 1)
        return cache, slots, tuple(a[ridx] for a in y)

    def passes(self, params, cache, ps, slots, nxt: Lookahead, state_slots, lora=None):
        """The step's model pass(es): (cache, slots, drafts, (y, lp, top_ids, top_lps) [B, width])."""
        if self.k == 0:
            cache, slots, ys = self.decode_pass(params, cache, ps, slots, nxt.lens, state_slots, lora)
            return cache, slots, nxt.drafts, ys
        num_seqs, tn = slots.active.shape[0], min(MAX_TOP_LOGPROBS, self.shapes.vocab_size)
        w = self.width
        ys = (jnp.zeros((num_seqs, w), jnp.int32), jnp.zeros((num_seqs, w), jnp.float32),
              jnp.zeros((num_seqs, w, tn), jnp.int32), jnp.zeros((num_seqs, w, tn), jnp.float32))
        drafting = jnp.any(nxt.num > 0)
        cache, drafts = self.proposer.draft(params, cache, ps, slots, nxt.lens, nxt.num, nxt.drafts)
        cache, slots, ys = _once(lambda c, sl: self.verify_pass(params, c, ps, sl, nxt.lens, drafts, nxt.num,
                                                                state_slots, lora), drafting, cache, slots, ys)
        cache, slots, ys = _once(lambda c, sl: self.decode_pass(params, c, ps, sl, nxt.lens, state_slots, lora),
                                 ~drafting, cache, slots, ys)
        return cache, slots, drafts, ys

    def replay(self, params, cache, before, ps, slots, lens, drafts, redo, emitted, state_slots):
        """Recurrent state under speculation, by recompute: the slots in `redo` (bool[B]) ran rows of drafts
        they rejected, which advanced their states. Their states go back to `before` (the states before the
        verify pass) and their kept rows (the first emitted[b]: the pending token and the accepted drafts)
        run again; the other slots keep the verify pass's states. The rows' K/V are written again (the same
        values the verify pass wrote). Returns the cache (a StateCache)."""
        keep = jnp.where(redo, state_slots, -1)   # i32[B] engine slots put back
        states = copy_slots(cache.states, before, keep, keep)
        args, order, *_ = self._rows(ps, slots, lens, drafts, jnp.where(redo, emitted, 0))
        with query_rows_at_most(self.width):
            _, cache = self.proposer.target_hidden(self.model, params, cache.replace(states=states), args, self.impl,
                                                   state_slots=keep[order])
        return cache

    # ------------------------------------------------------------------ acceptance and the loop

    def accept(self, slots, y, lens, drafts, num):
        """(accepted drafts a, stopped, emitted) i32/bool[B]: emitted token j is decode step j of
        plain decoding, so the stop checks run token by token."""
        act, jj = slots.active, jnp.arange(self.width, dtype=jnp.int32)
        a = jnp.where(act, accepted_prefix(y, drafts, num), 0) if self.k else jnp.zeros_like(lens)
        stops = jnp.stack([finished(slots.replace(num_generated=slots.num_generated + t + 1), y[:, t],
                                    lens + 1 + t, self.stop_ids) for t in range(self.width)], axis=1)
        stops = stops & (jj[None, :] <= a[:, None])
        stopped = act & jnp.any(stops, axis=1)
        emitted = jnp.where(act, jnp.where(stopped, jnp.argmax(stops, axis=1) + 1, a + 1), 0).astype(jnp.int32)
        return a, stopped, emitted

    def step(self, params, c: LoopCarry, state_slots, lora=None) -> LoopCarry:
        nxt = c.nxt
        cache, slots, n = copy_on_write(c.cache, c.slots, nxt.cow)
        ps, act, lens = nxt.ps, slots.active, nxt.lens
        slot_ids = jnp.arange(act.shape[0], dtype=jnp.int32)
        before = cache.states if self.k and isinstance(cache, StateCache) else None
        cache, slots, drafts, (y, lp, top_ids, top_lps) = self.passes(params, cache, ps, slots, nxt, state_slots,
                                                                      lora)
        a, stopped, emitted = self.accept(slots, y, lens, drafts, nxt.num)
        if before is not None:   # recurrent state: the rows of rejected drafts must not have advanced it
            redo = act & ~stopped & (emitted < 1 + nxt.num)
            cache, _, _ = _once(lambda c, sl: (self.replay(params, c, before, ps, sl, lens, drafts, redo, emitted,
                                                           state_slots), sl, ()), jnp.any(redo), cache, slots, ())
        emit = jnp.arange(self.width)[None, :] < emitted[:, None]  # bool[num_seqs, width]
        last = jnp.take_along_axis(y, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
        slots = slots.replace(tokens=jnp.where(act, last, slots.tokens), num_generated=slots.num_generated + emitted)
        if self.k:   # rejected drafts rolled back
            ps = pages.truncate(ps, jnp.where(act, slot_ids, -1), jnp.where(act, lens + emitted, 0))
        ps = pages.release(ps, jnp.where(stopped, slot_ids, -1))
        slots = slots.replace(active=act & ~stopped)
        r0 = c.i * self.width
        put = lambda buf, v: lax.dynamic_update_slice_in_dim(buf, jnp.moveaxis(v, 0, 1), r0, 0)  # noqa: E731
        out = Sampled(put(c.out.tokens, jnp.where(emit, y, -1)), put(c.out.logprobs, lp),
                      put(c.out.top_ids, jnp.where(emit[..., None], top_ids, -1)), put(c.out.top_logprobs, top_lps))
        counts = c.counts
        if self.k:
            counts = SpecCounts(counts.drafted + nxt.num, counts.accepted + a,
                                counts.steps + (nxt.num > 0).astype(jnp.int32),
                                counts.accepted_per_pos + jnp.sum(jnp.arange(self.k)[None, :] < a[:, None], axis=0,
                                                                  dtype=jnp.int32))
        return LoopCarry(c.i + 1, cache, ps, slots, out, self.lookahead(ps, slots), tally(c.usage, n, nxt.ps), counts)

    def __call__(self, params, cache, page_state, slots, max_steps, state_slots=None, lora=None):
        """Up to max_steps (a traced scalar <= steps_per_call) steps of the active slots (lora: the LoRA
        adapter slots, or None).

        state_slots: i32[num_seqs], the engine slot of each of the loop's slots (the step-shape ladder's
        gathered sub-slots; default 0..num_seqs-1): the state slots of a model with recurrent state.

        Returns (cache, page_state, slots, out: Sampled, steps i32[], usage: Usage, counts: SpecCounts).
        """
        num_seqs, tn = slots.active.shape[0], min(MAX_TOP_LOGPROBS, self.shapes.vocab_size)  # max_seqs, or a ladder shape's rows
        total = self.shapes.steps_per_call * self.width
        out = Sampled(jnp.full((total, num_seqs), -1, jnp.int32), jnp.zeros((total, num_seqs), jnp.float32),
                      jnp.full((total, num_seqs, tn), -1, jnp.int32),
                      jnp.full((total, num_seqs, tn), -jnp.inf, jnp.float32))
        zeros = jnp.zeros((num_seqs,), jnp.int32)
        counts = SpecCounts(zeros, zeros, zeros, jnp.zeros((max(self.k, 1),), jnp.int32))
        if state_slots is None:
            state_slots = jnp.arange(num_seqs, dtype=jnp.int32)
        init = LoopCarry(jnp.int32(0), cache, page_state, slots, out, self.lookahead(page_state, slots),
                         Usage.zero(), counts)
        c = lax.while_loop(lambda c: (c.i < max_steps) & c.nxt.ok & jnp.any(c.slots.active),
                           lambda c: self.step(params, c, state_slots, lora), init)
        return c.cache, c.ps, c.slots, c.out, c.i, c.usage, c.counts


def decode_pad_rows(num_seqs: int) -> int:
    """Idle rows the plain decode pass adds to its model pass of num_seqs rows: one on a GPU when
    num_seqs is 1, else none. XLA's GPU pipeline rewrites a one-row product with a small weight
    (Llama-3-8B's wk and wv, [4096, 1024]) into a multiply and a reduce that materializes the
    float32 product, 2.2 GB a step for 8B (`jpa.tools.traffic`); a two-row gemm reads the weight in
    place through cuBLAS. The CPU program is unchanged."""
    return 1 if num_seqs == 1 and current_target().platform == "gpu" else 0


def _once(run, pred, cache, slots, ys):
    """run(cache, slots) under a while_loop of 0 or 1 iterations (the cache is carried in place)."""
    def body(c):
        _, cache, slots, _ = c
        return (jnp.int32(1),) + run(cache, slots)
    return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), body, (jnp.int32(0), cache, slots, ys))[1:]
