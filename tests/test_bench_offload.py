"""KV offload's bench tier: benchmarks/bench_offload.py end to end on the tiny random model (outputs
identical on and off, fewer prompt tokens computed with offload), and a host tier too small for
some preempted requests (those are recomputed; outputs unchanged)."""

import dataclasses
import importlib.util
import pathlib

import numpy as np
import pytest

from jpa.testing.engine import assert_same, mixed_params, random_prompts, run, snapshot
from jpa.tools import deviceless

pytestmark = [pytest.mark.bench, pytest.mark.soak]   # CI's bench tier (.ci/run), not ./run test

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_offload.py"


def _assert_constraints_met(specs, outs):
    """Every sample of each request finished by its constraint: a JSON schema (dict) or a regex."""
    import re

    from structured_util import check_json

    for spec, group in zip(specs, outs):
        for o in group:
            assert o.finish_reason == "stop", (spec, o.completion)
            if isinstance(spec, dict):
                check_json(o.completion, spec)
            else:
                assert re.fullmatch(spec, o.completion), (spec, o.completion)


def test_bench_script_tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_offload_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--model", "tiny-llama", "--json", str(tmp_path / "offload.json")])
    assert r["same_tokens"] == "16/16"
    assert r["off"]["preemptions"] > 0 and r["on"]["swapped_in"] > 0
    assert r["on"]["prefill_tokens"] < r["off"]["prefill_tokens"]
    assert (tmp_path / "offload.json").exists()


def test_small_host_tier_recomputes_the_rest(engines):
    """A host tier of 4 pages holds blocks of at most 4 pages: longer preempted requests are
    recomputed, shorter ones swapped; outputs equal the reference either way."""
    rng = np.random.default_rng(7)
    lens = np.random.default_rng(20).integers(20, 51, 6)
    prompts = [random_prompts(rng, 1, lo=int(m), hi=int(m))[0] for m in lens]
    params = mixed_params(rng, 6, lo=40, hi=40)
    want = engines.reference(prompts, params)
    probe = engines.get(num_pages=16)
    eng = engines.get(num_pages=16, kv_offload_bytes=4 * probe.cache_config.bytes_per_page)
    assert eng.host_tier.num_pages == 4
    before = snapshot(eng)
    got = run(eng, prompts, params)
    st = eng.stats
    assert st.preemptions - before.preemptions > st.swapped_out - before.swapped_out, "some were recomputed"
    assert_same(got, want, "a small host tier")
    assert eng.pool_is_whole()


def test_swap_with_speculation_and_prompt_logprobs(engines):
    """n-gram speculation (the verify loop's drafts reserve and roll back pages) and a request asking
    for prompt logprobs, under preemption with offload: outputs equal the reference."""
    from jpa.engine import SpeculativeConfig

    ngram = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, verify_rows=16)
    rng = np.random.default_rng(20)
    lens = np.random.default_rng(20).integers(20, 51, 6)
    prompts = []
    for m in lens:   # a few random segments repeated: the n-gram lookup finds drafts
        segs = [rng.integers(3, 40, int(rng.integers(2, 6))).tolist() for _ in range(3)]
        toks = []
        while len(toks) < m:
            toks += segs[int(rng.integers(3))]
        prompts.append(toks[:m])
    params = mixed_params(rng, 6, lo=40, hi=40)
    params[2] = dataclasses.replace(params[2], prompt_logprobs=2)
    want = engines.reference(prompts, params)
    eng = engines.get(num_pages=16, kv_offload_bytes=64 << 20, speculative=SpeculativeConfig(**ngram))
    before = snapshot(eng)
    got = run(eng, prompts, params)
    assert eng.stats.swapped_in > before.swapped_in, "some request came back from the host tier"
    assert eng.stats.spec_accepted_tokens > before.spec_accepted_tokens
    assert_same(got, want, "offload + speculation")
    g, w = got[2].prompt_logprobs, want[2].prompt_logprobs
    assert len(g) == len(w)
    np.testing.assert_allclose([x.logprob for x in g[1:]], [x.logprob for x in w[1:]], atol=1e-5)
    assert eng.pool_is_whole()


