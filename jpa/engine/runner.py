"""The device side of the engine: jitted prefill and multi-step decode over donated state.

Everything the decode loop needs lives on the device: the KV cache, the PageState, and per-slot
state (`Slots`: pending token, sampling parameters, counters). One call of the decode loop runs
up to `steps_per_call` decode steps inside a `lax.while_loop`, allocating pages with
`jpa.pages.append`, sampling, and checking stop conditions (EOS, max_new_tokens, length limit)
on the device; finished sequences release their pages inside the loop. The loop ends early when
every slot is idle or when the pool runs out of pages (the host then preempts and calls again).

Every call reads back, in the same device->host transfer as its results, the PageState's free
page count and seq_lens: the scheduler's only source of page counts.

The model is anything that meets `jpa.engine.model.EngineModel`; its params are an argument of
every compiled function (never a closed-over constant) and the cache, page state and slots are
donated.

Attention backend: the decode loop passes `attention_impl` to the model's decode. With "auto",
`jpa.paged_decode` picks the kernel for the device the loop is compiled for while the loop is
traced, with the loop's exact shapes (the self-check runs concretely then, once per
configuration). What was picked is read off the compiled program (`attention`), so the summary
reports what actually runs.

Tensor parallelism (`mesh` with a "tp" axis): the cache pools are sharded on their kv-head axis;
page state, slots and every host input are replicated, so page allocation, sampling and stop
checks run identically on every device and the host reads one copy. The model (sharded by its
`shard(mesh)`) runs attention per device. Every compiled call pins its outputs to the same
shardings as its inputs, so one executable serves every call.
"""

import dataclasses
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa import pages
from jpa.cache import CacheConfig, KVCache, copy_pages
from jpa.engine.model import EngineModel, check_model
from jpa.engine.sampling import sample_with_logprobs
from jpa.sharding import POOL, REPLICATED, named


