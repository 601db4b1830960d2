"""The unified engine step (chunked prefill over a token budget) against the separate-call engine.

The separate engine (EngineConfig(chunked_prefill=False): bucketed prefill calls, then the decode
loop) is the reference: with the same model and requests, the unified step must give the same
tokens, whatever the budget, the pool pressure (preemption of prefilling requests) or the mix of
prompt lengths, and compile exactly one program.
"""

import dataclasses

import numpy as np
import pytest

import models
from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.engine.scheduler import Scheduler
from jpa.engine.detokenizer import IncrementalDetokenizer
from jpa.engine.request import Request
from models.tokenizer import ByteTokenizer

GREEDY = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.load("tiny-llama", seed=4)
    return models.GPTForEngine(model), tok


def make(tiny, **kw):
    model, tok = tiny
    cfg = dict(max_seqs=4, page_size=8, num_pages=64, steps_per_call=4, max_model_len=192)
    cfg.update(kw)
    return LLMEngine(model, tok, EngineConfig(**cfg))


def random_prompts(rng, n, vocab, lo=1, hi=100):
    """Token-id prompts of random lengths in [lo, hi] (crossing pages and any budget)."""
    return [rng.integers(3, vocab, rng.integers(lo, hi + 1)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def case(tiny):
    """Fresh random prompts and their outputs from the separate engine (the reference)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, 7, tiny[0].config.vocab_size)
    params = [dataclasses.replace(GREEDY, max_new_tokens=int(rng.integers(1, 30))) for _ in prompts]
    ref = make(tiny, chunked_prefill=False).generate(prompts, params)
    return seed, prompts, params, [o.token_ids for o in ref]


def compiled_once(eng):
    r = eng.runner
    return (r.step_traces, r.decode_traces, r.prefill_traces) == (1, 0, 0)


@pytest.mark.parametrize("budget,block", [(4, None), (16, None), (64, 8), (37, 5)])
def test_unified_equals_separate_at_any_budget(tiny, case, budget, block):
    """block: rows per model pass of the ragged step (chunks cut at block boundaries too)."""
    seed, prompts, params, want = case
    eng = make(tiny, max_num_batched_tokens=budget, ragged_block_tokens=block)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got == want, f"seed {seed}"
    assert compiled_once(eng), "one compiled program, whatever the prompt lengths"
    assert eng.pool_is_whole()
    assert eng.stats.prefill_tokens == sum(len(p) for p in prompts), "each prompt token computed once"


def test_preempting_prefilling_requests_keeps_outputs(tiny, case):
    seed, _, _, _ = case
    rng = np.random.default_rng(seed)
    # 16 pages of 8 tokens for 4 slots of 20-50-token prompts growing by 40 tokens: running and
    # prefilling requests are preempted (every draw of lengths needs more than the pool).
    prompts = random_prompts(rng, 6, tiny[0].config.vocab_size, lo=20, hi=50)
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    eng = make(tiny, num_pages=16, watermark=0.0, max_num_batched_tokens=8)
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    ref = make(tiny, num_pages=16, watermark=0.0, chunked_prefill=False).generate(prompts, params)
    assert outs == [o.token_ids for o in ref], f"seed {seed}"
    assert eng.stats.preemptions > 0
    assert eng.pool_is_whole() and compiled_once(eng)


def test_seeded_sampling_and_stops_equal_separate(tiny, case):
    seed, prompts, _, _ = case
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=seed + i,
                             stop=("e",) if i % 3 == 0 else ()) for i in range(len(prompts))]
    got = make(tiny, max_num_batched_tokens=16).generate(prompts, params)
    want = make(tiny, chunked_prefill=False).generate(prompts, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason, g.completion) == (w.token_ids, w.finish_reason, w.completion), \
            f"seed {seed}"
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-4, atol=1e-4)


def test_long_prompt_does_not_stall_running_decodes(tiny):
    """A prompt 8x the budget spans 8+ rounds; a running request gets one token in every one."""
    rng = np.random.default_rng()
    vocab = tiny[0].config.vocab_size
    eng = make(tiny, max_num_batched_tokens=16, max_model_len=256)
    short = eng.add_request(rng.integers(3, vocab, 5).tolist(), SamplingParams(max_new_tokens=60, greedy=True,
                                                                               ignore_eos=True))
    while not short.output_ids:
        eng.step()
    long = eng.add_request(rng.integers(3, vocab, 128).tolist(), GREEDY)
    gained = []
    while not long.output_ids:
        before = len(short.output_ids)
        eng.step()
        gained.append(len(short.output_ids) - before)
    # 128 prompt tokens, 16 - 1 per round next to the decoding request; one decode token per
    # round while the prompt is prefilled, then the round of its last chunk runs the decode loop.
    assert len(gained) == -(-128 // 15)
    assert gained == [1] * (len(gained) - 1) + [eng.config.steps_per_call]
    while eng.has_unfinished:
        eng.step()
    assert eng.pool_is_whole()


def test_abort_while_prefilling_frees_its_pages(tiny):
    rng = np.random.default_rng()
    eng = make(tiny, max_num_batched_tokens=8)
    req = eng.add_request(rng.integers(3, 200, 100).tolist(), GREEDY)
    eng.step()
    eng.step()
    assert eng.scheduler.prefilling and eng.scheduler.free_pages < eng.num_pages
    assert eng.abort(req.request_id)
    outs = eng.step()
    assert [o.output.finish_reason for o in outs] == ["abort"] and not req.output_ids
    assert eng.pool_is_whole()


def test_budget_below_max_seqs_is_refused(tiny):
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_seqs"):
        EngineConfig(max_seqs=8, max_num_batched_tokens=4)
    EngineConfig(max_seqs=8, max_num_batched_tokens=4, chunked_prefill=False)  # unused there


def test_model_without_ragged_needs_separate_calls(tiny):
    class NoRagged:
        def __init__(self, inner):
            self.config, self.dtype, self.params = inner.config, inner.dtype, inner.params
            self.prefill, self.decode = inner.prefill, inner.decode

    model, tok = tiny
    with pytest.raises(TypeError, match="needs a model with ragged"):
        LLMEngine(NoRagged(model), tok, EngineConfig(max_seqs=2, num_pages=16, page_size=8))
    eng = LLMEngine(NoRagged(model), tok, EngineConfig(max_seqs=2, num_pages=16, page_size=8,
                                                       chunked_prefill=False, max_model_len=64))
    assert len(eng.generate(["hello"], GREEDY)[0].token_ids) == 24


# ---------------------------------------------------------------- the planner alone (no device)


def scheduler(**kw):
    args = dict(max_seqs=4, page_size=4, num_pages=32, max_model_len=128, steps_per_call=4, watermark=0.0,
                max_prefill_tokens=64)
    args.update(kw)
    return Scheduler(**args)


def request(i, n):
    r = Request(i, "", list(range(1, n + 1)), GREEDY)
    r.detokenizer = IncrementalDetokenizer(ByteTokenizer(), ())
    return r


def test_plan_decode_first_then_chunks_in_admission_order():
    s = scheduler()
    for i, n in enumerate((10, 3, 20)):
        s.add(request(i, n))
    plan = s.plan_round(8)
    assert [(e.slot, e.q_len, e.final) for e in plan.entries] == [(0, 8, False)]
    assert plan.decode_steps == 0, "prompt work is left: no decode steps after the ragged step"
    s.set_pages(s.num_pages - 2, [8, 0, 0, 0])
    plan = s.plan_round(8)
    # The first prompt ends (2 tokens), the second is admitted whole (3), the third starts (3).
    assert [(e.slot, e.q_len, e.final) for e in plan.entries] == [(0, 2, True), (1, 3, True), (2, 3, False)]
    assert plan.entries[0].tokens == tuple(range(9, 11))
    s.set_pages(s.num_pages - 3 - 1 - 1, [10, 3, 3, 0])
    s.stepped(plan, [7, 7, 0], [0.0] * 3, np.full((0, 4), -1), np.zeros((0, 4)), [True] * 4)
    plan = s.plan_round(8)
    assert [(e.slot, e.decode, e.q_len) for e in plan.entries] == [(0, True, 1), (1, True, 1), (2, False, 6)]
    assert plan.num_prompt_tokens == 6


def test_plan_without_prompt_work_is_decode_only():
    s = scheduler()
    s.add(request(0, 3))
    plan = s.plan_round(8)
    assert plan.decode_steps == 3, "the last chunk: steps_per_call - 1 decode steps follow"
    s.set_pages(31, [3, 0, 0, 0])
    s.stepped(plan, [5], [0.0], np.full((3, 4), -1), np.zeros((3, 4)), [True] * 4)
    plan = s.plan_round(8)
    assert plan.entries == () and plan.decode_steps == 4


def test_plan_chunk_fits_the_free_pages():
    s = scheduler()
    s.add(request(0, 30))
    plan = s.plan_round(10)
    assert [e.q_len for e in plan.entries] == [10]
    # 3 pages hold the 10 tokens (2 slots spare in the last); with 1 page free the next chunk is 2 + 4.
    s.set_pages(1, [10, 0, 0, 0])
    plan = s.plan_round(64)
    assert [e.q_len for e in plan.entries] == [6]
    s.set_pages(0, [8, 0, 0, 0])
    assert s.plan_round(64).entries == (), "no free page, full last page: no chunk this round"


def test_unplan_puts_admissions_back_in_order():
    s = scheduler()
    for i in range(3):
        s.add(request(i, 5))
    plan = s.plan_round(64)
    assert plan.admitted == (0, 1, 2) and not s.waiting
    s.unplan(plan)
    assert [r.request_id for r in s.waiting] == [0, 1, 2] and not s.running and not s.prefilling
