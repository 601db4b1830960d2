"""The step-shape ladder (`jpa.engine.ladder`, EngineConfig.step_shapes): each round runs the smallest
compiled shape that holds it, with the full shape's outputs, donation and one program per shape."""

import threading

import jax
import numpy as np
import pytest

from jpa import models
from jpa.args import EngineArgs, UsageError
from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.engine.batch import make_step_batch
from jpa.engine.ladder import Ladder
from jpa.engine.shapes import StepShape, step_ladder
from jpa.testing.engine import LOGPROB_ATOL

CFG = dict(max_seqs=8, page_size=4, num_pages=128, max_model_len=96, max_num_batched_tokens=64, steps_per_call=3)


def test_automatic_ladder_doubles_rows_and_caps_at_the_full_shape():
    assert step_ladder("ladder", 8, 64) == (StepShape(1, 16), StepShape(2, 32), StepShape(4, 64), StepShape(8, 64))
    assert step_ladder("ladder", 32, 512)[-2:] == (StepShape(16, 256), StepShape(32, 512))
    assert step_ladder("ladder", 6, 6) == (StepShape(1, 6), StepShape(2, 6), StepShape(4, 6), StepShape(6, 6))
    assert step_ladder("off", 8, 64) == (StepShape(8, 64),)
    assert step_ladder([(2, 8), [1, 4]], 8, 64) == (StepShape(1, 4), StepShape(2, 8), StepShape(8, 64))


@pytest.mark.parametrize("bad, rule", [
    ("stairs", "must be 'ladder', 'off' or a sequence"), ([(1,)], "must be 'ladder', 'off' or a sequence"),
    ([(0, 16)], "must be 'ladder', 'off' or a sequence"), ([(9, 64)], "rows <= max_seqs"),
    ([(2, 128)], "tokens <= max_num_batched_tokens"), ([(4, 2)], "rows <= tokens")])
def test_bad_step_shapes_are_refused_naming_the_rule(bad, rule):
    with pytest.raises(ValueError, match="EngineConfig.step_shapes") as e:
        EngineConfig(**CFG, step_shapes=bad)
    assert rule in str(e.value)


def test_step_shapes_flag_parses_and_refuses():
    assert EngineArgs(step_shapes="1:16,4:64").engine_config().step_shapes == ((1, 16), (4, 64))
    assert EngineArgs().engine_config().step_shapes == "ladder"
    with pytest.raises(UsageError, match="--step-shapes must be ladder, off or rows:tokens"):
        EngineArgs(step_shapes="1x16").check()
    with pytest.raises(UsageError, match="rows <= max_seqs"):
        EngineArgs(step_shapes="64:64", max_seqs=8).engine_config()


def test_ladder_picks_the_smallest_ready_shape_and_never_waits_for_one():
    """Until the thread has compiled a shape, rounds that it would hold run on a larger ready one
    (the full shape at worst): a cold start waits for the full shape alone."""
    shapes = step_ladder("ladder", 8, 64)
    release, compiled = threading.Event(), []

    def compile(shape, background=False):
        if background:
            release.wait(10)
        compiled.append((shape, background))
        return f"exe{shape.rows}"

    lad = Ladder(shapes, compile)
    assert lad.get(lad.full) == "exe8" and lad.pick(1, 3) == lad.full   # nothing else ready
    lad.start()
    assert lad.pick(1, 3) == lad.full and lad.pick(3, 40) == lad.full   # the thread is held at its first shape
    release.set()
    assert lad.wait(10)
    assert [lad.pick(*w) for w in ((1, 3), (1, 16), (1, 17), (2, 1), (3, 40), (5, 8))] == [
        StepShape(1, 16), StepShape(1, 16), StepShape(2, 32), StepShape(2, 32), StepShape(4, 64), StepShape(8, 64)]
    assert compiled == [(lad.full, False)] + [(s, True) for s in shapes[:-1]]   # one compile per shape
    assert lad.background_compiles == 3 and lad.error is None


def test_a_small_shape_batch_carries_the_held_slots():
    """make_step_batch at a ladder shape: B = its rows, T = its tokens, the loop's slots are the held
    ones; the release list stays max_seqs long; a plan holding more slots than the shape is refused."""
    from jpa.engine.shapes import EngineShapes

    shapes = EngineShapes(max_seqs=8, page_size=4, num_pages=16, pages_per_seq=8, max_model_len=32, num_tokens=64,
                          steps_per_call=2, vocab_size=64)
    plan = type("Plan", (), dict(entries=(), evict=(), decode_steps=2, held=(1, 6), release=(0, 2, 3, 4, 5)))
    b = make_step_batch(plan, shapes, shape=StepShape(2, 32))
    assert b.rows.seq_ids.shape == (2,) and b.rows.tokens.shape == (32,) and b.pages.release.shape == (8,)
    assert list(b.loop_slots) == [1, 6] and list(b.pages.release[:6]) == [0, 2, 3, 4, 5, -1]
    with pytest.raises(ValueError, match="needs the plan's held slots, at most 1"):
        make_step_batch(plan, shapes, shape=StepShape(1, 16))


