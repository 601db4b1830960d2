"""Prompt logprobs (SamplingParams.prompt_logprobs) and the text options (include_stop_str_in_output,
skip_special_tokens) through the engine.

Prompt logprobs are computed on the device, in the ragged pass, from the model's hidden rows
(EngineModel's optional ragged_hidden/head pair). The oracle is a dense forward pass without a
cache (`models.forward_dense`): log_softmax at row p - 1 gathered at prompt token p, its rank and
the top k of the row. Prompts are longer than the token budget (chunked prefill: a chunk's last
row predicts the next chunk's first token), start with cached pages (a request that asks does not
read the prefix cache), are preempted and recomputed (nothing computed twice) and have parallel
samples (computed once, reported with each).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpa import models
from jpa.testing.engine import BASE, fresh_seed, random_prompts, snapshot
from jpa.engine import SamplingParams
from jpa.engine.detokenizer import IncrementalDetokenizer
from jpa.models.tokenizer import ByteTokenizer

pytestmark = pytest.mark.xdist_group("engines_b")  # one worker compiles the group's programs once

ATOL = 1e-4   # f32: the paged ragged pass vs the dense forward


def dense_log_softmax(model, ids) -> np.ndarray:
    """f32[len(ids), vocab]: log_softmax of the dense forward pass of one sequence."""
    gpt = nnx.merge(model.graphdef, model.params)
    logits = models.forward_dense(gpt, jnp.asarray([ids], jnp.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def check_prompt_logprobs(model, out, k: int):
    """out.prompt_logprobs equal the dense model's: logprob, rank and the top k (tie-robust: each
    reported id's dense logprob is the reported value, and the values are the dense top k)."""
    ids = list(out.prompt_ids)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None, out.request_id
    lsm = dense_log_softmax(model, ids)
    rows = lsm[:-1]                                                  # row p - 1 predicts token p
    want = rows[np.arange(len(ids) - 1), ids[1:]]
    got = np.array([e.logprob for e in plp[1:]])
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=str(out.request_id))
    for p, e in enumerate(plp[1:]):
        row = rows[p]
        lo, hi = int((row > want[p] + ATOL).sum()) + 1, int((row >= want[p] - ATOL).sum())
        assert lo <= e.rank <= hi, (p, e.rank, lo, hi)
        assert len(e.top) == k
        if k:
            top_vals, _ = jax.lax.top_k(jnp.asarray(row), k)
            top_ids = [t for t, _ in e.top]
            assert len(set(top_ids)) == k
            np.testing.assert_allclose([v for _, v in e.top], np.asarray(top_vals), rtol=0, atol=ATOL)
            np.testing.assert_allclose(row[top_ids], np.asarray(top_vals), rtol=0, atol=ATOL)


@contextlib.contextmanager
def counting_prompt_rows(eng):
    """Counts the prompt rows the device is asked to score (rows[0]) while the block runs."""
    rows = [0]
    step = eng.runner.step

    def counting(batch):
        rows[0] += int((np.asarray(batch.prompt.targets) >= 0).sum())
        return step(batch)

    eng.runner.step = counting
    try:
        yield rows
    finally:
        del eng.runner.step


def drive(eng, prompts, params):
    """Runs requests with add_request/step (page state checked every round); returns (outputs,
    how many StepOutputs of each request carried prompt_logprobs (always the final ones), prompt
    rows the device was asked for in total)."""
    with counting_prompt_rows(eng) as rows:
        tag = object()
        for k, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(p, sp, request_id=(tag, k))
        final, carried = {}, {}
        while eng.has_unfinished:
            for o in eng.step():
                if o.prompt_logprobs is not None:
                    carried.setdefault(o.request_id, []).append(o.prompt_logprobs)
                if o.finished:
                    final[o.request_id] = o.output
            eng.check_page_state()
    for rid, seen in carried.items():
        assert all(s == final[rid].prompt_logprobs for s in seen), rid
    carried = {rid: len(seen) for rid, seen in carried.items()}
    outs = []
    for k, sp in enumerate(params):
        rid = (tag, k)
        outs.append(final[rid] if sp.n == 1 else [final[(rid, i)] for i in range(sp.n)])
    return outs, carried, rows[0]


