"""`jpa generate` on the tiny gpt-oss checkpoint (tests/data/hf/gpt_oss) with the engine's features on:
the unified ragged step (attention sinks, alternating sliding/full layers, YaRN, the clamped SwiGLU
experts), automatic prefix caching and n-gram speculation give transformers' greedy tokens.

Bench tier: one engine compile with speculation is ~45 s on the 2-core VM. The main tier keeps gpt-oss's
numerics (tests/test_hf_models.py: prefill logits, 32 greedy steps of paged decode, the ragged step)
and the engine on a mixture of experts (test_generate_command_runs_a_moe_checkpoint, Mixtral)."""

import json
import pathlib

import pytest

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

DATA = pathlib.Path(__file__).parent / "data" / "hf"


@pytest.mark.soak
@pytest.mark.parametrize("name,n", [("gpt_oss", 16), ("gpt_oss_mxfp4", 24)])
def test_generate_gpt_oss_with_prefix_caching_and_ngram_speculation(name, n, capsys):
    """gpt_oss_mxfp4: the experts in MXFP4; one sequence, so the decode loop runs the gathered form
    (models.moe._mxfp4_matvec)."""
    from jpa.cli import generate as mod
    g = json.loads((DATA / name / "golden.json").read_text())["prompts"]["robot"]
    # Its greedy continuation repeats (243 125 243 125 ...; 92 268 92 268): the n-gram proposer finds drafts.
    # One sequence at a time: the second request finds the first one's prompt pages cached.
    rc = mod.main(["--model", str(DATA / name), "--greedy", "--max-new-tokens", str(n), "--json",
                   "--no-compile-cache", "--no-progress", "--max-seqs", "1", "--max-model-len", "128",
                   "--kv-memory", "1", "--page-size", "4",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
                   g["text"], g["text"]])
    out, _ = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    recs, summary = [r for r in lines if "token_ids" in r], next(r["summary"] for r in lines if "summary" in r)
    assert rc == 0 and len(recs) == 2
    for rec in recs:
        assert rec["error"] is None
        assert rec["token_ids"] == g["greedy_ids"][:n]
    assert summary["prefix_hit_tokens"] > 0
    spec = summary["speculative"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0, spec
