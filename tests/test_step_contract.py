"""The contract between the scheduler's plan and the compiled step: StepBatch in, StepResult out,
and a round whose pages cannot be reserved changes nothing on the device (fault injection)."""

import functools

import jax
import numpy as np
import pytest

from jpa import models
from jpa.engine import Phase, SamplingParams, SlotParams
from jpa.engine.batch import StepBatch, make_step_batch
from jpa.engine.shapes import EngineShapes
from jpa.testing.engine import Engines

CFG = dict(max_seqs=4, page_size=4, num_pages=48, max_model_len=96, max_num_batched_tokens=16, steps_per_call=3)


@pytest.fixture(scope="module")
def tiny():
    gpt, tok = models.load("tiny-llama", seed=3)
    return models.GPTForEngine(gpt), tok


@pytest.fixture(scope="module")
def engines(tiny):
    """The module's engines: one per config (CFG updated), compiled once, handed out settled."""
    return Engines(*tiny, base=CFG)


def prompts(rng, n):
    return ["".join(chr(97 + x) for x in rng.integers(0, 26, rng.integers(6, 30))) for _ in range(n)]


def test_step_batch_has_the_legend_shapes(engines):
    eng = engines.get()
    for p in prompts(np.random.default_rng(0), 3):
        eng.add_request(p, SamplingParams(max_new_tokens=4, temperature=0.7, seed=5))
    plan = eng.scheduler.plan_round(CFG["max_num_batched_tokens"])
    assert eng.shapes == EngineShapes(max_seqs=4, page_size=4, num_pages=eng.num_pages,
                                      pages_per_seq=eng.pages_per_seq, max_model_len=eng.max_model_len, num_tokens=16,
                                      steps_per_call=3, vocab_size=eng.model.config.vocab_size)
    batch = make_step_batch(plan, eng.shapes)
    assert isinstance(batch, StepBatch) and isinstance(batch.sampling.params, SlotParams)
    b, t = 4, 16
    for name, shape in {"rows.seq_ids": (b,), "rows.q_lens": (b,), "rows.decode_row": (b,), "rows.final": (b,),
                        "rows.tokens": (t,), "rows.fork_from": (b,), "prompt.targets": (t,),
                        "sampling.num_generated": (b,), "sampling.resume_token": (b,), "pages.hit_tokens": (b,),
                        "pages.hit_tables": (b, eng.pages_per_seq), "pages.cache_upto": (b,),
                        "pages.evict": (eng.num_pages,), "structured.allowed": (b, eng.model.config.vocab_size // 32),
                        "structured.constrained": (b,), "run_ragged": (), "decode_steps": ()}.items():
        assert functools.reduce(getattr, name.split("."), batch).shape == shape, name
    rows, params = batch.rows, batch.sampling.params
    n = len(plan.entries)
    assert n and sum(rows.q_lens) == sum(e.q_len for e in plan.entries) <= t
    assert list(rows.seq_ids[:n]) == [e.slot for e in plan.entries] and (rows.seq_ids[n:] == -1).all()
    # Final chunks carry their request's parameters; every other row is padding (top_p 1 = off).
    for i, e in enumerate(plan.entries):
        assert params.temperature[i] == (np.float32(0.7) if e.final else 0.0)
    assert (params.top_p[n:] == 1.0).all()
    eng.scheduler.unplan(plan)
    while eng.has_unfinished:   # run them out: the engine is the module's, shared with later tests
        eng.step()


def test_a_failed_reservation_changes_nothing_on_the_device(engines):
    """Regression: a round whose reservation failed still ran its decode steps and its evictions,
    so the device held tokens the host never saw. Fault injection: the host is told the pool has
    more free pages than it does, plans past it, and the round must leave the device as it was."""
    rng = np.random.default_rng(7)
    # Two 17-token prompts hold 10 of the 12 pages once prefilled: any chunk of another prompt the
    # host admits (up to 14 tokens, 4 pages) cannot be reserved.
    ps = ["".join(chr(97 + x) for x in rng.integers(0, 26, 17 if i < 2 else 20)) for i in range(6)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(6)]
    eng = engines.get(num_pages=12)
    ref = eng.generate(ps, params)   # the same engine before the fault: the reference run
    eng = engines.get(num_pages=12)
    for i, (p, sp) in enumerate(zip(ps[:2], params[:2])):
        eng.add_request(p, sp, request_id=i)
    out = {}
    for _ in range(3):   # two requests decoding
        out.update({o.request_id: o.output for o in eng.step() if o.finished})
    assert eng.scheduler.phase_count(Phase.DECODING) == 2
    before_device = jax.device_get((eng.runner.page_state, eng.runner.slots))
    before_host = {s: (r.num_computed_tokens, list(r.output_ids)) for s, r in eng.scheduler.running.items()}
    for i, (p, sp) in enumerate(zip(ps[2:], params[2:])):
        eng.add_request(p, sp, request_id=i + 2)
    truth = eng.scheduler.free_pages
    assert truth <= 2
    eng.scheduler.free_pages = 10 * eng.num_pages            # the fault: the host believes in 120 free pages
    with pytest.raises(RuntimeError, match="could not reserve pages"):
        eng.step()
    after_device = jax.device_get((eng.runner.page_state, eng.runner.slots))
    for a, b in zip(jax.tree_util.tree_leaves(before_device), jax.tree_util.tree_leaves(after_device)):
        np.testing.assert_array_equal(a, b)
    assert {s: (r.num_computed_tokens, list(r.output_ids)) for s, r in eng.scheduler.running.items()} == before_host
    assert [r.request_id for r in eng.scheduler.waiting] == [2, 3, 4, 5]   # admitted ones are back, in order
    eng.scheduler.free_pages = truth
    eng.check_page_state()
    while eng.has_unfinished:
        out.update({o.request_id: o.output for o in eng.step() if o.finished})
        eng.check_page_state()
    for i, r in enumerate(ref):
        got = out[i]
        assert got.token_ids == r.token_ids
        np.testing.assert_allclose(got.logprobs, r.logprobs, atol=1e-5)
    assert eng.pool_is_whole()


def test_a_group_id_stays_taken_until_every_sample_is_out(engines):
    """Regression: add_request(request_id="x", n=2) twice was accepted while the first ran; two
    live requests shared the ids ("x", 0) and ("x", 1), and the first to finish made
    has_unfinished False while the other still held slots and pages."""
    eng = engines.get()
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=1, n=2)
    eng.add_request("abcdefgh", sp, request_id="x")
    with pytest.raises(ValueError, match="already used"):
        eng.add_request("ijklmnop", sp, request_id="x")
    with pytest.raises(ValueError, match="already used"):
        eng.add_request("ijklmnop", request_id=("x", 1))
    with pytest.raises(ValueError, match="already used"):   # a group whose sample ids are taken
        eng.add_request("ijklmnop", SamplingParams(n=3), request_id="x")
    done = []
    while eng.has_unfinished:
        done += [o.request_id for o in eng.step() if o.finished]
    assert sorted(done) == [("x", 0), ("x", 1)] and eng.pool_is_whole()
    eng.add_request("ijklmnop", sp, request_id="x")          # free again
    while eng.has_unfinished:
        eng.step()
    assert eng.pool_is_whole()


