"""Sampling controls on the device (vLLM's names): repetition/presence/frequency penalties,
logit_bias, min_tokens, stop_token_ids and min_p, against a numpy reference and through the engine
(where the token history comes from the pool's page_tokens, shared by prefix hits and forks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpa import models
from jpa.engine import SamplingParams, SlotParams
from jpa.engine.sampling import apply_controls, sample_with_logprobs
from jpa.testing.engine import Engines, snapshot


def reference_controls(logits, rows, history, num_cached, counters, stop_ids):
    out = logits.astype(np.float64).copy()
    for b, r in enumerate(rows):
        toks = history[b, : num_cached[b]]
        counts = np.bincount(toks[r["prompt_len"]:], minlength=out.shape[1]).astype(np.float64)
        for v in set(toks.tolist()):
            out[b, v] = out[b, v] / r["repetition_penalty"] if out[b, v] > 0 else out[b, v] * r["repetition_penalty"]
        out[b] -= r["presence_penalty"] * (counts > 0) + r["frequency_penalty"] * counts
        for t, bias in zip(r["bias_ids"], r["bias_values"]):
            out[b, t] += bias
        if counters[b] < r["min_tokens"]:
            out[b, list(stop_ids) + list(r["stop_token_ids"])] = -np.inf
    return out


@pytest.mark.parametrize("seed,sparse", [(0, False), (1, False), (2, False), (0, True), (3, True)])
def test_controls_equal_a_numpy_reference(seed, sparse):
    """Both ways of applying the penalties (`apply_controls`' sparse: the GPU's sort of the history,
    no [n, vocab] temporary; dense: the CPU's counts) against the reference."""
    rng = np.random.default_rng(seed)
    n, vocab, length = 5, 64, 40
    logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    history = rng.integers(0, 12, (n, length)).astype(np.int32)   # a small alphabet: many repeats
    num_cached = rng.integers(0, length + 1, n).astype(np.int32)
    counters = rng.integers(0, 6, n).astype(np.int32)
    rows = []
    for _ in range(n):
        bias = sorted({int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, rng.integers(0, 6))}.items())
        sp = SamplingParams(max_new_tokens=8, repetition_penalty=float(rng.uniform(0.5, 2)),
                            presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                            logit_bias=bias, min_tokens=int(rng.integers(0, 5)),
                            stop_token_ids=tuple(int(t) for t in rng.integers(0, vocab, rng.integers(0, 3))))
        rows.append(SlotParams.row(sp, 100, prompt_len=int(rng.integers(0, length))))
    params = jax.tree_util.tree_map(jnp.asarray, SlotParams.from_rows(rows, n))
    stop_ids = np.array([vocab - 1], np.int32)
    got = np.asarray(apply_controls(jnp.asarray(logits), params, jnp.asarray(history), jnp.asarray(num_cached),
                                    jnp.asarray(counters), jnp.asarray(stop_ids), sparse=sparse))
    want = reference_controls(logits, rows, history, num_cached, counters, stop_ids)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-5, atol=1e-4)


