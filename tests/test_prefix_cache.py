"""Automatic prefix caching: shared, reference-counted pages give the same tokens as no sharing.

Reference: the same engine with EngineConfig(prefix_caching=False). Prompts share 0 tokens, part
of a page, exactly one page, many pages, or all of the prompt; with greedy and seeded sampling,
with and without preemption. After every round the device's page state must account for every
page exactly once (free, cached-idle or referenced), with refcounts equal to the block-table
references plus the cache's own, and the host's cache must name exactly the device's cached pages.
"""

import dataclasses

import numpy as np
import pytest

import models
from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.engine.prefix_cache import PrefixCache

PS = 8
GREEDY = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.load("tiny-llama", seed=5)
    return models.GPTForEngine(model), tok


def make(tiny, **kw):
    model, tok = tiny
    cfg = dict(max_seqs=4, page_size=PS, num_pages=96, steps_per_call=4, max_model_len=160,
               max_num_batched_tokens=32)
    cfg.update(kw)
    return LLMEngine(model, tok, EngineConfig(**cfg))


def shared_prompts(rng, vocab):
    """Prompts over one random system prefix of 5 pages + 3 tokens: sharing 0 tokens, part of a
    page, exactly one page, many pages, the whole prompt (twice the same prompt, and a prompt that
    is exactly 3 cached pages)."""
    sys_ = rng.integers(3, vocab, 5 * PS + 3).tolist()
    tail = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731
    return [
        sys_ + tail(9),
        tail(20),                  # shares nothing
        sys_[:5] + tail(30),       # part of a page
        sys_[:PS] + tail(7),       # exactly one page
        sys_ + tail(17),           # many pages
        sys_ + tail(9),            # a different tail of the same length
        sys_[: 3 * PS],            # a whole prompt of cached pages: its last page is recomputed
        sys_ + tail(2),
    ]


def check_pages(eng):
    """Every page exactly one of free / cached-idle / referenced; refcounts = table refs + cache;
    the host's cache = the device's cached pages (engine.check_page_state raises otherwise)."""
    eng.check_page_state()
    assert np.asarray(eng.runner.page_state.cached).sum() == len(eng.scheduler.prefix.cached)


def run_checked(eng, prompts, params):
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_unfinished:
        eng.step()
        check_pages(eng)
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def case(tiny):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    prompts = shared_prompts(rng, tiny[0].config.vocab_size)
    return seed, prompts


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_outputs_equal_without_caching(tiny, case, sampling, pool):
    seed, prompts = case
    new = 40 if pool == "preempting" else 12  # 16 pages cannot hold 4 requests growing by 40 tokens
    if sampling == "greedy":
        params = [dataclasses.replace(GREEDY, max_new_tokens=new)] * len(prompts)
    else:
        params = [SamplingParams(max_new_tokens=new, temperature=1.0, top_k=20, seed=seed + i, ignore_eos=True)
                  for i in range(len(prompts))]
    kw = dict(num_pages=16, watermark=0.0) if pool == "preempting" else {}
    off = make(tiny, prefix_caching=False, **kw)
    want = [o.token_ids for o in off.generate(prompts, params)]
    eng = make(tiny, **kw)
    got = run_checked(eng, prompts, params)
    # Again on the warm cache: each prompt's full pages are now cached.
    again = run_checked(eng, prompts, params)
    assert [list(w) for w in want] == got == again, f"seed {seed}"
    s = eng.summary()
    assert s["prefix_hit_tokens"] > 0 and 0 < s["prefix_hit_rate"] < 1
    assert s["prefill_tokens"] < 2 * off.summary()["prefill_tokens"], "hits are not recomputed"
    if pool == "preempting":
        assert eng.stats.preemptions > 0
    assert eng.pool_is_whole()
    n = eng.flush_prefix_cache()
    assert n > 0 and eng.runner.pool_is_whole() and eng.scheduler.free_pages == eng.num_pages


def test_warm_cache_prefills_only_the_uncached_tail(tiny, case):
    _, prompts = case
    eng = make(tiny)
    first = eng.generate(prompts[:1], GREEDY)[0]
    before = eng.stats.prefill_tokens
    again = eng.generate(prompts[:1], GREEDY)[0]
    n = len(prompts[0])
    # All full pages but the one holding the last token are shared; that page is recomputed.
    assert eng.stats.prefill_tokens - before == n - ((n - 1) // PS) * PS
    assert again.token_ids == first.token_ids
    assert eng.summary()["peak_shared_pages"] == 0  # one request at a time shares with no one
    together = eng.generate(prompts[:1] * 3, GREEDY)
    assert all(o.token_ids == first.token_ids for o in together)
    assert eng.summary()["peak_shared_pages"] >= (n - 1) // PS


def test_eviction_frees_cached_pages_when_the_pool_runs_short(tiny):
    rng = np.random.default_rng()
    vocab = tiny[0].config.vocab_size
    eng = make(tiny, num_pages=24)
    # Distinct prompts: each leaves its full pages cached; the pool (24 pages) cannot keep them
    # all, so later requests evict the least recently used ones instead of failing or preempting.
    prompts = [rng.integers(3, vocab, 6 * PS).tolist() for _ in range(8)]
    outs = run_checked(eng, prompts, [GREEDY] * len(prompts))
    assert all(len(o) == GREEDY.max_new_tokens for o in outs)
    assert eng.stats.preemptions == 0
    assert len(eng.scheduler.prefix.cached) <= 24
    assert eng.pool_is_whole()


def test_caching_off_and_separate_engine_keep_no_cache(tiny):
    eng = make(tiny, prefix_caching=False)
    eng.generate(["hello there, paged attention"], GREEDY)
    assert eng.scheduler.prefix is None and eng.runner.pool_is_whole()
    assert eng.summary()["prefix_caching"] is False
    sep = make(tiny, chunked_prefill=False)
    assert sep.scheduler.prefix is None


def test_prefix_cache_keys_are_exact():
    c = PrefixCache(4)
    toks = list(range(1, 14))  # 3 full pages + 1
    c.register(toks, [7, 3, 9])
    assert c.lookup(toks) == [7, 3, 9]
    assert c.lookup(toks[:12]) == [7, 3], "the page holding the last token is never a hit"
    assert c.lookup(toks[:4] + [99] * 9) == [7]
    assert c.lookup([0] + toks[1:]) == []
    other = [5] * 4 + toks[4:]  # same second page, different first: a different key
    assert c.lookup(other) == []
    c.register(toks, [8, 3, 9])  # another copy of page 0's content: kept unkeyed, first to go
    assert c.lookup(toks) == [7, 3, 9]
    assert c.victims(1, referenced=set()) == [8]
    c.forget([8])
    assert c.victims(5, referenced={3}) == [7, 9]


def test_check_page_state_catches_a_drifted_host_cache(tiny):
    eng = make(tiny)
    eng.generate(["a prompt that fills a few pages of the cache, and more"], GREEDY)
    eng.check_page_state()
    page = next(iter(eng.scheduler.prefix.cached))
    eng.scheduler.prefix.forget([page])  # the host forgets a page the device still caches
    with pytest.raises(RuntimeError, match="host prefix cache != device cached pages"):
        eng.check_page_state()
