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
from marks import tiered

# the server's feature files run in CI's bench tier (tests/test_server.py keeps the server in the main tier);
# one worker runs the tiny_server group (its programs compile once)
pytestmark = [pytest.mark.bench, pytest.mark.xdist_group("tiny_server")]

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


def _random_output(fmt, rng):
    """A model output in the format: content, 0-3 calls with random arguments, junk between and
    after; then maybe cut, maybe with a stray piece of the format's syntax inserted."""
    def value():
        return rng.choice([1, -2.5, "x, y", 'q"uote', "é", True, None, [1, "a"], {"k": [2]}])

    calls = [(rng.choice(["f", "get_weather", "a.b"]), {rng.choice("abcd"): value() for _ in range(rng.randint(0, 3))})
             for _ in range(rng.randint(0, 3))]
    junk = ["", " ", "\n", "text", "]", "}"]
    if fmt == MISTRAL:
        if rng.random() < 0.5:
            body = "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls]) if calls else ""
        else:
            body = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" + rng.choice(junk[:2]) for n, a in calls)
        syntax = ["[TOOL_CALLS]", "[ARGS]", "{", '"', "[", ","]
    elif fmt == QWEN3_CODER:
        body = "".join("<tool_call>\n<function=%s>\n%s</function>\n</tool_call>" % (n, "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in a.items()))
            + rng.choice(junk) for n, a in calls)
        syntax = ["<tool_call>", "<function=", "<parameter=", "</parameter>", "</function>", ">", "\n"]
    else:
        body = ("[" + ", ".join(f"{n.replace('.', '_')}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                                for n, a in calls) + "]") if calls else ""
        syntax = ["[", "(", ")", "=", ",", "'", '"', "]"]
    text = (rng.choice(["", "Sure. ", "é "]) if fmt != PYTHONIC else "") + body + rng.choice(junk)
    if rng.random() < 0.4:
        text = text[:rng.randint(0, len(text))]
    if rng.random() < 0.3:
        k = rng.randint(0, len(text))
        text = text[:k] + rng.choice(syntax) + text[k:]
    return text


@pytest.mark.parametrize("fmt", [MISTRAL, QWEN3_CODER, PYTHONIC])
def test_random_outputs_stream_as_they_parse_whole(fmt):
    """Seeded random outputs (calls, junk, cuts, stray syntax): streamed with a boundary at every
    position, and a character at a time, the result equals the whole text's."""
    rng, found = random.Random(fmt), 0
    for _ in range(150):
        text = _random_output(fmt, rng)
        for parallel in (True, False):
            content, calls = SnapshotStream(fmt, parallel, SCHEMAS).content_and_calls(text)
            want = ((content or "") if calls else text, [(c["function"]["name"], c["function"]["arguments"])
                                                         for c in calls])
            found += bool(calls)
            for chunks in [list(text) or [""]] + [[text[:k], text[k:]] for k in range(len(text) + 1)]:
                assert _run(fmt, chunks, parallel) == want, (text, chunks)
    assert found > 100      # most outputs hold calls


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


# ---------------------------------------------------------------------- through the server

NAME = "tiny"
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
                                                                          "note": {"type": "string"}},
                                       "required": ["zone"]}}}
MSGS = [{"role": "user", "content": "What time is it?"}]
_TURNS = ("{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
          "{% elif m.role == 'assistant' %}{{ m.content or '' }}</s>{% else %}{{ m.content }}{% endif %}{% endfor %}")
# Chat templates in each format (tools listed, the call syntax shown), and a regex that makes the
# tiny random model write a call in it: (template, --tool-call-parser or None for "from the
# template", regex, content, arguments whole, the start of the arguments when cut by max_tokens).
FORMATS = {
    MISTRAL: ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}" + _TURNS +
              "{# calls: [TOOL_CALLS]name[ARGS]{arguments} #}", None,
              r'Sure\. \[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "(UTC|CET)", "note": "[a-z]{8}"\}',
              "Sure. ", r'\{"zone": "(UTC|CET)", "note": "[a-z]{8}"\}', 44),
    QWEN3_CODER: ("{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n"
                  "Call a tool as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
                  "</function>\n</tool_call>\n{% endif %}" + _TURNS, None,
                  r"Sure\. <tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n"
                  r"<parameter=note>\n[a-z]{8}\n</parameter>\n</function>\n</tool_call>",
                  "Sure. ", r'\{"zone": "(UTC|CET)", "note": "[a-z]{8}"\}', 80),
    PYTHONIC: ("{% if tools %}Tools: {{ tools | tojson }}\nCall them as a Python list: "
               "[func_name1(param1=value1), func_name2(param2=value2)]\n{% endif %}" + _TURNS, PYTHONIC,
               r'\[get_time\(zone="(UTC|CET)", note="[a-z]{8}"\)\]', None,
               r'\{"zone": "(UTC|CET)", "note": "[a-z]{8}"\}', 30),
}