def test_prompt_logprobs_equal_the_dense_forward_chunked(ctx_model, engines):
    """Prompts up to 4x the token budget (32), with decoding requests in the same rounds; each
    prompt's logprobs, ranks and top-k equal the dense forward's; the generated tokens are those
    of the same requests without prompt logprobs."""
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    model, _ = ctx_model
    # The first (it asks for prompt logprobs) longer than the budget by construction: 6 draws in
    # [2, 120] all within it were a 3e-4 event.
    prompts = (random_prompts(rng, 1, lo=BASE["max_num_batched_tokens"] + 1, hi=120)
               + random_prompts(rng, 7, lo=2, hi=120))
    ks = [int(rng.choice([0, 1, 5, 20])) if i % 4 != 3 else None for i in range(8)]
    base = [SamplingParams(max_new_tokens=int(rng.integers(1, 12)), greedy=bool(i % 2), temperature=0.9,
                           seed=int(rng.integers(0, 2 ** 30)), ignore_eos=True) for i in range(8)]
    params = [dataclasses.replace(b, prompt_logprobs=k) for b, k in zip(base, ks)]
    eng = engines.get()
    outs, carried, rows = drive(eng, prompts, params)
    assert any(len(p) > BASE["max_num_batched_tokens"] for p, k in zip(prompts, ks) if k is not None)
    for o, k in zip(outs, ks):
        if k is None:
            assert o.prompt_logprobs is None and o.request_id not in carried
        else:
            check_prompt_logprobs(model, o, k)
            assert carried[o.request_id] == 1   # streamed once
    assert rows == sum(len(p) - 1 for p, k in zip(prompts, ks) if k is not None)   # each row computed once
    ref = engines.reference(prompts, base)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, rtol=0, atol=1e-5)
    assert eng.summary()["step_compiles"] == 1


def test_prompt_logprobs_with_cached_prefixes(ctx_model, engines):
    """A prompt whose pages are cached: a request that asks for prompt logprobs computes the whole
    prompt (every position reported, equal to the dense forward), one that does not still hits."""
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    model, _ = ctx_model
    shared = rng.integers(3, 256, 40).tolist()
    prompts = [shared + rng.integers(3, 256, int(rng.integers(1, 20))).tolist() for _ in range(4)]
    eng = engines.get()
    greedy = SamplingParams(max_new_tokens=3, greedy=True, ignore_eos=True)
    drive(eng, [shared + [7]], [greedy])                       # caches the shared pages
    before = snapshot(eng)
    hits0 = eng.summary()["prefix_hit_tokens"]
    outs, _, rows = drive(eng, prompts[:2], [SamplingParams(max_new_tokens=3, greedy=True, ignore_eos=True,
                                                            prompt_logprobs=3)] * 2)
    assert eng.summary()["prefix_hit_tokens"] == hits0          # they did not read the cache
    assert rows == sum(len(p) - 1 for p in prompts[:2])
    for o in outs:
        check_prompt_logprobs(model, o, 3)
    plain, _, rows = drive(eng, prompts[2:], [greedy] * 2)
    assert rows == 0 and eng.summary()["prefix_hit_tokens"] > hits0   # the others still hit
    assert eng.stats.preemptions == before.preemptions


@pytest.mark.soak
def test_prompt_logprobs_survive_preemption_and_forks(ctx_model, engines):
    """A pool that forces preemption (recompute) and parallel samples: every request's prompt
    logprobs are complete and equal the dense forward's, each prompt row is computed once (a
    recompute asks for none; n samples share their leader's), and each sample's stream carries
    them once."""
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    model, _ = ctx_model
    # Any two of these outgrow the pool together (>= 110 tokens = 14 pages each, of 26), but
    # whether two run together long enough is the schedule's, a function of the lengths (ignore_eos;
    # random tokens share no page): lengths and max_new_tokens are seeded (this schedule preempts,
    # the same every run), the tokens stay fresh.
    sizes = np.random.default_rng(20)
    prompts = [random_prompts(rng, 1, lo=int(n), hi=int(n))[0] for n in sizes.integers(60, 91, 6)]
    params = [SamplingParams(max_new_tokens=int(sizes.integers(50, 70)), temperature=0.8, seed=i, ignore_eos=True,
                             prompt_logprobs=int(sizes.choice([0, 4])), n=3 if i == 2 else 1) for i in range(6)]
    eng = engines.get(num_pages=26)
    before = snapshot(eng)
    outs, carried, rows = drive(eng, prompts, params)
    assert eng.stats.preemptions > before.preemptions, "the pool was meant to force preemption"
    assert rows == sum(len(p) - 1 for p in prompts)
    for o, sp in zip(outs, params):
        for s in (o if isinstance(o, list) else [o]):
            check_prompt_logprobs(model, s, sp.prompt_logprobs)
            assert carried[s.request_id] == 1
    assert outs[2][0].prompt_logprobs == outs[2][1].prompt_logprobs == outs[2][2].prompt_logprobs


def test_a_model_without_the_hidden_pair_refuses_prompt_logprobs(ctx_model):
    """EngineModel's ragged_hidden/head pair is optional: without it the request fails, naming it."""
    from jpa.engine import EngineConfig, LLMEngine

    model, tok = ctx_model

    class NoPair:   # the required protocol only
        config, dtype, params = model.config, model.dtype, model.params
        ragged, decode = model.ragged, model.decode

    eng = LLMEngine(NoPair(), tok, EngineConfig(**BASE))
    eng.add_request([5, 6, 7], SamplingParams(prompt_logprobs=1))
    (o,) = eng.step()
    assert o.finished and o.output.finish_reason == "error" and "ragged_hidden" in o.output.error
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)


# ---------------------------------------------------------------------- text options

