"""The continuous-batching engine on a tiny random llama: batching, preemption, sampling, stops."""

import dataclasses

import numpy as np
import pytest

import models
from jpa.engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["The paged cache", "hello", "a much longer prompt that spans several pages of the cache",
           "x", "continuous batching keeps slots busy", "12345", "jax", "last one here"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = models.load("tiny-llama", seed=1)
    return models.GPTForEngine(model), tok


def engine(tiny, tokenizer=None, **kw):
    model, tok = tiny
    cfg = dict(max_seqs=4, page_size=8, num_pages=64, steps_per_call=4, max_model_len=160)
    cfg.update(kw)
    return LLMEngine(model, tokenizer or tok, EngineConfig(**cfg))


def compiled_once(eng) -> bool:
    """The whole run used one compiled program: the unified step (chunked prefill, the default)."""
    r = eng.runner
    return (r.step_traces, r.decode_traces, r.prefill_traces) == (1, 0, 0)


GREEDY = SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny):
    """Each prompt run by itself: the reference outputs."""
    eng = engine(tiny, max_seqs=1)
    return [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_batched_equals_one_at_a_time(tiny, alone):
    eng = engine(tiny)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outs)
    assert eng.pool_is_whole()
    assert compiled_once(eng), "one compiled program for the whole run"


def test_preemption_keeps_outputs(tiny, alone):
    # 16 pages of 8 tokens cannot hold 4 sequences of ~50-100 tokens: someone must be preempted.
    eng = engine(tiny, num_pages=16, watermark=0.0)
    outs = eng.generate(PROMPTS, GREEDY)
    assert eng.stats.preemptions > 0
    assert sum(o.num_preemptions for o in outs) == eng.stats.preemptions
    assert [o.token_ids for o in outs] == alone
    assert eng.pool_is_whole()
    assert compiled_once(eng)


def test_steps_per_call_does_not_change_outputs(tiny, alone):
    eng = engine(tiny, steps_per_call=1, max_seqs=3)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone
    # Rounds with prompt chunks may run no decode step after the ragged step; none runs two.
    assert eng.stats.decode_steps <= eng.stats.decode_calls


def test_seeded_sampling_is_independent_of_batching(tiny):
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=s,
                             ignore_eos=True) for s in range(len(PROMPTS))]
    together = engine(tiny).generate(PROMPTS, params)
    solo = engine(tiny, max_seqs=1)
    apart = [solo.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in apart]
    other_seed = engine(tiny).generate(PROMPTS, [dataclasses.replace(p, seed=p.seed + 100) for p in params])
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in together]


def test_top_k_one_is_greedy(tiny, alone):
    outs = engine(tiny).generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=2.0, top_k=1,
                                                         ignore_eos=True, seed=3))
    assert [o.token_ids for o in outs] == alone


def test_sampling_follows_the_distribution():
    """Tokens drawn by the on-device sampler match softmax(logits / T) restricted by top-k/top-p."""
    import jax.numpy as jnp
    from jpa.engine.sampling import sample

    rng = np.random.default_rng()
    logits = rng.standard_normal(8).astype(np.float32) * 2
    n = 4000
    draw = lambda t, k, p: np.asarray(sample(
        jnp.asarray(np.tile(logits, (n, 1))), jnp.full((n,), t, jnp.float32), jnp.full((n,), k, jnp.int32),
        jnp.full((n,), p, jnp.float32), jnp.arange(n, dtype=jnp.int32), jnp.zeros((n,), jnp.int32)))
    for t, k, p in ((1.0, 0, 1.0), (0.5, 3, 1.0), (1.0, 0, 0.7), (2.0, 20, 1.0), (1.0, 5, 0.8)):
        probs = np.exp(logits / t - np.max(logits / t)); probs /= probs.sum()
        order = np.argsort(-probs)
        keep = np.zeros(8, bool)
        keep[order[: k or 8]] = True
        # top-p applies to the distribution left after top-k (renormalized), as in vLLM.
        after_k = np.where(keep, probs, 0)[order] / probs[keep].sum()
        mass_before = np.cumsum(after_k) - after_k
        keep[order[mass_before >= p]] = False
        want = np.where(keep, probs, 0); want /= want.sum()
        got = np.bincount(draw(t, k, p), minlength=8) / n
        assert np.all(got[~keep] == 0), (t, k, p)
        assert np.max(np.abs(got - want)) < 0.04, (t, k, p, got, want)
    assert np.all(draw(0.0, 0, 1.0) == np.argmax(logits))


class StopAt:
    """Wraps a tokenizer so that `token` is an end-of-sequence token."""

    def __init__(self, tok, token):
        self.tok, self.stop_token_ids, self.eos_token_id = tok, (token,), token

    def encode(self, text):
        return self.tok.encode(text)

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stops_on_eos_and_max_new_tokens(tiny, alone):
    ref = alone[2]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    eng = engine(tiny, tokenizer=StopAt(tiny[1], stop_tok))
    out = eng.generate([PROMPTS[2], PROMPTS[2]], [SamplingParams(max_new_tokens=40, greedy=True),
                                                   SamplingParams(max_new_tokens=3, greedy=True)])
    assert out[0].token_ids == ref[: first + 1] and out[0].finish_reason == "stop"
    assert out[1].token_ids == ref[:3] and out[1].finish_reason == "length" or first < 3
    assert eng.pool_is_whole()