def test_min_p_keeps_only_tokens_near_the_top():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(np.tile(rng.normal(0, 1.5, (1, 50)).astype(np.float32), (4, 1)))  # one row, 4 min_p
    min_p = jnp.asarray([0.0, 0.1, 0.5, 1.0], jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    seen = [set() for _ in range(4)]
    draw = jax.jit(lambda c: sample_with_logprobs(logits, jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.ones(4),
                                                  jnp.arange(4, dtype=jnp.int32), jnp.full(4, c, jnp.int32),
                                                  min_p=min_p)[0])
    for c in range(200):
        for b, t in enumerate(np.asarray(draw(c))):
            assert probs[b, t] >= float(min_p[b]) * probs[b].max() - 1e-7
            seen[b].add(int(t))
    assert len(seen[0]) > len(seen[1]) > len(seen[2]) >= len(seen[3]) == 1


@pytest.fixture(scope="module")
def tiny():
    gpt, tok = models.load("tiny-llama", seed=2)
    return models.GPTForEngine(gpt), tok


CFG = dict(max_seqs=4, page_size=4, num_pages=200, max_model_len=128, max_num_batched_tokens=32, steps_per_call=4)


@pytest.fixture(scope="module")
def engines(tiny):
    """The module's engines: one per config (CFG updated), compiled once, handed out settled."""
    return Engines(*tiny, base=CFG)


def run(engines, prompts, params, **cfg):
    eng = engines.get(**cfg)
    outs = eng.generate(prompts, params)
    assert eng.pool_is_whole()
    return outs, eng


def test_each_control_changes_outputs_as_specified(engines):
    rng = np.random.default_rng(5)
    prompts = ["".join(chr(97 + x) for x in rng.integers(0, 26, 12)) for _ in range(4)]
    greedy = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)
    base, _ = run(engines, prompts, greedy)
    # logit_bias -100 on every token the greedy run produced: none of them appears again.
    banned = sorted({t for o in base for t in o.token_ids})
    got, _ = run(engines, prompts, SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True,
                                               logit_bias={t: -100 for t in banned}))
    assert all(not set(o.token_ids) & set(banned) for o in got)
    # frequency_penalty: fewer repeated tokens than the greedy run (which loops).
    rep = lambda outs: sum(len(o.token_ids) - len(set(o.token_ids)) for o in outs)  # noqa: E731
    got, _ = run(engines, prompts, SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True,
                                               frequency_penalty=2.0))
    assert rep(got) < rep(base), (rep(got), rep(base))
    # stop_token_ids: the request ends at the first such token, finish_reason "stop"; with
    # min_tokens the token is barred until min_tokens tokens were made.
    first = base[0].token_ids[0]
    stop, _ = run(engines, prompts[:1], SamplingParams(max_new_tokens=24, greedy=True, stop_token_ids=(first,)))
    assert stop[0].token_ids == (first,) and stop[0].finish_reason == "stop"
    held, _ = run(engines, prompts[:1], SamplingParams(max_new_tokens=24, greedy=True, stop_token_ids=(first,),
                                                    min_tokens=6))
    assert first not in held[0].token_ids[:6] and len(held[0].token_ids) >= 7


@pytest.mark.soak
def test_controls_survive_preemption_prefix_hits_and_forks(engines):
    """The history the penalties read comes from the pool's page_tokens: a recomputed request, a
    request whose prompt starts with cached pages, and forked samples must see exactly the tokens
    a run that neither preempts nor shares sees."""
    rng = np.random.default_rng(9)
    shared = "".join(chr(97 + x) for x in rng.integers(0, 26, 13))
    prompts = [shared + "".join(chr(97 + x) for x in rng.integers(0, 26, rng.integers(1, 9))) for _ in range(6)]
    params = [SamplingParams(max_new_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
                             logit_bias={3: 5.0, 7: -3.0}, n=2 if i == 4 else 1) for i in range(6)]
    ref, _ = run(engines, prompts, params, prefix_caching=False, num_pages=400)
    eng = engines.get(num_pages=14)
    before, hits, cows = snapshot(eng), eng.summary()["prefix_hit_tokens"], eng.runner.cow_copies
    got, _ = run(engines, prompts, params, num_pages=14)        # preempts, shares cached prefixes, forks
    assert eng.stats.preemptions > before.preemptions and eng.summary()["prefix_hit_tokens"] > hits
    assert eng.runner.cow_copies > cows
    flat = lambda outs: [x for o in outs for x in (o if isinstance(o, list) else [o])]  # noqa: E731
    for a, b in zip(flat(ref), flat(got)):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_bad_control_values_are_refused():
    for kw, msg in [(dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
                    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(min_p=1.5), "min_p"),
                    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
                    (dict(logit_bias={i: 1 for i in range(301)}), "logit_bias"),
                    (dict(min_tokens=9, max_new_tokens=8), "min_tokens"), (dict(stop_token_ids=(-1,)), "stop_token_ids")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={"5": 1.0}).logit_bias == ((5, 1.0),)   # JSON object keys are strings


def test_token_ids_past_the_vocabulary_fail_the_request(engines):
    eng = engines.get()
    req = eng.add_request("abc", SamplingParams(logit_bias={10 ** 6: 1.0}))
    (out,) = eng.step()
    assert out.request_id == req.request_id and out.output.finish_reason == "error"
    assert "logit_bias and stop_token_ids" in out.output.error


