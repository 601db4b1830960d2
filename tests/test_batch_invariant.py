"""batch_invariant=True (issue 53): a request's tokens and logprobs are bitwise the same whatever else runs
(batch size, slot, neighbours, prefill chunking, steps_per_call, preemption and recompute, prefix-cache
hits), and the prompt logprobs of prompt + completion equal the greedy sampler's logprobs (scoring parity).
On CPU, on fresh random inputs."""

import numpy as np
import pytest

from jpa import LLM, SamplingParams
from jpa.engine import EngineConfig
from jpa.testing.engine import context_gpt

ENGINE = dict(max_seqs=4, page_size=8, num_pages=120, max_num_batched_tokens=32, watermark=0.0, batch_invariant=True)


@pytest.fixture(scope="module")
def model():
    return context_gpt(1)


def targets(rng):
    """A greedy and a seeded sampled request, with logprobs, on random prompts."""
    prompts = [rng.integers(3, 250, int(rng.integers(20, 40))).tolist() for _ in range(2)]
    params = [SamplingParams(max_tokens=int(rng.integers(10, 20)), temperature=t, seed=int(rng.integers(1 << 20)),
                             logprobs=1, ignore_eos=True) for t in (0.0, 0.9)]
    return prompts, params


def neighbours(rng, n, target_prompts):
    """Random requests, some long (chunked across rounds), some sharing a target's prefix."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            p = target_prompts[i % 2][: int(rng.integers(8, 20))] + rng.integers(3, 250, 5).tolist()
        else:
            p = rng.integers(3, 250, int(rng.integers(3, 70))).tolist()
        out.append((p, SamplingParams(max_tokens=int(rng.integers(2, 40)), temperature=float(rng.uniform(0, 1.2)),
                                      seed=int(rng.integers(1 << 20)), ignore_eos=True)))
    return out


def run_mixed(llm, rng, prompts, params, n=9):
    """The targets among neighbours, in a random order; returns the targets' outputs."""
    reqs = [(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))] + [
        (p, sp, None) for p, sp in neighbours(rng, n, prompts)]
    order = rng.permutation(len(reqs))
    outs = llm.generate([reqs[k][0] for k in order], [reqs[k][1] for k in order])
    got = {reqs[k][2]: o for k, o in zip(order, outs) if reqs[k][2] is not None}
    return [got[i] for i in range(len(prompts))]


def bits(outs):
    return [(o.token_ids, np.asarray(o.logprobs, np.float32).tobytes()) for o in outs]


@pytest.mark.bench   # two compiles (a second engine for preemption and steps_per_call): about 20 s
def test_tokens_and_logprobs_do_not_depend_on_the_batch(model):
    gpt, tok = model
    rng = np.random.default_rng()
    prompts, params = targets(rng)
    llm = LLM.from_model(gpt, tok, **ENGINE)
    alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    llm.engine.flush_prefix_cache()
    # Mixed twice: the second time the targets' prompts hit the prefix cache.
    mixed = run_mixed(llm, rng, prompts, params)
    hits = run_mixed(llm, rng, prompts, params)
    assert all(o.num_cached_tokens > 0 for o in hits)
    # A small pool (preemption and recompute) and another steps_per_call: another engine.
    small = LLM.from_model(gpt, tok, **{**ENGINE, "num_pages": 14, "steps_per_call": 3})
    squeezed = []
    for _ in range(4):  # random neighbours need not overflow 14 pages: fresh ones until a run preempts (bounded)
        squeezed.append(run_mixed(small, rng, prompts, params, n=8))
        if small.engine.stats.preemptions:
            break
    assert small.engine.stats.preemptions > 0
    assert bits(mixed) == bits(alone) and bits(hits) == bits(alone) and all(bits(r) == bits(alone) for r in squeezed)


def test_scoring_parity(model):
    """The prompt logprobs of prompt + completion are, bitwise, the greedy sampler's logprobs."""
    gpt, tok = model
    rng = np.random.default_rng()
    llm = LLM.from_model(gpt, tok, **ENGINE)
    prompt = rng.integers(3, 250, int(rng.integers(5, 30))).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=int(rng.integers(8, 30)), temperature=0.0, logprobs=1,
                                                ignore_eos=True))[0]
    llm.engine.flush_prefix_cache()
    full = list(prompt) + list(out.token_ids)
    scored = llm.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    got = [scored.prompt_logprobs[len(prompt) + i].logprob for i in range(len(out.token_ids))]
    assert np.asarray(got, np.float32).tobytes() == np.asarray(out.logprobs, np.float32).tobytes()


@pytest.mark.parametrize("kw, match", [
    (dict(batch_invariant=1), "batch_invariant must be a bool"),
    (dict(batch_invariant=True, speculative={"method": "ngram", "num_speculative_tokens": 2}),
     "batch_invariant does not go with speculative decoding"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_batch_invariant_flag():
    import argparse

    from jpa.args import EngineArgs

    ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(ap)
    assert EngineArgs.from_cli_args(ap.parse_args(["--batch-invariant"])).engine_config().batch_invariant
    assert not EngineArgs.from_cli_args(ap.parse_args([])).engine_config().batch_invariant


def test_batch_invariant_needs_one_step_shape():
    with pytest.raises(ValueError, match="batch_invariant needs one compiled step shape"):
        EngineConfig(batch_invariant=True, step_shapes="ladder")