# ---------------------------------------------------------------------------- the engine (compiles: bench tier)

@pytest.fixture(scope="module")
def tiny():
    gpt, tok = models.load("tiny-llama", seed=3)
    return models.GPTForEngine(gpt), tok


def staggered(eng, prompts, params):
    """One request first (alone), then the others one a round: {request id: (tokens, logprobs)} and
    the step shapes the rounds ran."""
    shapes, step = [], eng.runner.step

    def spy(batch):
        shapes.append(StepShape(batch.rows.seq_ids.shape[0], batch.rows.tokens.shape[0]))
        return step(batch)

    eng.runner.step = spy
    got = {}

    def take(outs):
        for o in outs:
            toks, lps = got.setdefault(o.request_id, ([], []))
            toks += o.new_token_ids
            lps += o.new_logprobs

    eng.add_request(prompts[0], params[0])
    take(eng.step())
    eng.runner.ladder.wait()   # the test compares outputs at every shape: all of them ready
    for p, sp in zip(prompts[1:], params[1:]):
        eng.add_request(p, sp)
        take(eng.step())
    while eng.has_unfinished:
        take(eng.step())
    eng.runner.step = step
    return got, shapes


@pytest.mark.bench
@pytest.mark.parametrize("case", ["plain", "ngram", "samples"])
def test_ladder_outputs_equal_the_full_shape(tiny, case):
    """Fresh random prompts and sampling parameters (seeded, top logprobs) through an engine with one
    shape and one with the ladder: the same tokens, logprobs within f32 rounding (the shapes' matmuls
    have other row counts), on several shapes; one program per shape, donated state at each. Cases:
    plain decoding, n-gram speculation (repetitive prompts), parallel samples (n = 2, forked pages)
    of prompts sharing a prefix (prefix-cache hits)."""
    rng = np.random.default_rng()
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}' if case == "ngram" else None
    word = lambda lo, hi, k=26: "".join(chr(97 + x) for x in rng.integers(0, k, rng.integers(lo, hi)))  # noqa: E731
    shared = word(16, 24)
    prompts = [word(6, 20, 8) * 2 if case == "ngram" else (shared + word(2, 10) if case == "samples" else word(6, 40))
               for _ in range(6)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(6, 16)), temperature=float(rng.uniform(0.3, 1.0)),
                             seed=int(rng.integers(1 << 30)), top_logprobs=3, n=2 if case == "samples" else 1)
              for _ in prompts]
    cfg = dict(CFG, speculative=spec)
    full, _ = staggered(LLMEngine(*tiny, EngineConfig(**cfg)), prompts, params)
    eng = LLMEngine(*tiny, EngineConfig(**cfg, step_shapes="ladder"))
    got, shapes = staggered(eng, prompts, params)
    assert got.keys() == full.keys()
    for rid in full:
        assert got[rid][0] == full[rid][0], rid
        np.testing.assert_allclose(got[rid][1], full[rid][1], atol=LOGPROB_ATOL, rtol=0)
    # At least one smaller shape served rounds (which ones depends on when the random requests finish: a run of
    # forked samples can hold 4 or 8 slots to its end)
    assert len(set(shapes) - {eng.runner.ladder.full}) >= 1, shapes
    # One program per shape: the full one traced for the first round, each other once by the thread.
    lad = eng.runner.ladder
    assert set(lad.exes) == set(lad.shapes) and eng.runner.step_traces == 1
    assert eng.runner.ladder_traces == lad.background_compiles == len(lad.shapes) - 1
    cache_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(eng.runner.cache))
    for shape, exe in lad.exes.items():
        mem = exe.memory_analysis()
        assert mem.alias_size_in_bytes >= cache_bytes, shape   # the pool is donated and aliased at each shape
    old = jax.tree_util.tree_leaves((eng.runner.cache, eng.runner.page_state, eng.runner.slots))
    eng.add_request(prompts[0], SamplingParams(max_new_tokens=2))
    eng.step()
    assert all(a.is_deleted() for a in old)
    while eng.has_unfinished:
        eng.step()
    assert eng.pool_is_whole()