def test_generate_command_refuses_bad_control_flags(capsys):
    from jpa.cli import generate as gen
    assert gen.main(["--model", "tiny-llama", "--presence-penalty", "3", "hi"]) == 2
    assert "presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err
    args = gen.parse_args(["--model", "tiny-llama", "--min-p", "0.1", "--stop-token-id", "5", "--stop-token-id", "9",
                           "--repetition-penalty", "1.2", "hi"])
    p = gen.sampling_flags(args, 2)
    assert (p["min_p"], p["stop_token_ids"], p["repetition_penalty"], p["seed"]) == (0.1, (5, 9), 1.2, 2)


def test_top_logprobs_equal_the_dense_models_top_k(engines):
    """Greedy rows report the model's own distribution: each output token's top_logprobs are the
    top-k of log_softmax of a full forward pass (no cache) at that position; sampled rows report
    the distribution they were drawn from, so the token's own log-probability is in its list when
    it ranks in the top k."""
    rng = np.random.default_rng(4)
    prompts = ["".join(chr(97 + x) for x in rng.integers(0, 26, rng.integers(5, 20))) for _ in range(3)]
    eng = engines.get()
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=7, greedy=True, ignore_eos=True, top_logprobs=5),
                                  SamplingParams(max_new_tokens=7, greedy=True, ignore_eos=True),
                                  SamplingParams(max_new_tokens=7, temperature=0.8, top_k=30, seed=3,
                                                 ignore_eos=True, top_logprobs=20)])
    gpt = models.load("tiny-llama", seed=2)[0]
    o = outs[0]
    ids = list(o.prompt_ids) + list(o.token_ids)
    logits = np.asarray(models.forward_dense(gpt, jnp.asarray([ids], jnp.int32))[0], np.float64)
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    assert len(o.top_logprobs) == len(o.token_ids) == 7 and outs[1].top_logprobs == ()
    for i, top in enumerate(o.top_logprobs):
        row = lsm[len(o.prompt_ids) - 1 + i]
        want = np.argsort(-row)[:5]
        assert [t for t, _ in top] == want.tolist()
        np.testing.assert_allclose([v for _, v in top], row[want], atol=1e-5)
        assert top[0][0] == o.token_ids[i] and abs(top[0][1] - o.logprobs[i]) < 1e-6
    s = outs[2]
    assert all(len(top) == 20 for top in s.top_logprobs)
    for t, lp, top in zip(s.token_ids, s.logprobs, s.top_logprobs):
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        d = dict(top)
        if t in d:
            assert abs(d[t] - lp) < 1e-6
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)