def test_swap_with_structured_outputs_and_parallel_samples(engines):
    """tests/test_structured.py's preemption case with offload on: constrained requests (their
    grammar matchers stay on the host across a swap) and n = 2 samples, in a pool too small for
    them; every output meets its constraint and equals a separate request's on an ample pool."""
    import re

    from jpa.engine import SamplingParams
    from structured_util import random_regex, random_schema

    rng = np.random.default_rng(20)
    eng = engines.get(num_pages=20, kv_offload_bytes=64 << 20)
    before = snapshot(eng)
    schemas = [random_schema(rng) for _ in range(3)]
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=int(rng.integers(2 ** 30)), n=2,
                             structured={"json": s}) for s in schemas]
    regex = random_regex(rng)
    params.append(SamplingParams(max_new_tokens=60, temperature=1.0, seed=3, n=2, structured={"regex": regex}))
    prompts = random_prompts(rng, len(params), 30, 50)
    outs = run(eng, prompts, params)
    assert eng.stats.swapped_in > before.swapped_in, "the test must swap"
    _assert_constraints_met(schemas + [regex], outs)
    ample = engines.get()
    alone = run(ample, [p for p in prompts for _ in range(2)],
                [dataclasses.replace(sp, n=1, seed=sp.seed + i) for sp in params for i in range(2)])
    assert_same(outs, alone, "offload + structured outputs")
    assert eng.pool_is_whole()


def test_spill_multi_turn_on_off_identical(engines):
    """Prefix-cache spill over three turns of four chats (one with n = 2 samples, greedy and seeded),
    one request at a time in a 16-page pool that cannot hold the histories (a 64 MiB host tier can):
    outputs equal with offload on and off, turn by turn (tests/test_kv_offload.py compares a host
    hit with the reference); the on engine hits the host tier (the off engine recomputes those
    tokens); both tiers whole at the end."""
    from test_kv_offload import chat_turn

    rng = np.random.default_rng(38)
    on, off = engines.get(num_pages=16, kv_offload_bytes=64 << 20), engines.get(num_pages=16)
    b_on, b_off = snapshot(on), snapshot(off)
    hh0 = on.scheduler.prefix.host_hit_tokens
    histories = [random_prompts(rng, 1, lo=24, hi=24)[0] for _ in range(4)]
    params = mixed_params(rng, 4, lo=8, hi=8)
    params[3] = dataclasses.replace(params[3], n=2, greedy=False, temperature=1.0, seed=int(rng.integers(2 ** 30)))
    for turn in range(3):
        prompts, got = chat_turn(on, histories, rng, params)
        assert_same(got, run(off, prompts, params), f"turn {turn}: offload on vs off")
    host_hits = on.scheduler.prefix.host_hit_tokens - hh0
    assert host_hits > 0 and on.stats.restore_pages > b_on.restore_pages
    assert on.stats.prefill_tokens - b_on.prefill_tokens < off.stats.prefill_tokens - b_off.prefill_tokens
    tier = on.host_tier
    assert on.pool_is_whole() and off.pool_is_whole() and tier.num_free + len(tier.spilled) == tier.num_pages


def test_generate_summary_line_has_offload(tmp_path, capsys):
    """`jpa generate --kv-offload-memory` prints the offload figures on its summary line and in --json."""
    import json

    from jpa.cli import generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"tell me about {w} " * 6, "max_new_tokens": 24,
                                             "greedy": True}) for w in ("rivers", "stars", "cells", "ships")) + "\n")
    rc = generate.main(["--model", "tiny-llama", "--prompts-file", str(prompts), "--json", "--no-progress",
                        "--max-seqs", "4", "--page-size", "8", "--num-pages", "24", "--kv-offload-memory", "0.01",
                        "--no-compile-cache"])
    out, err = capsys.readouterr()
    summary = json.loads(out.splitlines()[-1])["summary"]["kv_offload"]
    assert rc == 0 and summary["host_pages"] > 0 and "spilled_pages" in summary and "cost_rule" in summary
    assert "KV offload: " in err and "prefix pages spilled" in err and "pool whole after run: True" in err


