"""The scheduler and the incremental detokenizer alone: no model, no device.

A small host model of the device's page pool (`Pool`, ceil arithmetic written out here, not taken
from jpa) plays the device: it hands the scheduler free pages and seq_lens as the runner would.
"""

import math

import numpy as np
import pytest

from jpa.engine.batch import DeviceCounts, PageUsage, Sampled, StepResult
from jpa.engine.detokenizer import IncrementalDetokenizer
from jpa.engine.request import Phase, Request
from jpa.engine.sampling import SamplingParams
from jpa.engine.scheduler import Scheduler
from jpa.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
EOS = TOK.EOS
BUDGET = 1024


class Pool:
    """What the device's PageState would report: pages per slot = ceil(seq_len / page_size)."""

    def __init__(self, num_pages, page_size, max_seqs):
        self.num_pages, self.page_size = num_pages, page_size
        self.lens = [0] * max_seqs

    def free(self):
        return self.num_pages - sum(math.ceil(n / self.page_size) for n in self.lens)

    def own(self):
        """Pages each slot alone holds (this model shares no page): what releasing it frees."""
        return np.array([math.ceil(n / self.page_size) for n in self.lens]), np.zeros(len(self.lens), bool)

    def report(self, sched):
        assert self.free() >= 0, "the scheduler over-committed the pool"
        sched.set_pages(self.free(), list(self.lens), *self.own())


def make(num_pages=16, page_size=4, max_seqs=4, steps=2, watermark=0.0, max_model_len=None):
    sched = Scheduler(max_seqs=max_seqs, page_size=page_size, num_pages=num_pages,
                      max_model_len=max_model_len or num_pages * page_size, steps_per_call=steps,
                      watermark=watermark, stop_ids=(EOS,))
    return sched, Pool(num_pages, page_size, max_seqs)


_ids = iter(range(10 ** 9))


def req(n_prompt, stop=(), ignore_eos=False, max_new=100):
    params = SamplingParams(max_new_tokens=max_new, greedy=True, stop=stop, ignore_eos=ignore_eos)
    prompt = list(np.random.default_rng().integers(97, 123, n_prompt))
    return Request(next(_ids), "", [int(t) for t in prompt], params, IncrementalDetokenizer(TOK, stop))


def play(sched, pool, plan, first_token=ord("a"), loop=None, finished_on_device=()):
    """Plays the device for one round of `plan`: each entry's rows are cached (a fork copies its
    leader's length), decode rows and final chunks emit first_token, then the decoding slots emit
    loop[slot] (each token stored before it; the device may run fewer steps than planned); slots
    in finished_on_device are finished and released by the device. Returns stepped()'s events."""
    loop = loop or {}
    b, n = len(pool.lens), len(plan.entries)
    for e in plan.entries:
        pool.lens[e.slot] = pool.lens[e.fork_of] if e.fork_of >= 0 else pool.lens[e.slot] + e.q_len
    decoding = [s for s, r in sched.running.items()
                if r.phase is Phase.DECODING or any(e.slot == s and e.final for e in plan.entries)]
    steps = max((len(loop.get(s, [])) for s in decoding), default=0)
    out = np.full((steps, b), -1, np.int32)
    for s in decoding:
        toks = loop.get(s, [])
        out[: len(toks), s] = toks
        pool.lens[s] += len(toks)
    active = np.array([s in decoding and s not in finished_on_device for s in range(b)])
    for s in finished_on_device:
        pool.lens[s] = 0
    assert pool.free() >= 0, "the scheduler over-committed the pool"
    result = StepResult(
        first=Sampled(tokens=np.full((n,), first_token, np.int32), logprobs=np.zeros((n,), np.float32),
                      top_ids=np.full((n, 2), -1, np.int32), top_logprobs=np.zeros((n, 2), np.float32)),
        ok=np.bool_(True),
        loop=Sampled(tokens=out, logprobs=np.zeros(out.shape, np.float32),
                     top_ids=np.full(out.shape + (2,), -1, np.int32),
                     top_logprobs=np.zeros(out.shape + (2,), np.float32)),
        steps=np.int32(steps),
        state=DeviceCounts(num_free=np.int32(pool.free()), seq_lens=np.array(pool.lens), active=active,
                           tables=np.zeros((n, 1), np.int32), own=pool.own()[0], shared=pool.own()[1]),
        usage=PageUsage(cow_copies=np.int32(0), peak_pages=np.int32(0), peak_tokens=np.int32(0)))
    return sched.stepped(plan, result)


