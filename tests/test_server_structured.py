"""Structured outputs and tool calling through the OpenAI-compatible server (tiny random llama, the
official `openai` client on a loopback port): response_format with a pydantic model (`.parse()`),
structured_outputs / guided_* on both endpoints, named / required / auto tool calls (streamed calls
reassemble into the non-streamed ones), tool-role messages, and 400s naming the field for bad
constraints (nothing reaches the engine).
"""

import json
import re
from typing import Literal

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from jpa import models  # noqa: E402
from jpa.engine import AsyncEngine, EngineConfig, LLMEngine  # noqa: E402
from jpa.server import build_app  # noqa: E402
from test_server import serving  # noqa: E402

# the server's feature files run in CI's bench tier (tests/test_server.py keeps the server in the main tier)
pytestmark = pytest.mark.bench

NAME = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]}}, "required": ["city", "days", "units"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


class Live:
    def __init__(self, url, aengine, tok):
        self.url, self.aengine, self.tok = url, aengine, tok
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)

    def post(self, path, body):
        return httpx.post(f"{self.url}{path}", json={"model": NAME, **body}, timeout=60)


@pytest.fixture(scope="module")
def live():
    model, tok = models.load("tiny-llama", seed=1)
    eng = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(max_seqs=4, page_size=16, num_pages=600,
                                                                  steps_per_call=4, max_model_len=2048,
                                                                  max_num_batched_tokens=64))
    with AsyncEngine(eng, max_waiting=32) as aengine:
        with serving(build_app(aengine, tok, model_name=NAME, max_n=4)) as url:
            yield Live(url, aengine, tok)


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    tags: list[Literal["a", "b"]] = Field(max_length=2)
    note: str = Field(max_length=5)


@pytest.mark.soak
def test_parse_with_a_pydantic_model(live):
    chat = getattr(live.client.beta.chat.completions, "parse", None) or live.client.chat.completions.parse
    r = chat(model=NAME, messages=MSGS, response_format=Item, max_tokens=200, temperature=1.0, seed=3, n=2)
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, Item), c.message.content
        assert Item.model_validate_json(c.message.content) == c.message.parsed


def _calls_of_stream(chunks):
    """Tool calls reassembled from streamed deltas, by choice: [(name, arguments)]."""
    calls, reasons = {}, {}
    for ch in chunks:
        for c in ch.choices:
            for d in c.delta.tool_calls or ():
                slot = calls.setdefault(c.index, {}).setdefault(d.index, ["", ""])
                if d.function and d.function.name:
                    slot[0] += d.function.name
                if d.function and d.function.arguments:
                    slot[1] += d.function.arguments
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return {i: [tuple(v) for _, v in sorted(cs.items())] for i, cs in calls.items()}, reasons


@pytest.mark.parametrize("choice", ["named", pytest.param("required", marks=pytest.mark.soak)])
def test_forced_tool_calls_validate_and_stream(live, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = dict(model=NAME, messages=MSGS, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200,
              temperature=1.0, seed=11, n=2, parallel_tool_calls=choice == "named")
    r = live.client.chat.completions.create(**kw)
    want = {}
    for c in r.choices:
        assert c.finish_reason == ("stop" if choice == "named" else "tool_calls")
        assert c.message.tool_calls and c.message.content is None
        if choice == "required":
            assert len(c.message.tool_calls) == 1   # parallel_tool_calls false
        for call in c.message.tool_calls:
            spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
            assert call.id.startswith("call_") and call.type == "function"
        want[c.index] = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    got, reasons = _calls_of_stream(live.client.chat.completions.create(stream=True, **kw))
    assert got == want
    assert reasons == {c.index: c.finish_reason for c in r.choices}


# Two tools whose parameters use local references into their own definitions, under the same name.
PLACE = {"type": "function", "function": {"name": "place", "parameters": {
    "type": "object", "properties": {"at": {"$ref": "#/$defs/P"}, "near": {"$ref": "#/$defs/my%20P~1b"}},
    "required": ["at", "near"], "additionalProperties": False,
    "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["x"], "additionalProperties": False},
              "my P/b": {"enum": ["n", "s"]}}}}}
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/definitions/P"}}, "required": ["to"],
    "additionalProperties": False, "definitions": {"P": {"enum": ["up", "down"]}}}}}