@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_offload_compile_check_h100(tmp_path):
    """`jpa tools compile-offload` (deviceless H100, ~35 s here): swap-out and spill outputs in
    host memory through asynchronous copies, swap-in and restore update the donated pool in place,
    the engine's step holds no host transfer."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "report.json"
    root = str(SCRIPT.parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-m", "jpa.tools", "compile-offload", "--json", str(out)],
                          capture_output=True, text=True,
                          timeout=900, env=env, cwd=root)
    assert out.exists(), proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert proc.returncode == 0 and r["problems"] == [], r["problems"]
    for name in ("swap_out", "spill"):
        assert r[name]["host_output_bytes"] == r["block_bytes"] and r[name]["copy_starts"] > 0, name
    for name in ("swap_in_scatter", "restore_scatter"):
        assert r[name]["alias_bytes"] >= r["pool_bytes"] and r[name]["pool_copies"] == 0, name
    step = r["engine_step"]
    assert step["compiled"] and step["host_buffers"] == 0 and step["copy_starts"] == 0


def test_offload_soak_short():
    """jpa/testing/soak.py with a host tier (benchmarks/soak_engine.py --kv-offload-memory): random
    requests with shared prefixes through both tiny pools, requests arriving between steps, aborts;
    both tiers' page state checked after every round (`check_page_state`: HostTier.check, blocks
    only of waiting requests, PrefixCache.check), nothing left in either tier after each run, and
    every output equal to the ample pool's (no offload, no prefix cache). Bounded: 48 requests, 240 s."""
    import os

    from jpa.testing import soak

    seed = int(os.environ.get("JPA_TEST_SEED") or 3)
    total = soak.soak(48, 240.0, seed, check=True, abort_p=0.05, kv_offload_bytes=1 << 24)
    print(f"seed {seed}", total)
    assert total["requests"] == 48, "the time bound cut the run short"
    bad = ("lost", "duplicated", "leaked_runs", "stream_mismatch", "greedy_mismatch", "sampled_mismatch",
           "logprob_mismatch", "abort_not_prefix", "bad_stop", "errors", "reference_preemptions")
    assert {k: total[k] for k in bad} == dict.fromkeys(bad, 0), total
    assert total["preemptions"] > 0 and total["swapped_in"] > 0, "the soak must swap"
    assert total["spill_pages"] > 0 and total["restore_pages"] > 0, "the soak must spill and hit the host tier"
    assert total["aborted"] > 0, "aborts must happen"


NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, verify_rows=16)


def repetitive_prompts(rng, lens):
    """Prompts of the given lengths made of a few random segments repeated (n-gram drafts find them)."""
    prompts = []
    for m in lens:
        segs = [rng.integers(3, 40, int(rng.integers(2, 6))).tolist() for _ in range(3)]
        toks = []
        while len(toks) < m:
            toks += segs[int(rng.integers(3))]
        prompts.append(toks[:m])
    return prompts


def test_on_off_identical_under_speculation(engines):
    """n-gram speculation, offload on vs off, same pool: (1) six 20-50-token prompts growing by 40
    tokens in a 16-page pool MUST preempt (tests/test_kv_offload.py's sizes): on swaps, off
    recomputes; (2) multi-turn chats one at a time whose histories overflow the pool MUST evict
    cached prefix pages: on spills them and restores them on a later turn, off recomputes. Outputs
    (tokens, finish reasons, logprobs; greedy, seeded, n = 2) identical on and off, both tiers checked
    every round and whole at the end."""
    from jpa.engine import SpeculativeConfig
    from jpa.testing.engine import fresh_seed
    from test_kv_offload import chat_turn

    seed = fresh_seed()
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    spec = SpeculativeConfig(**NGRAM)
    on = engines.get(num_pages=16, kv_offload_bytes=64 << 20, speculative=spec)
    off = engines.get(num_pages=16, speculative=spec)
    b_on, b_off = snapshot(on), snapshot(off)
    prompts = repetitive_prompts(rng, np.random.default_rng(20).integers(20, 51, 6))
    params = mixed_params(rng, 6, lo=40, hi=40)
    params[1] = dataclasses.replace(params[1], n=2, greedy=False, temperature=1.0, seed=int(rng.integers(2 ** 30)))
    assert_same(run(on, prompts, params), run(off, prompts, params), "speculation, preemption: offload on vs off")
    assert off.stats.preemptions > b_off.preemptions, "the off engine must preempt (and recompute)"
    assert on.stats.swapped_in > b_on.swapped_in, "the on engine must swap"
    assert on.stats.spec_accepted_tokens > b_on.spec_accepted_tokens, "drafts were accepted"

    s_on = snapshot(on)
    hh0 = on.scheduler.prefix.host_hit_tokens
    histories = repetitive_prompts(rng, [24] * 4)
    params = mixed_params(rng, 4, lo=8, hi=8)
    params[3] = dataclasses.replace(params[3], n=2, greedy=False, temperature=1.0, seed=int(rng.integers(2 ** 30)))
    for turn in range(3):
        turn_rng = np.random.default_rng(seed + turn)
        h_on, h_off = [list(h) for h in histories], [list(h) for h in histories]
        p_on, got = chat_turn(on, h_on, turn_rng, params)
        p_off, want = chat_turn(off, h_off, np.random.default_rng(seed + turn), params)
        assert p_on == p_off
        assert_same(got, want, f"speculation, chat turn {turn}: offload on vs off")
        histories = h_on
    assert on.stats.spill_pages > s_on.spill_pages and on.stats.restore_pages > s_on.restore_pages
    assert on.scheduler.prefix.host_hit_tokens > hh0, "a later turn hit the host tier"
    assert on.pool_is_whole() and off.pool_is_whole()


