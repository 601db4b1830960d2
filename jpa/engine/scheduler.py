"""The scheduler: which requests hold slots and pages, when to admit, whom to preempt, when to stop.

Plain Python over request metadata and page counts; no model and no device work (unit tests drive
it directly). The engine glues it to the device:

    batch = scheduler.schedule()                  # admission (None: nothing to admit)
    ... prefill on the device ...
    scheduler.set_pages(free, seq_lens)           # the device's PageState, read back
    events = scheduler.admitted(batch, first_tokens, done_on_device)
    ... decode up to steps_per_call steps ...
    scheduler.set_pages(free, seq_lens)
    events += scheduler.decoded(tokens, active)   # tokens per slot; stops handled here
    release, preempted = scheduler.end_round()    # slots whose pages the device must release
    ... release them, then set_pages(...) again ...

With chunked prefill (the unified step) a round is planned by `plan_round()` instead of
schedule()/decoded():

    plan = scheduler.plan_round()                 # decode rows, prompt chunks, admissions
    ... one device call: the ragged step over plan.entries, then plan.decode_steps decode steps ...
    scheduler.set_pages(free, seq_lens)
    events = scheduler.stepped(plan, first_tokens, logprobs, decode_out, decode_lp, active)
    release, preempted = scheduler.end_round()

A request then holds a slot from its first prompt chunk on; it is "prefilling" (in `running` and
in `prefilling`) until the chunk that ends its prompt, and decoding afterwards. Its progress is the
device's seq_lens for its slot (tokens cached), not a host counter.

Page counts have one source of truth: the device's PageState (free pages and seq_lens), handed to
`set_pages` after every device call. The host only projects from it with the same rule the device
uses (`jpa.pages.pages_for_tokens`); it keeps no running count of its own.

Policies (vLLM's, in nano-vllm's split):
- admission: first come, first served, into free slots, while the pool holds the prompt plus its
  growth during the next decode call, the running requests' growth (headroom) and a watermark of
  free pages; an idle engine admits any prompt that fits in the whole pool. No admission in the
  round after a preemption (it would take back the pages just freed).
- preemption by recompute: when the next decode step cannot get pages for every running request,
  the newest admitted is preempted (its pages released, back to the front of the queue with its
  generated tokens kept) until the step fits. A lone request always fits, because the engine caps
  max_model_len at the pool size, so preemption never empties the running set for lack of pages.
- token budget (chunked prefill, vLLM v1's order): every decoding request gets its one token
  first, then prefilling requests continue in admission order, then waiting requests are admitted,
  each taking a chunk of min(budget left, prompt left, what the free pages hold). A round with no
  prompt work skips the ragged step and runs steps_per_call decode steps; a round with prompt work
  runs steps_per_call - 1 decode steps after it only when no prompt work is left for the next round.
- prefix caching (with the token budget): see `plan_round` and `jpa.engine.prefix_cache`.
- parallel sampling (SamplingParams.n): a request's samples wait with the first one (`siblings`),
  take their slots with it (`forking`: slot -> its leader's slot) and join the plan with q_len 0
  in the round of its last prompt chunk, when the device forks its pages to them; until each has
  written past the shared partly filled last page (`cow_pending`), one more page is counted for
  its copy on write. A preempted leader takes its unforked samples back to the queue with it.
- stops: the device finishes requests on EOS, max_new_tokens and the length limit (and releases
  their pages itself); stop strings are found here, on the incremental detokenizer's text, and
  the output is cut at the token that completed the stop.
"""

import collections
import dataclasses
import math