@pytest.mark.parametrize("ways", [4, 16, 256])
def test_multiway_search_finds_the_binary_searchs_thresholds(ways):
    """`_bisect` with `ways` thresholds a pass (a GPU's top-k / top-p search) finds the same t as
    the binary search (the CPU's), ties, -inf, top_k past the vocabulary and no t at all included."""
    from jpa.engine.sampling import _bisect, _order_key
    rng = np.random.default_rng(ways)
    x = rng.normal(0, 3, (8, 300)).astype(np.float32)
    x[0, :40] = 1.25                 # ties at the threshold
    x[1, ::2] = -np.inf              # filtered tokens
    key = _order_key(jnp.asarray(x))
    k = jnp.asarray([1, 40, 0, 299, 300, 5000, 7, 150], jnp.int32)
    want = _bisect(lambda t: jnp.sum(key >= t[:, None], axis=-1) < k, 8)
    got = _bisect(lambda t: jnp.sum(key[:, :, None] >= t[:, None, :], axis=1) < k[:, None], 8, ways)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(want[2]) == 0xFFFFFFFF and int(want[0]) == int(key[0].max()) + 1   # no t; past the largest key
    probs = jax.nn.softmax(jnp.asarray(x), axis=-1)
    pkey, p = _order_key(probs), jnp.asarray([0.1, 0.5, 0.9, 0.99, 1.0, 0.3, 0.7, 0.95], jnp.float32)
    want = _bisect(lambda t: jnp.sum(jnp.where(pkey > t[:, None], probs, 0.0), axis=-1) < p, 8)
    got = _bisect(lambda t: jnp.sum(jnp.where(pkey[:, :, None] > t[:, None, :], probs[:, :, None], 0.0), axis=1)
                  < p[:, None], 8, ways)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gpu_sampler_search_draws_the_cpu_samplers_tokens(monkeypatch):
    """The sampler with the GPU's 16-way threshold search (forced here on the CPU) draws the same
    tokens with the same log-probabilities as with the binary search, rows with top-k, top-p,
    min-p, both and neither."""
    from jpa.engine import sampling
    rng = np.random.default_rng(7)
    n, vocab = 12, 700
    args = (jnp.asarray(rng.normal(0, 3, (n, vocab)).astype(np.float32)),
            jnp.asarray(rng.uniform(0.3, 1.5, n).astype(np.float32)),
            jnp.asarray([0, 1, 5, 50, 0, 0, 20, 700, 3, 0, 9, 100], jnp.int32),
            jnp.asarray([1.0, 1.0, 0.9, 1.0, 0.5, 0.95, 0.8, 1.0, 1.0, 0.99, 0.3, 0.7], jnp.float32),
            jnp.arange(n, dtype=jnp.int32), jnp.asarray(rng.integers(0, 9, n).astype(np.int32)))
    min_p = jnp.asarray(np.where(np.arange(n) % 4 == 3, 0.05, 0.0).astype(np.float32))
    out = {}
    for ways in (2, 16):
        monkeypatch.setattr(sampling, "search_ways", lambda w=ways: w)
        out[ways] = [np.asarray(a) for a in jax.jit(
            lambda *a: sampling.sample_with_logprobs(*a, min_p=min_p))(*args)]
    for a, b in zip(out[2], out[16]):
        np.testing.assert_array_equal(a, b)


def test_chunked_rows_sample_as_the_whole_batch():
    """`sample_rows` in chunks (the verify pass's sampler: chunks of equal size, the last
    overlapping) gives every row the token, log-probability and top log-probabilities
    `sample_slots` gives it over the whole batch, with penalties, a logit bias, top-k/top-p and
    greedy rows."""
    from jpa.engine.sampling import sample_rows, sample_slots
    rng = np.random.default_rng(11)
    n, vocab, length = 13, 96, 24
    rows = []
    for i in range(n):
        sp = SamplingParams(max_new_tokens=8, temperature=0.0 if i % 3 == 0 else float(rng.uniform(0.5, 1.5)),
                            top_k=int(rng.integers(0, 20)), top_p=float(rng.uniform(0.5, 1.0)),
                            repetition_penalty=1.3 if i % 2 else 1.0, presence_penalty=0.5 if i == 4 else 0.0,
                            logit_bias=[(3, 5.0)] if i == 5 else [], seed=i, top_logprobs=3 if i % 4 == 1 else 0)
        rows.append(SlotParams.row(sp, 100, prompt_len=4))
    params = jax.tree_util.tree_map(jnp.asarray, SlotParams.from_rows(rows, n))
    logits = jnp.asarray(rng.normal(0, 3, (n, vocab)).astype(np.float32))
    history = jnp.asarray(rng.integers(0, 12, (n, length)).astype(np.int32))
    cached = jnp.asarray(rng.integers(4, length, n).astype(np.int32))
    counters = jnp.asarray(rng.integers(0, 6, n).astype(np.int32))
    stop = jnp.asarray([vocab - 1], jnp.int32)
    whole = jax.jit(lambda: sample_slots(logits, params, counters, lambda: history, cached, stop))()
    # 5 rows a chunk: 3 chunks at rows 0, 5, 8 (the last overlapping the second).
    chunked = jax.jit(lambda: sample_rows(logits, params, counters, lambda: history, cached, stop,
                                          max_elements=5 * vocab))()
    want_top = np.asarray(params.top_logprobs) > 0
    for k, (a, b) in enumerate(zip(whole, chunked)):
        a, b = np.asarray(a), np.asarray(b)
        if k >= 2:   # top log-probabilities: only the rows that ask (others get them or not by chunk)
            a, b = a[want_top], b[want_top]
        if np.issubdtype(a.dtype, np.floating):  # sums over the vocabulary in two programs: XLA may order them
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)  # differently (1 ulp seen on jaxlib 0.12.1)
        else:
            np.testing.assert_array_equal(a, b)


