"""Parallel sampling: n samples of one prompt, prefilled once, on forked copy-on-write pages.

Reference: the same samples as n separate requests (sample i = seed + i) on the reference engine
(tests/engine_util: no sharing, no preemption); token ids and per-token logprobs are compared.
The samples fork their leader's pages when its prompt is computed; the shared partly filled last
page is copied on each sample's first write. The page state is checked after every round.
"""

import dataclasses

import numpy as np
import pytest

from jpa.testing.engine import PAGE_SIZE as PS
from jpa.testing.engine import assert_same, compiled_once, fresh_seed, random_prompts, run, snapshot
from jpa.engine import SamplingParams

pytestmark = pytest.mark.xdist_group("engines")  # one worker compiles the group's programs once


@pytest.fixture(scope="module")
def case():
    seed = fresh_seed() % 2 ** 30
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    # Lengths off page multiples (a shared partial last page: copy-on-write), one exact multiple.
    lens = [int(rng.integers(2, 12)) * PS + int(rng.integers(1, PS)) for _ in range(3)] + [5 * PS]
    prompts = [random_prompts(rng, 1, lo=n, hi=n)[0] for n in lens]
    sampled = SamplingParams(max_new_tokens=14, temperature=1.0, top_k=30, seed=seed, n=4, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=14, greedy=True, n=3, ignore_eos=True)
    return seed, prompts, [sampled, greedy, sampled, dataclasses.replace(sampled, seed=seed + 7, top_p=0.9)]


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_n_samples_equal_n_separate_requests(engines, case, pool):
    seed, prompts, params = case
    kw = {}
    if pool == "preempting":
        # 16 pages of 8 tokens: 3-4 samples growing by 30 tokens (4 pages each) never fit with
        # their prompt, whatever its drawn length: samples are preempted and recomputed alone.
        kw = dict(num_pages=16)
        params = [dataclasses.replace(p, max_new_tokens=30) for p in params]
    want = engines.reference(prompts, params)
    eng = engines.get(**kw)
    before, cow0 = snapshot(eng), eng.summary()["cow_copies"]
    got = run(eng, prompts, params)
    assert [len(g) for g in got] == [p.n for p in params]
    assert_same(got, want, f"seed {seed}, {pool}")
    assert len({o.token_ids for o in got[1]}) == 1, "greedy samples of one prompt are identical"
    assert eng.pool_is_whole() and compiled_once(eng)
    if pool == "roomy":
        # Each prompt with a partly filled last page: n - 1 samples copy it (one keeps it).
        cow = sum(p.n - 1 for x, p in zip(prompts, params) if len(x) % PS)
        assert eng.summary()["cow_copies"] - cow0 == cow
        assert eng.stats.prefill_tokens - before.prefill_tokens == sum(len(p) for p in prompts), \
            "each prompt computed once"
        assert eng.summary()["peak_shared_pages"] > 0
    else:
        assert eng.stats.preemptions > before.preemptions


def test_generate_groups_samples(engines, case):
    _, prompts, _ = case
    eng = engines.get()
    outs = eng.generate(prompts[:2] + ["a plain one"], [SamplingParams(max_new_tokens=6, greedy=True, n=3),
                                                         SamplingParams(max_new_tokens=6, seed=3, n=2),
                                                         SamplingParams(max_new_tokens=6, greedy=True)])
    assert [len(o) for o in outs[:2]] == [3, 2] and not isinstance(outs[2], list)
    assert len({o.token_ids for o in outs[0]}) == 1, "greedy samples of one prompt are identical"
    assert eng.pool_is_whole()


def test_aborting_the_leader_before_the_fork_takes_its_samples(engines):
    rng = np.random.default_rng()
    eng = engines.get(max_num_batched_tokens=4)
    lead = eng.add_request(random_prompts(rng, 1, lo=60, hi=60)[0],
                           SamplingParams(max_new_tokens=8, n=3, seed=1, ignore_eos=True), request_id="lead")
    assert not any(o.new_token_ids for o in eng.step()), "the first 4-token chunk: nothing forked yet"
    assert eng.abort(lead.request_id)
    outs = eng.step()
    assert sorted(o.request_id for o in outs if o.finished) == [("lead", i) for i in range(3)]
    assert all(o.output.finish_reason == "abort" and o.output.token_ids == () for o in outs)
    eng.check_page_state()
    assert eng.pool_is_whole() and not eng.has_unfinished


def test_aborting_one_waiting_sample_keeps_the_others(engines):
    rng = np.random.default_rng()
    eng = engines.get()
    eng.add_request(random_prompts(rng, 1, lo=20, hi=20)[0],
                    SamplingParams(max_new_tokens=5, n=3, seed=2, ignore_eos=True), request_id="r")
    assert eng.abort(("r", 1))
    done = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output
        eng.check_page_state()
    assert done[("r", 1)].finish_reason == "abort"
    assert len(done[("r", 0)].token_ids) == len(done[("r", 2)].token_ids) == 5
    assert eng.pool_is_whole()