def admit(sched, pool, first_token=ord("a")):
    """A round with the whole budget and no decode steps; returns the requests it admitted."""
    plan = sched.plan_round(BUDGET)
    play(sched, pool, plan, first_token)
    return [r for r in (sched.running.get(s) for s in plan.admitted) if r is not None]


def decode(sched, pool, tokens_by_slot, finished_on_device=()):
    """A decode-only round: tokens_by_slot[slot] = tokens produced."""
    plan = sched.plan_round(BUDGET)
    assert not plan.entries, "expected a decode-only round"
    return play(sched, pool, plan, loop=tokens_by_slot, finished_on_device=finished_on_device)


def end_round(sched, pool):
    release, preempted = sched.end_round()
    for slot in release:
        pool.lens[slot] = 0
    pool.report(sched)
    return release, preempted


def test_admission_is_first_come_first_served_into_free_slots():
    sched, pool = make(max_seqs=2)
    reqs = [req(5) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    got = admit(sched, pool)
    assert got == reqs[:2]
    assert [r.slot for r in got] == [0, 1] and all(r.phase is Phase.DECODING for r in got)
    assert list(sched.waiting) == reqs[2:]
    assert sched.plan_round(BUDGET).admitted == ()  # no free slot


def test_token_budget_chunks_prompts_in_admission_order():
    """Decoding requests take one token each first; prompts are cut into chunks of what is left,
    in admission order, and finish over rounds (PREFILLING until their last chunk)."""
    sched, pool = make(num_pages=64, max_seqs=4)
    a = req(3)
    sched.add(a)
    admit(sched, pool)
    b, c = req(9), req(6)
    sched.add(b)
    sched.add(c)
    plan = sched.plan_round(8)                            # a's token + 7 prompt tokens
    assert [(e.slot, e.q_len, e.decode, e.final) for e in plan.entries] == [(0, 1, True, False), (1, 7, False, False)]
    assert plan.decode_steps == 0 and b.phase is Phase.PREFILLING and c.phase is Phase.WAITING
    play(sched, pool, plan)
    assert b.num_computed_tokens == 7 and b.phase is Phase.PREFILLING
    plan = sched.plan_round(8)                            # a, the rest of b, then c's first 5
    assert [(e.slot, e.q_len, e.final) for e in plan.entries] == [(0, 1, False), (1, 2, True), (2, 5, False)]
    assert plan.entries[2].tokens == tuple(c.prompt_ids[:5])
    play(sched, pool, plan)
    assert b.phase is Phase.DECODING and c.phase is Phase.PREFILLING and b.output_ids == [ord("a")]


def test_headroom_holds_admission_back():
    # 10 pages of 4 tokens, 2 decode steps per call, watermark 40% = 4 pages.
    for a_tokens, admitted in ((10, True), (12, False)):
        sched, pool = make(num_pages=10, page_size=4, steps=2, watermark=0.4)
        a, b = req(10), req(10)   # each needs ceil((10 + 2) / 4) = 3 pages at admission
        sched.add(a)
        assert admit(sched, pool) == [a]                  # 10 - 3 = 7 left, not below 4
        pool.lens[a.slot] = a_tokens                      # 3 pages held either way, 7 free
        pool.report(sched)
        # At 10 tokens a grows to 12 in the next call (no new page); at 12 it needs a 4th page.
        assert sched.headroom() == (0 if admitted else 1)
        sched.add(b)
        assert (admit(sched, pool) == [b]) is admitted    # 7 - headroom - 3 vs the watermark 4


def test_watermark_boundary_and_idle_engine():
    sched, pool = make(num_pages=10, page_size=4, steps=2, watermark=0.3)
    a = req(10)
    sched.add(a)
    admit(sched, pool)                                    # a holds 3 pages, 7 free, headroom 0
    b = req(10)                                           # needs 3: 7 - 0 - 3 = 4, not < 3
    sched.add(b)
    assert admit(sched, pool) == [b]
    c = req(6)                                            # needs 2: 4 - 1 - 2 = 1 < 3 (a decoded: headroom 1)
    sched.add(c)
    assert sched.plan_round(BUDGET).admitted == () and list(sched.waiting) == [c]
    # An idle engine admits a prompt that breaks the watermark, as long as it fits in the pool.
    sched2, pool2 = make(num_pages=10, page_size=4, steps=2, watermark=0.5)
    big = req(30)                                         # 8 pages (10 with growth) > 10 - 5
    sched2.add(big)
    assert admit(sched2, pool2) == [big]


def test_preemption_takes_the_newest_until_the_step_fits():
    sched, pool = make(num_pages=6, page_size=4, max_seqs=3, steps=1)
    reqs = [req(3) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    admit(sched, pool)                                    # 1 page each (3 + 1 growth), 3 free
    # Everyone grows to 8 tokens (2 pages each): the pool is full and the next step needs 3 pages.
    decode(sched, pool, {s: [ord("a")] * 5 for s in range(3)})
    assert pool.free() == 0 and sched.next_step_pages() == 3
    release, preempted = end_round(sched, pool)
    # Preempting the newest frees 2 pages; the two left need 2: one preemption is enough.
    assert preempted == [reqs[2]] and release == [2]
    assert reqs[2].phase is Phase.WAITING and reqs[2].num_preemptions == 1
    assert list(sched.waiting) == [reqs[2]] and sched.num_preemptions == 1
    assert reqs[2].output_ids == [ord("a")] * 6           # generated tokens are kept
    assert sched.plan_round(BUDGET).admitted == ()        # no admission right after a preemption


def test_several_preemptions_keep_queue_order():
    sched, pool = make(num_pages=8, page_size=4, max_seqs=4, steps=1)
    reqs = [req(3) for _ in range(4)]
    for r in reqs:
        sched.add(r)
    admit(sched, pool)
    decode(sched, pool, {s: [97] * 5 for s in range(4)})  # 8 tokens = 2 full pages each
    assert pool.free() == 0
    _, preempted = end_round(sched, pool)
    # need 4 pages: preempting 3 frees 2 (need 3 left), preempting 2 frees 2 more (need 2): done.
    assert preempted == [reqs[3], reqs[2]]
    assert list(sched.waiting) == [reqs[2], reqs[3]]      # the older one is readmitted first


def test_preemption_never_empties_the_running_set():
    sched, pool = make(num_pages=2, page_size=4, max_seqs=2, steps=1)
    a, b = req(3), req(3)
    sched.add(a)
    sched.add(b)
    admit(sched, pool)
    decode(sched, pool, {0: [97], 1: [97]})               # both at 4 tokens: full pages, pool full
    assert pool.free() == 0 and sched.next_step_pages() == 2
    assert end_round(sched, pool) == ([1], [b])
    assert list(sched.running.values()) == [a] and pool.free() == 1


def test_admission_after_a_preemption_and_an_abort_of_the_rest():
    """Found by the randomized test: the pause after a preemption left an idle engine idle."""
    sched, pool = make(num_pages=2, page_size=4, max_seqs=2, steps=1)
    a, b = req(3), req(3)
    sched.add(a)
    sched.add(b)
    admit(sched, pool)
    decode(sched, pool, {0: [97], 1: [97]})
    assert end_round(sched, pool) == ([1], [b])
    assert sched.abort(a.request_id) == [a]               # between steps
    pool.lens[sched.take_releases()[0]] = 0
    pool.report(sched)
    assert admit(sched, pool) == [b]


def test_stop_and_exhaustion_in_the_same_round():
    """The issue's crash: a stop string frees pages in the round the pool ran out."""
    sched, pool = make(num_pages=4, page_size=4, max_seqs=2, steps=2)
    a, b = req(3, stop=("xy",)), req(3)
    sched.add(a)
    sched.add(b)
    admit(sched, pool)
    # Both reach 8 tokens (a page boundary) and fill the pool; a's text completes "xy" one token
    # before the end of the call.
    events = decode(sched, pool, {0: [ord(c) for c in "qqxyz"], 1: [ord("q")] * 5})
    assert pool.free() == 0
    assert a.phase is Phase.FINISHED and a.finish_reason == "stop"
    assert a.output_ids == [ord(c) for c in "aqqxy"]      # ends at the stop, not at "z"
    assert a.text == "aqq" and sched.next_step_pages() == 1
    assert [e.request for e in events if e.finished] == [a]
    release, preempted = end_round(sched, pool)
    assert release == [0] and preempted == [] and list(sched.running.values()) == [b]
    assert pool.free() == 2


def test_empty_running_set():
    sched, pool = make()
    assert end_round(sched, pool) == ([], [])
    plan = sched.plan_round(BUDGET)
    assert plan.entries == () and play(sched, pool, plan) == []
    # Everyone finishing on the device in a round that also ran the pool out: nothing to preempt.
    sched, pool = make(num_pages=2, page_size=4, max_seqs=2, steps=1)
    a, b = req(3), req(3)
    sched.add(a)
    sched.add(b)
    admit(sched, pool)
    decode(sched, pool, {0: [97, EOS], 1: [97, EOS]}, finished_on_device={0, 1})
    assert a.finish_reason == b.finish_reason == "stop" and a.output_ids[-1] == EOS
    assert end_round(sched, pool) == ([], []) and not sched.has_unfinished


def test_device_finish_reasons_and_eos_text():
    sched, pool = make()
    a, b = req(3), req(3, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    admit(sched, pool)
    decode(sched, pool, {0: [ord("h"), EOS], 1: [ord("h"), EOS]}, finished_on_device={0, 1})
    assert a.finish_reason == "stop" and b.finish_reason == "length"
    assert a.text == "ah" and b.text == "ah"              # special tokens never reach the text


def test_abort_waiting_and_running():
    sched, pool = make(max_seqs=1)
    a, b = req(3), req(3)
    sched.add(a)
    sched.add(b)
    admit(sched, pool)
    assert sched.abort(b.request_id) == [b] and b.finish_reason == "abort" and not sched.waiting
    assert sched.abort(a.request_id) == [a] and a.finish_reason == "abort" and not sched.running
    assert sched.take_releases() == [0]
    assert sched.abort("nobody") == []


def test_unplan_keeps_order():
    sched, pool = make(max_seqs=2)
    reqs = [req(3) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.plan_round(BUDGET)
    assert len(plan.admitted) == 2
    sched.unplan(plan)
    assert list(sched.waiting) == reqs and not sched.running
    assert all(r.phase is Phase.WAITING and r.slot == -1 for r in reqs)


def test_phases_change_only_along_their_transitions():
    sched, pool = make()
    a = req(3)
    sched.add(a)
    with pytest.raises(RuntimeError, match="no transition waiting -> decoding"):
        sched._move(a, Phase.DECODING)
    admit(sched, pool)
    assert a.phase is Phase.DECODING
    with pytest.raises(RuntimeError, match="no transition decoding -> prefilling"):
        sched._move(a, Phase.PREFILLING)
    with pytest.raises(RuntimeError, match="only new requests"):
        sched.add(a)


def test_a_sample_finished_at_its_fork_charges_nothing_later():
    """Regression: the copy-on-write page of a fork was charged to the slot, not the request, so a
    sample the device finished at the fork (max_new_tokens 1) left its slot charged one page."""
    sched, pool = make(num_pages=16, page_size=4, max_seqs=2)
    lead = req(5, max_new=1)
    sib = Request((lead.request_id, 1), "", list(lead.prompt_ids), lead.params, IncrementalDetokenizer(TOK))
    lead.siblings, sib.leader = [sib], lead
    sched.add(lead)
    plan = sched.plan_round(BUDGET)
    assert sib.phase is Phase.FORKING and [e.fork_of for e in plan.entries] == [-1, lead.slot]
    play(sched, pool, plan, finished_on_device={0, 1})
    assert lead.finished and sib.finished and not sched.running
    assert sched.headroom() == 0 and sched.next_step_pages() == 0


def test_resumed_request_recomputes_all_but_its_pending_token():
    sched, pool = make(num_pages=6, page_size=4, max_seqs=3, steps=1)
    reqs = [req(3) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    admit(sched, pool)
    decode(sched, pool, {s: [98] * 5 for s in range(3)})
    end_round(sched, pool)
    decode(sched, pool, {0: [99], 1: [99]}, finished_on_device={0, 1})   # no admission in this round
    end_round(sched, pool)
    plan = sched.plan_round(BUDGET)
    victim = reqs[2]
    (e,) = plan.entries
    assert e.request is victim and e.final
    assert list(e.tokens) == victim.prompt_ids + victim.output_ids[:-1]
    events = play(sched, pool, plan, first_token=0)
    assert events[0].new_token_ids == () and len(victim.output_ids) == 6


# ----------------------------------------------------------------------------- detokenizer


def feed_in_chunks(text_ids, chunks, stop=()):
    det = IncrementalDetokenizer(TOK, stop)
    pieces, kept, i = [], 0, 0
    for n in chunks:
        part = text_ids[i:i + n]
        i += n
        kept += det.add(part, final=i >= len(text_ids))
        pieces.append(det.take_delta(det.stopped or i >= len(text_ids)))
        if det.stopped:
            break
    return det, pieces, kept


@pytest.mark.parametrize("chunks", [[1] * 40, [3] * 14, [7, 1, 9, 40]])
def test_incremental_text_equals_full_decode(chunks):
    text = "héllo wörld ✓ naïve 日本"
    ids = TOK.encode(text)
    ids = ids[:5] + [EOS] + ids[5:]                       # a special token in the middle
    det, pieces, kept = feed_in_chunks(ids, chunks + [len(ids)])
    assert "".join(pieces) == det.text == TOK.decode(ids, skip_special_tokens=True)
    assert kept == len(ids)


@pytest.mark.parametrize("chunks", [[1] * 40, [4] * 10, [40]])
def test_stop_string_across_tokens(chunks):
    ids = TOK.encode("abc wörld stop here and more")
    det, pieces, kept = feed_in_chunks(ids, chunks, stop=("ld st", "zzz"))
    assert det.stopped and det.text == "abc wör" and "".join(pieces) == "abc wör"
    assert TOK.decode(ids[:kept]).endswith("ld st")       # the kept tokens end at the stop
    assert not TOK.decode(ids[:kept - 1]).endswith("ld st")


@pytest.mark.parametrize("chunks", [[4, 2], [2, 3, 1], [1] * 6, [6]])
def test_stop_string_followed_by_an_incomplete_character(chunks):
    """Regression (found by the randomized engine test, seed 241755125): a stop string completed
    in a round whose text then ended in a partial UTF-8 sequence was only seen a round later, so
    token_ids ran past the stop."""
    ids = [105, 105, 105, 143, 143, 72]                  # "iii", two stray continuation bytes, "H"
    det, pieces, kept = feed_in_chunks(ids, chunks, stop=("iii", "dgb"))
    assert det.stopped and det.text == "" and "".join(pieces) == ""
    assert kept == 3                                     # the tokens kept end at the third "i"


def test_stop_string_never_matches_special_token_names():
    det = IncrementalDetokenizer(TOK, ("<eos>",))
    assert det.add([ord("a"), EOS, ord("b")]) == 3 and not det.stopped
    assert det.add(TOK.encode("<eos>")) == 5 and det.stopped and det.text == "ab"


def test_a_release_the_device_counts_cannot_make_exact_is_flushed_first():
    """Slots released on the host keep their pages until the next step releases them; the plan
    counts what that frees from the device's per-slot figures (`own`). Two released slots that
    share an uncached page (a forked sample and its leader) make that sum a lower bound: end_round
    then has the engine release them first (`flush`) instead of preempting on the lower bound."""
    sched, pool = make(num_pages=6, page_size=4, max_seqs=3, steps=1)
    a, b, c = req(3), req(3), req(3)
    for r in (a, b, c):
        sched.add(r)
    admit(sched, pool)
    decode(sched, pool, {s: [97] * 5 for s in range(3)})  # 8 tokens each: the pool is full
    # What the device would report if slots 0 and 1 shared both of their pages (a fork).
    sched.set_pages(0, list(pool.lens), np.array([0, 0, 2]), np.array([True, True, False]))
    sched.abort(a.request_id)
    sched.abort(b.request_id)
    assert sched.pending_release == (0, 1) and not sched.release_is_exact() and sched.free_pages == 0
    flushes = []

    def flush():
        flushes.append(sched.take_releases())
        for s in flushes[-1]:
            pool.lens[s] = 0
        pool.report(sched)

    release, preempted = sched.end_round(flush)
    assert flushes == [[0, 1]] and preempted == [] and release == []
    assert sched.free_pages == 4 and sched.release_is_exact() and list(sched.running.values()) == [c]
    # An exact pending release is left to the next step: the plan names it.
    sched.abort(c.request_id)
    assert sched.release_is_exact() and sched.free_pages == 6 and sched.end_round(flush) == ([2], [])
    assert len(flushes) == 1 and sched.plan_round(BUDGET).release == (2,)
