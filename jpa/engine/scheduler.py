"""The scheduler: which requests hold slots and pages, when to admit, whom to preempt, when to stop.

Plain Python over request metadata and page counts; no model and no device work (unit tests drive
it directly). The engine glues it to the device, one round at a time:

    plan = scheduler.plan_round(budget)                   # schedule: decode rows, prompt chunks, admissions,
                                                          #   and the pending release (plan.release)
    result = runner.step(make_step_batch(plan, shapes))   # execute: ONE device call (release, ragged step,
                                                          #   decode steps)
    events = scheduler.stepped(plan, result)              # update: tokens, stops, the device's page counts
    release, preempted = scheduler.end_round(flush)       # stop strings, preemptions: the next round's release

A request's life is its `phase` (`jpa.engine.request.Phase`), changed only by `_move`: WAITING in
the queue; PREFILLING from its first prompt chunk (it holds a slot); FORKING for a parallel sample
holding an empty slot until its leader's last chunk; DECODING after its last chunk; FINISHED.
Two collections hold the live requests: `waiting` (a queue) and `running` (slot -> request, every
phase that holds a slot). Everything else about a request (tokens computed, cached pages held,
a pending copy-on-write) is a field of the Request.

Page counts have one source of truth: the device's PageState (free pages and seq_lens), handed
back after every device call (`stepped`, `set_pages`). The host only projects from it with the same
rule the device uses (`jpa.kv.pages.pages_for_tokens`); it keeps no running count of its own.
Slots released on the host (stop strings, aborts, preemptions) keep their pages on the device
until the next round's step releases them first (`RoundPlan.release`); until then `free_pages` is
the device's count plus what that release frees, also the device's figure: each slot's `own`
pages (referenced by it alone; `batch.DeviceCounts`). That sum is exact unless two released slots
share uncached pages (a forked sample and its leader); then the engine releases them with a call
of its own first (`end_round(flush)`, `release_is_exact`), so every plan is the one the device's
state after the release gives.

Policies (vLLM v1's, in nano-vllm's split):
- token budget: every decoding request gets its one token first, then prefilling requests
  continue in admission order, then waiting requests are admitted, each taking a chunk of
  min(budget left, prompt left, what the free pages hold). A round with no prompt work skips the
  ragged step and runs steps_per_call decode steps (unless a constrained request decodes: see
  structured outputs below); a round with prompt work runs steps_per_call - 1 decode steps after
  it only when no prompt work is left for the next round and no prompt ends in it with its first
  token (time to first token: that token comes back with the round that samples it).
- admission: first come, first served, into free slots, while the pool holds the prompt plus its
  growth during the next decode call, the running requests' growth (headroom) and a watermark of
  free pages; an idle engine admits any prompt that fits in the whole pool. No admission in the
  round after a preemption (it would take back the pages just freed).
- preemption by recompute: when the next step cannot get pages for every running request, the
  newest admitted is preempted (its pages released, back to the front of the queue with its
  generated tokens kept) until the step fits. A lone request always fits, because the engine caps
  max_model_len at the pool size, so preemption never empties the running set for lack of pages.
- prefix caching: see `plan_round` and `jpa.kv.prefix_cache`.
- KV offload (a `jpa.kv.offload.HostTier`): a preempted request whose block fits in the host tier
  is swapped out (`take_swap_outs`: the engine copies its pages out before releasing them) rather
  than thrown away; on re-admission its pages past its prefix-cache hit are swapped back in
  (`RoundPlan.swap_in`, done by the engine before the round's step) and it prefills only its last
  token (whose logits are not kept: the pending token is known), instead of its whole history.
  Without room in the host tier, or where the model's cost rule (`jpa.kv.offload.SwapCost`, the
  scheduler's `swap_cost`) says recomputing is cheaper, it is recomputed as before.
- prefix-cache spill (KV offload with prefix caching): the plan names which of its evicted pages
  are copied to the host tier first (`RoundPlan.spill`); an admitted request whose longest cached
  prefix runs through host-resident pages gets them back (`SwapIn` with `restore`: fresh device
  pages, cached again, shared with the device-resident ones; done by the engine before the step)
  and prefills only past the hit.
- parallel sampling (SamplingParams.n): a request's samples wait with the first one (`siblings`),
  take their slots with it (FORKING) and join the plan with q_len 0 in the round of its last
  prompt chunk, when the device forks its pages to them; until each has written past the shared
  partly filled last page (`cow_pending`), one more page is counted for its copy on write. A
  preempted leader takes its unforked samples back to the queue with it.
- prompt logprobs (SamplingParams.prompt_logprobs): a chunk of such a request names, per row, the
  prompt token after it (`Entry.targets`, only for positions it has no logprob for yet, so a
  recompute asks nothing twice); `stepped` stores what the device returns per position. Such a
  request does not read the prefix cache while it still needs some.
- stops: the device finishes requests on EOS, max_new_tokens and the length limit (and releases
  their pages itself); stop strings are found here, on the incremental detokenizer's text, and
  the output is cut at the token that completed the stop.
- request hooks (`hooks`: a feature's plan and post-process points; the feature's module owns
  them): structured outputs (`jpa.engine.structured.StructuredHook`) is one. Its plan: a
  constrained request samples only in the ragged step (the device's decode loop skips it), so
  while one decodes every round has a ragged step with a decode row per decoding request, then
  steps_per_call - 1 decode steps for the others. Its post-process: each new token is fed to the
  request's grammar matcher; once the grammar admits nothing more the request finishes ("stop"),
  as with a stop string, and a token the grammar rejects (a bug: the sampler draws only allowed
  tokens) finishes it with "error".
"""