def test_on_off_identical_under_structured_outputs(engines):
    """Structured outputs (random JSON schemas and a random regex; seeded sampling, n = 2), offload
    on vs off, same pool: (1) all at once in a 20-page pool MUST preempt: on swaps (the grammar
    matchers stay on the host across the swap), off recomputes; (2) constrained multi-turn chats one
    at a time in a 16-page pool MUST evict cached prefixes: on spills and later restores them.
    Outputs identical on and off, each meeting its constraint; both tiers whole at the end."""
    import re

    from jpa.engine import SamplingParams
    from jpa.testing.engine import fresh_seed
    from structured_util import random_regex, random_schema
    from test_kv_offload import chat_turn

    seed = fresh_seed()
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    on, off = engines.get(num_pages=20, kv_offload_bytes=64 << 20), engines.get(num_pages=20)
    b_on, b_off = snapshot(on), snapshot(off)
    schemas = [random_schema(rng) for _ in range(3)]
    regex = random_regex(rng)
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=int(rng.integers(2 ** 30)), n=2,
                             structured={"json": s}) for s in schemas]
    params.append(SamplingParams(max_new_tokens=60, temperature=1.0, seed=3, n=2, structured={"regex": regex}))
    prompts = random_prompts(rng, len(params), 30, 50)
    got = run(on, prompts, params)
    assert_same(got, run(off, prompts, params), "structured outputs, preemption: offload on vs off")
    assert off.stats.preemptions > b_off.preemptions and on.stats.swapped_in > b_on.swapped_in
    _assert_constraints_met(schemas + [regex], got)

    on, off = engines.get(num_pages=16, kv_offload_bytes=64 << 20), engines.get(num_pages=16)
    s_on = snapshot(on)
    histories = [random_prompts(rng, 1, lo=32, hi=32)[0] for _ in range(4)]
    regexes = [random_regex(rng) for _ in range(4)]
    params = [SamplingParams(max_new_tokens=60, temperature=1.0, seed=int(rng.integers(2 ** 30)),
                             structured={"regex": r}) for r in regexes]
    for turn in range(3):
        h_on, h_off = [list(h) for h in histories], [list(h) for h in histories]
        p_on, got = chat_turn(on, h_on, np.random.default_rng(seed + turn), params)
        p_off, want = chat_turn(off, h_off, np.random.default_rng(seed + turn), params)
        assert p_on == p_off
        assert_same(got, want, f"structured outputs, chat turn {turn}: offload on vs off")
        for r, o in zip(regexes, got):
            assert o.finish_reason == "stop" and re.fullmatch(r, o.completion), (r, o.completion)
        histories = h_on
    assert on.stats.spill_pages > s_on.spill_pages and on.stats.restore_pages > s_on.restore_pages
    assert on.pool_is_whole() and off.pool_is_whole()