def test_stop_string_cuts_the_completion(tiny, alone):
    model, tok = tiny
    full = tok.decode(list(alone[0]), skip_special_tokens=True)
    target = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    eng = engine(tiny)
    out = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True,
                                                    stop=(target,)))[0]
    assert out.finish_reason == "stop"
    assert out.completion == full[: full.index(target)]
    assert eng.pool_is_whole()


def test_length_limit_of_the_model(tiny):
    eng = engine(tiny, max_model_len=40)
    out = eng.generate(["abcdefghij"], SamplingParams(max_new_tokens=100, greedy=True, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_ids) + len(out.token_ids) == 40


def test_bad_requests_fail_alone(tiny, alone):
    eng = engine(tiny, max_model_len=64)
    outs = eng.generate(["", "x" * 100, PROMPTS[0], PROMPTS[1]],
                        [GREEDY, GREEDY, {"max_new_tokens": 40, "greedy": True, "ignore_eos": True},
                         {"temperature": -1.0}])
    assert outs[0].finish_reason == "error" and "empty prompt" in outs[0].error
    assert outs[1].finish_reason == "error" and "prompt has 100 tokens" in outs[1].error
    assert outs[2].error is None and outs[2].token_ids == alone[0]
    assert "temperature must be a finite number >= 0" in outs[3].error
    assert eng.pool_is_whole()


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(seed=-5), r"seed must be an int in \[0, 2\*\*31\)"),
    (dict(stop=("",)), "stop must be non-empty strings"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
])
def test_sampling_params_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_seqs=0), "EngineConfig.max_seqs must be an int >= 1"),
    (dict(num_pages=0), "EngineConfig.num_pages must be an int >= 1 or None"),
    (dict(watermark=1.0), r"EngineConfig.watermark must be in \[0, 1\)"),
    (dict(attention_impl="cuda"), r"EngineConfig.attention_impl must be one of \('auto', 'xla'"),
])
def test_engine_config_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("stop_len", [22, 23])
def test_stop_string_in_the_round_the_pool_runs_out(stop_len):
    """Regression (issue 12): a stop string finished one request in the round the pool ran out;
    the engine then preempted anyway and raised "a lone sequence ran out of pages"."""
    model, tok = models.load("tiny-llama")
    eng = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(
        max_seqs=2, page_size=8, num_pages=8, steps_per_call=4, watermark=0.0))
    outs = eng.generate(["abcdefghij", "klmnopqrst"],
                        [SamplingParams(max_new_tokens=40, greedy=True, stop=("j" * stop_len,)),
                         SamplingParams(max_new_tokens=40, greedy=True)])
    assert outs[0].finish_reason == "stop" and outs[0].completion == ""
    assert tok.decode(list(outs[0].token_ids)) == "j" * stop_len   # token_ids end at the stop
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 40
    assert eng.pool_is_whole()


def test_step_streams_tokens_and_text(tiny, alone):
    eng = engine(tiny, num_pages=16, watermark=0.0)
    ids = [eng.add_request(p, GREEDY).request_id for p in PROMPTS]
    toks, text, final = {i: () for i in ids}, {i: "" for i in ids}, {}
    while eng.has_unfinished:
        for o in eng.step():
            assert o.request_id not in final, "a request came out twice"
            toks[o.request_id] += o.new_token_ids
            text[o.request_id] += o.new_text
            if o.finished:
                final[o.request_id] = o.output
    assert eng.stats.preemptions > 0
    for i, ref in zip(ids, alone):
        assert toks[i] == final[i].token_ids == ref
        assert text[i] == final[i].completion == tiny[1].decode(list(ref), skip_special_tokens=True)
    # Nothing of a finished request stays in a long-lived engine.
    assert not eng.scheduler.has_unfinished and not eng._live_ids and not eng._outbox
    assert eng.pool_is_whole()


def test_abort_and_add_between_steps(tiny, alone):
    eng = engine(tiny, max_seqs=2)
    a = eng.add_request(PROMPTS[0], GREEDY).request_id
    b = eng.add_request(PROMPTS[1], GREEDY, request_id="b").request_id
    waiting = eng.add_request(PROMPTS[3], GREEDY).request_id
    eng.step()
    assert eng.abort(a) and eng.abort(waiting) and not eng.abort(a) and not eng.abort("nobody")
    c = eng.add_request(PROMPTS[2], GREEDY).request_id
    with pytest.raises(ValueError, match="request_id 'b' is already used"):
        eng.add_request("x", GREEDY, request_id="b")
    outs = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                assert o.request_id not in outs
                outs[o.request_id] = o.output
    assert outs[a].finish_reason == "abort" and 0 < len(outs[a].token_ids) < 40
    assert outs[a].token_ids == alone[0][: len(outs[a].token_ids)]
    assert outs[waiting].finish_reason == "abort" and outs[waiting].token_ids == ()
    assert outs[b].token_ids == alone[1] and outs[c].token_ids == alone[2]
    assert eng.pool_is_whole()


