"""The device side of the engine: ONE compiled program, the unified step, over donated state.

Everything a round needs lives on the device: the KV cache, the PageState, and per-slot state
(`Slots`: pending token, counters, `SlotParams`). A round (`StepBatch` in, `StepResult` out, see
`jpa.engine.batch`) is a ragged step over the scheduler's entries (decode tokens and prompt
chunks back to back, `jpa.ragged_paged_attention` through the model's `ragged`), then up to
`steps_per_call` decode steps inside a `lax.while_loop` (the model's `decode`), allocating pages
with `jpa.kv.pages.append`, sampling, and checking stop conditions (EOS, max_new_tokens, length
limit) on the device; finished sequences release their pages inside the loop. The loop ends early
when every slot is idle or when the pool runs out of pages (the host then preempts).

Every round reads back, in the same device->host transfer as its tokens, the PageState's free
page count and seq_lens: the scheduler's only source of page counts.

Prompt logprobs (SamplingParams.prompt_logprobs): with the model's optional ragged_hidden/head
pair, the ragged step keeps every row's hidden state; rows the plan gives a target (the next
prompt token) get log_softmax of the head, the target's logprob and rank and a top-20, in the same
program, under a lax.cond that rounds without such rows skip (`_prompt_logprobs`). They are read
back only in rounds that asked.

The model is anything that meets `jpa.engine.model.EngineModel`; its params are an argument of
the compiled step (never a closed-over constant) and the cache, page state and slots are donated.

Attention backend: the step passes `attention_impl` to the model. With "auto", `jpa.paged_decode`
and `jpa.ragged_paged_attention` pick the kernel for the device the step is compiled for while it
is traced, with its exact shapes (the self-check runs concretely then, once per configuration).
What was picked is read off the compiled program (`attention`), so the summary reports what
actually runs.

Tensor parallelism (`mesh` with a "tp" axis): the cache pools are sharded on their kv-head axis;
page state, slots and every host input are replicated, so page allocation, sampling and stop
checks run identically on every device and the host reads one copy. The model (sharded by its
`shard(mesh)`) runs attention per device. The compiled step pins its outputs to the same
shardings as its inputs, so one executable serves every call.
"""

import time
import types

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa.kv import pages
from jpa.kv.cache import CacheConfig, KVCache, copy_pages
from jpa.engine.batch import StepBatch, StepResult, make_step_batch
from jpa.engine.model import EngineModel, check_model, has_hidden
from jpa.engine.sampling import MAX_TOP_LOGPROBS, SlotParams, allowed_tokens, sample_slots
from jpa.engine.speculative import DraftPair, SpeculativeConfig, accepted_prefix, propose_ngram
from jpa.core.sharding import REPLICATED, STACKED_POOL, named


# Executables served by JAX's persistent compilation cache in this process (a monitoring event
# JAX records on each hit); compile_step compares it before and after its compile.
_CACHE_HITS = [0]


def _count_cache_hits(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_cache_hits)


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


def _copy_on_write(cache, slots, cow):
    """(cache and slots with pages cow.src copied to cow.dst (`jpa.copy_pages`, and their token
    ids), pages copied), the copy made only when some pair is live: a while_loop of 0 or 1
    iterations, so steps without a fork cost no copy pass and the cache is carried in place."""
    any_copy = jnp.any(cow.dst >= 0).astype(jnp.int32)

    def copy(c):
        i, cache, slots = c
        toks = slots.page_tokens
        dst = jnp.where(cow.dst >= 0, cow.dst, toks.shape[0])
        toks = toks.at[dst].set(toks[jnp.maximum(cow.src, 0)], mode="drop")
        cache = (tuple(copy_pages(c, cow.src, cow.dst) for c in cache) if isinstance(cache, tuple)
                 else copy_pages(cache, cow.src, cow.dst))   # a draft model's cache too (DraftPair)
        return i + 1, cache, slots.replace(page_tokens=toks)

    _, cache, slots = lax.while_loop(lambda c: c[0] < any_copy, copy, (jnp.int32(0), cache, slots))
    return cache, slots, jnp.sum(cow.dst >= 0, dtype=jnp.int32)


def _tally(acc, copies, ps):
    """acc = (pages copied on write, most pages in use, tokens cached then) after one more step
    that copied `copies` pages and runs on page state ps. A page is in use when a sequence holds
    it (refcount above the prefix cache's own reference): the round's peak, which the host
    cannot see (sequences that finish inside the call release their pages before it returns).
    Tokens count once per page: a page that k sequences share (a cached prefix, a parallel
    sample's prompt) is taken as full, so (k - 1) x page_size come off the sum of sequence
    lengths (a forked sample's shared last page may be partly filled: that round counts low)."""
    n, used, tokens = acc
    held = ps.refcounts - ps.cached.astype(ps.refcounts.dtype)
    now = jnp.sum(held > 0, dtype=jnp.int32)
    stored = jnp.sum(ps.seq_lens, dtype=jnp.int32) - ps.page_size * jnp.sum(jnp.maximum(held - 1, 0), dtype=jnp.int32)
    more = now > used
    return n + copies, jnp.where(more, now, used), jnp.where(more, jnp.maximum(stored, 0), tokens)


NO_COPIES = (0, 0, 0)   # the `_tally` of no step


def _finished(slots, next_tok, seq_lens, stop_ids):
    """bool[B]: which slots stop after emitting next_tok (their cache holds seq_lens tokens)."""
    p = slots.params
    is_stop = (jnp.any(next_tok[:, None] == stop_ids[None, :], axis=-1) & ~p.ignore_eos) | jnp.any(
        next_tok[:, None] == p.stop_token_ids, axis=-1)
    # The next token would go to position seq_lens; it must stay below max_len to be fed back.
    return is_stop | (slots.num_generated >= p.max_new) | (seq_lens + 1 >= p.max_len)


