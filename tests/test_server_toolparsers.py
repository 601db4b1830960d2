"""Tool-call parsers for Mistral `[TOOL_CALLS]`, Qwen3-Coder XML and pythonic calls
(`jpa.server.toolparsers`): on hand-written model outputs, the whole text's (content, calls), and the
same when streamed with a chunk boundary at every position (and one character at a time, and random
chunkings): the name first, then the arguments growing, cut outputs included. Then through the
server: a chat template in each format written here renders the tools, a regex makes the tiny
random model write a call in that format, streamed == non-streamed (whole and cut by max_tokens).
"""

import json
import random

import pytest

from jpa.server.tools import call_stream, parser_format
from jpa.server.toolparsers import MISTRAL, PYTHONIC, QWEN3_CODER, SnapshotStream

SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "code": {"type": "string"}}}}

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, \"FR\"\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=code>\n007\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = '{"city": "Paris, \\"FR\\"", "days": 3, "metric": true, "code": "007"}'

# (format, model output, content when calls were found, [(name, arguments)])
CASES = [
    (MISTRAL, 'Let me check.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     "Let me check.", [("f", '{"a": 1}'), ("g", "{}")]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "x]y"', None, [("f", '{"a": "x]y"')]),  # cut
    (MISTRAL, 'ok [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]g[ARGS]{}', "ok ",
     [("get_weather", '{"city": "Oslo"}'), ("g", "{}")]),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"q": [1, {"r": "}"}]} trailing text', None, [("f", '{"q": [1, {"r": "}"}]}')]),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"q": "ab', None, [("f", '{"q": "ab')]),                        # cut
    (MISTRAL, "plain answer [TOOL_CALL", None, []),
    (MISTRAL, "a [TOOL_CALLS] is a token, b", None, []),
    (MISTRAL, '[TOOL_CALLS][{"nam', None, []),
    (MISTRAL, "[TOOL_CALLS]get_wea", None, []),
    (QWEN3_CODER, "Checking: café.\n" + XML_CALL, "Checking: café.\n", [("get_weather", XML_ARGS)]),
    (QWEN3_CODER, XML_CALL + "\n" + XML_CALL.replace("get_weather", "g").replace("Paris", "Rome"), None,
     [("get_weather", XML_ARGS), ("g", XML_ARGS.replace('"days": 3', '"days": "3"').replace(
         '"metric": true', '"metric": "true"').replace("Paris", "Rome"))]),   # g has no schema: strings
    (QWEN3_CODER, XML_CALL[:XML_CALL.index("<parameter=days>") + 20], None,
     [("get_weather", '{"city": "Paris, \\"FR\\""')]),                                               # cut
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
                  "<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", '{"hours": [1, 2], "days": "soon"}')]),
    (QWEN3_CODER, "x <tool_call>not xml</tool_call> y", None, []),
    (QWEN3_CODER, "x <tool_call>\n<function=bad name>", None, []),
    (QWEN3_CODER, "no calls <tool_ca", None, []),
    (PYTHONIC, '[get_weather(city="Paris", days=3, hours=(1, 2)), g(), h(s=\'a,b)\', d={"k": [None, True]})]',
     None, [("get_weather", '{"city": "Paris", "days": 3, "hours": [1, 2]}'), ("g", "{}"),
            ("h", '{"s": "a,b)", "d": {"k": [null, true]}}')]),
    (PYTHONIC, '<|python_start|>[f(x=1.5)]<|python_end|>', None, [("f", '{"x": 1.5}')]),
    (PYTHONIC, '[f(a="no", b=[1, 2', None, [("f", '{"a": "no"')]),                                   # cut
    (PYTHONIC, "[f(a=os.system(1))]", None, [("f", "{")]),           # not a literal: the call ends there
    (PYTHONIC, "The answer is [f(a=1)]", None, []),
    (PYTHONIC, "[1, 2, 3]", None, []),
    (PYTHONIC, "[get_wea", None, []),
    (PYTHONIC, "  ", None, []),
]


def _run(fmt, chunks, parallel):
    s, content, calls = SnapshotStream(fmt, parallel, SCHEMAS), "", {}
    for n, chunk in enumerate(chunks):
        c, deltas = s.feed(chunk, final=n == len(chunks) - 1)
        content += c
        for d in deltas:
            slot = calls.setdefault(d["index"], ["", ""])
            if "id" in d:
                assert not slot[0] and not slot[1], "the name comes once, before any argument"
                assert d["index"] == len(calls) - 1
                slot[0] = d["function"]["name"]
            else:
                assert slot[0] and d["function"]["arguments"]
            slot[1] += d["function"]["arguments"]
    return content, [tuple(v) for _, v in sorted(calls.items())]


def _chunkings(text):
    yield [text]
    yield list(text) or [""]
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    for seed in range(20):
        rng, out, i = random.Random(seed), [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            out.append(text[i:j])
            i = j
        yield out or [""]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_at_every_boundary(case):
    fmt, text, content, calls = CASES[case]
    for parallel in (True, False):
        want = calls if parallel else calls[:1]
        whole_content, whole_calls = SnapshotStream(fmt, parallel, SCHEMAS).content_and_calls(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == want
        assert whole_content == (content if want else text)
        for chunks in _chunkings(text):
            got = _run(fmt, chunks, parallel)
            assert got == (((content or "") if want else text), want), chunks


def test_complete_arguments_are_json():
    for fmt, text, _, calls in CASES:
        if text.rstrip().endswith(("]", "}", "</tool_call>", "<|python_end|>")) and calls:
            for _, args in calls:
                if args != "{":
                    json.loads(args)


def test_format_from_the_chat_template_and_unknown_formats():
    class Tok:
        chat_template = ""
    for template, fmt in [("{{ '<function=' }}{{ '<parameter=' }}<tool_call>", QWEN3_CODER),
                          ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", MISTRAL),
                          ("<|python_tag|>", "llama3_json"), ("<tool_call>", "hermes"), ("", "hermes")]:
        Tok.chat_template = template
        assert parser_format(Tok) == fmt
    assert isinstance(call_stream(PYTHONIC), SnapshotStream)
    with pytest.raises(ValueError, match="tool-call format must be one of"):
        SnapshotStream("xml")
