"""Structured outputs in the engine (SamplingParams.structured, llguidance): a random tiny model knows
nothing, so only the grammar mask can make its outputs valid. Fresh random schemas, regexes and
choices each run (the seed is printed); checked with jsonschema, re.fullmatch and Python's parser.
Also: preemption and parallel samples, unconstrained requests keeping the multi-step decode loop
in the same batch (and their outputs unchanged), logprobs under the masked distribution, stop
strings, and the errors of bad constraints.
"""

import dataclasses
import json
import math
import pathlib
import re

import numpy as np
import pytest

from jpa.testing.engine import assert_same, fresh_seed, random_prompts, run
from jpa.engine import SamplingParams
from jpa.engine.structured import Grammars, Reasoning, StructuredOutputs
from jpa.models.tokenizer import ByteTokenizer, HFTokenizer
from structured_util import ARITHMETIC, check_json, is_arithmetic, random_choices, random_regex, random_schema

pytestmark = pytest.mark.xdist_group("engines")  # one worker compiles the group's programs once

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")


def _check(kind, spec, out):
    assert out.finish_reason == "stop", (kind, spec, out.completion)
    if kind == "json":
        check_json(out.completion, spec)
    elif kind == "regex":
        assert re.fullmatch(spec, out.completion), (spec, out.completion)
    elif kind == "choice":
        assert out.completion in spec, (spec, out.completion)
    else:
        assert is_arithmetic(out.completion), out.completion


# Room for the longest constrained outputs of _requests (prompts of <= 40 tokens): a completion cut
# by max_new_tokens or the length limit is not "stop" and fails _check. Regex (<= 20 bytes), choice
# (<= 9) and ARITHMETIC (<= 125: 3 terms of 3 factors of 13) are bounded. A JSON value is not (any
# whitespace, escapes): of 1800 measured (seeds 4000-4299 of _requests, 350 tokens allowed) the mean
# was 45 tokens, 60 reached 100, 11 reached 120, 5 reached 130, the longest 147: the tail falls by
# about 0.45 every 10 tokens, so 320 tokens is passed with p ~ 5e-4 x 0.45^17 < 1e-9 per request (160,
# under a 192-token limit, failed with ~5e-4 each: about 1 run in 250).
STRUCTURED = dict(max_model_len=384)


def _requests(rng, n_json=6, n_regex=3, n_choice=2, n_grammar=2):
    """(kind, spec, SamplingParams) of fresh random constraints, seeded sampling at temperature 1
    (max_new_tokens: see STRUCTURED)."""
    out = []
    for kind, n, make, new in (("json", n_json, random_schema, 320), ("regex", n_regex, random_regex, 60),
                               ("choice", n_choice, random_choices, 30),
                               ("grammar", n_grammar, lambda r: ARITHMETIC, 128)):
        for _ in range(n):
            spec = make(rng)
            out.append((kind, spec, SamplingParams(max_new_tokens=new, temperature=1.0, seed=int(rng.integers(2 ** 30)),
                                                   structured={kind: spec})))
    return out


def test_random_constraints_are_met(engines):
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    reqs = _requests(rng)
    eng = engines.get(**STRUCTURED)
    outs = run(eng, random_prompts(rng, len(reqs), 3, 40), [sp for _, _, sp in reqs])
    for (kind, spec, _), o in zip(reqs, outs):
        _check(kind, spec, o)
    s = eng.summary()
    assert s["grammar_masks"] > 0 and s["step_compiles"] == 1


@pytest.mark.soak
def test_under_preemption_with_parallel_samples(engines):
    """A pool too small for the batch: constrained requests are preempted and recomputed (their
    matchers keep the output tokens' state), n = 2 samples each have their own matcher.

    Whether the pool runs short depends on how long the constrained outputs get (a JSON value may
    close after a few tokens), so on the draw: the seed is fixed (this draw preempts, the same every
    run); every output is still checked against its constraint and the ample pool's."""
    rng = np.random.default_rng(20)
    eng = engines.get(num_pages=20)
    before = eng.stats.preemptions
    schemas = [random_schema(rng) for _ in range(3)]
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=int(rng.integers(2 ** 30)), n=2,
                             structured={"json": s}) for s in schemas]
    regex = random_regex(rng)
    params.append(SamplingParams(max_new_tokens=60, temperature=1.0, seed=3, n=2, structured={"regex": regex}))
    prompts = random_prompts(rng, len(params), 30, 50)
    outs = run(eng, prompts, params)
    assert eng.stats.preemptions > before, "the test must preempt"
    for spec, group in zip(schemas + [regex], outs):
        assert len(group) == 2
        for o in group:
            _check("json" if isinstance(spec, dict) else "regex", spec, o)
    # Each sample equals a separate request with its seed on an ample pool (no preemption, no fork).
    ample = engines.get()
    before = ample.stats.preemptions
    alone = run(ample, [p for p in prompts for _ in range(2)],
                [dataclasses.replace(sp, n=1, seed=sp.seed + i) for sp in params for i in range(2)])
    assert ample.stats.preemptions == before
    assert_same(outs, alone)