import collections
import dataclasses

from jpa.kv.offload import HostTier, SwapCost, bucket
from jpa.kv.prefix_cache import PrefixCache
from jpa.engine.request import NEXT_PHASES, Phase, PromptLogprob, Request
from jpa.engine.structured import STRUCTURED
from jpa.kv.pages import pages_for_tokens


def _lora_salt(req: Request):
    """The prefix cache's key root of a request's KV: its LoRA adapter's id and weights' version
    (`jpa.engine.lora.LoraSlots.cache_key`; None: the base model)."""
    return None if req.lora_request is None else req.lora_cache_key


@dataclasses.dataclass(frozen=True)
class Entry:
    """One sequence's rows in a round: a decode token or a prompt chunk."""
    slot: int
    request: Request
    q_len: int                     # rows this round (1 for a decode token)
    decode: bool                   # feeds the slot's pending token
    final: bool                    # a prompt chunk that ends the prompt
    tokens: tuple[int, ...] = ()   # the chunk's token ids (empty for a decode token)
    hit_pages: tuple[int, ...] = ()  # cached pages shared before the chunk (prefix-cache hit, first chunk)
    fork_of: int = -1              # a parallel sample (q_len 0): the slot whose final chunk it forks
    cache_upto: int = 0            # full prompt pages a final chunk puts into the prefix cache
    start: int = 0                 # position of the chunk's first row in its sequence (a swap-in's chunk:
                                   # after the restored tokens)
    targets: tuple[int, ...] = ()  # prompt logprobs: per row, the next prompt token it predicts (-1: none
                                   # wanted); empty when no row of the chunk asks


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """KV offload: an admitted request whose pages come back from the host tier before the step.

    A swapped-out request (restore empty): the device shares its prefix-cache hit (hit_pages) into
    the empty slot, reserves pages up to num_tokens and copies its swap block's pages past the hit
    into them. A prefix hit partly in the host tier (restore: the spilled pages' key ids, in order):
    hit_pages holds -1 at their positions; the device caches fresh pages there, copies the spilled
    pages into them and shares the whole hit (num_tokens = its tokens). The request's chunk starts
    at num_tokens."""
    slot: int
    request: Request
    hit_pages: tuple[int, ...]
    num_tokens: int
    restore: tuple = ()


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """A round: the ragged step's entries (none: skipped), then decode_steps decode steps."""
    entries: tuple[Entry, ...]
    decode_steps: int
    admitted: tuple[int, ...] = ()   # slots whose request was admitted by this plan
    evict: tuple[int, ...] = ()      # cached-idle pages the device evicts first (prefix caching)
    swap_in: tuple[SwapIn, ...] = ()  # KV offload: page moves done before the step (the evictions first)
    spill: tuple[int, ...] = ()      # KV offload: the evicted pages copied to the host tier first
    release: tuple[int, ...] = ()    # slots the step releases before anything else (released on the host
                                     # since the last device call: stop strings, aborts, preemptions)
    held: tuple[int, ...] = ()       # slots holding a request once planned, ascending (the decode loop's
                                     # slots: a step shape needs rows for each, `StepBatch.loop_slots`)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(e.q_len for e in self.entries if not e.decode)