# Custom-call targets of the Pallas GPU kernels in a compiled program's HLO.
KERNEL_CALLS = (("mosaic", 'custom_call_target="mosaic_gpu'), ("triton", 'custom_call_target="__gpu$xla.gpu.triton"'))
DONATE = (1, 2, 3)  # cache, page state, slots: updated in place by the compiled step
# Prompt logprobs: the head runs over at most this many logits at once (rows x vocab; 16 MiB of
# f32), so a whole-budget block of a big vocabulary never materializes T x vocab logits. XLA
# reserves these buffers in every step, asked for or not: measured on SmolLM2's H100 unified step
# (deviceless compile), temporaries stay at 63 MiB as before prompt logprobs (142 MiB with 1 << 24).
PROMPT_LOGITS_ELEMENTS = 1 << 22


def attention_in(hlo_text: str) -> str:
    """Which attention implementation a compiled program runs: "mosaic", "triton" or "xla"."""
    return next((name for name, call in KERNEL_CALLS if call in hlo_text), "xla")


def _select(ok, new, old):
    """new where ok (a bool[] scalar) else old, leaf by leaf (the page state is small: no cache here)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)


class ModelRunner:
    """Owns the device state of one engine and the compiled unified step that advances it.

    With `allocate=False` the state is abstract (`jax.ShapeDtypeStruct`s, nothing allocated): such
    a runner only serves `state()`, `step_inputs()` and the traced `_step_impl`, e.g. to compile
    the engine's step for a GPU that is not attached (scripts/gpu_compile_check.py).
    """

    def __init__(self, model: EngineModel, cache_config: CacheConfig, *, max_seqs: int, pages_per_seq: int,
                 steps_per_call: int, stop_ids, attention_impl: str = "auto", allocate: bool = True,
                 mesh=None, block_tokens: int | None = None, speculative: SpeculativeConfig | None = None,
                 draft=None, draft_cache_config: CacheConfig | None = None):
        check_model(model)
        self.spec = speculative
        if (draft is not None) != (speculative is not None and speculative.method == "draft_model"):
            raise ValueError("a draft model goes with speculative method 'draft_model' (and that method needs one)")
        if draft is not None:
            check_model(draft)
            if mesh is not None:
                raise ValueError("speculative method 'draft_model' runs on one device (tensor_parallel=1); "
                                 "use method 'ngram' with tensor parallelism")
            model = DraftPair(model, draft)
        if speculative is not None:
            if not has_hidden(model):
                raise TypeError(f"speculative decoding needs a model with EngineModel's optional ragged_hidden() "
                                f"and head() (every row's logits); {type(model).__name__} lacks them")
            backend = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
            self.verify_rows = speculative.rows(max_seqs, backend)
        self.width = 1 if speculative is None else speculative.num_speculative_tokens + 1
        self.mesh = mesh
        self.model, self.params = model, model.params
        self.cache_config = cache_config
        self.max_seqs, self.pages_per_seq, self.steps_per_call = max_seqs, pages_per_seq, steps_per_call
        self.attention_impl = attention_impl
        self._block_tokens = block_tokens
        self.block_tokens = None  # rows per model pass of the ragged step, fixed at its compile
        self.prompt_chunk = None  # rows per head pass of prompt logprobs, fixed with block_tokens
        self.step_tokens = None   # the token budget the step was compiled for
        self.attention = None     # the implementation in the compiled step, once compiled
        self._pool = None if mesh is None else named(mesh, STACKED_POOL)
        self._rep = None if mesh is None else named(mesh, REPLICATED)
        make = lambda f, sharding: self._make(f, sharding, allocate)  # noqa: E731
        self.cache = make(lambda: KVCache.create(cache_config) if draft is None else (
            KVCache.create(cache_config), KVCache.create(draft_cache_config)), self._pool)
        self.page_state = make(lambda: pages.init(cache_config.num_pages, max_seqs, pages_per_seq,
                                                  cache_config.page_size), self._rep)
        self.slots = make(lambda: Slots.empty(max_seqs, cache_config.num_pages, cache_config.page_size), self._rep)
        self.stop_ids = jnp.asarray(sorted(set(stop_ids)) or [-1], jnp.int32)
        self.step_traces = 0
        self.cow_copies = 0  # pages copied on write (parallel samples' shared last pages)
        self.compile_seconds = 0.0
        self.step_from_cache = None  # set by compile_step
        self._step_exe = None
        self._retire = jax.jit(self._retire_impl, donate_argnums=(0, 1),
                               **({} if mesh is None else dict(out_shardings=self._rep)))
        self._uncache = jax.jit(pages.uncache, donate_argnums=(0,),
                                **({} if mesh is None else dict(out_shardings=self._rep)))

    @property
    def compiles(self) -> int:
        """Programs compiled so far (the unified step: 1 once it ran)."""
        return self.step_traces

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

    def _decode_loop(self, params, cache, page_state, slots, max_steps):
        """Up to max_steps (a traced scalar <= steps_per_call) decode steps of the active slots.

        Returns (cache, page_state, slots, (out i32[steps_per_call, max_seqs] tokens (-1 where a slot
        was idle or past the last step), out_lp f32[steps_per_call, max_seqs], their top tokens
        i32[steps_per_call, max_seqs, top_n] and log-probabilities), steps taken, (pages copied on
        write, peak pages in use, tokens then): see `_tally`).
        """
        k, num_seqs = self.steps_per_call, self.max_seqs

        # The allocation for step i+1 is computed at the end of step i (look-ahead), so the loop
        # condition can stop before a step the pool cannot serve, with no lax.cond around the
        # model (a conditional would have to carry the whole cache through both branches).
        # `ps` is the committed state; `nxt` = (state after append, slot_mapping, ok, cow).
        # Parallel samples forked from one prompt share its partly filled last page: the first
        # append of each copies it (copy-on-write) before the new token's K/V is written.
        def step(carry):
            i, cache, ps, slots, (out, out_lp, out_ids, out_tops), nxt, copies = carry
            ps, slot_mapping, _, cow = nxt
            cache, slots, n = _copy_on_write(cache, slots, cow)
            seq_lens = jnp.where(slots.active, ps.seq_lens, 0)
            logits, cache = self.model.decode(params, cache, slots.tokens, seq_lens, slot_mapping, ps.block_tables,
                                              impl=self.attention_impl)
            slots = slots.write_tokens(slots.tokens, jnp.where(slots.active, slot_mapping, -1))
            tok, lp, top_ids, top_lps = sample_slots(logits, slots.params, slots.num_generated,
                                                     lambda: slots.history(ps.block_tables), seq_lens, self.stop_ids)
            act = slots.active
            slots = slots.replace(num_generated=slots.num_generated + act.astype(jnp.int32),
                                  tokens=jnp.where(act, tok, slots.tokens))
            done = act & _finished(slots, tok, seq_lens, self.stop_ids)
            out = out.at[i].set(jnp.where(act, tok, -1))
            out_lp = out_lp.at[i].set(lp)
            out_ids, out_tops = out_ids.at[i].set(top_ids), out_tops.at[i].set(top_lps)
            ps = pages.release(ps, jnp.where(done, jnp.arange(num_seqs, dtype=jnp.int32), -1))
            slots = slots.replace(active=act & ~done)
            return (i + 1, cache, ps, slots, (out, out_lp, out_ids, out_tops), _lookahead(ps, slots),
                    _tally(copies, n, nxt[0]))

        def _lookahead(ps, slots):
            return pages.append(ps, slots.active)

        def cond(carry):
            i, _, _, slots, _, nxt, _ = carry
            return (i < max_steps) & nxt[2] & jnp.any(slots.active)

        tn = min(MAX_TOP_LOGPROBS, self.model.config.vocab_size)
        outs = (jnp.full((k, num_seqs), -1, jnp.int32), jnp.zeros((k, num_seqs), jnp.float32),
                jnp.full((k, num_seqs, tn), -1, jnp.int32), jnp.full((k, num_seqs, tn), -jnp.inf, jnp.float32))
        init = (jnp.int32(0), cache, page_state, slots, outs, _lookahead(page_state, slots),
                jax.tree_util.tree_map(jnp.int32, NO_COPIES))
        steps, cache, page_state, slots, outs, _, copies = lax.while_loop(cond, step, init)
        return cache, page_state, slots, outs, steps, copies

    def _spec_loop(self, params, cache, page_state, slots, max_steps):
        """`_decode_loop` with speculation: up to max_steps verify steps (see jpa.engine.speculative).

        Each step every active slot feeds its pending token and num[b] <= k n-gram drafts
        (proposed on the device from its history, look-ahead like the decode loop's page append)
        as one entry of a ragged pass of `verify_rows` rows; every row is sampled exactly as the
        decode loop samples (the request's key for that token index, controls and filters), and
        the slot emits its rows' tokens up to and including the first that differs from its
        draft (or the first that stops it). The cache then holds the pending token and the
        accepted drafts: rejected drafts are rolled back by `pages.truncate`, which releases the
        pages reserved for them in the same step. A step where no slot has a draft runs the
        plain decode pass over max_seqs rows instead (no extra rows computed).

        Returns what `_decode_loop` returns, with `out`'s rows per step `width` = k + 1 (row
        i * width + j: a slot's j-th token of step i, -1 past what it emitted), plus the
        speculation counters (drafted, accepted, steps with drafts: i32[max_seqs] each;
        accepted per draft position: i32[k]).
        """
        spec, num_seqs, ps_ = self.spec, self.max_seqs, self.cache_config.page_size
        k, width, rows = spec.num_speculative_tokens, self.width, self.verify_rows
        slot_ids = jnp.arange(num_seqs, dtype=jnp.int32)
        jj = jnp.arange(width, dtype=jnp.int32)

        def lookahead(ps, slots):
            """(lens, drafts, num, state with the rows reserved, ok, cow) for the next step."""
            act = slots.active
            lens = jnp.where(act, ps.seq_lens, 0)  # tokens cached (the pending one is not)
            # Never draft past what the request may still emit (max_new_tokens, its length limit),
            # and share the rows left after one per active slot equally.
            p = slots.params
            room = jnp.minimum(p.max_new - slots.num_generated - 1, p.max_len - lens - 2)
            n_act = jnp.sum(act, dtype=jnp.int32)
            share = (rows - n_act) // jnp.maximum(n_act, 1)
            if spec.disable_by_batch_size is not None:
                share = jnp.where(n_act >= spec.disable_by_batch_size, 0, share)
            cap = jnp.where(act, jnp.clip(jnp.minimum(room, share), 0, k), 0)
            none = (jnp.zeros((num_seqs, k), jnp.int32), jnp.zeros((num_seqs,), jnp.int32))
            if spec.method == "ngram":
                def propose(_):
                    hist = slots.history(ps.block_tables)
                    hist = jnp.where(jnp.arange(hist.shape[1])[None, :] == lens[:, None], slots.tokens[:, None], hist)
                    return propose_ngram(hist, jnp.where(act, lens + 1, 0), k, spec.prompt_lookup_min,
                                         spec.prompt_lookup_max)
                # A full batch leaves no row for drafts: no lookup either.
                drafts, num = lax.cond(jnp.any(cap > 0), propose, lambda _: none, None)
            else:   # the draft model proposes in the step, once its rows are reserved
                drafts, num = none[0], jnp.full((num_seqs,), k, jnp.int32)
            num = jnp.minimum(num, cap)
            ids = jnp.where(act, slot_ids, -1)
            plain = lambda: pages.reserve(ps, ids, jnp.where(act, lens + 1, 0), return_cow=True)  # noqa: E731
            ps1, ok1, cow1 = pages.reserve(ps, ids, jnp.where(act, lens + 1 + num, 0), return_cow=True)
            # Pages too short for the drafts: the plain step (one token each) may still fit.
            retry = ~ok1 & jnp.any(num > 0)
            ps1, ok1, cow1 = lax.cond(retry, lambda _: plain(), lambda _: (ps1, ok1, cow1), None)
            num = jnp.where(retry, 0, num)
            return lens, drafts, num, ps1, ok1, cow1

        def verify_pass(params, cache, ps, slots, lens, drafts, num):
            """Per slot [num_seqs, width]: tokens, logprobs, top ids, top logprobs of rows 0..num."""
            act = slots.active
            order = jnp.argsort(~act, stable=True).astype(jnp.int32)  # entries: active slots first
            q = jnp.where(act, 1 + num, 0)[order]
            cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q, dtype=jnp.int32)])
            row = jnp.arange(rows, dtype=jnp.int32)
            e = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, num_seqs - 1).astype(jnp.int32)
            s, j = order[e], row - cu[e]
            live = row < cu[-1]
            tok = jnp.where(j == 0, slots.tokens[s], jnp.take_along_axis(drafts[s], jnp.clip(j - 1, 0, k - 1)[:, None],
                                                                          axis=1)[:, 0])
            tok = jnp.where(live, tok, 0)
            pos = jnp.where(live, lens[s] + j, 0)
            page = jnp.take_along_axis(ps.block_tables[s], (pos // ps_)[:, None], axis=1, mode="clip")[:, 0]
            slot_mapping = jnp.where(live, page * ps_ + pos % ps_, -1)
            seq = jnp.where(act, lens + 1 + num, 0)[order]
            args = (tok, pos, slot_mapping, ps.block_tables[order], seq, cu, jnp.sum(act, dtype=jnp.int32))
            if draft is None:
                hidden, cache = self.model.ragged_hidden(params, cache, *args, impl=self.attention_impl)
            else:   # the draft passes have written the draft's cache for these rows
                hidden, tc = self.model.target.ragged_hidden(params[0], cache[0], *args, impl=self.attention_impl)
                cache = (tc, cache[1])
            slots = slots.write_tokens(tok, slot_mapping)
            rs = slots.rows(s)
            y = sample_slots(self.model.head(params, hidden), rs.params, rs.num_generated + j,
                             lambda: slots.history(ps.block_tables[s]), lens[s] + 1 + j, self.stop_ids)
            start = cu[jnp.argsort(order)]  # i32[num_seqs]: each slot's first row
            ridx = jnp.clip(start[:, None] + jj[None, :], 0, rows - 1)
            return cache, slots, tuple(a[ridx] for a in y)

        def decode_pass(params, cache, ps, slots, lens):
            """No drafts anywhere: the decode loop's pass over max_seqs rows, as [num_seqs, width]."""
            act = slots.active
            page = jnp.take_along_axis(ps.block_tables, (lens // ps_)[:, None], axis=1, mode="clip")[:, 0]
            slot_mapping = jnp.where(act, page * ps_ + lens % ps_, -1)
            seq_lens = jnp.where(act, lens + 1, 0)
            logits, cache = self.model.decode(params, cache, slots.tokens, seq_lens, slot_mapping, ps.block_tables,
                                              impl=self.attention_impl)
            slots = slots.write_tokens(slots.tokens, slot_mapping)
            y = sample_slots(logits, slots.params, slots.num_generated, lambda: slots.history(ps.block_tables),
                             seq_lens, self.stop_ids)
            return cache, slots, tuple(jnp.repeat(a[:, None], width, axis=1) for a in y)

        draft = self.model.draft if isinstance(self.model, DraftPair) else None

        def draft_pass(params, cache, ps, slots, lens, num):
            """The draft model's greedy drafts: passes j = 0..max(num) feed the pending token, then
            draft j - 1, at position lens + j (writing the draft's cache there, so it holds every
            token the target may accept) and take draft j as the argmax."""
            act = slots.active

            def body(c):
                j, dc, tok, drafts = c
                feed = act & (j <= num)
                pos = lens + j
                page = jnp.take_along_axis(ps.block_tables, (pos // ps_)[:, None], axis=1, mode="clip")[:, 0]
                logits, dc = draft.decode(params[1], dc, tok, jnp.where(feed, pos + 1, 0),
                                          jnp.where(feed, page * ps_ + pos % ps_, -1), ps.block_tables,
                                          impl=self.attention_impl)
                nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                drafts = jnp.where((jnp.arange(k)[None, :] == j) & (feed & (j < num))[:, None], nxt[:, None], drafts)
                return j + 1, dc, jnp.where(feed, nxt, tok), drafts

            init = (jnp.int32(0), cache[1], slots.tokens, jnp.zeros((num_seqs, k), jnp.int32))
            last = jnp.where(jnp.any(num > 0), jnp.max(jnp.where(act, num, -1)), -1)  # no drafts: no pass
            _, dc, _, drafts = lax.while_loop(lambda c: c[0] <= last, body, init)
            return (cache[0], dc), drafts

        def once(run, pred, cache, slots, ys):
            """run() under a while_loop of 0 or 1 iterations (the cache is carried in place)."""
            def body(c):
                _, cache, slots, _ = c
                return (jnp.int32(1),) + run(cache, slots)
            return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), body, (jnp.int32(0), cache, slots, ys))[1:]

        def step(carry):
            i, cache, ps, slots, outs, nxt, copies, counts = carry
            lens, drafts, num, ps, _, cow = nxt
            cache, slots, n = _copy_on_write(cache, slots, cow)
            act = slots.active
            tn = outs[2].shape[-1]
            ys = (jnp.zeros((num_seqs, width), jnp.int32), jnp.zeros((num_seqs, width), jnp.float32),
                  jnp.zeros((num_seqs, width, tn), jnp.int32), jnp.zeros((num_seqs, width, tn), jnp.float32))
            drafting = jnp.any(num > 0)
            if draft is not None:
                cache, drafts = draft_pass(params, cache, ps, slots, lens, num)
            cache, slots, ys = once(lambda c, sl: verify_pass(params, c, ps, sl, lens, drafts, num), drafting,
                                    cache, slots, ys)
            cache, slots, ys = once(lambda c, sl: decode_pass(params, c, ps, sl, lens), ~drafting, cache, slots, ys)
            y, lp, top_ids, top_lps = ys
            a = jnp.where(act, accepted_prefix(y, drafts, num), 0)
            # Stop checks token by token: emitted token j is decode step j of the plain loop.
            stops = jnp.stack([_finished(slots.replace(num_generated=slots.num_generated + t + 1), y[:, t],
                                         lens + 1 + t, self.stop_ids) for t in range(width)], axis=1)
            stops = stops & (jj[None, :] <= a[:, None])
            stopped = act & jnp.any(stops, axis=1)
            emitted = jnp.where(act, jnp.where(stopped, jnp.argmax(stops, axis=1) + 1, a + 1), 0).astype(jnp.int32)
            emit = jj[None, :] < emitted[:, None]  # bool[num_seqs, width]
            last = jnp.take_along_axis(y, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
            slots = slots.replace(tokens=jnp.where(act, last, slots.tokens),
                                  num_generated=slots.num_generated + emitted)
            ids = jnp.where(act, slot_ids, -1)
            ps = pages.truncate(ps, ids, jnp.where(act, lens + emitted, 0))  # rejected drafts rolled back
            ps = pages.release(ps, jnp.where(stopped, slot_ids, -1))
            slots = slots.replace(active=act & ~stopped)
            r0 = i * width
            put = lambda buf, v: lax.dynamic_update_slice_in_dim(buf, jnp.moveaxis(v, 0, 1), r0, 0)  # noqa: E731
            outs = (put(outs[0], jnp.where(emit, y, -1)), put(outs[1], lp),
                    put(outs[2], jnp.where(emit[..., None], top_ids, -1)), put(outs[3], top_lps))
            drafted, accepted, spec_steps, per_pos = counts
            counts = (drafted + num, accepted + a, spec_steps + (num > 0).astype(jnp.int32),
                      per_pos + jnp.sum(jj[None, :k] < a[:, None], axis=0, dtype=jnp.int32))
            return i + 1, cache, ps, slots, outs, lookahead(ps, slots), _tally(copies, n, nxt[3]), counts

        def cond(carry):
            i, _, _, slots, _, nxt, _, _ = carry
            return (i < max_steps) & nxt[4] & jnp.any(slots.active)

        tn = min(MAX_TOP_LOGPROBS, self.model.config.vocab_size)
        total = self.steps_per_call * width
        outs = (jnp.full((total, num_seqs), -1, jnp.int32), jnp.zeros((total, num_seqs), jnp.float32),
                jnp.full((total, num_seqs, tn), -1, jnp.int32), jnp.full((total, num_seqs, tn), -jnp.inf, jnp.float32))
        zeros = jnp.zeros((num_seqs,), jnp.int32)
        counts = (zeros, zeros, zeros, jnp.zeros((k,), jnp.int32))
        init = (jnp.int32(0), cache, page_state, slots, outs, lookahead(page_state, slots),
                jax.tree_util.tree_map(jnp.int32, NO_COPIES), counts)
        steps, cache, page_state, slots, outs, _, copies, counts = lax.while_loop(cond, step, init)
        return cache, page_state, slots, outs, steps, copies, counts

    def _prompt_logprobs(self, params, hidden, targets, b0, acc):
        """Prompt logprobs of one block's rows, written into acc at rows b0.. (see StepResult).

        The head runs over `prompt_chunk` rows at a time, and only over chunks where some row asks
        (targets >= 0), under lax.cond: a round without prompt logprobs pays for the test alone.

        Args: hidden f32[tb, d_model]; targets i32[tb] (the next prompt token, -1 = not asked); b0
          i32[] the block's first row; acc (f32[R], i32[R], i32[R, top_n], f32[R, top_n]) over
          R >= b0 + tb + prompt_chunk rows.
        """
        c = self.prompt_chunk
        num_chunks = -(-hidden.shape[0] // c)
        pad = num_chunks * c - hidden.shape[0]
        hidden = jnp.pad(hidden, ((0, pad), (0, 0)))  # [num_chunks * c, d_model]
        targets = jnp.pad(targets, (0, pad), constant_values=-1)
        tn = acc[2].shape[1]

        def chunk(i, acc):
            r0 = i * c
            t = lax.dynamic_slice_in_dim(targets, r0, c)  # i32[c]

            def compute(acc):
                logits = self.model.head(params, lax.dynamic_slice_in_dim(hidden, r0, c)).astype(jnp.float32)
                lsm = jax.nn.log_softmax(logits, axis=-1)  # f32[c, vocab]
                lp = jnp.take_along_axis(lsm, jnp.maximum(t, 0)[:, None], axis=1)[:, 0]
                rank = jnp.sum(lsm >= lp[:, None], axis=-1, dtype=jnp.int32)  # vLLM's rank: 1 = the top
                top_lps, top_ids = lax.top_k(lsm, tn)
                want = t >= 0

                def put(a, v):  # rows that asked take v; the others keep what they hold
                    old = lax.dynamic_slice_in_dim(a, b0 + r0, c)
                    w = want.reshape((c,) + (1,) * (v.ndim - 1))
                    return lax.dynamic_update_slice_in_dim(a, jnp.where(w, v.astype(a.dtype), old), b0 + r0, 0)

                return tuple(put(a, v) for a, v in zip(acc, (lp, rank, top_ids, top_lps)))

            return lax.cond(jnp.any(t >= 0), compute, lambda a: a, acc)

        return lax.fori_loop(0, num_chunks, chunk, acc)

    def _ragged_blocks(self, params, cache, tokens, positions, slot_mapping, tables, old, cu, entry, num_rows,
                       targets):
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
          prompt logprobs (-1 elsewhere).

        Returns (logits f32[B, vocab] at each entry's last row, cache, (prompt logprobs f32[T],
        ranks i32[T], top ids i32[T, top_n], top logprobs f32[T, top_n])).
        """
        tb, num_entries, num_tokens = self.block_tokens, old.shape[0], tokens.shape[0]
        pad = lambda a, v: jnp.pad(a, (0, tb), constant_values=v)  # noqa: E731  (whole-block slices)
        tokens, positions, slot_mapping = pad(tokens, 0), pad(positions, 0), pad(slot_mapping, -1)
        entry, targets = pad(entry, num_entries - 1), pad(targets, -1)
        k = jnp.arange(num_entries + 1, dtype=jnp.int32)
        vocab = self.model.config.vocab_size
        hidden_pair = has_hidden(self.model)
        rows = num_tokens + tb + self.prompt_chunk  # every chunk write of every block fits
        tn = min(MAX_TOP_LOGPROBS, vocab)
        prompt = (jnp.full((rows,), jnp.nan, jnp.float32), jnp.zeros((rows,), jnp.int32),
                  jnp.full((rows, tn), -1, jnp.int32), jnp.full((rows, tn), -jnp.inf, jnp.float32))

        def block(carry):
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
            if hidden_pair:
                hidden, cache = self.model.ragged_hidden(params, cache, *args, impl=self.attention_impl)
                out = self.model.head(params, hidden[jnp.clip(cu_b[1:] - 1, 0, tb - 1)])  # as `ragged` does
                prompt = self._prompt_logprobs(params, hidden, sl(targets), b0, prompt)
            else:
                out, cache = self.model.ragged(params, cache, *args, impl=self.attention_impl)
            # Entries whose last row is in this block take their logits from it.
            ends = in_block & (cu[e + 1] <= b1) & (cu[e + 1] > cu[e])
            logits = logits.at[jnp.where(ends, e, num_entries)].set(out, mode="drop")
            return j + 1, cache, logits, prompt

        init = (jnp.int32(0), cache, jnp.zeros((num_entries, vocab), jnp.float32), prompt)
        _, cache, logits, prompt = lax.while_loop(lambda c: c[0] * tb < num_rows, block, init)
        return logits, cache, tuple(a[:num_tokens] for a in prompt)

    def _step_impl(self, params, cache, page_state, slots, batch: StepBatch):
        """The unified round: a ragged step over a token budget, then up to batch.decode_steps
        decode steps, in one program (the engine's only compiled program). See StepBatch for the
        inputs and StepResult for what it returns besides (cache, page_state, slots).

        Page work comes first and is all or nothing: evict (`pages.uncache`), share prefix-cache
        hits into empty slots (`pages.share`), reserve every entry's rows (`pages.reserve`) and
        fork parallel samples' slots from their leader (`pages.fork`). If any of it fails (`ok`
        False) the page state is put back as it was and neither the ragged step nor a decode
        step runs: the round changed nothing. The ragged step then writes the entries' K/V,
        attends with `jpa.ragged_paged_attention`, and samples only where an entry is a decode row
        or a final chunk (resumed requests take their pending token instead). It is a while_loop
        of 0 or 1 iterations rather than a lax.cond, so the cache is carried in place.
        """
        self.step_traces += 1
        ps_ = self.cache_config.page_size
        ids, decode_row, final = batch.seq_ids, batch.decode_row, batch.final
        num_tokens, num_entries = batch.tokens.shape[0], ids.shape[0]
        live = ids >= 0
        safe = jnp.where(live, ids, 0)
        q_lens = jnp.where(live, batch.q_lens, 0)
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])  # i32[B + 1]
        row = jnp.arange(num_tokens, dtype=jnp.int32)
        entry = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, num_entries - 1)  # i32[T]
        row_live = row < cu[-1]
        hit = live & (batch.hit_tokens > 0)
        sib = live & (batch.fork_from >= 0)
        lead = jnp.clip(batch.fork_from, 0, num_entries - 1)

        # Page work, all or nothing.
        ps = pages.uncache(page_state, batch.evict)
        ps, shared = pages.share(ps, jnp.where(hit, ids, -1), batch.hit_tables, jnp.where(hit, batch.hit_tokens, 0))
        old = jnp.where(live, ps.seq_lens[safe], 0)  # i32[B] tokens cached before the rows (hits included)
        new = old + q_lens
        ps, reserved, cow = pages.reserve(ps, jnp.where(live & (q_lens > 0), ids, -1), new, return_cow=True)
        # Parallel samples: each sibling slot (empty) forks its leader's whole prompt (refcounts;
        # the shared partly filled last page is copied on the first write).
        ps, forked = pages.fork(ps, jnp.where(sib, ids[lead], 0), jnp.where(sib, ids, -1))
        ok = shared & reserved & forked
        page_state = _select(ok, ps, page_state)
        new = jnp.where(sib, new[lead], new)

        def ragged_step(carry):
            i, cache, ps, slots, _ = carry
            cache, slots, copies = _copy_on_write(cache, slots, cow)  # a forked sample's first token: its own last page
            pos = old[entry] + row - cu[entry]  # i32[T]
            page = jnp.take_along_axis(ps.block_tables[safe[entry]], (pos // ps_)[:, None], axis=1,
                                       mode="clip")[:, 0]
            slot_mapping = jnp.where(row_live, page * ps_ + pos % ps_, -1)  # i32[T]
            tokens = jnp.where(decode_row[entry], slots.tokens[safe[entry]], batch.tokens)
            logits, cache, prompt = self._ragged_blocks(params, cache, tokens, jnp.where(row_live, pos, 0),
                                                        slot_mapping, ps.block_tables[safe], old, cu, entry, cu[-1],
                                                        jnp.where(row_live, batch.prompt_targets, -1))
            slots = slots.write_tokens(tokens, slot_mapping)
            logits = jnp.where(sib[:, None], logits[lead], logits)  # a sample draws from its leader's logits

            def put(a, v, where):  # a[ids[e]] = v[e] where where[e]
                return a.at[jnp.where(where, ids, self.max_seqs)].set(v.astype(a.dtype), mode="drop")

            # Final chunks install the request's sampling state in its slot before sampling.
            start = live & final
            slots = slots.replace(
                num_generated=put(slots.num_generated, batch.num_generated, start),
                params=jax.tree_util.tree_map(lambda a, v: put(a, v, start), slots.params, batch.params))
            row_slots = slots.rows(safe)
            # Structured outputs: the host's grammar mask of each constrained row (else all allowed).
            allowed = ~batch.constrained[:, None] | allowed_tokens(batch.allowed, logits.shape[-1])  # bool[B, vocab]
            sampled, sampled_lp, top_ids, top_lps = sample_slots(
                logits, row_slots.params, row_slots.num_generated, lambda: slots.history(ps.block_tables[safe]), new,
                self.stop_ids, allowed=allowed)
            emits = live & (decode_row | final)
            fresh = decode_row | (batch.resume_token < 0)
            tok = jnp.where(fresh, sampled, batch.resume_token)
            lp = jnp.where(fresh, sampled_lp, jnp.nan)
            top_ids = jnp.where(fresh[:, None], top_ids, -1)   # a resumed token's were recorded before
            row_slots = row_slots.replace(num_generated=row_slots.num_generated + fresh.astype(jnp.int32))
            done = emits & fresh & _finished(row_slots, tok, new, self.stop_ids)
            slots = slots.replace(tokens=put(slots.tokens, tok, emits),
                                  num_generated=put(slots.num_generated, row_slots.num_generated, emits),
                                  active=put(slots.active, ~done, emits))
            ps = pages.cache(ps, jnp.where(live & final, ids, -1), batch.cache_upto)
            tables = ps.block_tables[safe]  # i32[B, pages_per_seq], before the finished are released
            ps = pages.release(ps, jnp.where(done, ids, -1))
            return i + 1, cache, ps, slots, (tok, lp, top_ids, top_lps, tables, copies, prompt)

        tn = min(MAX_TOP_LOGPROBS, self.model.config.vocab_size)
        empty_prompt = (jnp.full((num_tokens,), jnp.nan, jnp.float32), jnp.zeros((num_tokens,), jnp.int32),
                        jnp.full((num_tokens, tn), -1, jnp.int32), jnp.full((num_tokens, tn), -jnp.inf, jnp.float32))
        empty_out = (jnp.zeros((num_entries,), jnp.int32), jnp.full((num_entries,), jnp.nan, jnp.float32),
                     jnp.full((num_entries, tn), -1, jnp.int32), jnp.full((num_entries, tn), -jnp.inf, jnp.float32),
                     jnp.zeros((num_entries, self.pages_per_seq), jnp.int32), jnp.int32(0), empty_prompt)
        usage = _tally(jax.tree_util.tree_map(jnp.int32, NO_COPIES), 0, page_state)  # the entries' pages reserved
        _, cache, page_state, slots, (tok, lp, top_ids, top_lps, tables, copies, prompt) = lax.while_loop(
            lambda c: c[0] < batch.run_ragged * ok.astype(jnp.int32), ragged_step,
            (jnp.int32(0), cache, page_state, slots, empty_out))
        decode_steps = jnp.where(ok, jnp.minimum(batch.decode_steps, self.steps_per_call), 0)
        # Structured outputs: constrained slots sample only in the ragged step (under the host's
        # grammar mask); the decode loop (speculative or not) runs without them and they come back
        # as they were.
        held = slots.active & slots.params.constrained
        loop_slots = slots.replace(active=slots.active & ~held)
        if self.spec is None:
            cache, page_state, slots, (out, out_lp, out_ids, out_tops), steps, loop_copies = self._decode_loop(
                params, cache, page_state, loop_slots, decode_steps)
            zeros = jnp.zeros((self.max_seqs,), jnp.int32)
            spec_counts = (zeros, zeros, zeros, jnp.zeros((1,), jnp.int32))
        else:
            cache, page_state, slots, (out, out_lp, out_ids, out_tops), steps, loop_copies, spec_counts = \
                self._spec_loop(params, cache, page_state, loop_slots, decode_steps)
        slots = slots.replace(active=slots.active | held)
        loop_copies, peak, peak_tokens = (loop_copies[0],) + tuple(
            jnp.where(loop_copies[1] > usage[1], a, b) for a, b in zip(loop_copies[1:], usage[1:]))
        return cache, page_state, slots, StepResult(
            tokens=tok, logprobs=lp, top_ids=top_ids, top_logprobs=top_lps, ok=ok, out=out, out_logprobs=out_lp,
            out_top_ids=out_ids, out_top_logprobs=out_tops, steps=steps,
            num_free=pages.num_free_pages(page_state), seq_lens=page_state.seq_lens, active=slots.active,
            tables=tables, cow_copies=copies + loop_copies, prompt_logprobs=prompt[0], prompt_ranks=prompt[1],
            prompt_top_ids=prompt[2], prompt_top_logprobs=prompt[3], spec_drafted=spec_counts[0],
            spec_accepted=spec_counts[1], spec_steps=spec_counts[2], spec_accepted_per_pos=spec_counts[3],
            peak_pages=peak, peak_tokens=peak_tokens)

    @staticmethod
    def _retire_impl(page_state, slots, seq_ids):
        page_state = pages.release(page_state, seq_ids)
        idx = jnp.where(seq_ids >= 0, seq_ids, slots.active.shape[0])
        return page_state, slots.replace(active=slots.active.at[idx].set(False, mode="drop"))

    # ------------------------------------------------------------------ host entry points

    def jit_options(self) -> dict:
        """jax.jit options of the compiled step: state donated and, under a mesh, outputs pinned
        (the cache keeps its head sharding, everything else replicated)."""
        if self.mesh is None:
            return dict(donate_argnums=DONATE)
        return dict(donate_argnums=DONATE, out_shardings=(self._pool, self._rep, self._rep, self._rep))

    def state(self):
        """(params, cache, page_state, slots): the leading arguments of the compiled step."""
        return self.params, self.cache, self.page_state, self.slots

    def set_block_tokens(self, num_tokens: int) -> int:
        """Fixes the ragged step's rows per model pass for a budget of num_tokens: the configured
        value, else 64 rows on a CPU (compute-bound: padding rows cost as much as real ones) and the
        whole budget elsewhere (one pass; a GPU reads the weights once per pass)."""
        default = 64 if jax.default_backend() == "cpu" else num_tokens
        self.block_tokens = min(self._block_tokens or default, num_tokens)
        self.prompt_chunk = max(1, min(self.block_tokens, PROMPT_LOGITS_ELEMENTS // self.model.config.vocab_size))
        return self.block_tokens

    def step_inputs(self, num_tokens: int):
        """ShapeDtypeStructs of the step's StepBatch for a budget of num_tokens (for lowering)."""
        empty = types.SimpleNamespace(entries=(), evict=(), decode_steps=0)  # only the shapes matter
        batch = make_step_batch(empty, max_seqs=self.max_seqs, num_tokens=num_tokens, pages_per_seq=self.pages_per_seq,
                                num_pages=self.cache_config.num_pages, page_size=self.cache_config.page_size,
                                max_model_len=1, vocab_size=self.model.config.vocab_size)
        sharding = {} if self.mesh is None else dict(sharding=self._rep)
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, **sharding), batch)

    def compile_step(self, num_tokens: int):
        """Compiles the unified step for a token budget (done by the first `step`). Sets
        `step_from_cache`: whether JAX's persistent compilation cache served the executable."""
        self.set_block_tokens(num_tokens)
        t0 = time.perf_counter()
        hits = _CACHE_HITS[0]
        self._step_exe = jax.jit(self._step_impl, **self.jit_options()).lower(
            *self.state(), self.step_inputs(num_tokens)).compile()
        self.step_from_cache = _CACHE_HITS[0] > hits
        self.compile_seconds += time.perf_counter() - t0
        self.attention = attention_in(self._step_exe.as_text())
        self.step_tokens = num_tokens

    def step(self, batch: StepBatch) -> StepResult:
        """Runs one round (StepBatch of numpy arrays) and reads its StepResult back in one transfer.

        The result's `out`/`out_logprobs` are cut to the steps run. When `ok` is False the round
        changed nothing on the device.
        """
        num_tokens = batch.tokens.shape[0]
        if self._step_exe is None:
            self.compile_step(num_tokens)
        elif num_tokens != self.step_tokens:
            raise ValueError(f"the unified step was compiled for a token budget of {self.step_tokens}; got "
                             f"{num_tokens}")
        self.cache, self.page_state, self.slots, res = self._step_exe(
            *self.state(), self._put(jax.tree_util.tree_map(jnp.asarray, batch)))
        if not (np.asarray(batch.prompt_targets) >= 0).any():  # nobody asked: not read back
            res = res.replace(prompt_logprobs=None, prompt_ranks=None, prompt_top_ids=None, prompt_top_logprobs=None)
        res = jax.device_get(res)
        rows = int(res.steps) * self.width
        self.cow_copies += int(res.cow_copies)
        return res.replace(out=res.out[:rows], out_logprobs=res.out_logprobs[:rows],
                           out_top_ids=res.out_top_ids[:rows], out_top_logprobs=res.out_top_logprobs[:rows])

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
        """Evicts pages from the prefix cache now (`jpa.kv.pages.uncache`); returns (free pages, seq_lens)."""
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