def test_the_prefix_key_table_holds_no_more_keys_than_cached_pages():
    """Regression: keys were never dropped; 1,000 register/evict cycles left 2,000 keys."""
    from jpa.kv.prefix_cache import PrefixCache

    rng = np.random.default_rng(11)
    cache, page = PrefixCache(4), 0
    for _ in range(1000):
        tokens = rng.integers(0, 50, 9).tolist()              # two full pages
        cache.register(tokens, [page, page + 1])
        assert cache.lookup(tokens + [1]) == [page, page + 1]
        cache.forget(cache.victims(2, referenced=set()))
        page += 2
        assert cache.num_keys <= len(cache.cached) <= 2
    assert cache.num_keys == 0 and not cache.page_of
    # A key whose parent was evicted (and re-registered under a new id) is never matched.
    a = rng.integers(0, 50, 8).tolist()
    cache.register(a, [1, 2])
    cache.forget([1])                                          # the parent page goes
    cache.register(a[:4], [3])                                 # the same first page, a new key id
    assert cache.lookup(a + [0]) == [3]                        # page 2's key hangs off the old id


def test_engines_whose_programs_are_equal_share_one_compiled_step(engines):
    """A second engine whose step lowers to the same program reuses the first one's executable
    (runner.STEP_EXECUTABLES) instead of compiling: params are arguments of the program, so it
    serves another model's weights of the same shapes, and its greedy tokens and logprobs are that
    model's dense ones."""
    import jax
    import jax.numpy as jnp

    from jpa.engine import EngineConfig, LLMEngine
    from jpa.testing.engine import context_gpt, run

    first = engines.get()   # the module's engine of CFG (compiled here or by an earlier test)
    gpt, tok = context_gpt(seed=int(np.random.default_rng().integers(100, 1 << 20)))   # tiny-llama's shapes
    ps = prompts(np.random.default_rng(), 3)
    params = SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True)
    got_first = run(first, ps, params)
    shared = LLMEngine(models.GPTForEngine(gpt), tok, EngineConfig(**CFG))
    got_shared = run(shared, ps, params)
    assert shared.runner.step_source == "process" and shared.runner.compiles == 1
    assert shared.runner.compiled_step is first.runner.compiled_step
    for out in got_shared:
        seq = list(out.prompt_ids) + list(out.token_ids)
        dense = np.asarray(jax.nn.log_softmax(models.forward_dense(gpt, jnp.asarray([seq[:-1]]))[0], -1))
        n = len(out.prompt_ids)
        assert list(out.token_ids) == [int(np.argmax(dense[n - 1 + i])) for i in range(len(out.token_ids))]
        np.testing.assert_allclose(out.logprobs, [dense[n - 1 + i, t] for i, t in enumerate(out.token_ids)],
                                   rtol=0, atol=1e-4)
    assert not np.allclose(got_first[0].logprobs, got_shared[0].logprobs, atol=1e-3)   # other weights, not baked in