def test_unconstrained_requests_keep_the_decode_loop(engines):
    """In a batch with constrained requests, unconstrained ones still take several tokens per
    round (the decode loop), constrained ones one, and the unconstrained outputs equal a run
    without the constrained requests (seeded sampling does not depend on the batch)."""
    rng = np.random.default_rng(fresh_seed())
    eng = engines.get()
    free = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(2)]
    free_prompts = random_prompts(rng, 2, 5, 20)
    alone = run(eng, free_prompts, free)
    tied = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=7 + i, structured={"choice": random_choices(rng)})
            for i in range(2)]
    per_round = {}
    ids = []
    for k, (p, sp) in enumerate(zip(free_prompts + random_prompts(rng, 2, 5, 20), free + tied)):
        ids.append(eng.add_request(p, sp).request_id)
    final = {}
    while eng.has_unfinished:
        for o in eng.step():
            per_round.setdefault(o.request_id, []).append(len(o.new_token_ids))
            if o.finished:
                final[o.request_id] = o.output
    assert all(max(per_round[i]) > 1 for i in ids[:2]), per_round
    assert all(max(per_round[i]) <= 1 for i in ids[2:]), per_round
    assert_same([final[i] for i in ids[:2]], alone)


def test_logprobs_are_under_the_masked_distribution(engines):
    """Every top token of a constrained sample is an allowed one and their probabilities sum to 1
    (a choice of three one-character-different words: three tokens allowed at the first position)."""
    eng = engines.get()
    choice = ["abc", "xbc", "qbc"]
    outs = run(eng, [[5, 6, 7, 8]], [SamplingParams(max_new_tokens=8, temperature=1.0, seed=1, top_logprobs=5,
                                                     structured={"choice": choice})])
    o = outs[0]
    assert o.completion in choice
    first = [(t, lp) for t, lp in o.top_logprobs[0] if math.isfinite(lp)]
    assert sorted(bytes([t]).decode() for t, _ in first) == ["a", "q", "x"]
    assert math.isclose(sum(math.exp(lp) for _, lp in first), 1.0, rel_tol=1e-4)
    assert o.logprobs[0] == pytest.approx(dict(first)[o.token_ids[0]], abs=1e-5)
    for pos in range(1, 3):   # then the word is decided: one allowed token, logprob 0
        assert o.logprobs[pos] == pytest.approx(0.0, abs=1e-5)


def test_stop_strings_and_greedy(engines):
    eng = engines.get()
    outs = run(eng, [[9, 10, 11], [12, 13]], [
        SamplingParams(max_new_tokens=20, greedy=True, stop=["-"], structured={"choice": ["ab-cd"]}),
        SamplingParams(max_new_tokens=20, greedy=True, structured={"regex": "[0-9]{3}x"})])
    assert (outs[0].completion, outs[0].finish_reason) == ("ab", "stop")
    assert re.fullmatch("[0-9]{3}x", outs[1].completion) and outs[1].finish_reason == "stop"


@pytest.mark.parametrize("fields, match", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"json": {"type": "nope"}}, r"structured\.json: .*nope"),
    ({"json": "{not json"}, r"structured\.json: not valid JSON"),
    ({"json": [1, 2]}, "structured.json must be a JSON schema object"),
    ({"regex": "a(b"}, r"structured\.regex: .*unclosed group"),
    ({"regex": ""}, "structured.regex must be a non-empty string"),
    ({"choice": []}, "structured.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured.choice must be a non-empty list"),
    ({"grammar": "start: undefined_rule"}, r"structured\.grammar: .*undefined_rule"),
    ({"json_object": "yes"}, "structured.json_object must be a bool"),
])
def test_bad_constraints_are_value_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputs(**fields)
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured=fields)


def _mask(grammars, m) -> np.ndarray:
    row = np.zeros((grammars.words,), np.int32)
    m.fill(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:grammars.vocab_size].astype(bool)


