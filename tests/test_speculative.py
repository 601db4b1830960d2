"""Speculative decoding (n-gram drafts proposed on the device, exact verification in the decode loop).

The property: outputs with speculation equal outputs without it, token for token and logprob for
logprob (greedy, and seeded sampling, since every row samples with the request's own key for its
token index), under preemption, prefix-cache hits, parallel samples and stop strings; the page
state is checked after every round and nothing leaks after aborts mid-speculation. The sampled
distribution is also tested on its own (chi-square, disjoint seeds), so that the test does not
rest on the seed coupling. Prompts repeat random segments so drafts are proposed, and the context
model's continuations accept some and reject others: both paths (accept, roll back) run.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jpa.testing.engine import BASE, assert_same, fresh_seed, mixed_params, run, snapshot
from jpa.kv import pages
from jpa.engine import SamplingParams, SpeculativeConfig
from jpa.engine.speculative import accepted_prefix, propose_ngram

pytestmark = pytest.mark.xdist_group("engines_b")  # one worker compiles the group's programs once

# verify_rows 16: room for drafts with every slot of BASE (max_seqs 4) busy (the CPU default,
# max_seqs + k, leaves none then: speculation switched off under load).
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, verify_rows=16)


@pytest.fixture(scope="module")
def rng():
    seed = fresh_seed()
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def scheduled_rng():
    """The draws of the engine tests that assert what the schedule did (preemptions, prefix-cache
    hits, drafts accepted and rejected, a chi-square p-value). With speculation the schedule
    depends on the tokens (which drafts are proposed and accepted, so the pages taken), not only on
    the lengths, and no size here forces those counters for every draw: a fixed seed makes them the
    same every run (these draws exercise them). Their outputs are still compared with the plain
    engine's; the other tests draw fresh inputs (the module's rng)."""
    return np.random.default_rng(20)


def repetitive_prompts(rng, n, lo=12, hi=60, vocab=40):
    """Prompts made of a few random segments repeated (n-gram lookups find matches)."""
    out = []
    for _ in range(n):
        segs = [rng.integers(3, vocab, int(rng.integers(2, 6))).tolist() for _ in range(3)]
        toks = []
        length = int(rng.integers(lo, hi + 1))
        while len(toks) < length:
            toks += segs[int(rng.integers(3))]
        out.append(toks[:length])
    return out


# ----------------------------------------------------------------------------- the proposer


def ngram_oracle(tokens, k, n_min, n_max):
    """vLLM's rule, brute force: the longest n in [n_min, n_max] whose last-n suffix occurs ending
    before the last token; its earliest occurrence; up to k tokens after it."""
    n = len(tokens)
    best, where = 0, None
    for end in range(1, n):
        m = 0
        while m < n_max and end - 1 - m >= 0 and tokens[end - 1 - m] == tokens[n - 1 - m]:
            m += 1
        if m > best:
            best, where = m, end
    if best < n_min or where is None:
        return []
    return tokens[where: where + min(k, n - where)]


def test_propose_ngram_is_vllms_rule(rng):
    k, size = 4, 48
    for n_min, n_max in ((1, 1), (1, 3), (2, 5), (3, 3)):
        lengths = rng.integers(0, size, 32)
        hist = rng.integers(0, 3 if n_max > 2 else 6, (32, size)).astype(np.int32)  # small vocab: many matches
        drafts, num = jax.jit(propose_ngram, static_argnums=(2, 3, 4))(hist, lengths.astype(np.int32), k, n_min, n_max)
        found = 0
        for b in range(32):
            want = ngram_oracle(hist[b, : lengths[b]].tolist(), k, n_min, n_max)
            assert int(num[b]) == len(want), (b, n_min, n_max)
            assert np.asarray(drafts[b, : len(want)]).tolist() == want
            assert not np.asarray(drafts[b, len(want):]).any()
            found += bool(want)
        assert 0 < found < 32 or n_min == 1   # some rows propose, and (with n_min > 1) some do not


def test_accepted_prefix_counts_leading_matches():
    target = np.array([[5, 6, 7, 8], [5, 0, 7, 8], [1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    drafts = np.array([[5, 6, 7], [5, 6, 7], [9, 2, 3], [5, 6, 7]], np.int32)
    num = np.array([3, 3, 3, 2], np.int32)
    np.testing.assert_array_equal(accepted_prefix(target, drafts, num), [3, 1, 0, 2])


@pytest.mark.parametrize("spec, match", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "ngram", "num_speculative_token": 4}', "unknown speculative config key"),
    ('{"num_speculative_tokens": 4}', "needs 'method'"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be an int in \[1, 16\]"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must be <= prompt_lookup_max"),
    ('{"method": "draft_model"}', "needs 'model'"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_speculative_config_is_one_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(spec)


def test_vllm_defaults_for_lookup_lengths():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


def test_truncate_rolls_back_and_frees_draft_pages():
    s = pages.init(8, 2, 4, 4)
    s, ok = pages.reserve(s, [0, 1], [5, 3])
    s, ok, _ = pages.reserve(s, [0, 1], [11, 4], return_cow=True)   # drafts reserved
    assert bool(ok) and int(s.num_free) == 8 - 3 - 1
    s = pages.truncate(s, [0, 1], [6, 9])   # seq 1: 9 > 4, unchanged
    np.testing.assert_array_equal(s.seq_lens, [6, 4])
    assert int(s.num_free) == 8 - 2 - 1 and np.all(np.asarray(s.block_tables)[0, 2:] == 0)


# ----------------------------------------------------------------------------- the engine


# One pool for every engine test here (test_engine's TIGHT: the plain engine of the same sizes is
# shared with it), small enough that the batches below preempt.
TIGHT = dict(num_pages=16)


def spec_engine(engines):
    return engines.get(speculative=SpeculativeConfig(**NGRAM), **TIGHT)


def assert_both_paths(before, eng):
    """Drafts were verified, some accepted and some rejected (both the keep and the rollback ran)."""
    drafted = eng.stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = eng.stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.bench
def test_outputs_equal_without_speculation_under_preemption_and_prefix_hits(engines):
    """Greedy and seeded samples (top-k/top-p/temperature), stop strings, n > 1, a pool too small
    for the batch (preemption) and shared prefixes (prefix-cache hits): identical outputs."""
    rng = scheduled_rng()
    prompts = repetitive_prompts(rng, 8, 20, 50)
    prompts[5] = prompts[4][:40] + prompts[5][:10]   # a prefix shared with prompt 4 (cache hit)
    params = mixed_params(rng, 8, lo=30, hi=40)
    params[3] = dataclasses.replace(params[3], n=2, top_logprobs=3)
    want = engines.reference(prompts, params)
    stop_text = want[6].completion[5:8]
    if stop_text:
        params[6] = dataclasses.replace(params[6], stop=(stop_text,))
        want[6] = engines.reference([prompts[6]], [params[6]])[0]
    eng = spec_engine(engines)
    before = snapshot(eng)
    got = run(eng, prompts, params)   # checks the page state after every round
    assert_same(got, want, "speculative, tight pool")
    for g, w in zip(got[3][0].top_logprobs, want[3][0].top_logprobs):
        assert [i for i, _ in g] == [i for i, _ in w]
        np.testing.assert_allclose([v for _, v in g], [v for _, v in w], atol=1e-5)
    assert eng.stats.preemptions > before.preemptions
    assert eng.summary()["prefix_hit_tokens"] > 0
    assert_both_paths(before, eng)
    assert eng.pool_is_whole()


def test_one_program_and_several_tokens_per_step(engines):
    """Speculation keeps the unified step the engine's one compiled program, and a verify step
    emits several tokens of one sequence: some round hands a request more tokens than the round
    had steps (its decode row plus its loop steps)."""
    rng = scheduled_rng()
    eng = spec_engine(engines)
    before = snapshot(eng)
    for p in repetitive_prompts(rng, 3, 20, 30):
        eng.add_request(p, SamplingParams(max_new_tokens=30, greedy=True, ignore_eos=True))
    most, outs = 0, []
    while eng.has_unfinished:
        steps = eng.stats.decode_steps
        for o in eng.step():
            most = max(most, len(o.new_token_ids) - (eng.stats.decode_steps - steps) - 1)
            outs += [o.output] if o.finished else []
    assert most > 0, "no round gave a request more tokens than it had steps"
    assert eng.summary()["step_compiles"] == 1 and all(len(o.token_ids) == 30 for o in outs)
    assert sum(o.num_accepted_tokens for o in outs) == eng.stats.spec_accepted_tokens - before.spec_accepted_tokens
    s = eng.summary()["speculative"]
    assert s["num_draft_tokens"] >= s["num_accepted_tokens"] > 0 and 1 < s["mean_accepted_length"] <= 4


def test_aborts_mid_speculation_leak_nothing(engines):
    rng = scheduled_rng()
    eng = spec_engine(engines)
    prompts = repetitive_prompts(rng, 6, 20, 40)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=60, greedy=True, ignore_eos=True)) for p in prompts]
    for _ in range(40):   # until some verify step had drafts
        eng.step()
        eng.check_page_state()
        if eng.stats.spec_draft_tokens:
            break
    assert eng.stats.spec_draft_tokens > 0 and eng.has_unfinished
    for r in reqs[::2]:
        eng.abort(r.request_id)
    eng.check_page_state()
    while eng.has_unfinished:
        eng.step()
        eng.check_page_state()
    assert eng.pool_is_whole()


@pytest.mark.soak
def test_sampled_distribution_matches_plain_sampling(engines):
    """Chi-square two-sample test on the first two generated tokens with DISJOINT seeds for the two
    runs: equal in distribution without relying on shared keys. A logit_bias of +100 on 4 prompt
    tokens confines sampling to them (their odds still the model's, context-dependent), so the
    second token is always verified against a draft (a 1-gram match of the first; a third token
    is asked for so that one draft fits: a request's last token is never drafted)."""
    rng = scheduled_rng()
    n = 200
    prompt = repetitive_prompts(rng, 1, 30, 30)[0]
    support = sorted(set(prompt))[:4]
    # A high temperature spreads the mass over the support's pairs: at 1.3 a random prompt once put
    # 162 of 190 samples on one pair, leaving too few cells for the test (CI, stop 30).
    base = SamplingParams(max_new_tokens=3, temperature=2.5, ignore_eos=True, logit_bias={t: 100.0 for t in support})
    plain, spec = engines.get(**TIGHT), spec_engine(engines)
    before = snapshot(spec)
    a = run(plain, [prompt] * n, [dataclasses.replace(base, seed=s) for s in range(n)])
    b = run(spec, [prompt] * n, [dataclasses.replace(base, seed=s) for s in range(n, 2 * n)])
    # Every second token is verified against a draft, but for the few rounds where the tight pool
    # had no page for the draft (the step then runs without it).
    assert spec.stats.spec_drafts - before.spec_drafts >= 0.9 * n, spec.stats.spec_drafts - before.spec_drafts
    cats = sorted({o.token_ids[:2] for o in a + b})
    table = np.array([[sum(o.token_ids[:2] == c for o in outs) for c in cats] for outs in (a, b)], float)
    table = table[:, table.sum(0) >= 10]   # chi-square needs expected counts of a few per cell
    dof = table.shape[1] - 1

    def p_value(t):
        expected = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
        return float(jax.scipy.stats.chi2.sf(float(((t - expected) ** 2 / expected).sum()), dof))

    assert dof >= 2 and p_value(table) > 1e-3, (table, dof)
    # The statistic does reject a different distribution (the second run's mass moved to one
    # category: a verifier that always accepted would concentrate it like this), so a passing
    # p-value says something.
    wrong = table.copy()
    wrong[1] = 0
    wrong[1, int(np.argmin(table[0]))] = table[1].sum()
    assert p_value(wrong) < 1e-3


def test_max_new_tokens_and_length_limit_hold_with_drafts(engines, rng):
    """Drafts never carry a request past max_new_tokens or the engine's length limit (against the
    plain engine of the same sizes, whose max_model_len the pool caps at 128)."""
    plain, spec = engines.get(**TIGHT), spec_engine(engines)
    limit = plain.max_model_len
    prompts = repetitive_prompts(rng, 3, 20, 30) + repetitive_prompts(rng, 1, limit - 10, limit - 10)
    params = [SamplingParams(max_new_tokens=m, greedy=True, ignore_eos=True) for m in (1, 2, 7, 64)]
    want = run(plain, prompts, params)
    got = run(spec, prompts, params)
    assert_same(got, want, "limits")
    assert [len(o.token_ids) for o in got[:3]] == [1, 2, 7]
    assert got[3].finish_reason == "length" and len(got[3].prompt_ids) + len(got[3].token_ids) == limit


def test_server_streams_speculative_outputs_and_vllm_metrics(engines):
    """The OpenAI server over a speculative engine: completions (streamed and not) equal the plain
    engine's greedy outputs, and /metrics carries vLLM's spec-decode counters. Runs last: the
    engine is handed to the server's thread and then discarded."""
    rng = scheduled_rng()
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from jpa.engine import AsyncEngine
    from jpa.server import build_app
    from server_util import serving

    prompts = repetitive_prompts(rng, 3, 20, 30)
    params = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)
    want = run(engines.get(**TIGHT), prompts, params)
    eng = spec_engine(engines)
    engines.discard(eng)
    with AsyncEngine(eng, max_waiting=8) as aengine, serving(build_app(aengine, engines.tokenizer, model_name="m")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="m", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        for p, w in zip(prompts, want):
            r = client.completions.create(prompt=p, **kw)
            assert r.choices[0].text == w.completion and r.usage.completion_tokens == 24
            streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True, **kw)
                               if c.choices)
            assert streamed == w.completion
        metrics = httpx.get(f"{url}/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode")}
    drafted = values['vllm:spec_decode_num_draft_tokens_total{model_name="m"}']
    accepted = values['vllm:spec_decode_num_accepted_tokens_total{model_name="m"}']
    assert drafted >= accepted > 0 and values['vllm:spec_decode_num_drafts_total{model_name="m"}'] > 0
    assert sum(v for k, v in values.items() if "per_pos" in k and k.endswith('"}') and "_created" not in k) == accepted