@dataclasses.dataclass
class _RoundDraft:
    """plan_round's working state over one round (mutable while it plans)."""
    left: int                 # tokens of the budget not yet given out
    alloc: int                # pages the ragged step takes
    idle: int                 # cached-idle pages (evictable, so counted as free)
    referenced: set           # cached pages running (or just admitted) requests hold
    prompt: list = dataclasses.field(default_factory=list)     # prompt chunk entries, in order
    swap_in: list = dataclasses.field(default_factory=list)    # SwapIn records (KV offload)
    admitted: list = dataclasses.field(default_factory=list)   # slots admitted by this plan
    blocked_by_budget: bool = False


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a round did to one request: tokens kept this round and whether it finished."""
    request: Request
    new_token_ids: tuple[int, ...]
    finished: bool
    new_logprobs: tuple[float, ...] = ()   # one per new token
    new_top_logprobs: tuple = ()           # one per new token when the request asked for top_logprobs


class Scheduler:
    """Admission, preemption and stop handling for one engine.

    Args:
      max_seqs: decode slots.
      page_size: tokens per page.
      num_pages: pages in the pool.
      max_model_len: longest sequence (prompt + completion); at most num_pages * page_size.
      steps_per_call: decode steps per device call (the growth admission must leave room for).
      watermark: fraction of the pool kept free at admission.
      stop_ids: token ids that end a request unless its params say ignore_eos.
      prefix_caching: keep full prompt pages cached for later requests (`PrefixCache`).
      host_tier: KV offload's host tier (`jpa.kv.offload.HostTier`); None = preemption recomputes.
      swap_cost: the model's swap-vs-recompute rule (`jpa.kv.offload.SwapCost`); None = swap
        whenever the host tier has room.
      hooks: request hooks, a feature's plan and post-process points (`plan(req)`: the decoding
        request needs a ragged row this round; `post(req, device_done)`: (finish reason, error)
        when the feature ends it on the host). Default: structured outputs
        (`jpa.engine.structured.StructuredHook`).
    """

    def __init__(self, *, max_seqs: int, page_size: int, num_pages: int, max_model_len: int,
                 steps_per_call: int, watermark: float, stop_ids=(), prefix_caching: bool = False,
                 host_tier: HostTier | None = None, swap_cost: SwapCost | None = None, hooks=(STRUCTURED,),
                 state_pages: int | None = None):
        if max_model_len > num_pages * page_size:
            raise ValueError(f"max_model_len must be <= num_pages * page_size = {num_pages * page_size} "
                             f"(a lone sequence must fit in the pool); got {max_model_len}")
        self.max_seqs, self.page_size, self.num_pages = max_seqs, page_size, num_pages
        self.max_model_len, self.steps_per_call = max_model_len, steps_per_call
        self.watermark_pages = int(watermark * num_pages)
        self.stop_ids = frozenset(stop_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}      # slot -> request holding it (prefilling, forking, decoding)
        self.host = host_tier
        self.swap_cost = swap_cost
        # A model with recurrent state (`jpa.engine.states`): host pages its states take in a swap block beside
        # its KV pages (None: no recurrent state). A swapped-in request then gets back every token it had: its
        # state is that of all of them, so nothing may be recomputed (a decoding one takes a zero-row chunk).
        self.state_pages = state_pages
        self.hooks = tuple(hooks)
        self.recomputed_by_rule = 0                # preemptions the cost rule sent to recompute
        self.prefix = PrefixCache(page_size, host=host_tier) if prefix_caching else None
        self._swap_outs: list[tuple[int, Request, int]] = []   # (slot, request, block pages) to copy out
        # The device's counts after its last call (stepped / set_pages): free pages, and per slot the
        # pages only it references and whether it shares uncached pages (`batch.DeviceCounts`).
        self.device_free_pages = num_pages
        self._own = self._shared = None
        self.num_preemptions = 0
        # (slot, request) released on the host (stop strings, aborts, preemptions) whose pages the
        # device still holds: the next step releases them first (`RoundPlan.release`).
        self._to_release: list[tuple[int, Request]] = []
        self._admissions = 0
        self._preempted_last_round = False
        # LoRA adapters (`jpa.engine.lora.LoraSlots`, set by the engine with enable_lora): admission takes a
        # device slot for a request's adapter; leaving its decode slot gives the reference back.
        self.lora = None

    @classmethod
    def for_shapes(cls, shapes, *, watermark: float, stop_ids=(), prefix_caching: bool = False,
                   host_tier: HostTier | None = None, swap_cost: SwapCost | None = None,
                   extra_hooks=(), state_pages: int | None = None) -> "Scheduler":
        """The scheduler of an engine whose sizes are `shapes` (`jpa.engine.shapes.EngineShapes`);
        extra_hooks: request hooks after the default ones; state_pages: see `Scheduler`."""
        return cls(max_seqs=shapes.max_seqs, page_size=shapes.page_size, num_pages=shapes.num_pages,
                   max_model_len=shapes.max_model_len, steps_per_call=shapes.steps_per_call, watermark=watermark,
                   stop_ids=stop_ids, prefix_caching=prefix_caching, host_tier=host_tier,
                   swap_cost=swap_cost, hooks=(STRUCTURED, *extra_hooks), state_pages=state_pages)

    # ------------------------------------------------------------------ the one place phases change

    def _move(self, req: Request, phase: Phase, slot: int = -1) -> None:
        """Moves req to `phase` (along NEXT_PHASES) and keeps `running` in step: a request entering
        a slot-holding phase from WAITING takes `slot`; one leaving for WAITING or FINISHED gives
        its slot up. The caller decides what the device must release."""
        if phase not in NEXT_PHASES[req.phase]:
            raise RuntimeError(f"request {req.request_id!r}: no transition {req.phase.value} -> {phase.value}")
        if req.phase is Phase.WAITING and phase is not Phase.FINISHED:   # admission: a fresh stay in a slot
            assert slot not in self.running, f"slot {slot} is taken"
            req.slot, req.num_computed_tokens, req.cache_refs, req.cow_pending = slot, 0, (), False
            req.kv_epoch = None   # its KV is computed from the weights served now
            self.running[slot] = req
        elif phase in (Phase.WAITING, Phase.FINISHED) and req.slot >= 0:
            del self.running[req.slot]
            req.slot = -1
        if phase in (Phase.WAITING, Phase.FINISHED) and req.lora_slot >= 0:   # its adapter's slot reference
            self.lora.release(req.lora_slot)
            req.lora_slot = -1
        req.phase = phase

    def _finish(self, req: Request, reason: str) -> Request:
        self._move(req, Phase.FINISHED)
        req.finish_reason = reason
        return req

    # ------------------------------------------------------------------ queue

    def add(self, req: Request) -> None:
        """Queues a validated request (a new one: WAITING)."""
        if req.phase is not Phase.WAITING or req.slot >= 0:
            raise RuntimeError(f"request {req.request_id!r} is {req.phase.value}: only new requests are added")
        self.waiting.append(req)

    def abort(self, request_id) -> list[Request]:
        """Takes an unfinished request out (finish_reason "abort"); returns it first, then the
        samples that had not forked from it yet (aborted with it); [] if it is not here.

        Slots it held are queued for release: the next round's step releases them first
        (`RoundPlan.release`), or the engine sooner (`take_releases`); the slots are free to admit into.
        """
        req = next((r for r in self.waiting if r.request_id == request_id), None)
        if req is None:
            req = next((r for r in self.running.values() if r.request_id == request_id), None)
        if req is None:   # a sample waiting with its leader in the queue
            for lead in self.waiting:
                sib = next((s for s in lead.siblings if s.request_id == request_id), None)
                if sib is not None:
                    lead.siblings.remove(sib)
                    return [self._finish(sib, "abort")]
            return []
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
            if self.host is not None:
                self.host.drop(req.request_id)   # its swapped pages: not needed any more
        if req.phase is Phase.FORKING:
            req.leader.siblings.remove(req)
        if req.slot >= 0:
            self._to_release.append((req.slot, req))
        aborted = [self._finish(req, "abort")]
        for sib in req.siblings:   # an aborted leader takes its unforked samples along
            if sib.slot >= 0:
                self._to_release.append((sib.slot, sib))
            aborted.append(self._finish(sib, "abort"))
        req.siblings = []
        return aborted

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def phase_count(self, phase: Phase) -> int:
        return sum(r.phase is phase for r in self.running.values())

    # ------------------------------------------------------------------ page projections

    def set_pages(self, free_pages: int, seq_lens, own=None, shared=None, *, released=None) -> None:
        """Records the device's PageState after a device call: free pages, tokens per slot, and
        per slot the pages only it references and whether it shares uncached ones (`own`,
        `shared` of `batch.DeviceCounts`; None: unknown, so a pending release counts as freeing
        nothing and is not exact). released: the slots of the pending release that call released
        (None: all of them)."""
        self.device_free_pages = int(free_pages)
        self._own, self._shared = own, shared
        self._to_release = [] if released is None else [(s, r) for s, r in self._to_release if s not in released]
        for slot, req in self.running.items():
            req.num_computed_tokens = int(seq_lens[slot])

    def _freed(self, slots) -> tuple[int, bool]:
        """(pages that releasing `slots` frees by the device's last counts, whether that is exact):
        the sum of their `own` pages, exact unless two of them share uncached pages (then a lower
        bound), and (0, False) when the device's counts are unknown."""
        slots = set(slots)
        if not slots:
            return 0, True
        if self._own is None:
            return 0, False
        return (sum(int(self._own[s]) for s in slots),
                sum(bool(self._shared[s]) for s in slots) <= 1)

    @property
    def pending_release(self) -> tuple[int, ...]:
        """Slots released on the host whose pages the device still holds (the next step releases them)."""
        return tuple(s for s, _ in self._to_release)

    def release_is_exact(self) -> bool:
        """Whether `free_pages` (the device's count plus what the pending release frees) is exact."""
        return self._freed(self.pending_release)[1]

    @property
    def free_pages(self) -> int:
        """Free pages once the pending release is done: the device's count plus the pages the
        released slots alone hold (exact when `release_is_exact()`, else a lower bound)."""
        return self.device_free_pages + self._freed(self.pending_release)[0]

    @free_pages.setter
    def free_pages(self, value: int) -> None:   # tests: what the host believes
        self.device_free_pages = int(value) - self._freed(self.pending_release)[0]

    def _growth(self, num_tokens: int, steps: int) -> int:
        """Pages a sequence holding num_tokens takes to grow by `steps` tokens (capped at the limit)."""
        ps = self.page_size
        return pages_for_tokens(min(num_tokens + steps, self.max_model_len), ps) - pages_for_tokens(num_tokens, ps)

    def _prompt_left(self, req: Request) -> int:
        """Prompt tokens a prefilling request has not cached yet (0 once it decodes)."""
        if req.phase is not Phase.PREFILLING:
            return 0
        return len(self.prefill_tokens(req)) - req.num_computed_tokens

    def _fork_pages(self) -> int:
        """Pages a sample that forks a prompt may take over one decode call: its new tokens'
        pages and a copy of the shared partly filled last page."""
        return pages_for_tokens(self.steps_per_call, self.page_size) + 1

    def headroom(self) -> int:
        """Pages the running requests may take during the next decode call (prefilling ones: the
        rest of their prompt too; samples waiting to fork: `_fork_pages`)."""
        return sum(self._fork_pages() if r.phase is Phase.FORKING else
                   self._growth(r.num_computed_tokens, self._prompt_left(r) + self.steps_per_call) + r.cow_pending
                   for r in self.running.values())

    def next_step_pages(self) -> int:
        """Pages the next step needs: one per running sequence whose last page is full (a
        prefilling one must be able to take at least one more prompt token; a forked one may copy
        its shared last page)."""
        return sum(self._growth(r.num_computed_tokens, 1) + r.cow_pending for r in self.running.values()
                   if r.phase is not Phase.FORKING)

    def held_cached_pages(self) -> set:
        """Cached pages that running requests hold (not evictable)."""
        return {p for r in self.running.values() for p in r.cache_refs}

    def expected_seq_len(self, slot: int) -> tuple[int, int]:
        """The range [lo, hi] of tokens the device may hold for `slot` given the host's view (for
        `LLMEngine.check_page_state`): 0 for a free or forking slot, fewer than its prompt while
        prefilling, exactly all but the pending token while decoding."""
        req = self.running.get(slot)
        if req is None or req.phase is Phase.FORKING:
            return 0, 0
        if req.phase is Phase.PREFILLING:
            return 0, len(self.prefill_tokens(req)) - 1
        return req.num_tokens - 1, req.num_tokens - 1

    # ------------------------------------------------------------------ planning a round

    @staticmethod
    def prefill_tokens(req: Request) -> list[int]:
        """What admission prefills: a preempted request recomputes all but its pending token."""
        return req.prompt_ids + req.output_ids[:-1]

    def plan_round(self, budget: int) -> RoundPlan:
        """Plans a round over a token budget (see the module doc for the policy).

        Admitted requests are popped from the queue into slots (PREFILLING) here; if the device
        call does not happen, `unplan(plan)` undoes that. With a prefix cache, an admitted request
        starts after its longest cached full-page prefix (its pages shared, not recomputed), and
        cached-idle pages count as free: the plan names the least recently used ones the device
        must evict first so that every allocation of the call finds a free page.
        """
        if budget < self.max_seqs:
            raise ValueError(f"the token budget ({budget}) must be >= max_seqs ({self.max_seqs}): every decoding "
                             f"sequence takes one token of it")
        referenced = self.held_cached_pages() if self.prefix is not None else set()
        decoding = [s for s in sorted(self.running) if self.running[s].phase is Phase.DECODING]
        r = _RoundDraft(left=budget - len(decoding),
                        alloc=sum(self._growth(self.running[s].num_computed_tokens, 1) for s in decoding),
                        idle=self.prefix.num_idle(referenced) if self.prefix is not None else 0,
                        referenced=referenced)
        self._continue_prefills(r)
        admit = True
        if self._preempted_last_round:
            self._preempted_last_round = False
            admit = not self.running
        if admit:
            self._admit(r)
        entries, steps = self._entries(r, decoding)
        evict = self._evictions(r, entries, steps)
        # Spill only where the cost rule prefers a page's copy to its recompute (a prefix page's recompute
        # is a page of prefill; its copy, out and back).
        pays = self.swap_cost is None or self.swap_cost.prefers_swap(self.page_size)
        spill = tuple(self.prefix.spillable(evict)) if evict and pays else ()
        return RoundPlan(entries, steps, tuple(r.admitted), evict, tuple(r.swap_in), spill, self.pending_release,
                         tuple(sorted(self.running)))

    def _fit(self, r: "_RoundDraft", seq_len: int) -> int:
        """Tokens a sequence holding seq_len can add within the free pages."""
        ps = self.page_size
        return max(0, self.free_pages + r.idle - r.alloc) * ps + pages_for_tokens(seq_len, ps) * ps - seq_len

    def _chunk(self, req: Request, done: int, n: int, hit=()) -> Entry:
        toks = self.prefill_tokens(req)
        final = done + n == len(toks)
        upto = len(toks) // self.page_size if final and self.prefix is not None else 0
        return Entry(req.slot, req, n, False, final, tuple(toks[done:done + n]), tuple(hit), cache_upto=upto,
                     start=done, targets=self.prompt_targets(req, done, n))

    def _continue_prefills(self, r: "_RoundDraft") -> None:
        """Prefilling requests continue in admission order, each a chunk within the budget and pages."""
        for req in sorted((q for q in self.running.values() if q.phase is Phase.PREFILLING),
                          key=lambda q: q.admitted_at):
            done = req.num_computed_tokens
            n = min(r.left, len(self.prefill_tokens(req)) - done, self._fit(r, done))
            if n <= 0:
                continue
            r.prompt.append(self._chunk(req, done, n))
            r.left -= n
            r.alloc += self._growth(done, n)

    def _admit(self, r: "_RoundDraft") -> None:
        """Waiting requests are admitted first come, first served, into free slots, while the pool
        holds them (see the module doc); each takes its first chunk."""
        ps = self.page_size
        free_slots = [s for s in range(self.max_seqs) if s not in self.running]
        avail = self.free_pages + r.idle - self.headroom()
        while self.waiting and free_slots:
            if r.left <= 0:
                r.blocked_by_budget = True
                break
            req = self.waiting[0]
            if len(req.siblings) + 1 > len(free_slots):
                break   # parallel samples are admitted together: one slot each
            toks = self.prefill_tokens(req)
            # A request that still needs prompt logprobs computes its whole prompt (cached
            # pages have no logits; vLLM v1 does the same). It still caches its pages.
            # KV offload: a swapped-out request's tokens past the hit come back from its block (all but
            # the last one to prefill: the chunk that ends the prompt computes it); any other's hit
            # may run through pages spilled to the host tier (restored: `restore` key ids).
            block = self.host.blocks.get(req.request_id) if self.host is not None else None
            hit, restore = [], []
            if self.prefix is not None and not req.needs_prompt_logprobs:
                salt = _lora_salt(req)
                hit, restore = (self.prefix.lookup_tiers(toks, salt) if self.host is not None and block is None
                                else (self.prefix.lookup(toks, salt), []))
            on_device = [p for p in hit if p >= 0]
            # Shared pages that were idle are no longer evictable.
            newly_held = sum(1 for p in on_device if p not in r.referenced)
            h = len(hit) * ps
            start = h if block is None else max(h, block.num_tokens if self.state_pages is not None
                                                else min(block.num_tokens, len(toks) - 1))
            need = (len(restore) + self._growth(h, len(toks) - h + self.steps_per_call)
                    + len(req.siblings) * self._fork_pages())
            alone = not self.running
            if avail - newly_held - need < self.watermark_pages and not (
                    alone and pages_for_tokens(len(toks), ps) - len(on_device) <= self.free_pages + r.idle - newly_held):
                break
            n = min(r.left, len(toks) - start, self._fit(r, h) - (start - h) - len(restore) * ps)
            if n < 0 or (n == 0 and start < len(toks)):   # (a recurrent model's whole swap-in: a zero-row chunk)
                break
            if req.lora_request is not None:   # LoRA: a device slot for its adapter, one reference per sample
                lora_slot = self.lora.acquire(req.lora_request, 1 + len(req.siblings))
                if lora_slot is None:
                    break   # every adapter slot is in use by running requests: it waits (first come, first served)
                for q in (req, *req.siblings):
                    q.lora_slot = lora_slot
            r.idle -= newly_held
            self.waiting.popleft()
            self._admissions += 1
            self._move(req, Phase.PREFILLING, free_slots.pop(0))
            # Restored pages join cache_refs once the device names them (`stepped`).
            req.admitted_at, req.cache_refs = self._admissions, tuple(on_device)
            if start > h:
                req.num_computed_tokens = start   # the device holds them once the swap-in ran
                r.swap_in.append(SwapIn(req.slot, req, tuple(hit), start))
            elif restore:
                req.num_computed_tokens = h       # the device holds them once the restore ran
                r.swap_in.append(SwapIn(req.slot, req, tuple(hit), h, tuple(restore)))
            elif block is not None:
                self.host.drop(req.request_id)   # the prefix cache holds as much: the copy is not needed
            if not req.num_preemptions:   # OpenAI usage.prompt_tokens_details.cached_tokens
                req.num_cached_tokens = h
            for sib in req.siblings:  # their slots wait for the fork of the prompt's last chunk
                self._move(sib, Phase.FORKING, free_slots.pop(0))
                sib.admitted_at = self._admissions
                r.admitted.append(sib.slot)
            r.referenced.update(on_device)
            if self.prefix is not None:
                self.prefix.touch(on_device)
                if restore:
                    self.host.touch(restore)
            r.admitted.append(req.slot)
            r.prompt.append(self._chunk(req, h, n, hit) if start == h and not restore else self._chunk(req, start, n))
            r.left -= n
            r.alloc += len(restore) + self._growth(h, start - h + n)
            avail -= newly_held + need

    def _entries(self, r: "_RoundDraft", decoding: list) -> tuple[tuple[Entry, ...], int]:
        """(the ragged step's entries, decode steps after it)."""
        prompt = r.prompt
        # A request hook's plan (structured outputs: `StructuredHook.plan`) can ask for a ragged row:
        # while such a request decodes, a round without prompt work still runs the ragged step
        # (every decoding request's decode row), then steps_per_call - 1 decode steps for the
        # others. (The ragged pass costs about a block of rows however few are live, so the other
        # requests' first token of the round is better made there than in an extra decode step:
        # measured in BENCHMARKS.md.)
        if prompt or any(h.plan(self.running[s]) for h in self.hooks for s in decoding):
            more = r.blocked_by_budget or any(not e.final for e in prompt) or len(prompt) < len(
                [q for q in self.running.values() if q.phase is Phase.PREFILLING])
            forks = [Entry(sib.slot, sib, 0, False, True, fork_of=e.slot)
                     for e in prompt if e.final for sib in e.request.siblings if sib.phase is Phase.FORKING]
            entries = tuple(Entry(s, self.running[s], 1, True, False) for s in decoding) + tuple(prompt) + tuple(forks)
            # A request's first token comes back with the round that samples it, not after
            # steps_per_call - 1 decode steps more (time to first token; one more host round trip).
            first = any(e.final and not e.request.output_ids for e in prompt)
            return entries, 0 if more or first else self.steps_per_call - 1
        r.alloc = 0
        return (), self.steps_per_call

    def _evictions(self, r: "_RoundDraft", entries, steps: int) -> tuple[int, ...]:
        """Cached-idle pages the device must evict first so that every allocation of the call
        (the ragged step's and the decode steps') finds a free page."""
        if self.prefix is None:
            return ()
        ps = self.page_size
        # Pages the decode steps after the ragged step may take (as headroom() counts them).
        after = {e.slot: e.request.num_computed_tokens + len(e.hit_pages) * ps + e.q_len for e in entries}
        after.update({e.slot: after[e.fork_of] for e in entries if e.fork_of >= 0})
        finals = {e.slot for e in entries if e.final}
        loop = sum(self._growth(after.get(s, q.num_computed_tokens), steps)
                   + (q.phase is Phase.FORKING or q.cow_pending)
                   for s, q in self.running.items() if q.phase is not Phase.PREFILLING or s in finals)
        short = r.alloc + loop - self.free_pages
        return tuple(self.prefix.victims(short, r.referenced)) if short > 0 else ()

    @staticmethod
    def prompt_targets(req: Request, start: int, n: int) -> tuple[int, ...]:
        """Per row of a chunk of rows start..start + n - 1: the prompt token after it, where the
        request asks for prompt logprobs and that position has none yet (a recompute after
        preemption asks nothing twice), else -1; () when no row asks."""
        if not req.needs_prompt_logprobs:
            return ()
        ids, have = req.prompt_ids, req.prompt_lp
        out = tuple(ids[p + 1] if p + 1 < len(ids) and p + 1 not in have else -1 for p in range(start, start + n))
        return out if any(t >= 0 for t in out) else ()

    def _record_prompt_logprobs(self, e: Entry, at: int, result) -> None:
        """Stores the prompt logprobs of entry e's rows (rows at.. of the round) in its request."""
        req, k = e.request, e.request.params.prompt_logprobs
        for i, t in enumerate(e.targets):
            if t >= 0:
                r = at + i
                top = tuple((int(a), float(b)) for a, b in zip(result.prompt.top_ids[r, :k],
                                                                 result.prompt.top_logprobs[r, :k]))
                req.prompt_lp[e.start + i + 1] = PromptLogprob(float(result.prompt.logprobs[r]),
                                                               int(result.prompt.ranks[r]), top)

    def unplan(self, plan: RoundPlan) -> None:
        """Undoes plan_round's admissions (their device call did not happen): back to the queue, in order."""
        for slot in reversed(plan.admitted):
            req = self.running[slot]
            self._move(req, Phase.WAITING)
            if req.leader is None:   # samples stay with their leader
                self.waiting.appendleft(req)

    # ------------------------------------------------------------------ recording a round

    def stepped(self, plan: RoundPlan, result, spilled=None) -> list[Progress]:
        """Records a round's StepResult (numpy, `loop` cut to the steps run): the device's page
        counts, then each entry's token (read where the entry is a decode row or a final chunk),
        then the decode steps' tokens and whether the device still decodes each slot. spilled:
        {evicted page: its data in host memory} for plan.spill (KV offload)."""
        st = result.state
        self.set_pages(st.num_free, st.seq_lens, st.own, st.shared, released=plan.release)
        if self.prefix is not None:
            swaps = {s.slot: s for s in plan.swap_in}
            rows = {e.slot: row for e, row in zip(plan.entries, result.state.tables)}
            for s in plan.swap_in:   # restored pages are cached on the device now: their keys come back
                if s.restore:
                    pages = [int(p) for p in rows[s.slot][: len(s.hit_pages)]]
                    self.prefix.register(self.prefill_tokens(s.request), pages, salt=_lora_salt(s.request))
                    s.request.cache_refs = tuple(pages)
            self.prefix.forget(plan.evict, spilled)
            ps = self.page_size
            for e, row in zip(plan.entries, result.state.tables):
                if e.slot in plan.admitted and e.fork_of < 0:
                    s, num = swaps.get(e.slot), len(self.prefill_tokens(e.request))
                    hit = len(s.hit_pages) if s is not None else len(e.hit_pages)
                    host_hit = len(s.restore) if s is not None else 0
                    host_query = num - (hit - host_hit) * ps if self.host is not None else 0
                    self.prefix.record_query(num, hit * ps, host_query, host_hit * ps)
                if e.final and e.fork_of >= 0:
                    e.request.cache_refs = self.running[e.fork_of].cache_refs
                elif e.final:
                    pages = [int(p) for p in row[: e.cache_upto]]
                    self.prefix.register(self.prefill_tokens(e.request), pages, e.request.kv_epoch,
                                         salt=_lora_salt(e.request))
                    e.request.cache_refs = tuple(pages)
        at = 0
        for e in plan.entries:
            if e.targets:
                self._record_prompt_logprobs(e, at, result)
            at += e.q_len
        new: dict[int, list] = {}
        for i, (e, tok, lp) in enumerate(zip(plan.entries, result.first.tokens, result.first.logprobs)):
            first = [(int(tok), float(lp), (result.first.top_ids[i], result.first.top_logprobs[i]))]
            if e.decode:
                new[e.slot] = first
                e.request.cow_pending = False   # it has written past its (possibly shared) last page
            elif e.final and e.fork_of >= 0:
                self._move(e.request, Phase.DECODING)
                new[e.slot] = first
                if len(self.prefill_tokens(e.request)) % self.page_size:  # a shared partly filled last page
                    e.request.cow_pending = self.running[e.fork_of].cow_pending = True
                if e.request.leader is not None:
                    e.request.leader.siblings = []   # forked: independent requests from now on
            elif e.final:
                self._move(e.request, Phase.DECODING)
                # A resumed request's pending token is already recorded.
                new[e.slot] = [] if e.request.output_ids else first
        events = []
        for slot, req in list(self.running.items()):
            if req.phase is not Phase.DECODING:
                continue
            loop = [(int(t), float(lp), (result.loop.top_ids[i, slot], result.loop.top_logprobs[i, slot]))
                    for i, (t, lp) in enumerate(zip(result.loop.tokens[:, slot], result.loop.logprobs[:, slot])) if t >= 0]
            if loop:
                req.cow_pending = False
            if result.spec is not None:
                req.num_draft_tokens += int(result.spec.drafted[slot])
                req.num_accepted_tokens += int(result.spec.accepted[slot])
            events.append(self._on_tokens(req, new.get(slot, []) + loop, device_done=not result.state.active[slot]))
        return events

    def _device_reason(self, req: Request) -> str:
        last = req.output_ids[-1]
        stop = (last in self.stop_ids and not req.params.ignore_eos) or last in req.params.stop_token_ids
        return "stop" if stop else "length"

    def _on_tokens(self, req: Request, got: list, *, device_done: bool) -> Progress:
        """Records (token, log-probability, (top ids, top log-probabilities)) triples."""
        n_before = len(req.output_ids)
        new = [t for t, _, _ in got]
        req.output_ids.extend(new)
        req.output_logprobs.extend(lp for _, lp, _ in got)
        k = req.params.top_logprobs
        if k:
            req.output_top_logprobs.extend(tuple((int(i), float(v)) for i, v in zip(ids[:k], vals[:k]) if i >= 0)
                                           for _, _, (ids, vals) in got)
        eos_last = device_done and self._device_reason(req) == "stop"
        ended = None   # (finish reason, error) of the first request hook that ends it (structured outputs)
        for hook in self.hooks:
            verdict = hook.post(req, device_done)
            ended = ended or verdict
        # A final stop token (EOS, stop_token_ids) is not part of the text, unless the request keeps
        # what stopped it (include_stop_str_in_output, as vLLM).
        text_ids = new[:-1] if eos_last and new and not req.params.include_stop_str_in_output else new
        kept = req.detokenizer.add(text_ids, final=device_done or ended is not None)
        if ended is not None and not req.detokenizer.stopped:   # the device still decodes it
            self._to_release.append((req.slot, req))
            self._finish(req, ended[0])
            if ended[1] is not None:
                req.error = ended[1]
        elif req.detokenizer.stopped:
            del req.output_ids[n_before + kept:]
            del req.output_logprobs[n_before + kept:]
            del req.output_top_logprobs[n_before + kept:]
            if not device_done:   # the device is still decoding it: its pages must be released
                self._to_release.append((req.slot, req))
            self._finish(req, "stop")
        elif device_done:
            self._finish(req, self._device_reason(req))
        return Progress(req, tuple(req.output_ids[n_before:]), req.finished, tuple(req.output_logprobs[n_before:]),
                        tuple(req.output_top_logprobs[n_before:]))

    # ------------------------------------------------------------------ end of round: preemption

    def take_swap_outs(self) -> list[tuple[int, Request, int]]:
        """KV offload: (slot, request, block pages) of the requests end_round preempted whose pages
        the engine must copy to the host tier before it releases them (their host pages are reserved)."""
        out, self._swap_outs = self._swap_outs, []
        return out

    def _swap_out(self, req: Request) -> None:
        """Reserves host pages for a preempted request's pages when the cost rule prefers the copy
        (`swap_cost`, `jpa.kv.offload.SwapCost`) and the host tier has room (spilled prefix pages
        give theirs up, LRU); else it is recomputed."""
        n = req.num_computed_tokens
        if self.host is None or n == 0:
            return
        if self.swap_cost is not None and not self.swap_cost.prefers_swap(n):
            self.recomputed_by_rule += 1
            return
        size = bucket(pages_for_tokens(n, self.page_size), pages_for_tokens(self.max_model_len, self.page_size))
        if self.host.reserve(req.request_id, size + (self.state_pages or 0), n):
            self._swap_outs.append((req.slot, req, size))

    def take_releases(self) -> list[int]:
        """Takes the pending release (slots finished on the host, aborted or preempted whose pages
        the device still holds) for a device call of its own (`ModelRunner.retire`); the next
        round's step then has nothing to release."""
        release, self._to_release = self._to_release, []
        return [slot for slot, _ in release]

    def end_round(self, flush=None) -> tuple[list[int], list[Request]]:
        """Decides what the device must release: the next round's step does it first (`RoundPlan.release`).

        Returns (the pending release's slots, preempted requests). Host-finished requests (stop
        strings, aborts) are released first; if the next step still cannot get a page for every
        running sequence, the newest admitted requests are preempted until it can. The running set
        never empties for lack of pages: a lone sequence fits (max_model_len <= the pool).

        The pages the release frees are the device's count (`own` of the released slots); where
        that is not exact (two released slots share uncached pages), `flush()` (the engine's
        `flush_releases`: the release as a call of its own, then `set_pages`) is called first, so a
        request is preempted only when the pool after the release is short. Without `flush`, the
        count is a lower bound.
        """
        def available():
            # Pages free once the pending release is done, plus the cached-idle pages eviction can free.
            if flush is not None and not self.release_is_exact():
                flush()
            idle = self.prefix.num_idle(self.held_cached_pages()) if self.prefix is not None else 0
            return self.free_pages + idle

        preempted = []
        while self.running and self.next_step_pages() > available():
            preempted.append(self._preempt_newest(swap=True))
        if preempted:
            self._preempted_last_round = True
        return list(self.pending_release), preempted

    def _preempt_newest(self, *, swap: bool) -> Request:
        """Preempts the newest admitted running request (with its samples still waiting to fork):
        its slots join the pending release and it goes back to the front of the queue, its
        generated tokens kept; swapped out to the host tier when `swap` and `_swap_out` says so,
        else recomputed. Returns it."""
        req = max(self.running.values(), key=lambda r: r.admitted_at)
        req = req.leader if req.phase is Phase.FORKING else req   # a sample waiting to fork goes with its leader
        for sib in req.siblings:
            if sib.phase is Phase.FORKING:
                self._to_release.append((sib.slot, sib))
                self._move(sib, Phase.WAITING)
        self._to_release.append((req.slot, req))
        if swap:
            self._swap_out(req)
        self._move(req, Phase.WAITING)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        return req

    def requeue_running(self) -> list[Request]:
        """Preempts every running request, newest first, to be recomputed (no swap-out): for the
        engine's recovery from a round whose device call ran but whose result the host never
        recorded (`LLMEngine.execute`), when the device is ahead of the host. Every slot then
        belongs to the pending release; the caller releases all slots on the device and records
        its counts (`set_pages`). Returns the preempted requests."""
        preempted = []
        while self.running:
            preempted.append(self._preempt_newest(swap=False))
        return preempted
