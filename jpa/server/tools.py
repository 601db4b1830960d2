"""Structured outputs and tool calling for the OpenAI API (host side; the engine enforces constraints).

`request_constraint(body)` turns a request's `response_format` (json_object, json_schema),
`structured_outputs` (vLLM's json / regex / choice / grammar / json_object), the older `guided_*`
fields, or a chat's `tool_choice` ("required", a named function) into one
`jpa.engine.structured.StructuredOutputs`, or a 400 naming the field when it is invalid or when
two of them are given.

Tool calling (chat): the tools are rendered by the chat template; then, by `tool_choice`:
- "none" (or no tools): plain text;
- a named function: the output is constrained to the function's parameters (a JSON object) and
  returned as one call of it (finish_reason "stop", as OpenAI does for a forced function; cut by
  max_tokens: the call with the arguments so far and finish_reason "length", streamed or not);
- "required": the output is constrained to a JSON array of {"name", "parameters"} calls of the
  given functions (one at most with parallel_tool_calls false), returned as tool_calls
  (finish_reason "tool_calls"); it is never content: cut by max_tokens, the answer is the calls
  whose names were complete (the last one's arguments as written so far), content null (streamed:
  no content delta), finish_reason "length"; cut before the first name is complete, no call and
  no content. The Responses API shows the same (function_call items; none when cut that early);
- "auto" (the default with tools): the model decides; calls are parsed from its text by format:
  Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks (Qwen2.5, Qwen3, and the ChatML
  models here, whose tools are rendered that way) or Llama-3.1 JSON (`{"name", "parameters"}`, after
  an optional <|python_tag|>, `;`-separated), Mistral `[TOOL_CALLS]`, Qwen3-Coder XML or pythonic
  (`jpa.server.toolparsers`), picked from the chat template or by `--tool-call-parser`. Text before the
  first call is the message content (None if it is only whitespace). finish_reason "tool_calls" when
  calls were found.
Streaming (`ToolStream`): content streams as it comes (held back where it may begin a tool call);
calls stream as they are generated: a call's name once complete, then its arguments piece by piece
(`jpa.server.toolcalls`); the non-streamed answer is the same parser fed the whole text, so the two
are equal, a call cut by max_tokens included (its arguments as written so far).
"""

import json
import urllib.parse
import uuid

from jpa.engine.structured import StructuredOutputs
from jpa.server.protocol import APIError
from jpa.server.toolcalls import HERMES, LLAMA3_JSON, REQUIRED, CallStream
from jpa.server.toolparsers import MISTRAL, PYTHONIC, QWEN3_CODER, SnapshotStream

TOOL_CALL_PARSERS = (HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC)   # `--tool-call-parser`


def _spec(param: str, **fields) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as e:
        raise APIError(400, f"'{param}': {e}"[:600], param=param.split(".")[0]) from None


def tool_mode(body) -> str | None:
    """None (no tool calling), "auto", "required" or "named" for a chat request (400 when the
    tool_choice names no given tool, or asks for tools without any)."""
    tools, choice = getattr(body, "tools", None) or [], getattr(body, "tool_choice", None)
    if choice is None:
        return "auto" if tools else None
    if choice == "none":
        return None
    if not tools:
        raise APIError(400, f"'tool_choice' {choice if isinstance(choice, str) else 'a named function'!r} needs "
                            f"'tools'", param="tool_choice")
    if isinstance(choice, str):
        return choice
    if choice.function.name not in [t.function.name for t in tools]:
        raise APIError(400, f"'tool_choice' names the function {choice.function.name!r}, which is not in 'tools' "
                            f"({', '.join(t.function.name for t in tools)})", param="tool_choice")
    return "named"


def _parameters(fn) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {},
                                                            "additionalProperties": False}


# Keywords whose values are data, not subschemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _escape(token: str) -> str:      # a JSON-pointer reference token (RFC 6901) in a URI fragment
    return urllib.parse.quote(token.replace("~", "~0").replace("/", "~1"), safe="~!$&'()*+,;=:@-._")


def _unescape(token: str) -> str:
    return urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")


