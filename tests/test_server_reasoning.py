"""Reasoning parsers (`--reasoning-parser`, `build_app(reasoning_parser=...)`): think blocks as
`reasoning_content` / `reasoning`, streamed and not, with the official `openai` client; and
`chat_template_kwargs` (`enable_thinking`) reaching a real Qwen3 chat template (the tiny random
Qwen3 checkpoint of tests/data/hf, its tokenizer and template, the think tags made non-special as in
Qwen3's and DeepSeek-R1's own tokenizers, so that the text keeps them). Under a reasoning parser a
constraint (response_format, structured_outputs, a forced or required tool) applies to the answer
after the thought: seeded samples at temperature 1, streamed and not.
"""

import json
import pathlib
import random
import shutil

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import jax.numpy as jnp  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from jpa import models  # noqa: E402
from jpa.engine import AsyncEngine, EngineConfig, LLMEngine  # noqa: E402
from jpa.server import build_app  # noqa: E402
from jpa.server.reasoning import ReasoningParser, ReasoningStream  # noqa: E402
from server_util import serving  # noqa: E402

# the server's feature files run in CI's bench tier (tests/test_server.py keeps the server in the main tier)
pytestmark = pytest.mark.bench

NAME = "tiny-qwen3"
QWEN3 = pathlib.Path(__file__).parent / "data" / "hf" / "qwen3"
MSGS = [{"role": "user", "content": "Why is the sky blue?"}]


# ---------------------------------------------------------------------- the parsers