@flax.struct.dataclass
class Slots:
    """Per-slot decode state, all arrays [max_seqs]."""
    tokens: jax.Array         # i32: the pending token (sampled, not yet in the cache)
    active: jax.Array         # bool: slot is decoding
    num_generated: jax.Array  # i32: tokens generated so far (pending one included)
    max_new: jax.Array        # i32: the request's max_new_tokens
    max_len: jax.Array        # i32: longest sequence (prompt + generated) the slot may reach
    temperature: jax.Array    # f32: 0 = greedy
    top_k: jax.Array          # i32: 0 = off
    top_p: jax.Array          # f32: 1 = off
    seed: jax.Array           # i32
    ignore_eos: jax.Array     # bool

    @classmethod
    def empty(cls, max_seqs: int) -> "Slots":
        z = lambda dt: jnp.zeros((max_seqs,), dt)
        return cls(z(jnp.int32), z(bool), z(jnp.int32), z(jnp.int32), z(jnp.int32), z(jnp.float32),
                   z(jnp.int32), jnp.ones((max_seqs,), jnp.float32), z(jnp.int32), z(bool))


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Host-side values written into a slot at admission (one entry per prefill row)."""
    max_new: int
    max_len: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    ignore_eos: bool
    num_generated: int     # > 0 when resuming a preempted request
    resume_token: int      # its pending token, or -1 to sample from the prefill logits


def _row_columns(n: int, make) -> dict:
    """RowParams as columns of n entries: {field: make((n,), dtype)}."""
    return {f.name: make((n,), np.float32 if f.name in ("temperature", "top_p") else np.bool_ if f.name == "ignore_eos"
                         else np.int32) for f in dataclasses.fields(RowParams)}


def _copy_on_write(cache, cow):
    """(cache with pages cow.src copied to cow.dst (`jpa.copy_pages`), pages copied), the copy
    made only when some pair is live:
    a while_loop of 0 or 1 iterations, so steps without a fork cost no copy pass and the cache is
    carried in place."""
    any_copy = jnp.any(cow.dst >= 0).astype(jnp.int32)
    _, cache = lax.while_loop(lambda c: c[0] < any_copy,
                              lambda c: (c[0] + 1, copy_pages(c[1], cow.src, cow.dst)), (jnp.int32(0), cache))
    return cache, jnp.sum(cow.dst >= 0, dtype=jnp.int32)


def _finished(slots, next_tok, seq_lens, stop_ids):
    """bool[B]: which slots stop after emitting next_tok (their cache holds seq_lens tokens)."""
    is_stop = jnp.any(next_tok[:, None] == stop_ids[None, :], axis=-1) & ~slots.ignore_eos
    # The next token would go to position seq_lens; it must stay below max_len to be fed back.
    return is_stop | (slots.num_generated >= slots.max_new) | (seq_lens + 1 >= slots.max_len)


# Custom-call targets of the Pallas GPU kernels in a compiled program's HLO.
KERNEL_CALLS = (("mosaic", 'custom_call_target="mosaic_gpu'), ("triton", 'custom_call_target="__gpu$xla.gpu.triton"'))
DONATE = (1, 2, 3)  # cache, page state, slots: updated in place by every compiled call
# Outputs of the compiled calls: (cache, page state, slots, tokens, logprobs, steps, free, seq_lens) for
# decode; (cache, page state, slots, tokens, logprobs, done, ok, free, seq_lens) for prefill; the
# unified step's: (cache, page state, slots, tokens, logprobs, ok, out, out_lp, steps, free, seq_lens,
# active, final tables, pages copied on write); a request it finished is one no longer active.
DECODE_OUTPUTS, PREFILL_OUTPUTS, STEP_OUTPUTS = 8, 9, 14


def attention_in(hlo_text: str) -> str:
    """Which attention implementation a compiled program runs: "mosaic", "triton" or "xla"."""
    return next((name for name, call in KERNEL_CALLS if call in hlo_text), "xla")


class ModelRunner:
    """Owns the device state of one engine and the compiled functions that advance it.

    With `allocate=False` the state is abstract (`jax.ShapeDtypeStruct`s, nothing allocated): such
    a runner only serves `state()` and the traced `_decode_impl`/`_prefill_impl`, e.g. to compile
    the engine's steps for a GPU that is not attached (scripts/gpu_compile_check.py).
    """

    def __init__(self, model: EngineModel, cache_config: CacheConfig, *, max_seqs: int, pages_per_seq: int,
                 steps_per_call: int, stop_ids, attention_impl: str = "auto", allocate: bool = True,
                 mesh=None, block_tokens: int | None = None):
        check_model(model)
        self.mesh = mesh
        self.model, self.params = model, model.params
        self.cache_config = cache_config
        self.max_seqs, self.pages_per_seq, self.steps_per_call = max_seqs, pages_per_seq, steps_per_call
        self.attention_impl = attention_impl
        self._block_tokens = block_tokens
        self.block_tokens = None  # rows per model pass of the ragged step, fixed at its compile
        self.attention = None  # the implementation in the compiled decode loop, once compiled
        self._pool = None if mesh is None else named(mesh, POOL)
        self._rep = None if mesh is None else named(mesh, REPLICATED)
        make = lambda f, sharding: self._make(f, sharding, allocate)  # noqa: E731
        self.cache = make(lambda: KVCache.create(cache_config), self._pool)
        self.page_state = make(lambda: pages.init(cache_config.num_pages, max_seqs, pages_per_seq,
                                                  cache_config.page_size), self._rep)
        self.slots = make(lambda: Slots.empty(max_seqs), self._rep)
        self.stop_ids = jnp.asarray(sorted(set(stop_ids)) or [-1], jnp.int32)
        self.decode_traces = 0
        self.prefill_traces = 0
        self.step_traces = 0
        self.cow_copies = 0  # pages copied on write by the unified step (parallel samples' shared last pages)
        self.compile_seconds = 0.0
        self._decode_exe = None
        self._step_exe = None
        self._prefill_exe = {}
        self._retire = jax.jit(self._retire_impl, donate_argnums=(0, 1),
                               **({} if mesh is None else dict(out_shardings=self._rep)))
        self._uncache = jax.jit(pages.uncache, donate_argnums=(0,),
                                **({} if mesh is None else dict(out_shardings=self._rep)))

    @property
    def compiles(self) -> int:
        """Programs compiled so far (decode loop, prefill shapes and the unified step)."""
        return self.decode_traces + self.prefill_traces + self.step_traces

    def _make(self, f, sharding, allocate):
        """f() (device state), created directly in `sharding` under a mesh (never whole on one device)."""
        if not allocate:
            shapes = jax.eval_shape(f)
            if sharding is None:
                return shapes
            return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                          shapes)
        return f() if sharding is None else jax.jit(f, out_shardings=sharding)()

    def _put(self, tree):
        """Host inputs of a compiled call, replicated over the mesh (as they are given without one)."""
        return tree if self.mesh is None else jax.device_put(tree, self._rep)

    # ------------------------------------------------------------------ traced functions

    def _prefill_impl(self, params, cache, page_state, slots, tokens, seq_ids, lens, rows):
        self.prefill_traces += 1
        num_rows, width = tokens.shape
        page_state, ok = pages.reserve(page_state, seq_ids, lens)
        slot_mapping = pages.slot_mapping_for(page_state, seq_ids, 0, lens, width=width)  # i32[A, T]
        safe = jnp.where(seq_ids >= 0, seq_ids, 0)
        tables = page_state.block_tables[safe]  # i32[A, pages_per_seq]
        logits, cache = self.model.prefill(params, cache, tokens, jnp.zeros_like(lens), lens, slot_mapping, tables)
        sampled, sampled_lp = sample_with_logprobs(logits, rows["temperature"], rows["top_k"], rows["top_p"], rows["seed"],
                         rows["num_generated"])
        fresh = rows["resume_token"] < 0
        tok = jnp.where(fresh, sampled, rows["resume_token"])  # i32[A]
        lp = jnp.where(fresh, sampled_lp, jnp.nan)  # f32[A]; a resumed token's was recorded before
        n_gen = rows["num_generated"] + fresh.astype(jnp.int32)
        live = (seq_ids >= 0) & ok
        idx = jnp.where(live, seq_ids, self.max_seqs)  # rows that are padding are dropped
        put = lambda a, v: a.at[idx].set(v.astype(a.dtype), mode="drop")
        slots = slots.replace(
            tokens=put(slots.tokens, tok), num_generated=put(slots.num_generated, n_gen),
            max_new=put(slots.max_new, rows["max_new"]), max_len=put(slots.max_len, rows["max_len"]),
            temperature=put(slots.temperature, rows["temperature"]), top_k=put(slots.top_k, rows["top_k"]),
            top_p=put(slots.top_p, rows["top_p"]), seed=put(slots.seed, rows["seed"]),
            ignore_eos=put(slots.ignore_eos, rows["ignore_eos"]))
        row_slots = jax.tree_util.tree_map(lambda a: a[safe], slots)
        done = live & fresh & _finished(row_slots, tok, lens, self.stop_ids)
        slots = slots.replace(active=put(slots.active, live & ~done))
        page_state = pages.release(page_state, jnp.where(done, seq_ids, -1))
        return cache, page_state, slots, tok, lp, done, ok, pages.num_free_pages(page_state), page_state.seq_lens

    def _decode_impl(self, params, cache, page_state, slots):
        self.decode_traces += 1
        cache, page_state, slots, out, out_lp, steps, _ = self._decode_loop(params, cache, page_state, slots,
                                                                            self.steps_per_call)
        # When the loop stopped because the next step cannot get pages, the host sees it from the
        # page counts read back below and preempts.
        return (cache, page_state, slots, out, out_lp, steps, pages.num_free_pages(page_state),
                page_state.seq_lens)

    def _decode_loop(self, params, cache, page_state, slots, max_steps):
        """Up to max_steps (a traced scalar <= steps_per_call) decode steps of the active slots.

        Returns (cache, page_state, slots, out i32[steps_per_call, max_seqs] tokens (-1 where a slot
        was idle or past the last step), out_lp f32[steps_per_call, max_seqs], steps taken, pages
        copied on write).
        """
        k, num_seqs = self.steps_per_call, self.max_seqs

        # The allocation for step i+1 is computed at the end of step i (look-ahead), so the loop
        # condition can stop before a step the pool cannot serve, with no lax.cond around the
        # model (a conditional would have to carry the whole cache through both branches).
        # `ps` is the committed state; `nxt` = (state after append, slot_mapping, ok, cow).
        # Parallel samples forked from one prompt share its partly filled last page: the first
        # append of each copies it (copy-on-write) before the new token's K/V is written.
        def step(carry):
            i, cache, ps, slots, out, out_lp, nxt, copies = carry
            ps, slot_mapping, _, cow = nxt
            cache, n = _copy_on_write(cache, cow)
            seq_lens = jnp.where(slots.active, ps.seq_lens, 0)
            logits, cache = self.model.decode(params, cache, slots.tokens, seq_lens, slot_mapping, ps.block_tables,
                                              impl=self.attention_impl)
            tok, lp = sample_with_logprobs(logits, slots.temperature, slots.top_k, slots.top_p, slots.seed,
                                           slots.num_generated)
            act = slots.active
            slots = slots.replace(num_generated=slots.num_generated + act.astype(jnp.int32),
                                  tokens=jnp.where(act, tok, slots.tokens))
            done = act & _finished(slots, tok, seq_lens, self.stop_ids)
            out = out.at[i].set(jnp.where(act, tok, -1))
            out_lp = out_lp.at[i].set(lp)
            ps = pages.release(ps, jnp.where(done, jnp.arange(num_seqs, dtype=jnp.int32), -1))
            slots = slots.replace(active=act & ~done)
            return i + 1, cache, ps, slots, out, out_lp, _lookahead(ps, slots), copies + n

        def _lookahead(ps, slots):
            return pages.append(ps, slots.active)

        def cond(carry):
            i, _, _, slots, _, _, nxt, _ = carry
            return (i < max_steps) & nxt[2] & jnp.any(slots.active)

        out = jnp.full((k, num_seqs), -1, jnp.int32)
        out_lp = jnp.zeros((k, num_seqs), jnp.float32)
        init = (jnp.int32(0), cache, page_state, slots, out, out_lp, _lookahead(page_state, slots), jnp.int32(0))
        steps, cache, page_state, slots, out, out_lp, _, copies = lax.while_loop(cond, step, init)
        return cache, page_state, slots, out, out_lp, steps, copies

    def _ragged_blocks(self, params, cache, tokens, positions, slot_mapping, tables, old, cu, entry, num_rows):
        """The model over the ragged batch's first num_rows rows, `block_tokens` rows at a time.

        A while_loop over the live blocks only, so a round costs its live rows rounded up to a
        block, not the whole budget (on a CPU, where padding rows cost as much as real ones).
        Blocks run in row order; a sequence cut by a block boundary is a chunk ending mid-way
        in the first block and a chunk after a cached prefix in the next, exactly what
        `ragged_paged_attention` serves. Each block is re-based so its sequences are entries
        0..n_b - 1 (no live sequence without rows).

        Args: tokens, positions, slot_mapping i32[T]; tables i32[B, pages_per_seq] per entry; old
          i32[B] tokens cached per entry before the step; cu i32[B + 1] row offsets; entry i32[T]
          the entry of each row.

        Returns (logits f32[B, vocab] at each entry's last row, cache).
        """
        tb, num_entries = self.block_tokens, old.shape[0]
        pad = lambda a, v: jnp.pad(a, (0, tb), constant_values=v)  # noqa: E731  (whole-block slices)
        tokens, positions, slot_mapping = pad(tokens, 0), pad(positions, 0), pad(slot_mapping, -1)
        entry = pad(entry, num_entries - 1)
        k = jnp.arange(num_entries + 1, dtype=jnp.int32)
        vocab = self.model.config.vocab_size

        def block(carry):
            j, cache, logits = carry
            b0 = j * tb
            b1 = jnp.minimum(b0 + tb, num_rows)
            e0, e1 = entry[b0], entry[b1 - 1]  # the block's entries: e0..e1
            e = jnp.minimum(e0 + k, num_entries)  # i32[B + 1] block entry -> step entry
            cu_b = jnp.clip(cu[e], b0, b1) - b0  # i32[B + 1]
            e = e[:-1]
            in_block = k[:-1] <= e1 - e0
            seq_b = jnp.where(in_block, old[jnp.minimum(e, num_entries - 1)] + jnp.clip(cu[e + 1], b0, b1) - cu[e], 0)
            sl = lambda a: lax.dynamic_slice_in_dim(a, b0, tb)  # noqa: E731
            out, cache = self.model.ragged(params, cache, sl(tokens), sl(positions), sl(slot_mapping),
                                           tables[jnp.minimum(e, num_entries - 1)], seq_b, cu_b, e1 - e0 + 1,
                                           impl=self.attention_impl)
            # Entries whose last row is in this block take their logits from it.
            ends = in_block & (cu[e + 1] <= b1) & (cu[e + 1] > cu[e])
            logits = logits.at[jnp.where(ends, e, num_entries)].set(out, mode="drop")
            return j + 1, cache, logits

        init = (jnp.int32(0), cache, jnp.zeros((num_entries, vocab), jnp.float32))
        _, cache, logits = lax.while_loop(lambda c: c[0] * tb < num_rows, block, init)
        return logits, cache

    def _step_impl(self, params, cache, page_state, slots, batch):
        """The unified round: a ragged step over a token budget, then up to batch["decode_steps"]
        decode steps, in one program (the engine's only compiled program with chunked prefill).

        batch (host inputs; B = max_seqs entries, live entries first, T = the token budget):
          seq_ids i32[B]: the slot of each entry (-1 = padding).
          q_lens i32[B]: its rows in this step (1 for a decode row, the chunk length for a prompt).
          decode_row bool[B]: the entry feeds its slot's pending token (the rest are prompt chunks).
          final bool[B]: a prompt chunk that ends the prompt (the slot starts decoding after it).
          tokens i32[T]: the prompt chunks' token ids back to back (decode rows are filled here).
          rows: RowParams columns [B], read for final chunks (the slot's sampling state).
          ragged i32[]: 1 to run the ragged step, 0 to skip it (a decode-only round).
          decode_steps i32[]: decode steps after it, at most steps_per_call.
          hit_tokens i32[B], hit_tables i32[B, pages_per_seq]: prefix-cache hits, shared into the
            (empty) slot before its first chunk (`jpa.pages.share`); 0 = none.
          cache_upto i32[B]: full prompt pages a final chunk puts into the prefix cache
            (`jpa.pages.cache`); 0 = none (prefix caching off).
          evict i32[num_pages]: cached-idle pages to evict first (`jpa.pages.uncache`; -1 = padding).
          fork_from i32[B]: for a parallel sample's entry (q_len 0, final, empty slot), the entry of
            the request whose final chunk it forks (`jpa.pages.fork`); -1 elsewhere.

        The ragged step reserves each entry's pages for its rows (all or nothing, `ok`), writes
        their K/V, attends with `jpa.ragged_paged_attention`, and samples only where an entry is a
        decode row or a final chunk (resumed requests take their pending token instead). It is a
        while_loop of 0 or 1 iterations rather than a lax.cond, so the cache is carried in place.
        Besides the decode loop's outputs it returns the entries' block-table rows after the
        final chunks' pages were cached (i32[B, pages_per_seq]), for the host's prefix cache.
        """
        self.step_traces += 1
        ps_ = self.cache_config.page_size
        ids, q_lens = batch["seq_ids"], batch["q_lens"]
        decode_row, final, rows = batch["decode_row"], batch["final"], batch["rows"]
        num_tokens, num_entries = batch["tokens"].shape[0], ids.shape[0]
        live = ids >= 0
        safe = jnp.where(live, ids, 0)
        q_lens = jnp.where(live, q_lens, 0)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])  # i32[B + 1]
        row = jnp.arange(num_tokens, dtype=jnp.int32)
        entry = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, num_entries - 1)  # i32[T]
        row_live = row < cu[-1]
        empty_out = (jnp.zeros((num_entries,), jnp.int32), jnp.full((num_entries,), jnp.nan, jnp.float32),
                     jnp.bool_(True),
                     jnp.zeros((num_entries, self.pages_per_seq), jnp.int32), jnp.int32(0))
        page_state = pages.uncache(page_state, batch["evict"])
        hit = live & (batch["hit_tokens"] > 0)
        sib = live & (batch["fork_from"] >= 0)
        lead = jnp.clip(batch["fork_from"], 0, num_entries - 1)

        def ragged_step(carry):
            i, cache, ps, slots, _ = carry
            ps, shared = pages.share(ps, jnp.where(hit, ids, -1), batch["hit_tables"],
                                     jnp.where(hit, batch["hit_tokens"], 0))
            old = jnp.where(live, ps.seq_lens[safe], 0)  # i32[B] tokens cached before (hits included)
            new = old + q_lens
            ps, ok, cow = pages.reserve(ps, jnp.where(live & (q_lens > 0) & shared, ids, -1), new,
                                        return_cow=True)
            ok = ok & shared
            cache, copies = _copy_on_write(cache, cow)  # a forked sample's first token: its own last page
            # All or nothing: undo the hits when the reservation failed (those slots were empty).
            ps = pages.release(ps, jnp.where(hit & ~ok, ids, -1))
            pos = old[entry] + row - cu[entry]  # i32[T]
            ok_rows = row_live & ok
            page = jnp.take_along_axis(ps.block_tables[safe[entry]], (pos // ps_)[:, None], axis=1,
                                       mode="clip")[:, 0]
            slot_mapping = jnp.where(ok_rows, page * ps_ + pos % ps_, -1)  # i32[T]
            pending = slots.tokens[safe[entry]]
            tokens = jnp.where(decode_row[entry], pending, batch["tokens"])
            logits, cache = self._ragged_blocks(params, cache, tokens, jnp.where(ok_rows, pos, 0), slot_mapping,
                                                ps.block_tables[safe], old, cu, entry,
                                                jnp.where(ok, cu[-1], 0))
            # Parallel samples: each sibling slot (empty) forks its leader's whole prompt (refcounts;
            # the shared partly filled last page is copied on the first write) and samples its
            # first token from the leader's logits with its own seed.
            ps, forked = pages.fork(ps, jnp.where(sib & ok, ids[lead], 0), jnp.where(sib & ok, ids, -1))
            logits = jnp.where(sib[:, None], logits[lead], logits)
            new = jnp.where(sib, new[lead], new)
            # Final chunks install the request's sampling state in its slot before sampling.
            def put(a, v, where):  # a[ids[e]] = v[e] where where[e]
                return a.at[jnp.where(where, ids, self.max_seqs)].set(v.astype(a.dtype), mode="drop")

            start = live & final & ok
            put_rows = lambda name: put(getattr(slots, name), rows[name], start)  # noqa: E731
            slots = slots.replace(
                **{name: put_rows(name) for name in ("num_generated", "max_new", "max_len", "temperature",
                                                     "top_k", "top_p", "seed", "ignore_eos")})
            row_slots = jax.tree_util.tree_map(lambda a: a[safe], slots)
            sampled, sampled_lp = sample_with_logprobs(logits, row_slots.temperature, row_slots.top_k,
                                                       row_slots.top_p, row_slots.seed, row_slots.num_generated)
            emits = live & ok & (decode_row | final) & (~sib | forked)
            fresh = decode_row | (rows["resume_token"] < 0)
            tok = jnp.where(fresh, sampled, rows["resume_token"])
            lp = jnp.where(fresh, sampled_lp, jnp.nan)
            n_gen = row_slots.num_generated + fresh.astype(jnp.int32)
            row_slots = row_slots.replace(num_generated=n_gen)
            done = emits & fresh & _finished(row_slots, tok, new, self.stop_ids)
            slots = slots.replace(tokens=put(slots.tokens, tok, emits),
                                  num_generated=put(slots.num_generated, n_gen, emits),
                                  active=put(slots.active, ~done, emits))
            ps = pages.cache(ps, jnp.where(live & final & ok, ids, -1), batch["cache_upto"])
            tables = ps.block_tables[safe]  # i32[B, pages_per_seq], before the finished are released
            ps = pages.release(ps, jnp.where(done, ids, -1))
            return i + 1, cache, ps, slots, (tok, lp, ok & forked, tables, copies)

        _, cache, page_state, slots, (tok, lp, ok, tables, copies) = lax.while_loop(
            lambda c: c[0] < batch["ragged"], ragged_step,
            (jnp.int32(0), cache, page_state, slots, empty_out))
        cache, page_state, slots, out, out_lp, steps, loop_copies = self._decode_loop(
            params, cache, page_state, slots, jnp.minimum(batch["decode_steps"], self.steps_per_call))
        return (cache, page_state, slots, tok, lp, ok, out, out_lp, steps, pages.num_free_pages(page_state),
                page_state.seq_lens, slots.active, tables, copies + loop_copies)

    @staticmethod
    def _retire_impl(page_state, slots, seq_ids):
        page_state = pages.release(page_state, seq_ids)
        idx = jnp.where(seq_ids >= 0, seq_ids, slots.active.shape[0])
        return page_state, slots.replace(active=slots.active.at[idx].set(False, mode="drop"))

    # ------------------------------------------------------------------ host entry points

    def jit_options(self, num_outputs: int) -> dict:
        """jax.jit options of a compiled call (decode: 7 outputs, prefill: 8): state donated and, under a
        mesh, outputs pinned (the cache keeps its head sharding, everything else replicated)."""
        if self.mesh is None:
            return dict(donate_argnums=DONATE)
        return dict(donate_argnums=DONATE, out_shardings=(self._pool,) + (self._rep,) * (num_outputs - 1))

    def _compile(self, fn, *args, num_outputs):
        t0 = time.perf_counter()
        exe = jax.jit(fn, **self.jit_options(num_outputs)).lower(*args).compile()
        self.compile_seconds += time.perf_counter() - t0
        return exe

    def state(self):
        """(params, cache, page_state, slots): the leading arguments of every compiled call."""
        return self.params, self.cache, self.page_state, self.slots

    def prefill_inputs(self, num_rows: int, width: int):
        """ShapeDtypeStructs of a prefill call's own inputs (tokens, seq ids, lengths, row params)."""
        sds = jax.ShapeDtypeStruct
        rows = _row_columns(num_rows, sds)
        out = (sds((num_rows, width), jnp.int32), sds((num_rows,), jnp.int32), sds((num_rows,), jnp.int32), rows)
        if self.mesh is None:
            return out
        return jax.tree_util.tree_map(lambda s: sds(s.shape, s.dtype, sharding=self._rep), out)

    def decode(self):
        """Runs up to steps_per_call decode steps.

        Returns (out i32[steps, max_seqs] new tokens (-1 for idle slots), logprobs f32[steps,
        max_seqs] of those tokens, free pages, seq_lens i32[max_seqs], active bool[max_seqs]) in one
        device->host transfer.
        """
        args = self.state()
        if self._decode_exe is None:
            self._decode_exe = self._compile(self._decode_impl, *args, num_outputs=DECODE_OUTPUTS)
            self.attention = attention_in(self._decode_exe.as_text())
        self.cache, self.page_state, self.slots, out, lp, steps, free, lens = self._decode_exe(*args)
        out, lp, steps, free, lens, active = jax.device_get((out, lp, steps, free, lens, self.slots.active))
        return out[: int(steps)], lp[: int(steps)], int(free), lens, active

    def prefill(self, seq_ids, token_rows, rows: list[RowParams], num_rows: int, width: int):
        """Writes prompts into the cache and fills their slots.

        Returns (tokens i32[n], logprobs f32[n] (NaN for a resumed request's pending token), done
        bool[n], ok, free pages, seq_lens i32[max_seqs]); when ok is False (the pool could not hold
        the prompts) nothing changed on the device.
        """
        n = len(seq_ids)
        tokens = np.zeros((num_rows, width), np.int32)
        ids = np.full((num_rows,), -1, np.int32)
        lens = np.zeros((num_rows,), np.int32)
        for r, (sid, toks) in enumerate(zip(seq_ids, token_rows)):
            tokens[r, : len(toks)] = toks
            ids[r], lens[r] = sid, len(toks)
        cols = _row_columns(num_rows, lambda shape, dt: np.zeros(shape, dt))
        cols["top_p"][:] = 1.0
        cols["resume_token"][:] = -1
        for r, p in enumerate(rows):
            for name in cols:
                cols[name][r] = getattr(p, name)
        args = (self.params, self.cache, self.page_state, self.slots) + self._put(
            (jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(lens), {k: jnp.asarray(v) for k, v in cols.items()}))
        key = (num_rows, width)
        if key not in self._prefill_exe:
            self._prefill_exe[key] = self._compile(self._prefill_impl, *args, num_outputs=PREFILL_OUTPUTS)
        self.cache, self.page_state, self.slots, tok, lp, done, ok, free, lens = self._prefill_exe[key](*args)
        tok, lp, done, ok, free, lens = jax.device_get((tok, lp, done, ok, free, lens))
        return tok[:n], lp[:n], done[:n], bool(ok), int(free), lens

    def set_block_tokens(self, num_tokens: int) -> int:
        """Fixes the ragged step's rows per model pass for a budget of num_tokens: the configured
        value, else 64 rows on a CPU (compute-bound: padding rows cost as much as real ones) and the
        whole budget elsewhere (one pass; a GPU reads the weights once per pass)."""
        default = 64 if jax.default_backend() == "cpu" else num_tokens
        self.block_tokens = min(self._block_tokens or default, num_tokens)
        return self.block_tokens

    def step_inputs(self, num_tokens: int):
        """ShapeDtypeStructs of the unified step's own input (the `batch` dict) for a budget of num_tokens."""
        sds = jax.ShapeDtypeStruct
        b = self.max_seqs
        batch = dict(seq_ids=sds((b,), jnp.int32), q_lens=sds((b,), jnp.int32), decode_row=sds((b,), jnp.bool_),
                     final=sds((b,), jnp.bool_), tokens=sds((num_tokens,), jnp.int32),
                     rows=_row_columns(b, sds), ragged=sds((), jnp.int32), decode_steps=sds((), jnp.int32),
                     hit_tokens=sds((b,), jnp.int32), hit_tables=sds((b, self.pages_per_seq), jnp.int32),
                     cache_upto=sds((b,), jnp.int32), evict=sds((self.cache_config.num_pages,), jnp.int32),
                     fork_from=sds((b,), jnp.int32))
        if self.mesh is None:
            return batch
        return jax.tree_util.tree_map(lambda s: sds(s.shape, s.dtype, sharding=self._rep), batch)

    def step(self, entries, num_tokens: int, decode_steps: int, evict=()):
        """One unified round: a ragged step over `entries` (none: skipped), then decode steps.

        Args:
          entries: list of (slot, q_len, decode_row, final, prompt chunk token ids (empty for a
            decode row), RowParams or None, hit pages (prefix-cache hit shared before the chunk),
            full prompt pages to cache at a final chunk, the entry index a parallel sample forks
            from or -1), at most max_seqs, their q_lens summing to <= num_tokens.
          num_tokens: the token budget T (static: one compiled program per budget).
          decode_steps: decode steps after the ragged step (<= steps_per_call).
          evict: cached-idle pages to evict from the prefix cache first.

        Returns (tok i32[n], lp f32[n] of the entries, ok, out i32[steps, max_seqs],
        out_lp f32[steps, max_seqs], free pages, seq_lens i32[max_seqs], active bool[max_seqs],
        tables i32[n, pages_per_seq] (the entries' block tables once final chunks' pages were
        cached)) in one device->host transfer. When ok is False (the pool could not hold the
        entries' rows) the ragged step changed nothing on the device.
        """
        b, n = self.max_seqs, len(entries)
        ids = np.full((b,), -1, np.int32)
        q_lens = np.zeros((b,), np.int32)
        decode_row, final = np.zeros((b,), bool), np.zeros((b,), bool)
        tokens = np.zeros((num_tokens,), np.int32)
        rows = _row_columns(b, lambda shape, dt: np.zeros(shape, dt))
        rows["top_p"][:] = 1.0
        rows["resume_token"][:] = -1
        hit_tokens, cache_upto = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        fork_from = np.full((b,), -1, np.int32)
        hit_tables = np.zeros((b, self.pages_per_seq), np.int32)
        evict_ids = np.full((self.cache_config.num_pages,), -1, np.int32)
        evict_ids[: len(evict)] = evict
        at = 0
        for e, (slot, q_len, is_decode, is_final, chunk, params, hit, upto, fork) in enumerate(entries):
            ids[e], q_lens[e], decode_row[e], final[e], fork_from[e] = slot, q_len, is_decode, is_final, fork
            hit_tokens[e], cache_upto[e] = len(hit) * self.cache_config.page_size, upto
            hit_tables[e, : len(hit)] = hit
            tokens[at: at + len(chunk)] = chunk
            at += q_len
            if params is not None:
                for name in rows:
                    rows[name][e] = getattr(params, name)
        batch = dict(seq_ids=ids, q_lens=q_lens, decode_row=decode_row, final=final, tokens=tokens, rows=rows,
                     ragged=np.int32(n > 0), decode_steps=np.int32(decode_steps), hit_tokens=hit_tokens,
                     hit_tables=hit_tables, cache_upto=cache_upto, evict=evict_ids, fork_from=fork_from)
        args = self.state() + (self._put(jax.tree_util.tree_map(jnp.asarray, batch)),)
        if self._step_exe is None:
            self.set_block_tokens(num_tokens)
            self._step_exe = self._compile(self._step_impl, *args, num_outputs=STEP_OUTPUTS)
            self.attention = attention_in(self._step_exe.as_text())
            self.step_tokens = num_tokens
        elif num_tokens != self.step_tokens:
            raise ValueError(f"the unified step was compiled for a token budget of {self.step_tokens}; got "
                             f"{num_tokens}")
        self.cache, self.page_state, self.slots, *res = self._step_exe(*args)
        tok, lp, ok, out, out_lp, steps, free, lens, active, tables, copies = jax.device_get(res)
        steps = int(steps)
        self.cow_copies += int(copies)
        return (tok[:n], lp[:n], bool(ok), out[:steps], out_lp[:steps], int(free), lens, active,
                tables[:n])

    def retire(self, seq_ids):
        """Releases slots (finished on the host, aborted or preempted).

        Returns (free pages, seq_lens i32[max_seqs]) after the release.
        """
        ids = np.full((self.max_seqs,), -1, np.int32)
        ids[: len(seq_ids)] = seq_ids
        self.page_state, self.slots = self._retire(self.page_state, self.slots, self._put(jnp.asarray(ids)))
        free, lens = jax.device_get((self.page_state.num_free, self.page_state.seq_lens))
        return int(free), lens

    def uncache(self, page_ids):
        """Evicts pages from the prefix cache now (`jpa.pages.uncache`); returns (free pages, seq_lens)."""
        ids = np.full((self.cache_config.num_pages,), -1, np.int32)
        ids[: len(page_ids)] = list(page_ids)
        self.page_state = self._uncache(self.page_state, self._put(jnp.asarray(ids)))
        free, lens = jax.device_get((self.page_state.num_free, self.page_state.seq_lens))
        return int(free), lens

    def pool_is_whole(self, cached=()) -> bool:
        """True when no table holds a page and every page is free or one of `cached` (the host's
        prefix cache), held by the cache alone (no leak) — valid when no request is running."""
        ps = jax.device_get(self.page_state)
        want = np.zeros(self.cache_config.num_pages, bool)
        want[list(cached)] = True
        return (int(ps.num_free) == self.cache_config.num_pages - int(want.sum())
                and np.array_equal(np.asarray(ps.cached), want)
                and np.array_equal(np.asarray(ps.refcounts), want.astype(np.int32)))
