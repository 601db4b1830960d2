"""jpa.LLM, the public face: the same engine as one built by hand, the chat template, refused
options, and that `import jpa` / `jpa.engine` / `jpa.llm` load no model code (tests/test_layers.py checks
the whole import graph)."""

import pathlib
import subprocess
import sys

import pytest

from jpa import models
from jpa.engine import EngineConfig, LLMEngine, SamplingParams
from jpa.llm import LLM

pytestmark = pytest.mark.bench

ROOT = pathlib.Path(__file__).parents[1]
OPTIONS = dict(max_seqs=3, page_size=8, num_pages=48, steps_per_call=4, max_model_len=96)
PROMPTS = ["The paged cache", "hello", "a longer prompt that spans a few pages of the cache", "x"]
PARAMS = [SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True),
          SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, seed=3, ignore_eos=True),
          SamplingParams(max_new_tokens=6, temperature=0.5, seed=11, n=2, ignore_eos=True)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", seed=1, **OPTIONS)


def test_llm_equals_the_engine_built_by_hand(llm):
    gpt, tok = models.load("tiny-llama", seed=1)
    by_hand = LLMEngine(models.GPTForEngine(gpt), tok, EngineConfig(**OPTIONS))
    want = by_hand.generate(PROMPTS, PARAMS)
    got = llm.generate(PROMPTS, PARAMS)
    # LLM.generate answers vLLM's shape: one RequestOutput per prompt, its n samples in .outputs
    assert len(got) == len(want) == 4 and isinstance(want[3], list) and len(got[3].outputs) == 2
    flat_want = [o for out in want for o in (out if isinstance(out, list) else [out])]
    flat_got = [s for out in got for s in (out.samples or (out,))]
    assert len(flat_got) == len(flat_want) == 5
    for g, w in zip(flat_got, flat_want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs and g.completion == w.completion
        assert g.error is None and len(g.token_ids) > 0
    for out, w in zip(got, want):
        samples = w if isinstance(w, list) else [w]
        assert [c.text for c in out.outputs] == [s.completion for s in samples]
        assert [c.token_ids for c in out.outputs] == [s.token_ids for s in samples]
        assert [c.index for c in out.outputs] == list(range(len(samples)))
        assert out.completion == samples[0].completion and out.prompt_token_ids == list(samples[0].prompt_ids)
    assert llm.engine.config == by_hand.config and llm.engine.pool_is_whole()
    # a single string is one prompt
    one = llm.generate(PROMPTS[0], PARAMS[0])
    assert len(one) == 1 and one[0].token_ids == want[0].token_ids


def test_chat_applies_the_template(llm):
    params = SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    rendered = llm.tokenizer.render_chat(conv)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>") and rendered.endswith("assistant\n")
    out = llm.chat(conv, params)
    assert len(out) == 1 and out[0].prompt == rendered
    assert out[0].token_ids == llm.generate([rendered], params)[0].token_ids
    two = llm.chat([conv, [{"role": "user", "content": "hi"}]], params)   # a list of conversations
    assert [o.prompt for o in two] == [rendered, llm.tokenizer.render_chat([{"role": "user", "content": "hi"}])]
    assert two[0].token_ids == out[0].token_ids
    # one user turn renders as generate.py --chat renders a prompt
    assert llm.chat([{"role": "user", "content": "hi"}], params)[0].prompt == llm.tokenizer.apply_chat_template("hi")


@pytest.mark.parametrize("messages,msg", [
    ([], "messages must be a conversation"),
    ("hello", "messages must be a conversation"),
    ([[{"role": "user", "content": "a"}], "b"], "conversation 1 must be a list"),
    ([{"role": "user"}], "must be a dict with str 'role' and 'content'"),
])
def test_chat_refuses_bad_messages(llm, messages, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        llm.chat(messages)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_seq=4), "unknown engine option 'max_seq'; the options are EngineConfig's fields: max_seqs"),
    (dict(gpu_memory_utilization=0.9, chunky=1), "unknown engine options 'chunky', 'gpu_memory_utilization'"),
    (dict(max_seqs=0), "EngineConfig.max_seqs must be an int >= 1; got 0"),
    (dict(attention_impl="cuda"), "EngineConfig.attention_impl must be one of"),
    (dict(engine_config=EngineConfig(), max_seqs=2), "pass engine options (max_seqs) or engine_config, not both"),
    (dict(engine_config={"max_seqs": 2}), "engine_config must be a jpa.engine.EngineConfig; got dict"),
    (dict(dtype="float99"), "dtype must be float32 or bfloat16"),
    (dict(dtype="int32"), "dtype must be a floating dtype"),
])
def test_bad_options_are_refused_by_name(kwargs, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        LLM("tiny-llama", **kwargs)


def test_bad_model_is_refused():
    with pytest.raises(ValueError, match="unknown model 'gpt-17'"):
        LLM("gpt-17")
    with pytest.raises(ValueError, match="model must be a preset name or a checkpoint directory path"):
        LLM(42)


def test_importing_jpa_and_the_engine_does_not_import_models():
    code = ("import sys, jpa, jpa.engine; assert 'jpa.models' not in sys.modules, 'import jpa, jpa.engine'\n"
            "from jpa import LLM, SamplingParams; assert 'jpa.models' not in sys.modules, 'from jpa import LLM'\n"
            "import jpa.llm; assert 'jpa.models' not in sys.modules, 'import jpa.llm'\n"
            "assert jpa.LLM is jpa.llm.LLM and jpa.SamplingParams is jpa.engine.SamplingParams\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


def test_vllm_spelling_of_params_and_outputs(llm):
    """What a user switching from vLLM types: max_tokens, temperature=0, logprobs=k, and
    out.outputs[0].text / .token_ids / .logprobs ({token id: Logprob}) / .cumulative_logprob."""
    import math

    vllm = SamplingParams(max_tokens=7, temperature=0, logprobs=3, ignore_eos=True)
    jpa_ = SamplingParams(max_new_tokens=7, greedy=True, top_logprobs=3, ignore_eos=True)
    assert vllm.max_new_tokens == 7 and vllm.top_logprobs == 3 and vllm.is_greedy
    (a,), (b,) = llm.generate(["vLLM users"], vllm), llm.generate(["vLLM users"], jpa_)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 7
    c = a.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == (a.completion, a.token_ids, a.finish_reason)
    assert len(c.logprobs) == 7 and math.isclose(c.cumulative_logprob, sum(a.logprobs), rel_tol=1e-6)
    for tok, lp, entry, top in zip(a.token_ids, a.logprobs, c.logprobs, a.top_logprobs):
        assert next(iter(entry)) == tok and entry[tok].logprob == lp   # the sampled token first
        assert set(entry) == {tok, *(t for t, _ in top)} and entry[tok].rank == 1   # greedy: the argmax
    with pytest.raises(ValueError, match="max_tokens .* and max_new_tokens .* name the same value"):
        SamplingParams(max_tokens=5, max_new_tokens=6)
    import dataclasses
    assert dataclasses.replace(vllm, max_new_tokens=9).max_new_tokens == 9   # folded: replace() still works