def test_detokenizer_include_stop_and_special_tokens():
    """include_stop keeps the stop string (and not what follows it in the same token); with
    skip_special_tokens False special tokens are in the text and in the stop search; the
    streamed pieces always join to the text."""
    tok = ByteTokenizer()
    ids = tok.encode("one two") + [258] + tok.encode(" three. four")
    for include in (False, True):
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, ("e. f", "<pad> t"), include_stop=include, skip_special_tokens=skip)
            pieces, kept = [], 0
            for i in range(0, len(ids), 3):
                kept += det.add(ids[i:i + 3])
                pieces.append(det.take_delta(det.stopped))
                if det.stopped:
                    break
            full = tok.decode(ids, skip_special_tokens=skip)
            stop = "e. f" if skip else "<pad> t"
            end = full.index(stop) + (len(stop) if include else 0)
            assert det.text == "".join(pieces) == full[:end], (include, skip, det.text)
            assert tok.decode(ids[:kept], skip_special_tokens=skip).startswith(det.text)


def test_include_stop_str_and_special_tokens_through_the_engine(engines):
    """A stop string found in a greedy run: the completion ends before it, or (include) with it;
    a forced special token shows its text only with skip_special_tokens False, and a final EOS's
    text is kept with include_stop_str_in_output (vLLM)."""
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    eng = engines.get()
    prompt = rng.integers(97, 123, 20).tolist()
    for s in range(20):   # seeded sampling: varied text (greedy may loop on one character)
        sp = SamplingParams(max_new_tokens=40, temperature=1.0, seed=int(rng.integers(0, 2 ** 30)), ignore_eos=True)
        base = eng.generate([prompt], sp)[0].completion
        clean = [i for i in range(5, len(base) - 3) if "\ufffd" not in base[i:i + 2] and base.find(base[i:i + 2]) == i]
        if clean:
            break
    assert clean, base
    stop = base[clean[0]:clean[0] + 2]
    cut, kept = eng.generate([prompt] * 2, [dataclasses.replace(sp, stop=(stop,), include_stop_str_in_output=inc)
                                            for inc in (False, True)])
    assert cut.completion == base[:clean[0]] and kept.completion == base[:clean[0] + 2]
    assert cut.finish_reason == kept.finish_reason == "stop" and cut.token_ids == kept.token_ids
    pad = {ByteTokenizer.PAD: 100.0}
    skipped, shown = eng.generate([prompt] * 2, [SamplingParams(max_new_tokens=3, greedy=True, ignore_eos=True,
                                                                logit_bias=pad, skip_special_tokens=skip)
                                                 for skip in (True, False)])
    assert skipped.token_ids == shown.token_ids == (ByteTokenizer.PAD,) * 3
    assert skipped.completion == "" and shown.completion == "<pad>" * 3
    eos = {ByteTokenizer.EOS: 100.0}
    outs = eng.generate([prompt] * 3, [SamplingParams(max_new_tokens=3, greedy=True, logit_bias=eos, **kw) for kw in
                                       (dict(skip_special_tokens=False),
                                        dict(skip_special_tokens=False, include_stop_str_in_output=True),
                                        dict(include_stop_str_in_output=True))])
    assert all(o.token_ids == (ByteTokenizer.EOS,) and o.finish_reason == "stop" for o in outs)
    assert [o.completion for o in outs] == ["", "<eos>", ""]


def test_a_prompt_preempted_mid_prefill_asks_only_for_what_it_lacks(ctx_model, engines):
    """A request preempted while its prompt is half computed keeps the prompt logprobs it has; its
    recompute asks the device only for the missing rows, and the result equals the dense forward."""
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    model, _ = ctx_model
    eng = engines.get()
    sched = eng.scheduler
    eng.add_request(rng.integers(3, 256, 10).tolist(), SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True))
    eng.step()
    prompt = rng.integers(3, 256, int(rng.integers(80, 150))).tolist()
    b = eng.add_request(prompt, SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True, prompt_logprobs=3))
    eng.step()
    assert b.phase.value == "prefilling" and 0 < len(b.prompt_lp) < len(prompt) - 1
    # The pool "runs short" at the end of the next round: the newest admitted (b, mid-prefill) goes.
    at_preemption = []

    def short():
        if b.slot >= 0 and b.phase.value == "prefilling":
            at_preemption.append(len(b.prompt_lp))
            return 10 ** 6
        return 0

    sched.next_step_pages = short
    try:
        eng.step()
    finally:
        del sched.next_step_pages
    assert b.phase.value == "waiting" and b.num_preemptions == 1
    assert 0 < at_preemption[0] < len(prompt) - 1 and len(b.prompt_lp) == at_preemption[0]
    outs = {}
    with counting_prompt_rows(eng) as rows:
        while eng.has_unfinished:
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.output
            eng.check_page_state()
    assert rows[0] == len(prompt) - 1 - at_preemption[0]   # the recompute asked only for what was missing
    out = outs[b.request_id]
    assert out.num_preemptions == 1
    check_prompt_logprobs(model, out, 3)
