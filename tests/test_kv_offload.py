"""KV offload: preempted requests swap their pages out to a host tier and back in instead of
recomputing them (`jpa.kv.offload`, EngineConfig.kv_offload_bytes).

Equivalence runs the context-dependent tiny model under a pool that must preempt (16 pages of 8
tokens for 4 slots of 20-50-token prompts growing by 40 tokens), with shared prefixes (prefix-cache
hits) and parallel samples, greedy and seeded; outputs and logprobs must equal the reference
engine's (no preemption), which is what the engine without offload gives too (tests/test_engine.py).
`run` checks both tiers' page state after every round.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jpa.engine import EngineConfig, LLMEngine
from jpa.kv.offload import HostTier, bucket
from jpa.testing.engine import assert_same, fresh_seed, mixed_params, random_prompts, run, snapshot

pytestmark = pytest.mark.xdist_group("engines_b")  # one worker compiles the group's programs once

OFFLOAD = dict(num_pages=16, kv_offload_bytes=64 << 20)   # a host tier far larger than the device pool


@pytest.fixture(scope="module")
def rng():
    seed = fresh_seed()
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def workload(rng, n=6):
    """n prompts of seeded lengths in [20, 50] (these lengths preempt in the 16-page pool whatever
    the tokens: see tests/test_engine.py tight_prompts), the last two sharing a 2-page prefix with
    the first; mixed greedy / seeded params, the second with n=2 samples."""
    lens = np.random.default_rng(20).integers(20, 51, n)
    prompts = [random_prompts(rng, 1, lo=int(m), hi=int(m))[0] for m in lens]
    for i in (n - 2, n - 1):
        prompts[i] = prompts[0][:16] + prompts[i][16:]
    params = mixed_params(rng, n, lo=40, hi=40)
    params[1] = dataclasses.replace(params[1], n=2, greedy=False, temperature=1.0, seed=int(rng.integers(2 ** 30)))
    return prompts, params


def test_swap_keeps_outputs(engines, rng):
    prompts, params = workload(rng)
    want = engines.reference(prompts, params)
    eng = engines.get(**OFFLOAD)
    before = snapshot(eng)
    got = run(eng, prompts, params)   # checks both tiers after every round
    st = eng.stats
    preempted = st.preemptions - before.preemptions
    swapped_out, swapped_in = st.swapped_out - before.swapped_out, st.swapped_in - before.swapped_in
    print(f"preemptions {preempted}, swapped out {swapped_out}, in {swapped_in}, "
          f"recompute avoided {st.recompute_avoided_tokens - before.recompute_avoided_tokens} tokens")
    assert preempted > 0, "the workload exceeds the pool: someone must be preempted"
    assert swapped_out == preempted, "the host tier has room for every preempted request"
    assert swapped_in > 0 and swapped_in <= swapped_out
    assert st.recompute_avoided_tokens > before.recompute_avoided_tokens
    assert st.swap_in_bytes - before.swap_in_bytes == (st.swap_in_pages - before.swap_in_pages) * \
        eng.host_tier.bytes_per_page
    # Prompt work: every prompt token once (less the prefix hits) plus, per swap-in, the few tokens
    # after the restored ones (1 for a request preempted while decoding): far less than recomputing.
    prompt_tokens = sum(len(p) for p in prompts)
    assert st.prefill_tokens - before.prefill_tokens <= prompt_tokens + 8 * swapped_in
    assert_same(got, want, "offload on, preempting pool")
    tier = eng.host_tier
    assert eng.pool_is_whole() and not tier.blocks and tier.num_free + len(tier.spilled) == tier.num_pages


def test_abort_frees_both_tiers(engines, rng):
    """Requests aborted while swapped out (waiting with a block) or running leave nothing behind."""
    prompts, params = workload(rng)
    eng = engines.get(**OFFLOAD)
    for k, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(p, sp, request_id=("abort", k))
    for _ in range(200):
        eng.step()
        eng.check_page_state()
        if eng.host_tier.blocks:
            break
    assert eng.host_tier.blocks, "a request was swapped out"
    kinds = {leaf.sharding.memory_kind for b in eng.host_tier.blocks.values() for leaf in
             jax.tree_util.tree_leaves(b.data)}
    assert kinds == {"pinned_host"}, f"swapped blocks live in host memory (this CPU backend has the kind); {kinds}"
    for k in range(len(prompts)):
        eng.abort(("abort", k))
    while eng.has_unfinished:
        eng.step()
    eng.check_page_state()
    tier = eng.host_tier
    assert tier.num_free + len(tier.spilled) == tier.num_pages and not tier.blocks
    assert eng.pool_is_whole()


def test_host_tier_bookkeeping():
    tier = HostTier(8, 100)
    assert tier.reserve("a", 4, 30) and tier.reserve("b", 2, 9)
    assert not tier.reserve("c", 4, 30), "no room: nothing taken"
    assert tier.num_free == 2 and "c" not in tier
    tier.attach("a", object())
    tier.attach("b", object())
    assert tier.check() == []
    assert tier.take("a").num_tokens == 30 and tier.num_free == 6
    tier.drop("b")
    tier.drop("b")   # dropping twice is harmless
    assert tier.num_free == 8 and tier.check() == []
    with pytest.raises(RuntimeError, match="already holds"):
        tier.reserve("d", 1, 1) and tier.reserve("d", 1, 1)
    assert [bucket(n, 24) for n in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]


def test_offload_config_errors(ctx_model):
    with pytest.raises(ValueError, match="kv_offload_bytes must be an int >= 0"):
        EngineConfig(kv_offload_bytes=-1)
    with pytest.raises(ValueError, match="needs tensor_parallel=1"):
        EngineConfig(kv_offload_bytes=1 << 20, tensor_parallel=2, max_seqs=4, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="holds no page"):
        LLMEngine(*ctx_model, EngineConfig(max_seqs=2, num_pages=8, page_size=8, kv_offload_bytes=16))


def test_offload_metrics(engines, rng):
    """The summary and the server's /metrics collector report the swaps (vLLM's num_preemptions too)."""
    import types

    from jpa.server.metrics import _EngineCollector

    prompts, params = workload(rng, 4)
    eng = engines.get(**OFFLOAD)
    run(eng, prompts, [dataclasses.replace(p, n=1) for p in params])
    s = eng.summary()["kv_offload"]
    assert s["swapped_out"] == eng.stats.swapped_out > 0 and s["memory_kind"] in ("pinned_host", None)
    assert s["host_pages_free"] + s["host_spilled_pages"] == s["host_pages"] == eng.host_tier.num_pages
    fake = types.SimpleNamespace(engine=eng, snapshot=types.SimpleNamespace(num_running=0, num_waiting=0,
                                                                            pages_used=0, num_pages=16))
    got = {m.name: m.samples[0].value for m in _EngineCollector(lambda: fake, "m")._vllm(fake) if m.samples}
    assert got["vllm:num_preemptions"] == eng.stats.preemptions
    assert got["jpa_kv_offload_swapped_out"] == eng.stats.swapped_out
    assert got["jpa_kv_offload_bytes_in"] == eng.stats.swap_in_bytes
    assert got["jpa_kv_offload_recompute_avoided_tokens"] == eng.stats.recompute_avoided_tokens
    assert got["jpa_kv_offload_host_pages_free"] == eng.host_tier.num_free
    prefix = eng.scheduler.prefix
    assert got["vllm:external_prefix_cache_hits"] == prefix.host_hit_tokens
    assert got["vllm:external_prefix_cache_queries"] == prefix.host_query_tokens
    assert got["vllm:prefix_cache_hits"] == prefix.hit_tokens - prefix.host_hit_tokens
    assert got["jpa_kv_offload_spilled_pages"] == eng.stats.spill_pages
    assert got["jpa_kv_offload_restore_bytes"] == eng.stats.restore_bytes
    assert got["jpa_kv_offload_host_spilled_pages"] == len(eng.host_tier.spilled)
    assert s["spilled_pages"] == eng.stats.spill_pages and "recompute" in s["cost_rule"]


def test_cost_rule():
    """Swap vs recompute, per model and platform: SmolLM2-135M (f32 KV, 46080 B/token) swaps on this
    CPU and recomputes on an H100; Llama-3-8B (bf16, 131072 B/token) swaps on both; the attention
    term makes long sequences favour the swap. Worked by hand: 1000 tokens of SmolLM2 on the CPU
    figures cost 2 * 1000 * 46080 / 5e9 = 18.4 ms to swap and (2 * 135e6 * 1000 + 2 * 30 * 9 * 64 *
    1000**2) / 100e9 = 3.05 s to recompute (this VM prefills SmolLM2 at ~450 tokens/s when idle)."""
    import types

    from jpa.kv.offload import SwapCost

    smol = types.SimpleNamespace(num_layers=30, num_q_heads=9, head_dim=64)
    llama = types.SimpleNamespace(num_layers=32, num_q_heads=32, head_dim=128)
    cpu = SwapCost.for_model(smol, 135_000_000, 46080, "cpu")
    assert cpu.swap_seconds(1000) == pytest.approx(18.432e-3)
    assert cpu.recompute_seconds(1000) == pytest.approx(3.0456)
    assert cpu.prefers_swap(1000) and cpu.prefers_swap(1)
    gpu = SwapCost.for_model(smol, 135_000_000, 23040, "gpu")
    assert not gpu.prefers_swap(100), "SmolLM2 on an H100: recomputing beats the PCIe link"
    assert gpu.prefers_swap(200_000), "the attention term grows with the square of the length"
    big = SwapCost.for_model(llama, 8_000_000_000, 131072, "cuda")
    assert big.prefers_swap(16) and big.prefers_swap(8000)
    with pytest.raises(ValueError, match="SwapCost.params must be > 0"):
        SwapCost(1, 0, 1, 1, 1, 1.0, 1.0)


def test_cost_rule_recompute_is_used(engines):
    """The scheduler follows the rule: a rule that prefers recompute swaps nothing out."""
    from jpa.kv.offload import SwapCost

    eng = engines.get(**OFFLOAD)
    before, rule, by_rule = snapshot(eng), eng.scheduler.swap_cost, eng.scheduler.recomputed_by_rule
    eng.scheduler.swap_cost = SwapCost(10 ** 9, 1, 1, 1, 1, 1.0, 1e18)   # a copy costs ages: recompute
    try:
        prompts, params = workload(np.random.default_rng(3), 4)
        run(eng, prompts, [dataclasses.replace(p, n=1) for p in params])
    finally:
        eng.scheduler.swap_cost = rule
    preempted = eng.stats.preemptions - before.preemptions
    assert preempted > 0 and eng.stats.swapped_out == before.swapped_out
    assert eng.scheduler.recomputed_by_rule - by_rule == preempted


def chat_turn(eng, histories, rng, params, *, new: int = 8, only=None):
    """One turn of multi-turn chats, one request at a time (the pressure is the prefix cache's
    alone): chat c's prompt is its history plus `new` fresh user tokens; its history then grows by
    the prompt and the completion. Returns the prompts and outputs of the chats run (`only`: their
    indices; default all)."""
    prompts, outs = [], []
    for c in (range(len(histories)) if only is None else only):
        prompt = histories[c] + rng.integers(3, 256, new).tolist()
        out, = run(eng, [prompt], [params[c]])
        histories[c] = prompt + list((out[0] if isinstance(out, list) else out).token_ids)   # n > 1: sample 0
        prompts.append(prompt)
        outs.append(out)
    return prompts, outs


def test_spill_multi_turn_host_hit(engines, rng):
    """Prefix-cache spill: four 40-token chats (5 full pages each, 6 pages with their 8 new tokens)
    one after another in a 16-page pool cache 20 pages, so the fourth MUST evict the first chat's 5
    (LRU); with offload they go to the host tier. The first chat's second turn then finds its whole
    history's full pages in the host tier only (the device lookup misses), copies them back and
    prefills only the rest; outputs and logprobs equal the reference (no prefix cache, no
    pressure). Then a host hit aborted right after its restore leaves both tiers whole."""
    eng = engines.get(**OFFLOAD)
    before = snapshot(eng)
    hit0, hhit0 = eng.scheduler.prefix.hit_tokens, eng.scheduler.prefix.host_hit_tokens
    histories = [random_prompts(rng, 1, lo=32, hi=32)[0] for _ in range(4)]
    params = mixed_params(rng, 4, lo=8, hi=8)
    prompts, outs = chat_turn(eng, histories, rng, params)   # 32 + 8 = 40-token prompts
    assert_same(outs, engines.reference(prompts, params), "turn 1")
    st = eng.stats
    assert st.spill_pages - before.spill_pages >= 5, "the fourth chat evicts (spills) the first chat's pages"
    prefix, tier = eng.scheduler.prefix, eng.host_tier
    probe = histories[0] + [7] * 8
    assert prefix.lookup(probe) == [], "the device pool has cycled: no device hit"
    pages, kids = prefix.lookup_tiers(probe)
    assert pages == [-1] * 5 and len(kids) == 5 and all(k in tier.spilled for k in kids)

    prompts, outs = chat_turn(eng, histories, rng, params, only=[0])
    assert_same(outs, engines.reference(prompts, params[:1]), "turn 2, a host hit")
    assert st.restored - before.restored == 1 and st.restore_pages - before.restore_pages == 5
    assert prefix.host_hit_tokens - hhit0 == 40 and prefix.hit_tokens - hit0 == 40
    assert st.restore_bytes - before.restore_bytes == 5 * tier.bytes_per_page
    assert not any(k in tier.spilled for k in kids), "restored pages left the host tier (one place)"
    eng.check_page_state()

    # Chat 1's history is in the host tier now too (chat 0's second turn evicted it): abort its
    # next turn right after the round that restored it.
    probe = histories[1] + [7] * 8
    pages, kids = prefix.lookup_tiers(probe)
    assert kids, "chat 1's pages were spilled"
    restored = st.restored
    eng.add_request(probe, params[1], request_id="abort-after-restore")
    eng.step()
    eng.check_page_state()
    assert st.restored == restored + 1
    assert eng.abort("abort-after-restore")
    while eng.has_unfinished:
        eng.step()
    eng.check_page_state()
    assert eng.pool_is_whole() and not tier.blocks
    assert tier.num_free + len(tier.spilled) == tier.num_pages


def test_spill_shares_the_tier_with_swaps():
    """The host tier's eviction policy: spills take free pages, then evict older spills (LRU); a
    swap block evicts spills (LRU) for room but is never evicted; a spill finds no room when swap
    blocks hold every page. Evicted spills are reported (the prefix cache drops their keys)."""
    tier = HostTier(4, 100)
    gone = []
    tier.on_evict = gone.append
    for kid in "abcd":
        assert tier.spill(kid, object())
    tier.touch(["a"])                          # a host hit: "a" is the most recently used now
    assert tier.spill("e", object()) and gone == ["b"]
    assert tier.reserve("req", 3, 20) and gone == ["b", "c", "d", "a"]
    assert list(tier.spilled) == ["e"] and tier.num_free == 0
    tier.attach("req", object())
    assert tier.spill("f", object()) and gone[-1] == "e"    # evicts the older spill, not the block
    assert not tier.reserve("req2", 2, 9), "a spill gives its page up, a swap block does not"
    assert tier.reserve("req2", 1, 9) and gone[-1] == "f"
    tier.attach("req2", object())
    assert not tier.spill("g", object()), "swap blocks hold every page: the spill is dropped"
    assert tier.check() == [] and tier.num_swap_pages == 4
    tier.drop("req")
    assert tier.spill("g", object()) and tier.unspill("g").host_page in range(4)
    assert tier.num_free == 3 and tier.check() == []


def test_alloc_cached_pages():
    """pages.alloc_cached: fresh pages straight into the prefix cache (cached-idle), shareable like
    any cached page and freed by uncache; all or nothing when too few are free."""
    from jpa.kv import pages

    st = pages.init(6, 2, 4, 4)
    st, ok = pages.reserve(st, 0, 8)                       # pages 0, 1 to sequence 0
    st, ids, ok2 = pages.alloc_cached(st, 3, width=4)
    assert bool(ok) and bool(ok2) and np.asarray(ids).tolist() == [2, 3, 4, -1]
    assert int(st.num_free) == 1 and np.asarray(st.cached).tolist() == [False, False, True, True, True, False]
    assert np.asarray(st.refcounts).tolist() == [1, 1, 1, 1, 1, 0]
    same, ids, ok3 = pages.alloc_cached(st, 2, width=4)
    assert not bool(ok3) and np.asarray(ids).tolist() == [-1] * 4
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), same, st))
    st, shared = pages.share(st, 1, np.array([[4, 2, 0, 0]]), 8)
    assert bool(shared) and np.asarray(st.refcounts).tolist() == [1, 1, 2, 1, 2, 0]
    st = pages.release(pages.uncache(st, [2, 3, 4]), [0, 1])
    assert int(st.num_free) == 6 and not np.asarray(st.cached).any()
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        pages.alloc_cached(st, 1, width=0)


def test_cost_rule_gates_the_spill(engines, rng):
    """Where the rule prefers recompute even for one page, evicted prefix pages are not spilled."""
    from jpa.kv.offload import SwapCost

    eng = engines.get(**OFFLOAD)
    before, rule = snapshot(eng), eng.scheduler.swap_cost
    eng.scheduler.swap_cost = SwapCost(10 ** 9, 1, 1, 1, 1, 1.0, 1e18)
    try:
        histories = [random_prompts(rng, 1, lo=32, hi=32)[0] for _ in range(4)]
        chat_turn(eng, histories, rng, mixed_params(rng, 4, lo=8, hi=8))
    finally:
        eng.scheduler.swap_cost = rule
    assert eng.stats.spill_pages == before.spill_pages and not eng.host_tier.spilled
    assert eng.scheduler.prefix.lookup_tiers(histories[0] + [7] * 8) == ([], [])


def test_offload_programs_place_and_alias():
    """The four offload programs as `Mover` jits them, lowered and compiled on this CPU backend (its
    device has pinned_host): swap-out and spill move their outputs to host memory inside the program
    (annotate_device_placement to pinned_host, pinned_host results, which is what survives a
    deviceless GPU compile: `jpa tools compile-offload`); swap-in and restore take pinned_host
    blocks and update the donated pool in place (aliased, no pool-sized temporaries); the data round-trips."""
    import jax.numpy as jnp

    from jpa.kv.cache import CacheConfig, KVCache
    from jpa.kv.offload import Mover, host_memory_kind

    kind = host_memory_kind()
    assert kind == "pinned_host", "this CPU backend offers pinned_host"
    cfg = CacheConfig(2, 1, 8, 64, 4, "float32")
    key = jax.random.key(fresh_seed())
    cache = KVCache.create(cfg)
    cache = jax.tree_util.tree_map(lambda a: jax.random.normal(key, a.shape, a.dtype), cache)
    pool_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(cache))
    mover = Mover(kind)
    tables = jnp.asarray(np.arange(4 * 16).reshape(4, 16)[:, ::-1] % 64, jnp.int32)
    want = np.asarray(cache.k[:, :, np.asarray(tables[1, :4])])
    block = mover.swap_out(cache, type("PS", (), dict(block_tables=tables))(), 1, 4)
    assert {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(block)} == {"pinned_host"}
    np.testing.assert_array_equal(np.asarray(block.k), want)
    spilled = mover.spill(cache, [5, 9, 2], 4)
    assert len(spilled) == 3 and {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(spilled)} == {"pinned_host"}
    np.testing.assert_array_equal(np.asarray(spilled[1].v[:, :, 0]), np.asarray(cache.v[:, :, 9]))
    for fn, args in ((mover._gathers[4], (cache, tables, jnp.int32(1))), (mover._gathers["spill", 4],
                                                                          (cache, jnp.zeros(4, jnp.int32)))):
        text = fn.lower(*args).as_text()
        assert "annotate_device_placement" in text and 'mhlo.memory_kind = "pinned_host"' in text
    ok, slot, zero = jnp.bool_(True), jnp.int32(2), jnp.int32(0)
    lowered = mover._scatter.lower(cache, tables, block, ok, slot, zero, jnp.int32(16), page_size=4)
    assert 'mhlo.memory_kind = "pinned_host"' in lowered.as_text(), "the block argument stays in host memory"
    mem = lowered.compile().memory_analysis()
    assert mem.alias_size_in_bytes >= pool_bytes and mem.temp_size_in_bytes < pool_bytes // 4
    pos = jnp.asarray([0, 3, 1, -1], jnp.int32)
    lowered = mover._scatter_pages.lower(cache, tables, tuple(spilled) + (spilled[0],), ok, slot, pos)
    assert 'mhlo.memory_kind = "pinned_host"' in lowered.as_text()
    mem = lowered.compile().memory_analysis()
    assert mem.alias_size_in_bytes >= pool_bytes and mem.temp_size_in_bytes < pool_bytes // 4
    out = mover._scatter(cache, tables, block, ok, slot, zero, jnp.int32(16), page_size=4)   # the block into slot 2
    np.testing.assert_array_equal(np.asarray(out.k[:, :, np.asarray(tables[2, :4])]), want)
