"""Automatic prefix caching: shared, reference-counted pages give the same outputs as no sharing.

Reference: the reference engine (tests/engine_util: prefix_caching=False, no preemption). Prompts
share 0 tokens, part of a page, exactly one page, many pages, or all of the prompt; greedy and
seeded-sampled, cold and warm cache, with and without preemption; token ids and per-token logprobs
are compared. After every round the device's page state must account for every page exactly once
(free, cached-idle or referenced), refcounts equal to the block-table references plus the cache's
own, and the host's cache must name exactly the device's cached pages (`check_page_state`).
"""

import copy

import numpy as np
import pytest

from jpa.testing.engine import PAGE_SIZE as PS
from jpa.testing.engine import assert_same, fresh_seed, mixed_params, random_prompts, run, snapshot
from jpa.engine import SamplingParams
from jpa.kv.prefix_cache import PrefixCache

pytestmark = pytest.mark.xdist_group("engines")  # one worker compiles the group's programs once

GREEDY = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
SMALL = dict(max_seqs=3, num_pages=24)   # this module's own engine: its stats start here


def shared_prompts(rng):
    """Prompts over one random system prefix of 5 pages + 3 tokens: sharing 0 tokens, part of a
    page, exactly one page, many pages, the whole prompt (twice the same prompt, and a prompt that
    is exactly 3 cached pages)."""
    sys_ = random_prompts(rng, 1, lo=5 * PS + 3, hi=5 * PS + 3)[0]
    tail = lambda n: random_prompts(rng, 1, lo=n, hi=n)[0]  # noqa: E731
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


@pytest.fixture(scope="module")
def case():
    seed = fresh_seed()
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    return seed, rng, shared_prompts(rng)


def uncached_tail(n: int) -> int:
    """Prompt tokens computed when every full page but the one holding the last token is cached."""
    return n - ((n - 1) // PS) * PS


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_outputs_equal_without_caching(engines, case, sampling, pool):
    seed, rng, prompts = case
    new = 40 if pool == "preempting" else 12  # 16 pages cannot hold 4 requests growing by 40 tokens
    params = mixed_params(rng, len(prompts), lo=new, hi=new, greedy_every=1 if sampling == "greedy" else 10 ** 6)
    want = engines.reference(prompts, params)
    eng = engines.get(**(dict(num_pages=16) if pool == "preempting" else {}))
    before, hits0 = snapshot(eng), eng.summary()["prefix_hit_tokens"]
    assert_same(run(eng, prompts, params), want, f"seed {seed}, cold cache")
    mid = snapshot(eng)
    # Again on the warm cache: each prompt's full pages are now cached.
    assert_same(run(eng, prompts, params), want, f"seed {seed}, warm cache")
    assert eng.summary()["prefix_hit_tokens"] > hits0
    warm = eng.stats.prefill_tokens - mid.prefill_tokens
    if pool == "roomy":
        assert warm == sum(uncached_tail(len(p)) for p in prompts), "warm: only the uncached tails are computed"
        assert mid.prefill_tokens - before.prefill_tokens <= sum(len(p) for p in prompts)
    else:
        assert eng.stats.preemptions > before.preemptions
        assert warm < sum(len(p) for p in prompts), "hits are not recomputed"
    assert eng.pool_is_whole()


def test_warm_cache_prefills_only_the_uncached_tail(engines, case):
    _, _, prompts = case
    eng = engines.get(**SMALL)
    first = run(eng, prompts[:1], GREEDY)[0]
    before = snapshot(eng)
    again = run(eng, prompts[:1], GREEDY)[0]
    n = len(prompts[0])
    # All full pages but the one holding the last token are shared; that page is recomputed.
    assert eng.stats.prefill_tokens - before.prefill_tokens == uncached_tail(n)
    assert_same([again], [first])
    assert eng.summary()["peak_shared_pages"] == 0, "one request at a time shares with no one"
    together = run(eng, prompts[:1] * 3, GREEDY)
    assert_same(together, [first] * 3)
    assert eng.summary()["peak_shared_pages"] >= (n - 1) // PS


def test_eviction_frees_cached_pages_when_the_pool_runs_short(engines):
    rng = np.random.default_rng()
    eng = engines.get(**SMALL)
    # Distinct prompts: each leaves its 6 full pages cached; the pool (24 pages) cannot keep them
    # all, so later requests evict the least recently used ones instead of failing or preempting.
    prompts = random_prompts(rng, 8, lo=6 * PS, hi=6 * PS)
    want = engines.reference(prompts, [GREEDY] * len(prompts))
    before = snapshot(eng)
    assert_same(run(eng, prompts, GREEDY), want, "evicting")
    assert eng.stats.preemptions == before.preemptions
    assert 0 < eng.summary()["cached_pages"] < 8 * 5, "cached pages were evicted"
    assert eng.pool_is_whole()


def test_caching_off_keeps_no_cache(engines):
    from jpa.testing.engine import REFERENCE

    eng = engines.get(**REFERENCE)
    run(eng, [list(range(3, 60))], GREEDY)
    s = eng.summary()
    assert s["prefix_caching"] is False and s["cached_pages"] == 0 and s["prefix_hit_tokens"] == 0
    assert eng.pool_is_whole()


def key_table(prefix):
    """The host cache's key table (key -> id): PrefixCache._ids."""
    assert hasattr(prefix, "_ids"), "PrefixCache's key table moved: update this test"
    return prefix._ids


def test_key_table_is_pruned_with_evictions(engines):
    """Regression: evicted pages' keys stayed in the key table forever (a long-lived server's host
    memory grew with every distinct prompt). Touches eng.scheduler.prefix (PrefixCache)."""
    rng = np.random.default_rng()
    eng = engines.get(**SMALL)
    prefix = eng.scheduler.prefix
    for _ in range(4):
        run(eng, random_prompts(rng, 6, lo=6 * PS, hi=7 * PS), SamplingParams(max_new_tokens=2, greedy=True))
        cached = len(prefix.cached)
        assert cached <= eng.num_pages
        assert len(key_table(prefix)) <= cached, \
            f"{len(key_table(prefix))} keys for {cached} cached pages: the key table is not pruned"


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


def test_check_page_state_catches_a_drifted_host_cache(engines):
    """Touches eng.scheduler.prefix (PrefixCache): the host forgets a page the device caches."""
    eng = engines.get(**SMALL)
    run(eng, ["a prompt that fills a few pages of the cache, and more"], GREEDY)
    eng.check_page_state()
    prefix = eng.scheduler.prefix
    saved = copy.deepcopy(prefix.__dict__)
    prefix.forget([next(iter(prefix.cached))])
    try:
        with pytest.raises(RuntimeError, match="host prefix cache != device cached pages"):
            eng.check_page_state()
    finally:
        prefix.__dict__.update(saved)
    eng.check_page_state()
