"""Recurrent state as a cache group (`jpa.engine.states`): the engine allocates state slots beside the paged pool
and threads them through its step, and a hybrid model's outputs equal a run of each sequence alone.

The model is `jpa.testing.recurrent.TinyHybrid` (two recurrent layers with a conv window and a decaying sum,
two paged attention layers); the reference (`reference_logprobs`) computes each sequence alone in float64
numpy. Every comparison is of per-token logprobs (and the greedy choice), on fresh random prompts.
"""

import dataclasses

import numpy as np
import pytest

from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.engine.speculative import SpeculativeConfig
from jpa.kv.cache import CacheConfig
from jpa.kv.spec import CacheGroup, CacheSpec, FullAttention, RecurrentState
from jpa.models.tokenizer import ByteTokenizer
from jpa.testing.engine import fresh_seed, run
from jpa.testing.recurrent import HybridConfig, TinyHybrid, reference_logits, reference_logprobs

ATOL = 1e-4   # float32 engine against the float64 reference
BASE = dict(max_seqs=4, page_size=8, num_pages=64, max_model_len=128, steps_per_call=4, watermark=0.0,
            max_num_batched_tokens=32, prefix_caching=False)

_MODEL = {}
_ENGINES = {}


def _model(hidden_pair: bool = True) -> TinyHybrid:
    if hidden_pair not in _MODEL:
        _MODEL[hidden_pair] = TinyHybrid(7, hidden_pair=hidden_pair)
    return _MODEL[hidden_pair]


def _engine(hidden_pair: bool = True, **kw) -> LLMEngine:
    """An engine over the tiny hybrid, built once per configuration (a compiled step serves every test)."""
    key = (hidden_pair, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        _ENGINES[key] = LLMEngine(_model(hidden_pair), ByteTokenizer(), EngineConfig(**{**BASE, **kw}))
    eng = _ENGINES[key]
    assert not eng.has_unfinished and eng.pool_is_whole()
    return eng


def _rng():
    seed = fresh_seed()
    print("seed", seed)
    return np.random.default_rng(seed)


def _prompts(rng, n, lo=1, hi=70):
    return [rng.integers(3, 256, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _greedy(rng, n, lo=1, hi=12):
    return [SamplingParams(max_new_tokens=int(rng.integers(lo, hi + 1)), greedy=True, ignore_eos=True)
            for _ in range(n)]


def assert_reference(model, prompt, out, *, greedy=True, where=""):
    """out's tokens have the logprobs the sequence has alone; a greedy token is the best (within ATOL)."""
    lp, best = reference_logprobs(model, prompt, out.token_ids)
    got = np.asarray(out.logprobs, np.float64)
    np.testing.assert_allclose(got, lp, rtol=0, atol=ATOL, err_msg=f"{where} logprobs differ from a run alone")
    if greedy:
        assert np.all(lp >= best - ATOL), f"{where} a greedy token is not the best of the run alone"


def test_outputs_equal_each_sequence_run_alone():
    """Requests of different lengths (prompts longer than the token budget are chunked; more requests than
    slots, so slots are reused) give each sequence's own logprobs, greedy tokens and prompt logprobs."""
    rng, model = _rng(), _model()
    eng = _engine()
    prompts = _prompts(rng, 7)
    params = _greedy(rng, 7)
    params[0] = dataclasses.replace(params[0], prompt_logprobs=0)
    states = eng.runner.cache.states["linear"]["ssm"]
    outs = run(eng, prompts, params)
    assert states.is_deleted(), "the state slots must be donated into the step (updated in place)"
    for k, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o.token_ids) == params[k].max_new_tokens
        assert_reference(model, p, o, where=f"request {k}")
    if len(prompts[0]) > 1:   # the hidden rows of every prompt position, through the state too
        want, _ = reference_logprobs(model, prompts[0][:1], prompts[0][1:])
        got = [e.logprob for e in outs[0].prompt_logprobs[1:]]
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert eng.summary()["step_compiles"] == 1


def test_neighbouring_slots_keep_their_own_state():
    """Two requests of the same length with different prompts, admitted together into neighbouring slots: a
    state read from or written to the other's slot would give it the other's context."""
    rng, model = _rng(), _model()
    eng = _engine()
    a = rng.integers(3, 256, int(rng.integers(5, 30))).tolist()
    b = [a[0] + 1 if a[0] < 255 else 3] + a[1:]   # only the first token differs: only the context tells them apart
    outs = run(eng, [a, b], [SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)] * 2)
    for p, o in zip((a, b), outs):
        assert_reference(model, p, o)
    lp_a, _ = reference_logprobs(model, a, outs[1].token_ids)   # b's tokens under a's context
    assert np.abs(lp_a - np.asarray(outs[1].logprobs)).max() > 1e-3, "the prompts must give different logprobs"


def test_parallel_samples_fork_the_state():
    """n = 2: each sample continues from its leader's state after the prompt (the fork's copy), so each
    sample's logprobs are those of its own tokens run alone."""
    rng, model = _rng(), _model()
    eng = _engine()
    prompts = _prompts(rng, 2, 3, 40)
    params = [SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=int(rng.integers(1 << 30)),
                             ignore_eos=True)] * 2
    outs = run(eng, prompts, params)
    for p, group in zip(prompts, outs):
        assert len(group) == 2 and group[0].token_ids != group[1].token_ids
        for o in group:
            assert_reference(model, p, o, greedy=False)