def _rebase(schema, defs_map: dict, root_key: str, uses_root: list):
    """schema with its local references rewritten for a root where its definitions live under $defs
    by the new names of defs_map ({old name: new name}, `$defs` and `definitions` alike) and the
    schema itself, where a reference points into it, under $defs[root_key] (uses_root: set True)."""
    if isinstance(schema, list):
        return [_rebase(v, defs_map, root_key, uses_root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            parts = v[1:].split("/")   # "", then the pointer's tokens
            if len(parts) >= 3 and parts[0] == "" and parts[1] in ("$defs", "definitions") \
                    and _unescape(parts[2]) in defs_map:
                v = "#/$defs/" + "/".join([_escape(defs_map[_unescape(parts[2])]), *parts[3:]])
            else:                      # "#" or a pointer into the parameters themselves
                uses_root[0] = True
                v = f"#/$defs/{_escape(root_key)}{v[1:]}"
            out[k] = v
        elif k in _DATA_KEYWORDS:
            out[k] = v
        else:
            out[k] = _rebase(v, defs_map, root_key, uses_root)
    return out


def required_schema(tools, parallel: bool) -> dict:
    """A JSON array of one or more {"name", "parameters"} calls of the tools (vLLM's form).

    Each tool's parameters sit inside the array's items, so their local references ("#/$defs/X",
    "#/definitions/X", "#", "#/properties/...") would resolve against the array: the definitions move
    to the root's $defs (named "tool<i>.<name>", so two tools' definitions never collide) and the
    references follow them; a reference into the parameters themselves points to a copy of them there."""
    calls, root_defs = [], {}
    for i, t in enumerate(tools):
        params = _parameters(t.function)
        name = t.function.name
        if isinstance(params, dict) and ("$defs" in params or "definitions" in params or _has_local_ref(params)):
            params = dict(params)
            defs = {}
            for key in ("definitions", "$defs"):   # $defs wins a name both hold, as it is the newer
                if isinstance(params.get(key), dict):
                    defs.update(params.pop(key))
            defs_map = {k: f"tool{i}.{k}" for k in defs}   # by position: names may repeat
            root_key, uses_root = f"tool{i}", [False]
            params = _rebase(params, defs_map, root_key, uses_root)
            for k, d in defs.items():
                root_defs[defs_map[k]] = _rebase(d, defs_map, root_key, uses_root)
            if uses_root[0]:
                root_defs[root_key] = params
                params = {"$ref": f"#/$defs/{_escape(root_key)}"}
        calls.append({"type": "object", "properties": {"name": {"enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if root_defs:
        schema["$defs"] = root_defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _has_local_ref(schema) -> bool:
    if isinstance(schema, list):
        return any(_has_local_ref(v) for v in schema)
    if not isinstance(schema, dict):
        return False
    return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or
               (k not in _DATA_KEYWORDS and _has_local_ref(v)) for k, v in schema.items())


def request_constraint(body, chat: bool, build=_spec) -> StructuredOutputs | None:
    """The one constraint a request asks for (see the module doc), or None.

    build(param, **fields) makes the StructuredOutputs of the field `param` (default: at once, here;
    the server passes one that checks limits and compiles on its guarded workers)."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", lambda: build("response_format", json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "'response_format.json_schema.schema' is required with type 'json_schema'",
                           param="response_format")
        found.append(("response_format",
                      lambda: build("response_format.json_schema.schema", json=rf.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(so, name) is not None:
                raise APIError(400, f"'structured_outputs.{name}' is not supported", param="structured_outputs")
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if v is not None}
        if len(given) != 1:
            raise APIError(400, f"'structured_outputs' needs exactly one of json, regex, choice, grammar, "
                                f"json_object; got {', '.join(given) or 'none'}", param="structured_outputs")
        (k, v), = given.items()
        found.append(("structured_outputs", lambda k=k, v=v: build(f"structured_outputs.{k}", **{k: v})))
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        v = getattr(body, name)
        if v is not None:
            found.append((name, lambda name=name, field=field, v=v: build(name, **{field: v})))
    mode = tool_mode(body) if chat else None
    if mode == "named":
        fn = next(t.function for t in body.tools if t.function.name == body.tool_choice.function.name)
        found.append(("tool_choice", lambda: build(f"tools.{fn.name}.parameters", json=_parameters(fn))))
    elif mode == "required":
        def required():
            try:
                schema = required_schema(body.tools, body.parallel_tool_calls is not False)
            except RecursionError:
                raise APIError(400, "'tools': a function's parameters are nested too deeply", param="tools") from None
            return build("tools", json=schema)
        found.append(("tool_choice", required))
    if len(found) > 1:
        raise APIError(400, f"give one constraint at a time; got {', '.join(n for n, _ in found)}",
                       param=found[1][0])
    return found[0][1]() if found else None


def constraint_field(body) -> str | None:
    """The request field that holds its constraint (what an error during constrained generation
    names), or None."""
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type != "text":
        return "response_format"
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name, None) is not None:
            return name
    if getattr(body, "tool_choice", None) is not None and not isinstance(body.tool_choice, str) \
            or getattr(body, "tool_choice", None) == "required":
        return "tools"
    return None


def parser_format(tokenizer) -> str:
    """The tool-call format of a model, from its chat template: Qwen3-Coder XML where it writes
    `<function=` and `<parameter=`, Mistral where it writes [TOOL_CALLS], Llama-3.1 JSON where it
    speaks of <|python_tag|> / ipython and not of <tool_call>, else Hermes. (Pythonic calls are not
    recognised from a template: `--tool-call-parser pythonic`.)"""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3_JSON
    return HERMES


def call_stream(fmt: str, parallel: bool = True, tools=None):
    """The incremental tool-call parser of a format (`feed`, `calls`, `content_and_calls`); tools:
    the request's tools (Qwen3-Coder converts parameters by their schemas)."""
    if fmt in (HERMES, LLAMA3_JSON, REQUIRED):
        return CallStream(fmt, parallel)
    schemas = {t.function.name: _parameters(t.function) for t in tools or ()}
    return SnapshotStream(fmt, parallel, schemas)


def _call(name: str, arguments) -> dict:
    """An OpenAI tool call; arguments: a dict (serialized) or the JSON text as the model wrote it."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_output(text: str, mode: str | None, fmt: str, name: str | None = None,
                 parallel: bool = True, tools=None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole chat output under a tool mode: for "auto" and "required",
    the stream parser (`jpa.server.toolcalls.CallStream`) fed the whole text, so a non-streamed
    answer equals the streamed one."""
    if mode == "named":
        # The arguments as generated (and streamed), even when max_tokens cut them (finish_reason
        # "length", as vLLM): streamed and non-streamed answers are the same call.
        return None, [_call(name, text)]
    if mode == "required":
        # The output is the grammar's JSON array of calls, never content: cut by max_tokens, it is the
        # calls whose names are complete, the last one's arguments as written so far, and no content
        # (a stream shows the same: it never streams content under "required").
        _, calls = call_stream(REQUIRED, parallel, tools).content_and_calls(text)
        return None, calls
    if mode == "auto":
        return call_stream(fmt, parallel, tools).content_and_calls(text)
    return text, []


class ToolStream:
    """One streamed choice's text under a tool mode: text deltas -> (content delta, tool-call deltas).
    A named function's arguments stream as they are generated; "auto" and "required" calls stream
    as they are parsed: the name once complete, then the arguments piece by piece."""

    def __init__(self, mode: str, fmt: str, name: str | None = None, parallel: bool = True, tools=None):
        self.mode, self.name = mode, name
        self.call_id = None
        self._calls = None if mode == "named" else call_stream(REQUIRED if mode == "required" else fmt, parallel,
                                                               tools)

    @property
    def calls(self) -> list[dict]:
        return self._calls.calls if self._calls is not None else []

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        if self.mode == "named":
            out = []
            if delta or (final and self.call_id is None):
                if self.call_id is None:
                    call = _call(self.name, "")
                    self.call_id = call["id"]
                    out = [{"index": 0, "id": self.call_id, "type": "function",
                            "function": {"name": self.name, "arguments": delta}}]
                else:
                    out = [{"index": 0, "function": {"arguments": delta}}]
            return "", out
        return self._calls.feed(delta, final)