def test_own_pages_count_exactly_what_a_release_frees():
    """`ragged_step.own_pages` against the allocator: for every set of slots of a pool with prefix-cached
    pages, a forked sequence (shared prompt pages and a shared partly filled last page) and private
    pages, releasing the set frees exactly the sum of its slots' `own` when at most one of them is
    `shared`, and at least that sum otherwise (the scheduler then flushes: `Scheduler.release_is_exact`)."""
    import itertools

    import jax.numpy as jnp

    from jpa.engine.ragged_step import own_pages
    from jpa.kv import pages

    @jax.jit
    def pool():
        st = pages.init(24, 5, 6, 4)
        st, ok = pages.reserve(st, jnp.arange(3), jnp.asarray([10, 7, 4]))   # 3, 2, 1 pages
        st = pages.cache(st, jnp.asarray([0]), jnp.asarray([2]))               # slot 0's two full pages cached
        st, ok2 = pages.share(st, jnp.asarray([3]), st.block_tables[:1], jnp.asarray([8]))   # slot 3 shares them
        st, ok3 = pages.reserve(st, jnp.asarray([3]), jnp.asarray([9]))       # and takes a page of its own
        st, ok4 = pages.fork(st, jnp.asarray([1]), jnp.asarray([4]))          # slot 4 forks slot 1 (7 tokens)
        return st, ok & ok2 & ok3 & ok4, own_pages(st)

    st, ok, (own, shared) = pool()
    assert bool(ok)
    own, shared = np.asarray(own), np.asarray(shared)
    assert own.tolist() == [1, 0, 1, 1, 0] and shared.tolist() == [False, True, False, False, True]
    subsets = [c for k in range(1, 6) for c in itertools.combinations(range(5), k)]
    ids = np.asarray([list(c) + [-1] * (5 - len(c)) for c in subsets], np.int32)
    freed = np.asarray(jax.jit(jax.vmap(lambda i: pages.release(st, i).num_free))(ids)) - int(st.num_free)
    checked_inexact = 0
    for subset, got in zip(subsets, freed):
        counted = int(own[list(subset)].sum())
        if shared[list(subset)].sum() <= 1:
            assert got == counted, subset
        else:
            checked_inexact += 1
            assert got >= counted, subset
    assert checked_inexact