def test_chunk_budget_and_preemption_do_not_change_outputs():
    """A smaller token budget (other chunk boundaries) and a pool so small that requests are preempted and
    recomputed (the reset rule: no state is cleared by the engine) give the same outputs as a run alone."""
    rng, model = _rng(), _model()
    eng = _engine(max_num_batched_tokens=16, num_pages=16)
    prompts = _prompts(rng, 6, 40, 60)   # two sequences fill the pool's 16 pages before they finish
    params = _greedy(rng, 6, 20, 30)
    before = eng.stats.preemptions
    outs = run(eng, prompts, params)
    assert eng.stats.preemptions > before, "the pool must be small enough to preempt"
    for k, (p, o) in enumerate(zip(prompts, outs)):
        assert_reference(model, p, o, where=f"request {k}")


def test_step_shape_ladder_runs_sub_slots_on_their_own_states():
    """With a rung of 2 rows, the decode loop runs the two slots still holding a request gathered out of the 4
    (slots 2 and 3 once the requests in 0 and 1 finished): their states are read and written at the real
    slots, and the outputs equal the runs alone."""
    rng, model = _rng(), _model()
    eng = _engine(step_shapes=((2, 16),))
    runner = eng.runner
    for shape in runner.ladder.shapes:
        runner.compile_step(shape.tokens, shape.rows)
    rows, step = [], runner.step
    runner.step = lambda batch: (rows.append(batch.rows.seq_ids.shape[0]), step(batch))[1]
    try:
        prompts = _prompts(rng, 4, 2, 8)
        params = [SamplingParams(max_new_tokens=n, greedy=True, ignore_eos=True) for n in (2, 3, 20, 24)]
        outs = run(eng, prompts, params)
    finally:
        del runner.step
    assert 2 in rows and 4 in rows, f"rounds ran on {rows} rows: the rung must serve the last rounds"
    for k, (p, o) in enumerate(zip(prompts, outs)):
        assert_reference(model, p, o, where=f"request {k}")


