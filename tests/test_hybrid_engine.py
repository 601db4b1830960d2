"""A Qwen3.5 / Qwen3-Next checkpoint (Gated DeltaNet layers beside gated attention) served by the engine.

tests/test_hybrid_models.py checks the model against transformers called directly; tests/test_recurrent_engine.py
checks the engine's state slots with a synthetic hybrid. Here the two meet: the tiny transformers checkpoints of
tests/data/hf/qwen3_5 and qwen3_next, loaded with models.load and run by `LLMEngine`, give transformers' greedy
tokens (and the first token's logprob from transformers' prefill logits), and the same tokens and logprobs
whatever the engine does around them: another chunk budget, preemption and recompute, n = 2 (the state fork),
n-gram speculation (rejected drafts replayed), the step-shape ladder.
"""

import json
import pathlib

import numpy as np
import pytest

from jpa import models
from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.engine.speculative import SpeculativeConfig
from jpa.testing.engine import run

DATA = pathlib.Path(__file__).resolve().parent / "data" / "hf"
BASE = dict(max_seqs=4, page_size=16, num_pages=64, max_model_len=256, steps_per_call=4, watermark=0.0,
            max_num_batched_tokens=64)   # prefix_caching left at its default: off for these models, with a notice
TOL = 2e-3      # engine float32 logprobs against transformers' float64 golden logits (the model tests' tolerance)
SAME = 5e-4     # one engine configuration against another (other chunks and pages: float32 rounding, 1.2e-4 seen)

_LOADED = {}


def _load(family):
    if family not in _LOADED:
        _LOADED[family] = models.load(DATA / family, dtype=np.float32)
    return _LOADED[family]


def _golden(family):
    g = json.loads((DATA / family / "golden.json").read_text())
    return g, np.load(DATA / family / "golden.npz")


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _generate(family, prompts, new_tokens, n=1, **config):
    model, tok = _load(family)
    eng = LLMEngine(model, tok, EngineConfig(**{**BASE, **config}))
    params = [SamplingParams(max_new_tokens=k, greedy=True, ignore_eos=True, n=n) for k in new_tokens]
    return eng, run(eng, prompts, params)


def _prompts(family):
    g, _ = _golden(family)
    keys = list(g["prompts"])
    return g, keys, [g["prompts"][k]["ids"] for k in keys]


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.bench)])
def test_the_engine_gives_transformers_greedy_tokens(family):
    """All four golden prompts at once (the long one, 156 tokens, crosses two 64-token GDN chunks and is cut by
    the 64-token budget into three chunks): transformers' 32 greedy tokens each, and the first token's logprob
    from transformers' prefill logits."""
    g, keys, prompts = _prompts(family)
    _, arrays = _golden(family)
    eng, outs = _generate(family, prompts, [len(g["prompts"][k]["greedy_ids"]) for k in keys])
    assert eng.summary()["prefix_caching"] is False   # the default, resolved for a model with recurrent state
    for k, o in zip(keys, outs):
        assert list(o.token_ids) == g["prompts"][k]["greedy_ids"], k
        want = _log_softmax(arrays[f"{k}_logits"][-1])[o.token_ids[0]]
        assert abs(o.logprobs[0] - want) <= TOL, (k, o.logprobs[0], want)


def _same(base, other, where):
    for i, (a, b) in enumerate(zip(base, other)):
        b = b[0] if isinstance(b, list) else b
        assert list(b.token_ids) == list(a.token_ids), f"{where}: request {i} tokens"
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=SAME, rtol=0, err_msg=f"{where}: request {i}")


@pytest.mark.bench
def test_engine_features_leave_the_outputs_unchanged():
    """Against the baseline run: a 16-token budget with a pool that preempts (and recomputes from position 0),
    n = 2 (both samples, the second on a slot whose states were copied at the fork), n-gram speculation, and the
    step-shape ladder: the same greedy tokens and logprobs."""
    family = "qwen3_5"
    g, keys, prompts = _prompts(family)
    lens = [40, 36, 40, 32]
    _, base = _generate(family, prompts, lens)
    # the three shorter prompts (the long one would wait for the others): 20 pages of 8 hold their prompts, not
    # their 40 new tokens each, so growing sequences preempt one another
    short = [i for i, k in enumerate(keys) if k != "long"]
    eng, small = _generate(family, [prompts[i] for i in short], [40] * len(short), max_num_batched_tokens=16,
                           page_size=8, num_pages=22)
    assert eng.stats.preemptions > 0, "the pool must be small enough to preempt"
    _, wide = _generate(family, [prompts[i] for i in short], [40] * len(short))
    _same(wide, small, "budget 16 + preemption")
    _, forked = _generate(family, prompts, lens, n=2)
    for i, pair in enumerate(forked):
        assert len(pair) == 2
        _same([base[i]] * 2, [[s] for s in pair], f"n=2 request {i}")
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, verify_rows=16)
    eng, specd = _generate(family, prompts, lens, speculative=spec)
    s = eng.summary()["speculative"]
    assert s["num_accepted_tokens"] < s["num_draft_tokens"], s   # drafts rejected: their rows were replayed
    _same(base, specd, "n-gram speculation")
    _, laddered = _generate(family, prompts, lens, step_shapes="ladder")
    _same(base, laddered, "step-shape ladder")