def test_key_comparisons_on_probabilities_equal_the_keys():
    """`_key_compare`: the GPU top-p search's comparison of probabilities against u32 key
    thresholds equals comparing their order keys, at 0, 1, the smallest normal float and every edge
    threshold. (Subnormal floats are left out: XLA flushes them to zero on a CPU, and a softmax's
    probabilities there never are subnormal.)"""
    from jpa.engine.sampling import _key_compare, _order_key
    rng = np.random.default_rng(5)
    p = np.concatenate([[0.0, 1.0, np.finfo(np.float32).tiny, 0.5, np.nextafter(np.float32(0.5), np.float32(1))],
                        rng.uniform(0, 1, 40), rng.uniform(1e-30, 1e-6, 10)]).astype(np.float32)
    keys = np.asarray(_order_key(jnp.asarray(p)), np.uint64)
    t = np.concatenate([[0, 1, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xBF800000, 0xBF800001, 0xFF800000, 0xFFC00000,
                         0xFFFFFFFF], keys - 1, keys, keys + 1, rng.integers(0, 2 ** 32, 60)]) % 2 ** 32
    t = t[(t <= 0x80000000) | (t >= 0x80800000)].astype(np.uint32)   # no subnormal threshold
    for op, npop in ((jnp.greater, np.greater), (jnp.greater_equal, np.greater_equal)):
        got = np.asarray(_key_compare(jnp.asarray(p)[:, None], jnp.asarray(t)[None, :], op))
        np.testing.assert_array_equal(got, npop(keys[:, None], t[None, :].astype(np.uint64)))


def test_gpu_sampler_formulations_equal_the_cpus(monkeypatch):
    """The sampler as compiled for a GPU (forced here on the CPU): penalties at the history's tokens
    (`apply_controls` sparse), the top logprobs selected before subtracting the log-normalizer, the
    16-way threshold search. Same tokens and logprobs as the CPU program, same top logprobs (ids
    whose values tie may swap)."""
    from jpa.engine import sampling
    from jpa.ops.dispatch import Target
    rng = np.random.default_rng(11)
    n, vocab, length = 10, 900, 64
    rows = [SlotParams.row(SamplingParams(
        temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(mp), repetition_penalty=1.3,
        presence_penalty=0.5, frequency_penalty=0.25, top_logprobs=5, logit_bias={3: 2.0}), 100, prompt_len=20)
        for t, k, p, mp in zip([0, 0.7, 1.0, 1.3, 0.5, 0, 1.0, 0.9, 2.0, 1.0], [0, 5, 0, 40, 0, 3, 900, 0, 10, 0],
                               [1, 1, 0.9, 0.8, 0.95, 0.5, 1, 0.7, 1, 1], [0, 0, 0, 0.05, 0, 0, 0, 0.1, 0, 0])]
    params = jax.tree_util.tree_map(jnp.asarray, SlotParams.from_rows(rows, n))
    logits = jnp.asarray(rng.normal(0, 3, (n, vocab)).astype(np.float32))
    history = jnp.asarray(rng.integers(0, 50, (n, length)).astype(np.int32))
    num_cached = jnp.asarray(rng.integers(20, length + 1, n).astype(np.int32))
    counters = jnp.asarray(rng.integers(0, 9, n).astype(np.int32))

    def run():
        return [np.asarray(a) for a in jax.jit(lambda x: sampling.sample_slots(
            x, params, counters, lambda: history, num_cached, jnp.asarray([1], jnp.int32)))(logits)]

    cpu = run()
    monkeypatch.setattr(sampling, "current_target", lambda: Target("gpu", "NVIDIA H100 80GB HBM3", 9.0, False))
    gpu = run()
    np.testing.assert_array_equal(gpu[0], cpu[0])                   # tokens
    np.testing.assert_allclose(gpu[1], cpu[1], rtol=1e-5, atol=1e-5)   # their logprobs
    np.testing.assert_allclose(gpu[3], cpu[3], rtol=1e-5, atol=1e-5)   # top logprobs, in order
    assert (gpu[2] == cpu[2]).mean() > 0.95, (gpu[2], cpu[2])