from jpa.engine.prefix_cache import PrefixCache
from jpa.engine.request import Request, Status
from jpa.pages import pages_for_tokens


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """Requests admitted together: row r puts requests[r] in slots[r] with tokens[r] to prefill."""
    slots: tuple[int, ...]
    requests: tuple[Request, ...]
    tokens: tuple[tuple[int, ...], ...]
    num_rows: int            # rows of the compiled prefill (a power of two >= len(slots))
    width: int               # padded tokens per row (a power of two >= 16)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One sequence's rows in a unified round: a decode token or a prompt chunk."""
    slot: int
    request: Request
    q_len: int                     # rows this round (1 for a decode token)
    decode: bool                   # feeds the slot's pending token
    final: bool                    # a prompt chunk that ends the prompt
    tokens: tuple[int, ...] = ()   # the chunk's token ids (empty for a decode token)
    hit_pages: tuple[int, ...] = ()  # cached pages shared before the chunk (prefix-cache hit, first chunk)
    fork_of: int = -1              # a parallel sample (q_len 0): the slot whose final chunk it forks


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """A unified round: the ragged step's entries (none: skipped), then decode_steps decode steps."""
    entries: tuple[Entry, ...]
    decode_steps: int
    admitted: tuple[int, ...] = ()   # slots whose request was admitted by this plan
    evict: tuple[int, ...] = ()      # cached-idle pages the device evicts first (prefix caching)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(e.q_len for e in self.entries if not e.decode)


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a round did to one request: tokens kept this round and whether it finished."""
    request: Request
    new_token_ids: tuple[int, ...]
    finished: bool
    new_logprobs: tuple[float, ...] = ()   # one per new token


def bucket(n: int, minimum: int) -> int:
    """Next power of two >= n (at least `minimum`): bounds the number of prefill compilations."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class Scheduler:
    """Admission, preemption and stop handling for one engine.

    Args:
      max_seqs: decode slots.
      page_size: tokens per page.
      num_pages: pages in the pool.
      max_model_len: longest sequence (prompt + completion); at most num_pages * page_size.
      steps_per_call: decode steps per device call (the growth admission must leave room for).
      watermark: fraction of the pool kept free at admission.
      max_prefill_tokens: padded tokens (rows x width) per prefill call.
      stop_ids: token ids that end a request unless its params say ignore_eos.
    """

    def __init__(self, *, max_seqs: int, page_size: int, num_pages: int, max_model_len: int,
                 steps_per_call: int, watermark: float, max_prefill_tokens: int, stop_ids=(),
                 prefix_caching: bool = False):
        if max_model_len > num_pages * page_size:
            raise ValueError(f"max_model_len must be <= num_pages * page_size = {num_pages * page_size} "
                             f"(a lone sequence must fit in the pool); got {max_model_len}")
        self.max_seqs, self.page_size, self.num_pages = max_seqs, page_size, num_pages
        self.max_model_len, self.steps_per_call = max_model_len, steps_per_call
        self.watermark_pages = int(watermark * num_pages)
        self.max_prefill_tokens = max_prefill_tokens
        self.stop_ids = frozenset(stop_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}      # slot -> request
        self.prefilling: set[int] = set()          # slots of running requests whose prompt is not all cached
        # Prefix caching (unified rounds only): the cache's keys, and the cached pages each running
        # request holds (its hits, then the pages cached when its prompt completed).
        self.prefix = PrefixCache(page_size) if prefix_caching else None
        self.cache_refs: dict[int, tuple[int, ...]] = {}
        # Parallel sampling: slots held by samples waiting to fork their leader (slot -> leader
        # slot), and slots that may still share a partly filled last page after a fork (their
        # next token may need a copy-on-write page).
        self.forking: dict[int, int] = {}
        self.cow_pending: set[int] = set()
        self.aborted: list[Request] = []            # siblings aborted with their leader (engine drains)
        self.free_pages = num_pages                # device truth (set_pages)
        self.seq_lens = [0] * max_seqs             # device truth: tokens in the cache per slot
        self.num_preemptions = 0
        self._to_release: list[int] = []           # slots finished on the host, pages still held
        self._admissions = 0
        self._preempted_last_round = False

    # ------------------------------------------------------------------ queue

    def add(self, req: Request) -> None:
        """Queues a validated request."""
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, request_id) -> Request | None:
        """Takes an unfinished request out (finish_reason "abort"); None if it is not here.

        A running request's slot is queued for release: the engine must release what
        take_releases() returns before the next schedule() (the slot is free to admit into).
        """
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return self._abort_siblings(self._finish(req, "abort"))
            for sib in req.siblings:   # a sample waiting for its leader
                if sib.request_id == request_id:
                    req.siblings.remove(sib)
                    return self._finish(sib, "abort")
        for slot, req in list(self.running.items()):
            if req.request_id == request_id:
                del self.running[slot]
                self.prefilling.discard(slot)
                lead = self.forking.pop(slot, None)
                if lead is not None and lead in self.running:
                    self.running[lead].siblings.remove(req)
                self.cow_pending.discard(slot)
                self._to_release.append(slot)
                for sib_slot in [s for s, ld in self.forking.items() if ld == slot]:
                    del self.running[sib_slot], self.forking[sib_slot]
                    self._to_release.append(sib_slot)
                return self._abort_siblings(self._finish(req, "abort"))
        return None

    def _abort_siblings(self, req: Request) -> Request:
        """An aborted leader takes the samples that have not forked from it yet along."""
        for sib in req.siblings:
            if sib.status is not Status.FINISHED:
                self.aborted.append(self._finish(sib, "abort"))
        req.siblings = []
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ page projections

    def set_pages(self, free_pages: int, seq_lens) -> None:
        """Records the device's PageState after a device call: free pages, tokens per slot."""
        self.free_pages = int(free_pages)
        self.seq_lens = [int(n) for n in seq_lens]

    def _growth(self, num_tokens: int, steps: int) -> int:
        """Pages a sequence holding num_tokens takes to grow by `steps` tokens (capped at the limit)."""
        ps = self.page_size
        return pages_for_tokens(min(num_tokens + steps, self.max_model_len), ps) - pages_for_tokens(num_tokens, ps)

    def _prompt_left(self, slot: int) -> int:
        """Prompt tokens a prefilling request has not cached yet (0 once it decodes)."""
        if slot not in self.prefilling:
            return 0
        return len(self.prefill_tokens(self.running[slot])) - self.seq_lens[slot]

    def _fork_pages(self) -> int:
        """Pages a sample that forks a prompt may take over one decode call: its new tokens'
        pages and a copy of the shared partly filled last page."""
        return pages_for_tokens(self.steps_per_call, self.page_size) + 1

    def headroom(self) -> int:
        """Pages the running requests may take during the next decode call (prefilling ones: the
        rest of their prompt too; samples waiting to fork: `_fork_pages`)."""
        return sum(self._fork_pages() if s in self.forking else
                   self._growth(self.seq_lens[s], self._prompt_left(s) + self.steps_per_call) + (s in self.cow_pending)
                   for s in self.running)

    def next_step_pages(self) -> int:
        """Pages the next step needs: one per running sequence whose last page is full (a
        prefilling one must be able to take at least one more prompt token; a forked one may copy
        its shared last page)."""
        return sum(self._growth(self.seq_lens[s], 1) + (s in self.cow_pending) for s in self.running
                   if s not in self.forking)

    # ------------------------------------------------------------------ admission

    @staticmethod
    def prefill_tokens(req: Request) -> list[int]:
        """What admission prefills: a preempted request recomputes all but its pending token."""
        return req.prompt_ids + req.output_ids[:-1]

    def schedule(self) -> PrefillBatch | None:
        """Chooses waiting requests to admit now (and pops them from the queue), or None."""
        if self._preempted_last_round:
            self._preempted_last_round = False
            if self.running:  # (if an abort emptied the running set, there is nothing to wait for)
                return None
        free_slots = [s for s in range(self.max_seqs) if s not in self.running]
        free = self.free_pages - self.headroom()
        chosen, width = [], 0
        while self.waiting and len(chosen) < len(free_slots):
            req = self.waiting[0]
            toks = self.prefill_tokens(req)
            need = self._growth(0, len(toks) + self.steps_per_call)
            idle = not self.running and not chosen
            if free - need < self.watermark_pages and not (idle and pages_for_tokens(len(toks), self.page_size)
                                                           <= self.free_pages):
                break
            w = bucket(max(width, len(toks)), 16)
            if chosen and bucket(len(chosen) + 1, 1) * w > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            chosen.append((free_slots[len(chosen)], req, tuple(toks)))
            free, width = free - need, max(width, len(toks))
        if not chosen:
            return None
        slots, reqs, toks = zip(*chosen)
        return PrefillBatch(slots, reqs, toks, bucket(len(chosen), 1), bucket(width, 16))

    def held_cached_pages(self) -> set:
        """Cached pages that running requests hold (not evictable)."""
        return {p for slot in self.running for p in self.cache_refs.get(slot, ())}

    def plan_round(self, budget: int) -> RoundPlan:
        """Plans a unified round over a token budget (see the module doc for the policy).

        Admitted requests are popped from the queue into slots (and prefilling) here; if the device
        call does not happen, `unplan(plan)` undoes that. With a prefix cache, an admitted request
        starts after its longest cached full-page prefix (its pages shared, not recomputed), and
        cached-idle pages count as free: the plan names the least recently used ones the device
        must evict first so that every allocation of the call finds a free page.
        """
        if budget < self.max_seqs:
            raise ValueError(f"the token budget ({budget}) must be >= max_seqs ({self.max_seqs}): every decoding "
                             f"sequence takes one token of it")
        ps = self.page_size
        referenced = self.held_cached_pages() if self.prefix is not None else set()
        idle = self.prefix.num_idle(referenced) if self.prefix is not None else 0
        decoding = [s for s in sorted(self.running) if s not in self.prefilling and s not in self.forking]
        left = budget - len(decoding)
        alloc = sum(self._growth(self.seq_lens[s], 1) for s in decoding)  # pages the ragged step takes
        prompt: list[Entry] = []
        admitted: list[int] = []

        def fit(seq_len: int) -> int:  # tokens a sequence holding seq_len can add within the free pages
            return max(0, self.free_pages + idle - alloc) * ps + pages_for_tokens(seq_len, ps) * ps - seq_len

        for slot in sorted(self.prefilling, key=lambda s: self.running[s].admitted_at):
            req, done = self.running[slot], self.seq_lens[slot]
            toks = self.prefill_tokens(req)
            n = min(left, len(toks) - done, fit(done))
            if n <= 0:
                continue
            prompt.append(Entry(slot, req, n, False, done + n == len(toks), tuple(toks[done:done + n])))
            left -= n
            alloc += self._growth(done, n)
        blocked_by_budget = False
        if self._preempted_last_round:
            self._preempted_last_round = False
            admit = not self.running
        else:
            admit = True
        if admit:
            free_slots = [s for s in range(self.max_seqs) if s not in self.running]
            avail = self.free_pages + idle - self.headroom()
            while self.waiting and free_slots:
                if left <= 0:
                    blocked_by_budget = True
                    break
                req = self.waiting[0]
                if len(req.siblings) + 1 > len(free_slots):
                    break   # parallel samples are admitted together: one slot each
                toks = self.prefill_tokens(req)
                hit = self.prefix.lookup(toks) if self.prefix is not None else []
                # Shared pages that were idle are no longer evictable.
                newly_held = sum(1 for p in hit if p not in referenced)
                h = len(hit) * ps
                need = self._growth(h, len(toks) - h + self.steps_per_call) + len(req.siblings) * self._fork_pages()
                alone = not self.running
                if avail - newly_held - need < self.watermark_pages and not (
                        alone and pages_for_tokens(len(toks), ps) - len(hit) <= self.free_pages + idle - newly_held):
                    break
                idle -= newly_held
                n = min(left, len(toks) - h, fit(h))
                if n <= 0:
                    idle += newly_held
                    break
                self.waiting.popleft()
                slot = free_slots.pop(0)
                self._admissions += 1
                req.status, req.slot, req.admitted_at = Status.RUNNING, slot, self._admissions
                self.running[slot] = req
                self.prefilling.add(slot)
                self.cache_refs[slot] = tuple(hit)
                for sib in req.siblings:  # their slots wait for the fork of the prompt's last chunk
                    sib_slot = free_slots.pop(0)
                    sib.status, sib.slot, sib.admitted_at = Status.RUNNING, sib_slot, self._admissions
                    self.running[sib_slot] = sib
                    self.forking[sib_slot] = slot
                    admitted.append(sib_slot)
                referenced.update(hit)
                if self.prefix is not None:
                    self.prefix.touch(hit)
                admitted.append(slot)
                prompt.append(Entry(slot, req, n, False, h + n == len(toks), tuple(toks[h:h + n]), tuple(hit)))
                left -= n
                alloc += self._growth(h, n)
                avail -= newly_held + need
        if prompt:
            more = blocked_by_budget or any(not e.final for e in prompt) or len(prompt) < len(self.prefilling)
            forks = [Entry(s, self.running[s], 0, False, True, fork_of=e.slot)
                     for e in prompt if e.final for s, lead in sorted(self.forking.items()) if lead == e.slot]
            entries = tuple(Entry(s, self.running[s], 1, True, False) for s in decoding) + tuple(prompt) + tuple(forks)
            steps = 0 if more else self.steps_per_call - 1
        else:
            entries, steps, alloc = (), self.steps_per_call, 0
        evict = ()
        if self.prefix is not None:
            # Pages the decode steps after the ragged step may take (as headroom() counts them).
            after = {e.slot: self.seq_lens[e.slot] + len(e.hit_pages) * ps + e.q_len for e in entries}
            after.update({e.slot: after[e.fork_of] for e in entries if e.fork_of >= 0})
            loop = sum(self._growth(after.get(s, self.seq_lens[s]), steps) + (s in self.forking or s in self.cow_pending)
                       for s in self.running
                       if s not in self.prefilling or any(e.slot == s and e.final for e in entries))
            short = alloc + loop - self.free_pages
            if short > 0:
                evict = tuple(self.prefix.victims(short, referenced))
        return RoundPlan(entries, steps, tuple(admitted), evict)

    def unplan(self, plan: RoundPlan) -> None:
        """Undoes plan_round's admissions (their device call did not happen): back to the queue, in order."""
        for slot in reversed(plan.admitted):
            req = self.running.pop(slot)
            self.prefilling.discard(slot)
            self.cache_refs.pop(slot, None)
            req.status, req.slot = Status.WAITING, -1
            if self.forking.pop(slot, None) is None:   # samples stay with their leader
                self.waiting.appendleft(req)

    def stepped(self, plan: RoundPlan, first_tokens, logprobs, decode_tokens, decode_logprobs,
                active, final_tables=None) -> list[Progress]:
        """Records a unified round: the ragged step's token and log-probability per entry (read
        where the entry is a decode row or a final chunk), then the decode steps' tokens
        i32[steps, max_seqs] (-1 = none) and log-probabilities, and active[slot] = whether the
        device still decodes the slot (False: finished and released on the device).
        final_tables (prefix caching): i32[entries, pages_per_seq], each final chunk's block-table
        row when the device cached its full prompt pages."""
        if self.prefix is not None:
            self.prefix.forget(plan.evict)
            for e in plan.entries:
                if e.slot in plan.admitted:
                    self.prefix.record_query(len(self.prefill_tokens(e.request)), len(e.hit_pages) * self.page_size)
            for e, row in zip(plan.entries, final_tables):
                if e.final and e.fork_of >= 0:
                    self.cache_refs[e.slot] = self.cache_refs.get(e.fork_of, ())
                elif e.final:
                    toks = self.prefill_tokens(e.request)
                    pages = [int(p) for p in row[: len(toks) // self.page_size]]
                    self.prefix.register(toks, pages)
                    self.cache_refs[e.slot] = tuple(pages)
        new: dict[int, list] = {}
        decoded_rows = set()
        for e, tok, lp in zip(plan.entries, first_tokens, logprobs):
            if e.decode:
                new[e.slot] = [(int(tok), float(lp))]
                decoded_rows.add(e.slot)
            elif e.final and e.fork_of >= 0:
                del self.forking[e.slot]
                new[e.slot] = [(int(tok), float(lp))]
                if len(self.prefill_tokens(e.request)) % self.page_size:  # a shared partly filled last page
                    self.cow_pending.update((e.slot, e.fork_of))
                if e.request.leader is not None:
                    e.request.leader.siblings = []   # forked: independent requests from now on
            elif e.final:
                self.prefilling.discard(e.slot)
                # A resumed request's pending token is already recorded.
                new[e.slot] = [] if e.request.output_ids else [(int(tok), float(lp))]
        events = []
        for slot in list(self.running):
            if slot in self.prefilling or slot in self.forking:
                continue
            loop = [(int(t), float(lp)) for t, lp in zip(decode_tokens[:, slot], decode_logprobs[:, slot]) if t >= 0]
            if loop or slot in decoded_rows:   # it has written past its (possibly shared) last page
                self.cow_pending.discard(slot)
            got = new.get(slot, []) + loop
            events.append(self._on_tokens(slot, [t for t, _ in got], [lp for _, lp in got],
                                          device_done=not active[slot]))
        return events

    def requeue(self, batch: PrefillBatch) -> None:
        """Puts a batch back at the front of the queue, in order (its prefill did not happen)."""
        for req in reversed(batch.requests):
            self.waiting.appendleft(req)

    def admitted(self, batch: PrefillBatch, first_tokens, done, logprobs=None) -> list[Progress]:
        """Records a prefill: each row's first (or, when resumed, pending) token, device finish
        and (optionally) the first token's log-probability."""
        events = []
        logprobs = [math.nan] * len(batch.slots) if logprobs is None else logprobs
        for slot, req, t, d, lp in zip(batch.slots, batch.requests, first_tokens, done, logprobs):
            new = []
            if not req.output_ids:   # a resumed request's pending token is already recorded
                new = [int(t)]
            self._admissions += 1
            req.status, req.slot, req.admitted_at = Status.RUNNING, slot, self._admissions
            self.running[slot] = req
            events.append(self._on_tokens(slot, new, [float(lp)] * len(new), device_done=bool(d)))
        return events

    # ------------------------------------------------------------------ decoding and stops

    def decoded(self, tokens_per_slot, active, logprobs_per_slot=None) -> list[Progress]:
        """Records a decode call: tokens_per_slot[slot] = the slot's new tokens, active[slot] =
        whether the device is still decoding it (False: finished and released on the device),
        logprobs_per_slot[slot] = their log-probabilities (optional)."""
        def lps(slot):
            n = len(tokens_per_slot[slot])
            return [math.nan] * n if logprobs_per_slot is None else [float(x) for x in logprobs_per_slot[slot]]
        return [self._on_tokens(slot, [int(t) for t in tokens_per_slot[slot]], lps(slot),
                                device_done=not active[slot])
                for slot in list(self.running)]

    def _device_reason(self, req: Request) -> str:
        last = req.output_ids[-1]
        return "stop" if last in self.stop_ids and not req.params.ignore_eos else "length"

    def _on_tokens(self, slot: int, new: list[int], new_logprobs: list[float], *, device_done: bool) -> Progress:
        req = self.running[slot]
        n_before = len(req.output_ids)
        req.output_ids.extend(new)
        req.output_logprobs.extend(new_logprobs)
        eos_last = device_done and self._device_reason(req) == "stop"
        text_ids = new[:-1] if eos_last and new else new   # an EOS token is not part of the text
        kept = req.detokenizer.add(text_ids, final=device_done)
        if req.detokenizer.stopped:
            del req.output_ids[n_before + kept:]
            del req.output_logprobs[n_before + kept:]
            del self.running[slot]
            if not device_done:   # the device is still decoding it: its pages must be released
                self._to_release.append(slot)
            self._finish(req, "stop")
        elif device_done:
            del self.running[slot]
            self._finish(req, self._device_reason(req))
        return Progress(req, tuple(req.output_ids[n_before:]), req.status is Status.FINISHED,
                        tuple(req.output_logprobs[n_before:]))

    def _finish(self, req: Request, reason: str) -> Request:
        req.status, req.finish_reason, req.slot = Status.FINISHED, reason, -1
        return req

    # ------------------------------------------------------------------ end of round: preemption

    def take_releases(self) -> list[int]:
        """Slots finished on the host (stop strings, aborts) whose pages the device still holds."""
        release, self._to_release = self._to_release, []
        return release

    def end_round(self) -> tuple[list[int], list[Request]]:
        """Decides what the device must release before the next decode step.

        Returns (slots to release, preempted requests). Host-finished requests (stop strings,
        aborts) are released first; if the next step still cannot get a page for every running
        sequence, the newest admitted requests are preempted until it can. The running set never
        empties for lack of pages: a lone sequence fits (max_model_len <= the pool).
        """
        release = self.take_releases()

        def available():
            # Pages free once `release` is released: its own pages (a sequence shares only cached
            # pages, which stay cached) plus the cached-idle pages eviction can free.
            own = sum(pages_for_tokens(self.seq_lens[s], self.page_size) - len(self.cache_refs.get(s, ()))
                      - (s in self.cow_pending) for s in release)
            idle = self.prefix.num_idle(self.held_cached_pages()) if self.prefix is not None else 0
            return self.free_pages + own + idle

        preempted = []
        while self.running and self.next_step_pages() > available():
            slot = max(self.running, key=lambda s: self.running[s].admitted_at)
            slot = self.forking.get(slot, slot)   # a sample waiting to fork goes back with its leader
            for sib_slot in [s for s, lead in self.forking.items() if lead == slot]:
                sib = self.running.pop(sib_slot)
                del self.forking[sib_slot]
                sib.status, sib.slot = Status.WAITING, -1
                release.append(sib_slot)
            req = self.running.pop(slot)
            self.prefilling.discard(slot)
            req.status, req.slot = Status.WAITING, -1
            req.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(req)
            release.append(slot)
            preempted.append(req)
        if preempted:
            self._preempted_last_round = True
        for slot in release:
            self.cache_refs.pop(slot, None)
            self.cow_pending.discard(slot)
        return release, preempted