def test_n_beyond_the_slots_or_the_seed_range_is_refused(engines):
    eng = engines.get()   # max_seqs 4
    out = eng.generate(["hi"], SamplingParams(max_new_tokens=2, n=5))[0]
    assert out.finish_reason == "error" and "max_seqs 4" in out.error
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="seed \\+ n - 1"):
        SamplingParams(seed=2**31 - 2, n=3)


def drain(engines, eng, max_rounds=200):
    """Runs eng until it has nothing unfinished, running or waiting; an engine that cannot get
    there is dropped (no later test gets it)."""
    for _ in range(max_rounds):
        if not eng.has_unfinished:
            break
        eng.step()
    if eng.has_unfinished or eng.num_running or eng.num_waiting:
        engines.discard(eng)
        return False
    return True


def test_request_id_of_unfinished_samples_is_refused(engines):
    """Regression: add_request(..., request_id="x") with n=2, twice while the first was unfinished,
    was accepted (the id's samples are ("x", i), so "x" itself looked free); the second request was
    then stranded: has_unfinished stayed True."""
    eng = engines.get()
    params = SamplingParams(max_new_tokens=4, n=2, seed=5, ignore_eos=True)
    eng.add_request([5, 6, 7], params, request_id="x")
    try:
        with pytest.raises(ValueError, match="request_id 'x' is already used"):
            eng.add_request([8, 9], params, request_id="x")
    finally:
        assert drain(engines, eng), "requests stranded (unfinished, running or waiting after the drain)"
    eng.check_page_state()
    assert eng.pool_is_whole()


@pytest.mark.soak
def test_slot_finished_at_the_fork_is_not_charged_a_copy(engines):
    """Regression: a sample the device finished in the round of its fork (max_new_tokens=1) left
    its slot marked as owing a copy-on-write page; the next request in that slot was charged an
    extra page. A lone 23-token prompt exactly fills this 6-page pool of 4-token pages: it must
    run to the length limit without being preempted (a 4-token budget: its prompt spans rounds)."""
    eng = engines.get(max_seqs=2, page_size=4, num_pages=6, max_num_batched_tokens=4)
    rng = np.random.default_rng()
    try:
        forked = run(eng, [random_prompts(rng, 1, lo=5, hi=5)[0]], SamplingParams(max_new_tokens=1, n=2, seed=1))[0]
        assert [len(o.token_ids) for o in forked] == [1, 1]
        out = run(eng, [random_prompts(rng, 1, lo=23, hi=23)[0]],
                  SamplingParams(max_new_tokens=50, greedy=True, ignore_eos=True))[0]
    except Exception:
        engines.discard(eng)
        raise
    assert out.finish_reason == "length" and len(out.prompt_ids) + len(out.token_ids) == 24
    assert out.num_preemptions == 0, f"a lone request that fits the pool was preempted {out.num_preemptions}x"
    assert eng.pool_is_whole()


def test_samples_stopping_together_are_released_exactly(engines):
    """Greedy samples of one prompt stop on the same stop string in the same round. Without
    prefix caching they still share their uncached prompt pages, so the pages their release
    frees are not the sum of what each holds alone: the engine releases them with a call of its
    own (`flush_releases`) instead of planning from a lower bound; the page state (checked after
    every round, with the host's projected free count) stays exact and the outputs are the
    single request's."""
    from jpa.testing.engine import REFERENCE

    rng = np.random.default_rng(5)
    prompt = random_prompts(rng, 1, lo=3 * PS + 3, hi=3 * PS + 3)[0]
    eng = engines.get(**REFERENCE)   # no prefix caching (the reference engine: compiled already)
    plain = SamplingParams(max_new_tokens=20, greedy=True, ignore_eos=True)
    text = run(eng, [prompt], plain)[0].completion
    stop = text[1:3]   # seed 5: "OO", the 8th token completes it (a decode round, not the first token)
    assert len(stop.strip()) == 2, text
    one = run(eng, [prompt], dataclasses.replace(plain, stop=(stop,)))[0]
    assert one.finish_reason == "stop" and len(one.token_ids) < 20
    retire, calls = eng.runner.retire, []
    eng.runner.retire = lambda ids: calls.append(list(ids)) or retire(ids)
    try:
        got = run(eng, [prompt], dataclasses.replace(plain, stop=(stop,), n=3))[0]
    finally:
        del eng.runner.retire
    assert [o.token_ids for o in got] == [one.token_ids] * 3 and {o.finish_reason for o in got} == {"stop"}
    assert len(calls) == 1 and len(set(calls[0])) == 3, calls   # the three samples' slots, once
    assert eng.pool_is_whole()