def test_required_tools_with_local_refs(live):
    """tool_choice required nests each tool's parameters in an array schema: their "#/$defs/..." and
    "#/definitions/..." references (two tools, one definition name) still resolve (they were a 400),
    and every call's arguments validate against the tool's own schema; a reference to the
    parameters themselves ("#") too (checked on the schema: a random model recursing may not end)."""
    from types import SimpleNamespace as NS

    from jpa.server.tools import required_schema
    kw = dict(model=NAME, messages=MSGS, tools=[PLACE, MOVE], tool_choice="required", max_tokens=120,
              temperature=1.0, seed=4, n=3)
    r = live.client.chat.completions.create(**kw)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            spec = {"place": PLACE, "move": MOVE}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    tree = {"type": "object", "properties": {"v": {"$ref": "#/$defs/V"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["v"], "additionalProperties": False, "$defs": {"V": {"type": "integer"}}}
    schema = required_schema([NS(function=NS(name="tree", parameters=tree)),
                              NS(function=NS(name="move", parameters=MOVE["function"]["parameters"]))], True)
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid([{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2, "kids": []}]}},
                       {"name": "move", "parameters": {"to": "up"}}])
    assert not v.is_valid([{"name": "tree", "parameters": {"v": 1, "kids": [{"v": "x"}]}}])
    assert not v.is_valid([{"name": "move", "parameters": {"to": 1}}])
    r = live.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "tree", "parameters": tree}}]})
    assert r.status_code == 200, r.text


def test_auto_tool_calls_are_parsed_from_the_text(live):
    """With tool_choice auto the model's own text is parsed (Hermes <tool_call> blocks here); a
    regex makes the random model write one call after some content."""
    call = r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    kw = dict(model=NAME, messages=MSGS, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0, seed=5,
              extra_body={"structured_outputs": {"regex": call}})
    r = live.client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    (tc,) = c.message.tool_calls
    assert tc.function.name == "get_time" and json.loads(tc.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(live.client.chat.completions.create(stream=True, **kw))
    got, reasons = _calls_of_stream(chunks)
    assert got == {0: [(tc.function.name, tc.function.arguments)]} and reasons == {0: "tool_calls"}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Sure. "
    # Without calls in the text: plain content, finish_reason from the engine.
    plain = live.client.chat.completions.create(model=NAME, messages=MSGS, tools=[WEATHER], max_tokens=8,
                                                temperature=0, extra_body={"structured_outputs": {"choice": ["no"]}})
    assert plain.choices[0].message.content == "no" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_tool_messages_are_rendered(live):
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1, "units": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    r = live.client.chat.completions.create(model=NAME, messages=msgs, tools=[WEATHER], max_tokens=4, temperature=0)
    rendered = live.tok.render_chat([MSGS[0], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1,
                                                                              "units": "C"}}}]},
        {"role": "tool", "content": "sunny, 21"}], tools=[WEATHER])
    assert "<tool_response>\nsunny, 21\n</tool_response>" in rendered and '"name": "get_weather"' in rendered
    assert r.usage.prompt_tokens == len(live.tok.encode(rendered))
    bad = live.post("/v1/chat/completions", {"messages": MSGS + [{"role": "tool", "content": "x"}]})
    assert bad.status_code == 400 and "tool_call_id" in bad.json()["error"]["message"]
    bad = httpx.post(f"{live.url}/tokenize", json={"messages": [{"role": "user"}]}, timeout=60)
    assert bad.status_code == 400 and "'messages.0.content' is required" in bad.json()["error"]["message"]


def test_completions_structured_outputs(live):
    for body, check in (
            ({"structured_outputs": {"regex": "[a-c]{2}-[0-9]{2,3}"}}, lambda t: re.fullmatch("[a-c]{2}-[0-9]{2,3}", t)),
            ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
            ({"structured_outputs": {"json": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                              "required": ["n"], "additionalProperties": False}}},
             lambda t: json.loads(t)["n"] in (1, 2))):
        r = live.post("/v1/completions", {"prompt": "pick:", "max_tokens": 40, "temperature": 1.0, "seed": 2, **body})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert check(text), (body, text)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"structured_outputs": {"regex": "a(("}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "nowhere"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "[", "stream": True}, "guided_regex", "guided_regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "guided_choice", "one constraint"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "bogus"}}}}}], "tool_choice": "required"}, "tools", "tools"),
])
def test_bad_constraints_are_400s_naming_the_field(live, body, param, words):
    eng = live.aengine.engine
    compiles, masks = eng.grammars.compiles, eng.grammars.masks_computed
    r = live.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert (eng.grammars.compiles, eng.grammars.masks_computed) == (compiles, masks)   # nothing reached the engine