CASES = {
    "deepseek_r1": [("<think>abc</think>\n\nanswer", "abc", "\n\nanswer"), ("abc</think>x", "abc", "x"),
                    ("plain text", "plain text", None), ("<think>never closed", "never closed", None),
                    ("a</thin", "a</thin", None), ("", None, None), ("</think>only", None, "only")],
    "qwen3": [("<think>abc</think>\n\nanswer", "abc", "\n\nanswer"), (" \n<think>a</think>b", "a", "b"),
              ("abc</think>x", None, "abc</think>x"), ("plain text", None, "plain text"),
              ("<think>never closed", "never closed", None), ("<thi", None, "<thi"), ("", None, None)],
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_split_and_stream_agree_for_every_chunking(kind):
    parser = ReasoningParser(kind)
    for text, reasoning, content in CASES[kind]:
        assert parser.split(text) == (reasoning, content), text
        for seed in range(40):   # random chunkings, tags cut anywhere
            rng, stream, r, c, i = random.Random(seed), ReasoningStream(parser), "", "", 0
            while i < len(text):
                j = i + rng.randint(1, 5)
                a, b = stream.feed(text[i:j])
                r, c, i = r + a, c + b, j
            a, b = stream.feed("", final=True)
            assert ((r + a) or None, (c + b) or None) == (reasoning, content), (text, seed)
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        ReasoningParser("nope")


# ---------------------------------------------------------------------- through the server

class Live:
    def __init__(self, aengine, tok):
        self.aengine, self.tok = aengine, tok

    def client(self, url):
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    for f in QWEN3.iterdir():
        shutil.copy(f, path / f.name)
    spec = json.loads((QWEN3 / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        if t["content"] in ("<think>", "</think>"):   # Qwen3's and DeepSeek-R1's tokenizers: not special
            t["special"] = False
    (path / "tokenizer.json").write_text(json.dumps(spec))
    model, tok = models.load(path, dtype=jnp.float32)
    eng = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(max_seqs=4, page_size=16, num_pages=128,
                                                                  steps_per_call=4, max_model_len=512))
    with AsyncEngine(eng, max_waiting=16) as aengine:
        yield Live(aengine, tok)


def _app(live, parser):
    return build_app(live.aengine, live.tok, model_name=NAME, reasoning_parser=parser)


def _streamed(client, **kw):
    reasoning, content, reasons = "", "", []
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return reasoning or None, content or None, reasons


@pytest.mark.parametrize("kind", [pytest.param("deepseek_r1", marks=pytest.mark.soak), "qwen3"])
def test_reasoning_content_streamed_and_not(live, kind):
    """The answer of a server without a parser, split by the parser: non-streamed message fields and
    streamed deltas agree with ReasoningParser.split of the same greedy text."""
    kw = dict(model=NAME, messages=MSGS, max_tokens=24, temperature=0)
    with serving(_app(live, None)) as url:
        plain = live.client(url).chat.completions.create(**kw).choices[0].message.content
    reasoning, content = ReasoningParser(kind).split(plain)
    with serving(_app(live, kind)) as url:
        client = live.client(url)
        m = client.chat.completions.create(**kw).choices[0].message
        assert (m.model_extra["reasoning_content"], m.content) == (reasoning, content)
        assert m.model_extra["reasoning"] == reasoning
        assert _streamed(client, **kw)[:2] == (reasoning, content)
        # vllm-router's separate_reasoning: false keeps everything in content.
        off = client.chat.completions.create(extra_body={"separate_reasoning": False}, **kw).choices[0].message
        assert off.content == plain and "reasoning_content" not in (off.model_extra or {})


def test_chat_template_kwargs_reach_the_template(live):
    """enable_thinking false: Qwen3's template puts an empty think block in the prompt (more prompt
    tokens); reserved names are a 400."""
    with serving(_app(live, "qwen3")) as url:
        client = live.client(url)
        kw = dict(model=NAME, messages=MSGS, max_tokens=2, temperature=0)
        on = client.chat.completions.create(**kw).usage.prompt_tokens
        off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                             **kw).usage.prompt_tokens
        assert off > on
        r = httpx.post(f"{url}/v1/chat/completions", json={**kw, "chat_template_kwargs": {"messages": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_reasoning_with_auto_tools_streamed_equals_not(live):
    """With tools (auto), the think block is split off first and calls are parsed from the answer:
    streamed deltas reassemble into the non-streamed message."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    kw = dict(model=NAME, messages=MSGS, max_tokens=24, temperature=0, tools=[tool])
    for kind in ("deepseek_r1", "qwen3"):
        with serving(_app(live, kind)) as url:
            client = live.client(url)
            m = client.chat.completions.create(**kw).choices[0].message
            reasoning, content, reasons = _streamed(client, **kw)
            assert (reasoning, content) == (m.model_extra["reasoning_content"], m.content or None), kind
            assert not m.tool_calls and reasons and reasons[0] in ("stop", "length")


def test_responses_api_reasoning_items(live):
    """/v1/responses with a reasoning parser: a reasoning item (reasoning_text) before the message,
    streamed as response.reasoning_text.delta events that join to it."""
    kw = dict(model=NAME, messages=MSGS, max_tokens=24, temperature=0)
    with serving(_app(live, "deepseek_r1")) as url:
        client = live.client(url)
        m = client.chat.completions.create(**kw).choices[0].message
        rkw = dict(model=NAME, input=MSGS[0]["content"], max_output_tokens=24, temperature=0)
        r = client.responses.create(**rkw)
        items = [o for o in r.output if o.type == "reasoning"]
        want = m.model_extra["reasoning_content"]
        assert [i.content[0].text for i in items] == ([want] if want else [])
        assert (r.output_text or None) == m.content
        with client.responses.stream(**rkw) as stream:
            events = list(stream)
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == (want or "")
        final = events[-1].response
        assert [o.type for o in final.output] == [o.type for o in r.output]


# ---------------------------------------------------------------------- constraints after the thought

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "w": {"enum": ["red", "blue"]}},
          "required": ["n", "w"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}


def _valid(text) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _think_bias(live, kind) -> dict:
    """A random model ends a thought only when pushed: </think> (and for qwen3, whose thought is
    optional, <think>) get a logit bias."""
    ids = {t: live.tok.backend_tokenizer.token_to_id(t) for t in ("<think>", "</think>")}
    return {str(ids["</think>"]): 8.0, **({str(ids["<think>"]): 8.0} if kind == "qwen3" else {})}


def _streamed_choices(client, **kw) -> dict:
    """{index: (reasoning, content, tool calls {index: [name, arguments]}, finish_reason)} of a stream."""
    out = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            r, t, calls, reason = out.get(c.index, ("", "", {}, None))
            r += (c.delta.model_extra or {}).get("reasoning_content") or ""
            t += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, ["", ""])
                call[0] += d.function.name or "" if d.function else ""
                call[1] += d.function.arguments or "" if d.function else ""
            out[c.index] = (r, t, calls, c.finish_reason or reason)
    return {i: (r or None, t or None, calls, reason) for i, (r, t, calls, reason) in out.items()}


@pytest.mark.parametrize("kind", [pytest.param("deepseek_r1", marks=pytest.mark.soak), "qwen3"])
def test_constraint_applies_to_the_answer_after_the_thought(live, kind):
    """response_format json_schema under a reasoning parser: seeded samples at temperature 1 think
    freely (text the schema forbids), then answer; every answer validates against the schema, and the
    streamed choices equal the non-streamed ones."""
    kw = dict(model=NAME, messages=MSGS, max_tokens=64, temperature=1.0, n=3, logit_bias=_think_bias(live, kind),
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    thoughts = []
    with serving(_app(live, kind)) as url:
        client = live.client(url)
        for seed in (11, 14, 17):   # n = 3: samples seed, seed + 1, seed + 2
            r = client.chat.completions.create(seed=seed, **kw)
            streamed = _streamed_choices(client, seed=seed, **kw)
            for c in r.choices:
                m = c.message
                assert c.finish_reason == "stop" and _valid(m.content), (kind, m)
                thought = m.model_extra["reasoning_content"]
                assert m.model_extra["reasoning"] == thought
                assert streamed[c.index] == (thought, m.content, {}, "stop"), (kind, seed, c.index)
                thoughts.append(thought)
        # separate_reasoning false: no think block is split off, so the grammar covers the whole output.
        whole = client.chat.completions.create(seed=11, extra_body={"separate_reasoning": False}, **kw)
        for c in whole.choices:
            assert _valid(c.message.content) and "reasoning_content" not in (c.message.model_extra or {})
        # A constraint no token can start is a 400 up front, as without a thought (whose first mask
        # allows any text).
        r = httpx.post(f"{url}/v1/chat/completions", json={**{k: v for k, v in kw.items() if k != "response_format"},
                                                            "structured_outputs": {"regex": "[^\\x00-\\x{10FFFF}]"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    unconstrained = [t for t in thoughts if t and not _valid(t) and not t.lstrip().startswith("{")]
    assert len(unconstrained) >= 3, thoughts


def test_forced_and_required_tools_after_the_thought(live):
    """A named tool and tool_choice required under deepseek_r1: the thought is reasoning_content, the
    call (parsed from the answer after it) has arguments that validate; streamed equals non-streamed."""
    base = dict(model=NAME, messages=MSGS, max_tokens=80, temperature=1.0, seed=5, n=2, tools=[TOOL],
                logit_bias=_think_bias(live, "deepseek_r1"))
    with serving(_app(live, "deepseek_r1")) as url:
        client = live.client(url)
        for choice in ({"type": "function", "function": {"name": "lookup"}}, "required"):
            kw = {**base, "tool_choice": choice}
            r = client.chat.completions.create(**kw)
            streamed = _streamed_choices(client, **kw)
            for c in r.choices:
                m = c.message
                assert c.finish_reason == ("stop" if choice != "required" else "tool_calls"), m
                assert m.content is None and len(m.tool_calls) == 1, m
                call = m.tool_calls[0].function
                assert call.name == "lookup" and _valid(call.arguments), call
                assert streamed[c.index] == (m.model_extra["reasoning_content"], None,
                                             {0: [call.name, call.arguments]}, c.finish_reason), choice