def _recorded_run(eng, prompts_, params, *, flush_each_round: bool):
    """Runs prompts on eng round by round; returns (outputs by request, plans, device calls per round,
    retire calls). flush_each_round: release after every round as a call of its own (the engine
    before releases rode in the next StepBatch)."""
    calls = {"step": 0, "retire": 0}
    runner, schedule = eng.runner, eng.schedule
    originals = {k: getattr(runner, k) for k in calls}

    def counting(kind):
        def call(*a):
            calls[kind] += 1
            return originals[kind](*a)
        return call

    plans = []
    eng.schedule = lambda: plans.append(schedule()) or plans[-1]
    for k in calls:
        setattr(runner, k, counting(k))
    out, per_round = {}, []
    try:
        for i, (p, sp) in enumerate(zip(prompts_, params)):
            eng.add_request(p, sp, request_id=i)
        while eng.has_unfinished:
            before = dict(calls)
            out.update({o.request_id: o.output for o in eng.step() if o.finished})
            if flush_each_round:
                eng.flush_releases()
            per_round.append((calls["step"] - before["step"], calls["retire"] - before["retire"]))
            eng.check_page_state()
    finally:
        del eng.schedule
        for k in calls:
            delattr(runner, k)
    summary = [(tuple((e.slot, e.q_len, e.decode, e.final, e.tokens, e.hit_pages, e.fork_of, e.cache_upto)
                      for e in p.entries), p.decode_steps, p.admitted, p.evict) for p in plans]
    return out, summary, [p.release for p in plans], per_round


def test_a_stop_string_release_rides_in_the_next_step(tiny):
    """A round that releases a request its stop string finished (or a preempted one) makes ONE
    device call: the release rides in the next round's StepBatch (`RoundPlan.release`) and the
    plan counts what it frees from the device's per-slot counts. Every plan, output and logprob
    equals the engine's that releases after each round with a call of its own (`flush_releases`),
    on a seeded workload that preempts (two 17-token prompts outgrow the 12-page pool together) and
    stops on stop strings (taken from a first run's text)."""
    from jpa.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(**{**CFG, "num_pages": 12})
    rng = np.random.default_rng(7)
    ps = ["".join(chr(97 + x) for x in rng.integers(0, 26, 17 if i < 2 else 20)) for i in range(6)]
    plain = [SamplingParams(max_new_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
             for i in range(6)]
    first = LLMEngine(*tiny, cfg)
    texts = [o.completion for o in first.generate(ps, plain)]
    params = [sp if i < 2 or len(texts[i]) < 8 else replace_stop(sp, texts[i][5:7]) for i, sp in enumerate(plain)]
    folded, plans, releases, rounds = _recorded_run(first, ps, params, flush_each_round=False)
    second = LLMEngine(*tiny, cfg)
    second.generate(ps, plain)   # the same device state to start from
    flushed, plans2, releases2, rounds2 = _recorded_run(second, ps, params, flush_each_round=True)
    assert first.runner.compiled_step is second.runner.compiled_step
    assert plans == plans2
    for i in range(6):
        assert folded[i].token_ids == flushed[i].token_ids and folded[i].finish_reason == flushed[i].finish_reason
        np.testing.assert_array_equal(folded[i].logprobs, flushed[i].logprobs)
    assert sum(o.finish_reason == "stop" for o in folded.values()) >= 2
    assert first.stats.preemptions > 0 and first.stats.preemptions == second.stats.preemptions
    assert any(releases) and not any(releases2)          # released in the step / by a call of its own
    assert all(r == (1, 0) for r in rounds)               # one device call per round, no release call
    assert sum(r for _, r in rounds2) >= sum(1 for r in releases if r)


def replace_stop(sp, stop):
    from dataclasses import replace

    return replace(sp, stop=(stop,))