def test_structured_outputs_decode_from_the_state():
    """A regex-constrained greedy request beside free ones: its constrained tokens are held out of the decode
    loop and decoded by ragged rows, and each is the best allowed token of its sequence run alone."""
    rng, model = _rng(), _model()
    eng = _engine()
    prompts = _prompts(rng, 3, 2, 40)
    free = SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=12, greedy=True, structured={"regex": "[a-z]{3,8}"}), free, free]
    outs = run(eng, prompts, params)
    o = outs[0]
    letters = set(range(ord("a"), ord("z") + 1))
    text = [t for t in o.token_ids if t != ByteTokenizer.EOS]
    assert 3 <= len(text) <= 8 and set(text) <= letters, o.token_ids
    logits = reference_logits(model, prompts[0] + list(o.token_ids))[len(prompts[0]) - 1:]
    for i, t in enumerate(o.token_ids):
        allowed = sorted((letters if i < 8 else set()) | ({ByteTokenizer.EOS} if i >= 3 else set()))
        assert logits[i, t] >= logits[i, allowed].max() - ATOL, f"token {i} is not the best allowed one"
    for p, o in zip(prompts[1:], outs[1:]):
        assert_reference(model, p, o)


@pytest.mark.bench
@pytest.mark.parametrize("case", ["ragged", "recurrent_only"])
def test_other_model_shapes_equal_the_runs_alone(case):
    """A model without the ragged_hidden/head pair (the engine calls `ragged`), and a model whose every layer
    is recurrent (no paged group: the engine keeps a placeholder pool for the page state's bookkeeping)."""
    rng = _rng()
    if case == "ragged":
        model = _model(hidden_pair=False)
    else:
        model = TinyHybrid(3, HybridConfig(recurrent_layers=(0, 1, 2), attention_layers=()))
        assert model.cache_spec().check_served() is None
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(**BASE))
    if case == "recurrent_only":
        assert eng.cache_config.num_layers == 1 and eng.cache_config.head_dim == 1
    prompts = _prompts(rng, 6)
    outs = run(eng, prompts, _greedy(rng, 6))
    for k, (p, o) in enumerate(zip(prompts, outs)):
        assert_reference(model, p, o, where=f"request {k}")


@pytest.mark.bench
def test_ngram_speculation_does_not_advance_the_state_past_rejected_drafts():
    """n-gram speculation: a verify pass runs every draft row through the recurrent layers; a slot that
    rejects some drafts gets its states from before the pass back and recomputes its kept rows. Outputs equal
    the runs alone, with drafts both accepted and rejected. (The model of seed 2 repeats itself: its own
    n-grams are often right; the prompts' repeated patterns are mostly wrong.)"""
    rng, model = _rng(), TinyHybrid(2)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, verify_rows=16)
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(**{**BASE, "speculative": spec}))
    prompts = _prompts(rng, 2, 5, 30)
    for _ in range(2):
        pattern = rng.integers(3, 256, int(rng.integers(2, 5))).tolist()
        prompts.append((pattern * 12)[: int(rng.integers(8, 40))])
    outs = run(eng, prompts, [SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True)] * 4)
    for k, (p, o) in enumerate(zip(prompts, outs)):
        assert_reference(model, p, o, where=f"request {k}")
    s = eng.summary()["speculative"]
    print(s)
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s


@pytest.mark.bench
def test_kv_offload_swaps_the_state_with_the_pages():
    """KV offload: a preempted sequence's pages and recurrent states go to the host tier and come back (a
    decoding one with every token it had: a zero-row chunk, nothing recomputed); outputs equal the runs alone."""
    rng, model = _rng(), _model()
    eng = _engine(max_num_batched_tokens=16, num_pages=16, kv_offload_bytes=1 << 20)
    before = dataclasses.replace(eng.stats)
    prompts = _prompts(rng, 6, 40, 60)
    outs = run(eng, prompts, _greedy(rng, 6, 20, 30))
    st = eng.stats
    assert st.swapped_out > before.swapped_out and st.swapped_in > before.swapped_in, st
    for k, (p, o) in enumerate(zip(prompts, outs)):
        assert_reference(model, p, o, where=f"request {k}")
    assert eng.host_tier.num_free == eng.host_tier.num_pages


