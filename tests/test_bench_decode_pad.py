"""The idle row a GPU's plain decode pass adds at max_seqs 1 (`jpa.engine.verify.decode_pad_rows`,
tests/test_traffic.py's traffic reason) changes no output: two engine compiles, CI's bench tier
(the deviceless H100 compile in tests/test_traffic.py covers the GPU program)."""

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.soak]


def test_padded_decode_pass_gives_the_same_tokens(ctx_model, monkeypatch):
    """The idle row a GPU's decode pass adds at max_seqs 1 (`verify.decode_pad_rows`: a two-row
    gemm reads wk / wv in place) changes no token or log-probability: forced here on the CPU, one
    sequence at a time, greedy and seeded sampling with top-k / top-p, against the same engine
    without it."""
    import numpy as np

    from jpa.engine import EngineConfig, LLMEngine, SamplingParams, verify
    from jpa.testing.engine import BASE, random_prompts, run
    model, tok = ctx_model
    prompts = random_prompts(np.random.default_rng(4), 3, hi=30)
    params = [SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=1.3, seed=8, ignore_eos=True, top_logprobs=2)]
    cfg = EngineConfig(**{**BASE, "max_seqs": 1})
    outs = []
    for pad in (0, 1):
        monkeypatch.setattr(verify, "decode_pad_rows", lambda n, pad=pad: pad)
        outs.append(run(LLMEngine(model, tok, cfg), prompts, params))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
