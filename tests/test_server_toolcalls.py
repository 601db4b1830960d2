"""Tool calls streamed as they are generated (`jpa.server.toolcalls`): the name first, then the
arguments piece by piece, for Hermes `<tool_call>` blocks, Llama-3 JSON and "required" arrays;
streamed equals non-streamed for every chunking, a call cut by max_tokens included. Through the
official `openai` client on the tiny random llama (a regex makes it write a call), and an
agent-style loop: a forced call, the tool's result, an answer.
"""

import json
import random

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from jpa.server import toolcalls  # noqa: E402
from jpa.server.toolcalls import HERMES, LLAMA3_JSON, REQUIRED, CallStream, _JsonEnd  # noqa: E402
from jpa.server.toolparsers import MISTRAL, PYTHONIC, QWEN3_CODER, SnapshotStream  # noqa: E402

# the server's feature files run in CI's bench tier (tests/test_server.py keeps the server in the main tier);
# one worker runs the tiny_server group (its programs compile once)
pytestmark = [pytest.mark.bench, pytest.mark.xdist_group("tiny_server")]

CASES = [
    (HERMES, 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Sure. ", [("get_time", '{"zone": "UTC"}')]),
    (HERMES, 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UT', "Sure. ",
     [("get_time", '{"zone": "UT')]),                                    # cut by max_tokens
    (HERMES, 'a <tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
             '{"x": [1, {"y": "}"}]}}</tool_call> tail', "a ", [("f", "{}"), ("g", '{"x": [1, {"y": "}"}]}')]),
    (HERMES, "no calls here <tool_", "no calls here <tool_", []),
    (HERMES, "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    (HERMES, '<tool_call>{"nam', '<tool_call>{"nam', []),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    (LLAMA3_JSON, 'hello {"name": "f"}', 'hello {"name": "f"}', []),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"a": "b', None, [("f", '{"a": "b')]),
    (REQUIRED, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', None,
     [("f", '{"a": 1}'), ("g", "{}")]),
    (REQUIRED, '[{"name": "f", "parameters": {"a": 1', None, [("f", '{"a": 1')]),
]


def _stream(fmt, text, parallel, rng):
    s, content, calls, i, order = CallStream(fmt, parallel), "", {}, 0, []
    while True:
        j = i + rng.randint(1, 6)
        final = j >= len(text)
        c, deltas = s.feed(text[i:j], final=final)
        content += c
        for d in deltas:
            slot = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert not slot[1], "the name comes before any argument"
                slot[0] = d["function"]["name"]
            slot[1] += d["function"]["arguments"]
            order.append(d)
        if final:
            return content, [tuple(v) for _, v in sorted(calls.items())], order
        i = j


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_calls_equal_the_whole_text_for_every_chunking(case):
    fmt, text, content, calls = CASES[case]
    for parallel in (True, False):
        want_calls = calls if parallel else calls[:1]
        whole_content, whole_calls = CallStream(fmt, parallel).content_and_calls(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == want_calls
        assert whole_content == (content if want_calls else text)
        for seed in range(30):
            got_content, got_calls, _ = _stream(fmt, text, parallel, random.Random(seed))
            assert got_calls == want_calls, (seed, got_calls)
            assert got_content == ((content or "") if want_calls else text), (seed, got_content)


# ---------------------------------------------------------------------- through the server

NAME = "tiny"
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What time is it?"}]
CALL = r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)", "note": "[a-z]{8}"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def client():
    from server_util import tiny_server

    with tiny_server(model_name=NAME) as (url, _, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed(client, **kw):
    content, calls, reasons, arg_deltas = "", {}, [], 0
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                slot = calls.setdefault(d.index, ["", "", ""])
                if d.id:
                    assert not slot[2], "the name comes first"
                    slot[0], slot[1] = d.id, d.function.name
                if d.function.arguments:
                    slot[2] += d.function.arguments
                    arg_deltas += 1
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return content, [(v[1], v[2]) for _, v in sorted(calls.items())], reasons, arg_deltas


def _random_json(rng, depth=0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([1, -2.5e3, True, None, "x", 'a"}]\\{[', "\u00e9\n"])
    if r < 0.6:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "b}", '"q', "\\"]): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_json_end_is_raw_decode_read_incrementally():
    """_JsonEnd (the arguments' end, read a delta at a time) answers as json's raw_decode does on
    every prefix, for valid objects (strings with brackets, quotes and escapes) and broken ones."""
    rng = random.Random(7)
    for trial in range(300):
        text = json.dumps({"k": _random_json(rng)}, ensure_ascii=rng.random() < 0.5) + rng.choice(["", "}", " x"])
        if trial % 3 == 0:   # broken: a character dropped, doubled or replaced
            k = rng.randrange(len(text))
            text = text[:k] + rng.choice(["", text[k] * 2, "]", "'", "\\"]) + text[k + 1:]
        text = "ab" + text
        tracker, i = _JsonEnd(2), 2
        while i <= len(text):
            try:
                want = json.JSONDecoder().raw_decode(text[:i], 2)[1]
            except ValueError:
                want = None
            assert tracker.scan(text[:i]) == want, (text, i)
            i += rng.randint(1, 4)


@pytest.mark.parametrize("fmt", [HERMES, REQUIRED, MISTRAL, QWEN3_CODER, PYTHONIC])
def test_long_calls_are_read_once(fmt, monkeypatch):
    """A long call fed two characters at a time: its JSON is decoded once (it was on every delta,
    quadratic: 8.8 s for a 45k-character call), a Qwen3-Coder parameter converted once, a pythonic
    argument evaluated once; the calls are the whole text's."""
    args = {"items": [{"k": i, "s": "a}\"b{"} for i in range(300)]}
    text = {HERMES: f'<tool_call>{{"name": "f", "arguments": {json.dumps(args)}}}</tool_call>',
            REQUIRED: f'[{{"name": "f", "parameters": {json.dumps(args)}}}]',
            MISTRAL: f'[TOOL_CALLS][{{"name": "f", "arguments": {json.dumps(args)}}}]',
            QWEN3_CODER: f"<tool_call><function=f><parameter=items>{json.dumps(args['items'])}</parameter>"
                         f"</function></tool_call>",
            PYTHONIC: f"[f(items={json.dumps(args['items'])})]"}[fmt]
    tools = {"f": {"type": "object", "properties": {"items": {"type": "array"}}}}
    counts = {"decode": 0, "loads": 0, "literal": 0}
    from jpa.server import toolparsers
    real_decode, real_loads, real_literal = json.JSONDecoder.raw_decode, json.loads, toolparsers.ast.literal_eval

    def decode(self, s, idx=0):   # (json.loads of a short name string comes here too)
        counts["decode"] += len(s) - idx > 100
        return real_decode(self, s, idx)

    def loads(s, *a, **k):
        counts["loads"] += len(s) > 100
        return real_loads(s, *a, **k)

    def literal(s):
        counts["literal"] += 1
        return real_literal(s)
    monkeypatch.setattr(json.JSONDecoder, "raw_decode", decode)
    monkeypatch.setattr(toolparsers.json, "loads", loads)
    monkeypatch.setattr(toolparsers.ast, "literal_eval", literal)
    stream = CallStream(fmt) if fmt in (HERMES, REQUIRED) else SnapshotStream(fmt, tools=tools)
    for i in range(0, len(text), 2):
        stream.feed(text[i:i + 2])
    stream.feed("", final=True)
    assert counts["decode"] <= 1 and counts["loads"] <= 1 and counts["literal"] <= 1, counts
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in stream.calls] == [("f", args)]



@pytest.mark.parametrize("max_tokens", [200, pytest.param(64, marks=pytest.mark.soak)], ids=["whole", "cut"])
def test_auto_calls_stream_piece_by_piece_and_equal_the_answer(client, max_tokens):
    """A Hermes call written by the model (a regex makes the random model write it): streamed, the
    name comes first, then the arguments in several deltas; they reassemble into the non-streamed
    call; cut by max_tokens, both hold the arguments so far."""
    kw = dict(model=NAME, messages=MSGS, tools=[TIME], max_tokens=max_tokens, temperature=1.0, seed=5,
              extra_body={"structured_outputs": {"regex": CALL}})
    r = client.chat.completions.create(**kw).choices[0]
    (call,) = r.message.tool_calls
    assert call.function.name == "get_time" and r.message.content == "Sure. "
    content, calls, reasons, arg_deltas = _streamed(client, **kw)
    assert (content, calls) == ("Sure. ", [("get_time", call.function.arguments)])
    assert reasons == [r.finish_reason] and arg_deltas >= 2
    if max_tokens == 200:
        assert r.finish_reason == "tool_calls" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    else:
        assert r.finish_reason == "length" and call.function.arguments.startswith('{"zone": ')
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)


def test_an_agent_loop_with_a_forced_tool(client):
    """The model calls a tool (forced), gets the result, answers (tool_choice none)."""
    msgs = list(MSGS)
    kw = dict(model=NAME, tools=[TIME], temperature=0, max_tokens=60)
    r = client.chat.completions.create(messages=msgs, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       **kw)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"time": "12:00", **args})}]
    answer = client.chat.completions.create(messages=msgs, tool_choice="none", **{**kw, "max_tokens": 8})
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    base = client.chat.completions.create(messages=MSGS, tool_choice="none", **{**kw, "max_tokens": 1})
    assert answer.usage.prompt_tokens > base.usage.prompt_tokens   # the call and its result are in the prompt