@pytest.mark.bench
def test_draft_model_outputs_equal_without_speculation(engines):
    """A draft model (a tiny-llama of another seed: it often disagrees, so drafts are accepted and
    rejected) with its own cache on the same pages: outputs equal the plain engine's under
    preemption and prefix-cache hits, and nothing leaks."""
    rng = scheduled_rng()
    from jpa import models
    from jpa.engine import EngineConfig, LLMEngine

    draft = models.GPTForEngine(models.load("tiny-llama", seed=5)[0])
    eng = LLMEngine(engines.model, engines.tokenizer, EngineConfig(**{**BASE, **TIGHT}, speculative=SpeculativeConfig(
        method="draft_model", model="tiny-llama", num_speculative_tokens=3, verify_rows=16)), draft_model=draft)
    prompts = repetitive_prompts(rng, 6, 20, 45)
    prompts[3] = prompts[2][:32] + prompts[3][:8]   # a prefix-cache hit
    params = mixed_params(rng, 6, lo=25, hi=35)
    want = run(engines.get(**TIGHT), prompts, params)
    got = run(eng, prompts, params)
    assert_same(got, want, "draft model, tight pool")
    assert eng.stats.preemptions > 0 and eng.summary()["prefix_hit_tokens"] > 0
    assert 0 < eng.stats.spec_accepted_tokens < eng.stats.spec_draft_tokens
    assert eng.pool_is_whole() and "draft model" in eng.summary()["kv_cache"]
    with pytest.raises(ValueError, match="needs the draft model"):
        LLMEngine(engines.model, engines.tokenizer, eng.config)
