"""Randomized engine test at CI size (benchmarks/soak_engine.py is the long version; the driver is jpa/testing/soak.py).

Random prompt lengths, max_new_tokens, stop strings and sampling parameters (greedy and seeded)
on a tiny pool (2 slots, 8 pages of 4 tokens) with requests arriving between steps and random
aborts. Checked: no request lost or duplicated, the device page state consistent after every
round and the pool whole at the end, preemptions happened, streamed pieces add up to the
results, stop strings cut right, and every output (token ids, finish reason, completion and
per-token logprobs, greedy and sampled alike) identical to the reference engine's (no preemption,
no sharing: jpa.testing.engine).
"""

import os

import numpy as np
import pytest

from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.testing import soak


@pytest.mark.soak
def test_random_requests_under_page_pressure(engines, ctx_model):
    # A fixed seed unless JPA_TEST_SEED names another: what this test asserts besides equality
    # depends on the draw (random aborts may take the two long requests before they preempt, and
    # the workload's own coin flips: fewer than 5 seeded samples in 1 run of 2300, no stop string
    # in 0.6^22 and more), so a fresh draw could fail without a bug. benchmarks/soak_engine.py runs
    # fresh seeds (its checks are the equalities only).
    seed = int(os.environ.get("JPA_TEST_SEED") or 20)
    print(f"seed {seed}")  # shown on failure: reproduce with JPA_TEST_SEED=seed
    rng = np.random.default_rng(seed)
    eng = LLMEngine(*ctx_model, EngineConfig(max_seqs=2, page_size=4, num_pages=8, steps_per_call=3,
                                             max_model_len=32, watermark=0.0))
    # Two long requests first (greedy, seeded): together they need twice the pool: preemption.
    long = SamplingParams(max_new_tokens=20, greedy=True, ignore_eos=True)
    workload = [("abcdefghijkl", long), ("mnopqrstuvwx", SamplingParams(max_new_tokens=20, seed=int(rng.integers(
        1 << 30)), ignore_eos=True))]
    workload += soak.make_workload(rng, 22, 32, max_prompt=12, max_new=20)

    from jpa.testing.engine import REFERENCE
    ref_eng = engines.get(**REFERENCE)
    p0 = ref_eng.stats.preemptions
    # Stop strings on the random requests (not on the two long ones).
    free = soak.run(ref_eng, workload)[0]
    workload = workload[:2] + soak.with_stops(rng, workload[2:], [free[i] for i in range(2, len(workload))])
    ref, _ = soak.run(ref_eng, workload)
    assert ref_eng.stats.preemptions == p0 and ref_eng.pool_is_whole()

    got, counts = soak.run(eng, workload, rng, abort_p=0.03, wave=6, check=True)
    assert counts["lost"] == 0 and counts["duplicated"] == 0 and counts["stream_mismatch"] == 0, counts
    assert eng.stats.preemptions > 0
    assert eng.pool_is_whole()
    m = soak.compare(workload, ref, got, ctx_model[1])
    stops = sum(o.finish_reason == "stop" for o in got.values())
    print(m, counts, eng.stats.preemptions, stops)
    assert m["greedy_mismatch"] == 0 and m["sampled_mismatch"] == 0 and m["logprob_mismatch"] == 0, m
    assert m["abort_not_prefix"] == 0 and m["bad_stop"] == 0 and m["errors"] == 0, m
    assert sum(not p.is_greedy for _, p in workload) >= 5, "seeded samples are compared too"
    assert stops >= 1, "stop strings are checked"
    for i in (0, 1):
        if got[i].finish_reason != "abort":
            assert got[i].token_ids == ref[i].token_ids and len(got[i].token_ids) == 20