@pytest.mark.parametrize("block,count", [(16, 4), pytest.param(4, 8, marks=pytest.mark.bench)])
def test_gpu_candidate_sampler_draws_the_dense_samplers_tokens(monkeypatch, block, count):
    """The GPU sampler (`_sample_candidates`: two passes over the logits, thresholds from the
    candidate blocks, a whole-row search for the rows they cannot serve), forced here on the CPU,
    draws the dense sampler's tokens with its log-probabilities and top log-probabilities, on
    fresh random logits: greedy rows, top-k (past the candidates too), top-p (a flat row whose
    kept set reaches below the candidates), min-p, combinations, rows that want the top entries.
    The small blocks (16 or 32 candidates of 900) make some rows take the whole-row search, others the candidates (checked). The whole vocabulary in the
    candidates: test_gpu_sampler_formulations_equal_the_cpus."""
    from jpa.engine import sampling
    from jpa.ops.dispatch import Target
    rng = np.random.default_rng(block * 100 + count)
    n, vocab = 16, 900
    logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    logits[3] = rng.normal(0, 0.05, vocab)     # flat: top-p / min-p keep a long tail
    logits[9, 100:140] = logits[9].max() + 1   # ties at the top
    t = rng.uniform(0.3, 1.5, n).astype(np.float32)
    t[[0, 5]] = 0
    k = np.array([0, 1, 5, 50, 0, 0, 20, 700, 3, 0, 9, 100, 0, 300, 0, 899], np.int32)
    p = np.array([1, 1, .9, 1, .5, .95, .8, 1, 1, .99, .3, .7, 1, .9, .999, 1], np.float32)
    mp = np.where(np.arange(n) % 4 == 3, 0.05, 0.0).astype(np.float32)
    mp[12] = 0.2
    want = np.arange(n) % 2 == 0
    args = [jnp.asarray(a) for a in (logits, t, k, p, np.arange(n, dtype=np.int32),
                                      rng.integers(0, 9, n).astype(np.int32))]
    sampled = t > 0
    off = [jnp.asarray(a) for a in (np.where(sampled, t, 1), np.where(sampled, k, 0), np.where(sampled, p, 1),
                                    np.where(sampled, mp, 0))]   # the filters as the sampler sets them

    def run(*a):
        out = sampling.sample_with_logprobs(*a, min_p=jnp.asarray(mp), top_n=20, want_top=jnp.asarray(want))
        return out, (sampling._candidate_thresholds(a[0], *off, 20, jnp.asarray(want))
                     if sampling.gpu_sampler() else None)

    dense = [np.asarray(a) for a in jax.jit(run)(*args)[0]]
    monkeypatch.setattr(sampling, "current_target", lambda: Target("gpu", "NVIDIA H100 80GB HBM3", 9.0, False))
    monkeypatch.setattr(sampling, "GPU_CANDIDATE_BLOCK", block)
    monkeypatch.setattr(sampling, "GPU_CANDIDATE_BLOCKS", count)
    monkeypatch.setattr(sampling, "GPU_FALLBACK_ROWS", 3)   # several iterations of the whole-row search
    gpu, c = jax.jit(lambda *a: run(*a))(*args)   # a new function: not the dense trace from the cache
    gpu = [np.asarray(a) for a in gpu]
    np.testing.assert_array_equal(gpu[0], dense[0])
    np.testing.assert_allclose(gpu[1], dense[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gpu[2][want], dense[2][want])
    np.testing.assert_allclose(gpu[3][want], dense[3][want], rtol=1e-5, atol=1e-5)
    need, filt = np.asarray(c["need"]), np.asarray(c["filt"])
    if block * count >= vocab:
        assert not need.any()
    else:   # both paths taken: rows from the candidates alone, rows searched whole
        assert need.sum() >= 2 and (filt & ~need).sum() >= 2, (need, filt)