def test_engine_takes_a_model_protocol_not_a_gpt(tiny):
    gpt, tok = models.load("tiny-llama", seed=1)
    with pytest.raises(TypeError, match=r"models.GPTForEngine\(gpt\).*lacks: params, prefill\(\), decode\(\)"):
        LLMEngine(gpt, tok, EngineConfig(num_pages=8))


def test_engine_does_not_import_models():
    """Layering: scripts -> engine -> model; the engine reaches a model only through its protocol."""
    import ast
    import pathlib

    for path in (pathlib.Path(__file__).parents[1] / "jpa" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "models" or n.startswith("models.") for n in names), path


def test_sampled_logprobs_are_those_of_the_sampling_distribution():
    """sample_with_logprobs: log p(token) under softmax(logits / T) restricted by top-k/top-p; a
    greedy row reports the model's own log_softmax(logits)."""
    import jax.numpy as jnp
    from jpa.engine.sampling import sample_with_logprobs

    rng = np.random.default_rng()
    rows = [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.0, 0, 0.7), (2.0, 20, 1.0), (1.0, 5, 0.8), (0.0, 0, 1.0), (0.0, 4, 0.5)]
    n, vocab = len(rows), 32
    logits = (rng.standard_normal((n, vocab)) * 2).astype(np.float32)
    t, k, p = (np.array(c) for c in zip(*rows))
    tok, lp = sample_with_logprobs(jnp.asarray(logits), jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32),
                                   jnp.asarray(p, jnp.float32), jnp.asarray(rng.integers(0, 2 ** 31, n), jnp.int32),
                                   jnp.zeros((n,), jnp.int32))
    tok, lp = np.asarray(tok), np.asarray(lp)
    for r, (ti, ki, pi) in enumerate(rows):
        x = logits[r].astype(np.float64)
        if ti == 0:
            want = (x - np.log(np.sum(np.exp(x - x.max()))) - x.max())[tok[r]]
            assert tok[r] == np.argmax(x)
        else:
            probs = np.exp(x / ti - np.max(x / ti)); probs /= probs.sum()
            order = np.argsort(-probs)
            keep = np.zeros(vocab, bool)
            keep[order[: ki or vocab]] = True
            after_k = np.where(keep, probs, 0)[order] / probs[keep].sum()
            keep[order[(np.cumsum(after_k) - after_k) >= pi]] = False
            kept = np.where(keep, probs, 0) / probs[keep].sum()
            assert keep[tok[r]], (r, tok[r])
            want = np.log(kept[tok[r]])
        np.testing.assert_allclose(lp[r], want, rtol=1e-5, atol=1e-5, err_msg=str(rows[r]))


def test_engine_logprobs_match_the_dense_model(tiny):
    """Greedy logprobs from the engine (prefill's first token, then decode steps, under preemption
    too) equal log_softmax of the dense model's logits at each position; the streamed pieces add
    up to the final list, one per token."""
    import jax
    import jax.numpy as jnp

    gpt = models.load("tiny-llama", seed=1)[0]  # the same weights as the `tiny` fixture's
    params = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
    for kw in ({}, {"num_pages": 6, "watermark": 0.0}):
        eng = engine(tiny, **kw)
        reqs = [eng.add_request(p, params) for p in PROMPTS[:4]]
        streamed = {r.request_id: [] for r in reqs}
        final = {}
        while eng.has_unfinished:
            for o in eng.step():
                assert len(o.new_logprobs) == len(o.new_token_ids)
                streamed[o.request_id] += o.new_logprobs
                if o.finished:
                    final[o.request_id] = o.output
        for r in reqs:
            out = final[r.request_id]
            assert list(out.logprobs) == streamed[r.request_id] and len(out.logprobs) == len(out.token_ids)
            seq = list(out.prompt_ids) + list(out.token_ids)
            dense = np.asarray(jax.nn.log_softmax(models.forward_dense(gpt, jnp.asarray([seq[:-1]]))[0], -1))
            n = len(out.prompt_ids)
            want = [dense[n - 1 + i, t] for i, t in enumerate(out.token_ids)]
            np.testing.assert_allclose(out.logprobs, want, rtol=1e-4, atol=1e-4)
            assert all(lp <= 0 for lp in out.logprobs)
        if kw:
            assert eng.stats.preemptions > 0


def test_stop_string_cut_keeps_one_logprob_per_token(tiny, alone):
    text = tiny[1].decode(alone[1])
    stop = text[6:8]
    out = engine(tiny).generate([PROMPTS[1]], SamplingParams(max_new_tokens=40, greedy=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < 40
