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
- stops: the device finishes requests on EOS, max_new_tokens and the length limit (and releases
  their pages itself); stop strings are found here, on the incremental detokenizer's text, and
  the output is cut at the token that completed the stop.
"""

import collections
import dataclasses
import math

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
class Progress:
    """What a round did to one request: tokens kept this round and whether it finished."""
    request: Request
    new_token_ids: tuple[int, ...]
    finished: bool


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
                 steps_per_call: int, watermark: float, max_prefill_tokens: int, stop_ids=()):
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
                return self._finish(req, "abort")
        for slot, req in self.running.items():
            if req.request_id == request_id:
                del self.running[slot]
                self._to_release.append(slot)
                return self._finish(req, "abort")
        return None

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

    def headroom(self) -> int:
        """Pages the running requests may take during the next decode call."""
        return sum(self._growth(self.seq_lens[s], self.steps_per_call) for s in self.running)

    def next_step_pages(self) -> int:
        """Pages the next decode step needs: one per running sequence whose last page is full."""
        return sum(self._growth(self.seq_lens[s], 1) for s in self.running)

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

    def requeue(self, batch: PrefillBatch) -> None:
        """Puts a batch back at the front of the queue, in order (its prefill did not happen)."""
        for req in reversed(batch.requests):
            self.waiting.appendleft(req)

    def admitted(self, batch: PrefillBatch, first_tokens, done) -> list[Progress]:
        """Records a prefill: each row's first (or, when resumed, pending) token and device finish."""
        events = []
        for slot, req, t, d in zip(batch.slots, batch.requests, first_tokens, done):
            new = []
            if not req.output_ids:   # a resumed request's pending token is already recorded
                new = [int(t)]
            self._admissions += 1
            req.status, req.slot, req.admitted_at = Status.RUNNING, slot, self._admissions
            self.running[slot] = req
            events.append(self._on_tokens(slot, new, device_done=bool(d)))
        return events

    # ------------------------------------------------------------------ decoding and stops

    def decoded(self, tokens_per_slot, active) -> list[Progress]:
        """Records a decode call: tokens_per_slot[slot] = the slot's new tokens, active[slot] =
        whether the device is still decoding it (False: finished and released on the device)."""
        return [self._on_tokens(slot, [int(t) for t in tokens_per_slot[slot]], device_done=not active[slot])
                for slot in list(self.running)]

    def _device_reason(self, req: Request) -> str:
        last = req.output_ids[-1]
        return "stop" if last in self.stop_ids and not req.params.ignore_eos else "length"

    def _on_tokens(self, slot: int, new: list[int], *, device_done: bool) -> Progress:
        req = self.running[slot]
        n_before = len(req.output_ids)
        req.output_ids.extend(new)
        eos_last = device_done and self._device_reason(req) == "stop"
        text_ids = new[:-1] if eos_last and new else new   # an EOS token is not part of the text
        kept = req.detokenizer.add(text_ids, final=device_done)
        if req.detokenizer.stopped:
            del req.output_ids[n_before + kept:]
            del self.running[slot]
            if not device_done:   # the device is still decoding it: its pages must be released
                self._to_release.append(slot)
            self._finish(req, "stop")
        elif device_done:
            del self.running[slot]
            self._finish(req, self._device_reason(req))
        return Progress(req, tuple(req.output_ids[n_before:]), req.status is Status.FINISHED)

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
        free = self.free_pages + sum(pages_for_tokens(self.seq_lens[s], self.page_size) for s in release)
        preempted = []
        while self.running and self.next_step_pages() > free:
            slot = max(self.running, key=lambda s: self.running[s].admitted_at)
            req = self.running.pop(slot)
            free += pages_for_tokens(self.seq_lens[slot], self.page_size)
            req.status, req.slot = Status.WAITING, -1
            req.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(req)
            release.append(slot)
            preempted.append(req)
        if preempted:
            self._preempted_last_round = True
        return release, preempted