def test_constraint_after_a_thought_is_the_constraint():
    """StructuredOutputs(reasoning=...) over the byte tokenizer (think tags as text, a lazy match):
    any character is allowed in the thought (text each constraint forbids: random text, braces, `</thi`)
    and EOS is not; after `</think>` the masks equal the plain constraint's along a random walk of
    its allowed tokens, to the end. Fresh random constraints (the seed is printed)."""
    seed = fresh_seed()
    print("seed", seed)
    rng = np.random.default_rng(seed)
    tok = ByteTokenizer()
    g = Grammars(tok, tok.vocab_size, [tok.EOS])
    cases = [("json", random_schema(rng)), ("json", random_schema(rng)), ("regex", random_regex(rng)),
             ("choice", random_choices(rng)), ("grammar", ARITHMETIC), ("json_object", True)]
    for kind, spec in cases:
        for optional in (False, True):
            plain = g.matcher(StructuredOutputs(**{kind: spec}))
            after = g.matcher(StructuredOutputs(**{kind: spec}, reasoning=Reasoning(optional=optional)))
            if optional:   # qwen3's thought opens with <think> (after whitespace)
                assert after._m.consume_tokens(tok.encode(" <think>"))
            thought = bytes(rng.integers(0, 256, 12).tolist()).decode("utf-8", "replace") + '}{"x</thi\n<think>'
            for ch in thought:   # free: any character (every ASCII byte), never EOS (the answer must come)
                allowed, ids = _mask(g, after), tok.encode(ch)
                assert allowed[:128].all() and allowed[ids[0]] and not allowed[tok.EOS], (kind, optional, thought)
                assert after._m.consume_tokens(ids)
            assert after._m.consume_tokens(tok.encode("</think>"))
            for _ in range(400):   # the answer: the plain constraint's masks, token by token
                want = _mask(g, plain)
                assert (_mask(g, after) == want).all(), (kind, spec, optional)
                if plain.done:
                    break
                t = int(rng.choice(np.flatnonzero(want[:256]))) if want[:256].any() else tok.EOS
                if t == tok.EOS:
                    break
                assert plain._m.consume_token(t) and after._m.consume_token(t)
            assert after.done == plain.done
    # Think tags that are special tokens (llguidance reads every added token of a Hugging Face
    # tokenizer as special; the tiny Qwen3's): named as tokens; the thought holds no special token,
    # and `</think>` spelled in ordinary tokens is refused (a parser of the text would split there).
    qwen = HFTokenizer.from_dir(pathlib.Path(__file__).parent / "data" / "hf" / "qwen3")
    gq = Grammars(qwen, 320, [qwen.eos_token_id])
    end_id = qwen.backend_tokenizer.token_to_id("</think>")
    spelled = [next(i for i in range(320) if gq.llg_tokenizer().decode_bytes([i]) == bytes([c]))
               for c in b"</think>"]
    for optional in (False, True):
        m = gq.matcher(StructuredOutputs(json_object=True, reasoning=Reasoning(optional=optional, special=True)))
        head = [qwen.backend_tokenizer.token_to_id("<think>")] if optional else []
        body = qwen.backend_tokenizer.encode("a}{b</th", add_special_tokens=False).ids
        assert m._m.consume_tokens(head + body)
        assert m._m.try_consume_tokens(spelled) == len(spelled) - 1
        assert not _mask(gq, m)[qwen.eos_token_id] and _mask(gq, m)[end_id]
        assert m._m.consume_tokens([end_id] + qwen.backend_tokenizer.encode("{}", add_special_tokens=False).ids)
        assert m.done
    # qwen3's optional thought: an output that does not open one is the answer from its first token.
    m = g.matcher(StructuredOutputs(choice=["yes", "no"], reasoning={"optional": True}))
    assert m._m.consume_tokens(tok.encode("no")) and m.done
    # the thought ends at the first </think> (DeepSeek-R1's parser splits there too)
    m = g.matcher(StructuredOutputs(choice=["yes"], reasoning=Reasoning()))
    assert m._m.try_consume_tokens(tok.encode("a</think>b</think>yes")) == len("a</think>")
    with pytest.raises(ValueError, match="structured.reasoning: unknown field"):
        StructuredOutputs(json_object=True, reasoning={"stop": "x"})
    with pytest.raises(ValueError, match="special token is named <name>"):
        Reasoning(end="think end", special=True)


def test_bad_constraint_fails_only_its_request(engines):
    eng = engines.get()
    bad = eng.add_request([5, 6], {"max_new_tokens": 4, "structured": {"regex": "(("}})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured={"jsonschema": {}})
    outs = run(eng, [[7, 8]], [SamplingParams(max_new_tokens=40, temperature=1.0, seed=2,
                                             structured={"json_object": True})])
    assert bad.finish_reason == "error" and "structured.regex" in bad.error
    text = outs[0].completion   # any JSON object: a random model may run out of tokens inside it
    assert isinstance(json.loads(text), dict) if outs[0].finish_reason == "stop" else text.startswith("{")


@pytest.mark.soak
def test_with_speculative_decoding(engines):
    """Speculative decoding (n-gram drafts) drafts for the unconstrained requests only: constrained
    ones keep sampling in the ragged step under their mask, and every output equals the engine
    without speculation."""
    from jpa.engine import SpeculativeConfig

    rng = np.random.default_rng(fresh_seed())
    reqs = _requests(rng, n_json=2, n_regex=1, n_choice=1, n_grammar=0)
    params = [sp for _, _, sp in reqs] + [SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, ignore_eos=True)
                                          for i in range(2)]
    prompts = random_prompts(rng, len(params), 3, 30)
    spec = engines.get(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3), **STRUCTURED)
    outs = run(spec, prompts, params)
    for (kind, c, _), o in zip(reqs, outs):
        _check(kind, c, o)
    assert_same(outs, run(engines.get(**STRUCTURED), prompts, params))
