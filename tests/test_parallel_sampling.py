"""Parallel sampling: n samples of one prompt, prefilled once, on forked copy-on-write pages.

Reference: the same samples as n separate requests (sample i = seed + i). With the unified step
the samples fork their leader's pages when its prompt is computed; the shared partly filled last
page is copied on each sample's first write (`jpa.copy_pages` inside the jitted step). The page
state is checked after every round (`LLMEngine.check_page_state`).
"""

import dataclasses

import numpy as np
import pytest

import models
from jpa.engine import EngineConfig, LLMEngine, SamplingParams

PS = 8


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.load("tiny-llama", seed=6)
    return models.GPTForEngine(model), tok


def make(tiny, **kw):
    model, tok = tiny
    cfg = dict(max_seqs=8, page_size=PS, num_pages=96, steps_per_call=4, max_model_len=160,
               max_num_batched_tokens=32)
    cfg.update(kw)
    return LLMEngine(model, tok, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def case(tiny):
    seed = int(np.random.SeedSequence().entropy % 2**30)
    rng = np.random.default_rng(seed)
    vocab = tiny[0].config.vocab_size
    # Lengths off page multiples (a shared partial last page: copy-on-write), one exact multiple.
    lens = [int(rng.integers(2, 12)) * PS + int(rng.integers(1, PS)) for _ in range(3)] + [5 * PS]
    prompts = [rng.integers(3, vocab, n).tolist() for n in lens]
    params = SamplingParams(max_new_tokens=14, temperature=1.0, top_k=30, seed=seed, n=4, ignore_eos=True)
    return seed, prompts, params


def separately(tiny, prompts, params, **kw):
    eng = make(tiny, prefix_caching=False, **kw)
    flat = eng.generate([p for p in prompts for _ in range(params.n)],
                        [dataclasses.replace(params, n=1, seed=params.seed + i) for _ in prompts
                         for i in range(params.n)])
    return [o.token_ids for o in flat], eng


def run_checked(eng, prompts, params):
    leaders = [eng.add_request(p, params) for p in prompts]
    outs = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output
        eng.check_page_state()
    return [[outs[(r.request_id[0], i)] for i in range(params.n)] for r in leaders]


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_n_samples_equal_n_separate_requests(tiny, case, pool):
    seed, prompts, params = case
    kw = {}
    if pool == "preempting":
        # 16 pages of 8 tokens: 4 samples growing by 30 tokens (4 pages each) never fit with their
        # prompt, whatever its drawn length: samples are preempted and recomputed alone.
        kw = dict(num_pages=16, watermark=0.0)
        params = dataclasses.replace(params, max_new_tokens=30)
    want, sep = separately(tiny, prompts, params, **kw)
    eng = make(tiny, **kw)
    got = run_checked(eng, prompts, params)
    assert [o.token_ids for g in got for o in g] == want, f"seed {seed}"
    assert [o.request_id for o in got[0]] == [(got[0][0].request_id[0], i) for i in range(4)]
    assert eng.pool_is_whole() and compiled_once(eng)
    if pool == "roomy":
        # Each prompt with a partly filled last page: n - 1 samples copy it (the lowest slot keeps it).
        partial = sum(len(p) % PS != 0 for p in prompts)
        assert eng.summary()["cow_copies"] == partial * (params.n - 1)
        assert eng.stats.prefill_tokens == sum(len(p) for p in prompts), "each prompt computed once"
        assert eng.summary()["peak_shared_pages"] > 0
        assert eng.stats.peak_pages_used < sep.stats.peak_pages_used
    else:
        assert eng.stats.preemptions > 0


def compiled_once(eng):
    r = eng.runner
    return (r.step_traces, r.decode_traces, r.prefill_traces) == (1, 0, 0)


def test_generate_groups_samples_and_greedy_samples_agree(tiny, case):
    _, prompts, _ = case
    eng = make(tiny)
    outs = eng.generate(prompts[:2] + ["a plain one"], [SamplingParams(max_new_tokens=6, greedy=True, n=3),
                                                         SamplingParams(max_new_tokens=6, greedy=True, n=2),
                                                         SamplingParams(max_new_tokens=6, greedy=True)])
    assert [len(o) for o in outs[:2]] == [3, 2] and not isinstance(outs[2], list)
    for group in outs[:2]:
        assert len({o.token_ids for o in group}) == 1, "greedy samples of one prompt are identical"
    assert eng.pool_is_whole()


def test_aborting_the_leader_before_the_fork_takes_its_samples(tiny):
    rng = np.random.default_rng()
    eng = make(tiny, max_num_batched_tokens=8)
    lead = eng.add_request(rng.integers(3, 200, 60).tolist(),
                           SamplingParams(max_new_tokens=8, n=3, seed=1, ignore_eos=True))
    eng.step()  # the first 8-token chunk: the samples hold slots, waiting to fork
    assert len(eng.scheduler.forking) == 2
    assert eng.abort(lead.request_id)
    outs = eng.step()
    assert sorted(o.request_id for o in outs if o.finished) == [(lead.request_id[0], i) for i in range(3)]
    assert all(o.output.finish_reason == "abort" for o in outs)
    assert eng.pool_is_whole() and not eng.has_unfinished


def test_aborting_one_waiting_sample_keeps_the_others(tiny):
    rng = np.random.default_rng()
    eng = make(tiny)
    lead = eng.add_request(rng.integers(3, 200, 20).tolist(),
                           SamplingParams(max_new_tokens=5, n=3, seed=2, ignore_eos=True))
    rid = lead.request_id[0]
    assert eng.abort((rid, 1))
    done = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output
    assert done[(rid, 1)].finish_reason == "abort"
    assert len(done[(rid, 0)].token_ids) == len(done[(rid, 2)].token_ids) == 5
    assert eng.pool_is_whole()


def test_n_beyond_the_slots_or_the_seed_range_is_refused(tiny):
    eng = make(tiny, max_seqs=2, max_num_batched_tokens=8)
    out = eng.generate(["hi"], SamplingParams(max_new_tokens=2, n=3))[0]
    assert out.finish_reason == "error" and "max_seqs 2" in out.error
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="seed \\+ n - 1"):
        SamplingParams(seed=2**31 - 2, n=3)


def test_separate_engine_runs_samples_as_independent_requests(tiny, case):
    _, prompts, params = case
    eng = make(tiny, chunked_prefill=False)
    outs = eng.generate(prompts[:1], params)[0]
    want, _ = separately(tiny, prompts[:1], params)
    assert [o.token_ids for o in outs] == want