# ---------------------------------------------------------------------- the spec, memory and refusals

def test_spec_paged_layers_and_states():
    """The pool's layers are the paged ones in model order; init_states gives [group layers, slots, *shape]
    zeros of the declared dtypes; the state bytes are those arrays' bytes."""
    spec = TinyHybrid(0).cache_spec()
    assert spec.has_recurrent and spec.paged_layers() == (1, 3) and spec.check_served() == (1, 16)
    states = spec.init_states(5)
    assert set(states) == {"linear"} and set(states["linear"]) == {"conv", "ssm"}
    assert states["linear"]["conv"].shape == (2, 5, 2, 32) and states["linear"]["ssm"].shape == (2, 5, 32)
    assert all(not np.asarray(a).any() for a in states["linear"].values())
    assert spec.state_bytes_per_sequence() * 5 == sum(np.asarray(a).nbytes for a in states["linear"].values())
    mixed = CacheSpec((CacheGroup("ssm", (1,), RecurrentState((("h", (4, 4), "bfloat16"),))),
                       CacheGroup("attn", (0, 2), FullAttention(2, 8))))
    assert mixed.init_states(3)["ssm"]["h"].dtype == np.dtype("bfloat16")
    assert mixed.paged_layers() == (0, 2) and mixed.recurrent_groups()[0].name == "ssm"
    only = CacheSpec((CacheGroup("ssm", (0, 1), RecurrentState((("h", (4,), "float32"),))),))
    assert only.check_served() is None and only.paged_layers() == ()
    assert not CacheSpec.attention(2, 1, 8).has_recurrent and CacheSpec.attention(2, 1, 8).init_states(2) == {}
    with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
        spec.init_states(0)


def test_memory_budget_pays_the_states_first():
    """kv_memory_bytes pays for max_seqs state slots first and the pool of the paged layers with the rest;
    the start-up report names both; a budget the states alone exceed is refused naming it."""
    model = _model()
    spec = model.cache_spec()
    states = spec.state_bytes_per_sequence() * 4
    page = CacheConfig(2, 1, 16, 1, 8, "float32").bytes_per_page   # the 2 paged layers only
    eng = LLMEngine(model, ByteTokenizer(), EngineConfig(**{**BASE, "num_pages": None,
                                                            "kv_memory_bytes": states + 10 * page + page // 2}))
    assert eng.cache_config.num_layers == 2 and eng.cache_config.num_pages == 10
    assert eng.state_bytes == states and eng.summary()["state_bytes"] == states
    assert "recurrent state slots" in eng.cache_report() and f"4 x {states // 4:,} B" in eng.cache_report()
    with pytest.raises(ValueError, match=r"kv_memory_bytes=.* holds the recurrent states of max_seqs=4"):
        LLMEngine(model, ByteTokenizer(), EngineConfig(**{**BASE, "num_pages": None, "kv_memory_bytes": states}))


@pytest.mark.parametrize("option, value", [
    ("prefix_caching", True), ("tensor_parallel", 2),
    ("speculative", SpeculativeConfig(method="draft_model", model="tiny-llama", num_speculative_tokens=2))])
def test_options_not_served_with_a_recurrent_group_are_refused(option, value):
    with pytest.raises(ValueError, match=rf"EngineConfig.{option}=.* recurrent group 'linear'"):
        LLMEngine(_model(), ByteTokenizer(), EngineConfig(**{**BASE, option: value}))


def test_a_draft_model_with_a_recurrent_group_is_refused():
    from jpa import models

    gpt, tok = models.load("tiny-llama")
    spec = SpeculativeConfig(method="draft_model", model="tiny-llama", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="draft model's cache has a recurrent group \\(linear\\)"):
        LLMEngine(models.GPTForEngine(gpt), tok, EngineConfig(**{**BASE, "speculative": spec}), draft_model=_model())