class _TemplateTokenizer:
    """The tiny model's tokenizer with a chat template written by the test."""

    def __init__(self, tok, template):
        self.tok, self.chat_template = tok, template

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def render_chat(self, messages, add_generation_prompt=True, **kw):
        from jpa.models.chat_template import render
        return render(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **kw)


@pytest.fixture(scope="module")
def live():
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from server_util import tiny_engine

    with tiny_engine() as (aengine, tok):
        yield aengine, tok


def _streamed(client, **kw):
    content, calls, reasons = "", {}, []
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                slot = calls.setdefault(d.index, ["", ""])
                if d.id:
                    assert not slot[1], "the name comes first"
                    slot[0] = d.function.name
                slot[1] += d.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return content or None, [tuple(v) for _, v in sorted(calls.items())], reasons


@pytest.mark.parametrize("fmt", tiered(sorted(FORMATS), soak=("mistral", "qwen3_coder")))
def test_calls_in_each_format_through_the_server(live, fmt):
    """The template renders the tools; the model writes a call in its format; the server parses it
    (the format picked from the template, pythonic by tool_call_parser): non-streamed == streamed,
    whole (finish_reason tool_calls, the arguments JSON) and cut by max_tokens (length, the
    arguments so far)."""
    import re

    import openai
    from jpa.server import build_app
    from server_util import serving

    template, parser, regex, content, args_re, cut = FORMATS[fmt]
    aengine, tok = live
    app = build_app(aengine, _TemplateTokenizer(tok, template), model_name=NAME, tool_call_parser=parser)
    with serving(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for max_tokens in (300, cut):
            kw = dict(model=NAME, messages=MSGS, tools=[TIME], max_tokens=max_tokens, temperature=1.0, seed=5,
                      extra_body={"structured_outputs": {"regex": regex}})
            r = client.chat.completions.create(**kw).choices[0]
            (call,) = r.message.tool_calls
            assert call.function.name == "get_time" and r.message.content == content
            assert _streamed(client, **kw) == (content, [("get_time", call.function.arguments)],
                                               [r.finish_reason])
            if max_tokens == cut:
                assert r.finish_reason == "length" and call.function.arguments.startswith('{"zone": ')
                assert not re.fullmatch(args_re, call.function.arguments)
            else:
                assert r.finish_reason == "tool_calls" and re.fullmatch(args_re, call.function.arguments)
                assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_mistral_keeps_its_special_tokens_in_the_text(live):
    """Mistral's [TOOL_CALLS] / [ARGS] are special tokens of its tokenizers: with tools (auto) and the
    mistral parser, skip_special_tokens defaults to false (vLLM's), so the parser sees them; a
    request's own value, other formats and tool_choice none keep the default (true)."""
    from jpa.server import build_app

    aengine, tok = live

    def skip(template, parser=None, **body):
        api = build_app(aengine, _TemplateTokenizer(tok, template), model_name=NAME,
                        tool_call_parser=parser).state.jpa
        raw = json.dumps({"model": NAME, "messages": MSGS, "tools": [TIME], **body}).encode()
        _, params, _, _ = api.prepare_chat(raw)
        return {p.skip_special_tokens for _, p, _ in params}   # (prompt, params, LoRA request)

    mistral = FORMATS[MISTRAL][0]
    assert skip(mistral) == {False} and skip(FORMATS[QWEN3_CODER][0], parser=MISTRAL) == {False}
    assert skip(mistral, skip_special_tokens=True) == {True} and skip(mistral, tool_choice="none") == {True}
    assert skip(FORMATS[QWEN3_CODER][0]) == {True} and skip(mistral, parser=PYTHONIC) == {True}
    with pytest.raises(ValueError, match="tool_call_parser must be None or one of"):
        build_app(aengine, tok, model_name=NAME, tool_call_parser="xml")


def test_the_cli_offers_every_parser():
    """`jpa serve --tool-call-parser` takes exactly the formats build_app takes."""
    from jpa.cli.serve import parse_args
    from jpa.server.tools import TOOL_CALL_PARSERS

    for fmt in TOOL_CALL_PARSERS:
        assert parse_args(["--model", "tiny-llama", "--tool-call-parser", fmt]).tool_call_parser == fmt
    assert parse_args(["--model", "tiny-llama"]).tool_call_parser is None
    from jpa.args import UsageError
    with pytest.raises(UsageError, match="invalid choice: 'xml'"):
        parse_args(["--model", "tiny-llama", "--tool-call-parser", "xml"])
