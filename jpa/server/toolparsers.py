"""Tool-call parsers for Mistral `[TOOL_CALLS]`, Qwen3-Coder XML and pythonic calls, streamed as
generated: a call's name once complete, then its arguments (JSON text) piece by piece.

Each format is one pure scan, `parse(text, final) -> (content, [(name, arguments so far)])`, that
is monotone in the text: on a longer prefix the content and every call's arguments only grow, and a
name, once returned, stays. `SnapshotStream` feeds the scan the text so far and sends what grew, so
streamed and non-streamed answers (the scan of the whole text) are equal for any chunking, a call
cut by max_tokens included. The scan reruns per delta, but with a memo kept by the stream (the text
only grows): a JSON value, a Python literal and a parameter's conversion are each read once (an
incomplete one resumes where it stopped), so a long call costs about linear time, not quadratic.

Formats (text before the first call is the content; after a call, text that is not a call ends the
calls and is dropped; before any call, a block that turns out not to be a call is content):
- Mistral: `[TOOL_CALLS]` then either a JSON array of `{"name", "arguments"}` objects (v0.3) or
  `name[ARGS]{...}` (tokenizer v11+), repeated after further `[TOOL_CALLS]`. Arguments stream as written.
- Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`.
  A value is converted by the tool's JSON schema for that parameter (string by default; integer,
  number, boolean, object, array, null by JSON text, kept a string when it is not); one newline
  each side of it is dropped. The arguments grow a parameter at a time (`{`, each `"key": value`
  once its `</parameter>` is written, `}` at `</function>`): a cut call holds its complete parameters.
- pythonic (vLLM's, Llama-3.2/4): the output (after an optional `<|python_start|>`) is a Python list of
  calls with keyword arguments, `[f(a=1), g(b="x")]`; values are Python literals (True, None, tuples,
  ...) turned into JSON. An output that does not start as such a list is content. The arguments grow
  an argument at a time, as for Qwen3-Coder.
"""

import ast
import json
import re
import uuid
import warnings

from jpa.server.toolcalls import _json_end, _Obj, _partial_suffix, _skip

MISTRAL, QWEN3_CODER, PYTHONIC = "mistral", "qwen3_coder", "pythonic"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
XML_OPEN, XML_CLOSE, FN_OPEN, FN_CLOSE, P_OPEN, P_CLOSE = (
    "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
PYTHON_START = "<|python_start|>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DQ, _SQ = re.compile(r'"(?:[^"\\]|\\.)*"', re.S), re.compile(r"'(?:[^'\\]|\\.)*'", re.S)
_PLAIN = re.compile(r"[^\"'()\[\]{},]+")


def _held(text: str, at: int, tag: str, final: bool) -> int:
    """Where content may end when no `tag` starts at or after `at`: the text's end, less a suffix
    that may begin the tag (unless final)."""
    return len(text) if final else len(text) - _partial_suffix(text[at:], tag)


# ---------------------------------------------------------------------- Mistral

def _mistral(t: str, final: bool, parallel: bool, tools, memo=None) -> tuple[str, list]:
    calls, content, p, memo = [], "", 0, {} if memo is None else memo
    while True:
        at = t.find(TOOL_CALLS, p)
        if at < 0:
            if not calls:
                content += t[p:_held(t, p, TOOL_CALLS, final)]
            return content, calls
        if not calls:
            content += t[p:at]
        i, n0 = _skip(t, at + len(TOOL_CALLS)), len(calls)
        if i < len(t) and t[i] == "[":            # v0.3: a JSON array of {"name", "arguments"}
            end = _mistral_array(t, i, final, calls, parallel, memo)
        else:                                     # v11+: name[ARGS]{...}
            end = _mistral_args(t, i, final, calls, memo)
        if len(calls) == n0:                      # no call (yet)
            if end == "wait" and not final:
                return content, calls
            if calls:
                return content, calls             # after a call: the rest is dropped
            content += TOOL_CALLS                 # not a call: its text is content
            p = at + len(TOOL_CALLS)
            continue
        if not isinstance(end, int) or not parallel:
            return content, calls
        p = _skip(t, end)                         # after a complete call: only another [TOOL_CALLS]
        if not t.startswith(TOOL_CALLS, p):
            return content, calls


def _mistral_args(t, i, final, calls, memo):
    """`name[ARGS]{...}` at i: appends the call once its name is complete; returns where it ends,
    "wait" (incomplete), or "stop" (bad after the name, or cut)."""
    m = _NAME.match(t, i)
    j = m.end() if m else i
    if not t.startswith(ARGS, j):
        return "wait" if ARGS.startswith(t[j:]) and not final else "bad"
    if m is None:
        return "bad"
    k = _skip(t, j + len(ARGS))
    calls.append((m.group(0), ""))
    if k >= len(t):
        return "wait"
    if t[k] != "{":
        return "stop"
    e = _json_end(t, k, memo)
    if e is None:
        calls[-1] = (calls[-1][0], t[k:])
        return "wait"
    calls[-1] = (calls[-1][0], t[k:e])
    return e


def _mistral_array(t, i, final, calls, more, memo):
    i = _skip(t, i + 1)
    first = True
    while True:
        if i >= len(t):
            return "wait"
        if not first:
            if t[i] == "]":
                return i + 1
            if t[i] != ",":
                return "stop"
            i = _skip(t, i + 1)
            if i >= len(t):
                return "wait"
            if not more:
                return "stop"
        if t[i] != "{":
            return "stop" if not first else "bad"
        obj = _Obj(t, i, memo)
        if obj.name is None:
            return "bad" if (obj.bad or final) and first else ("wait" if not obj.bad else "stop")
        args = ""
        if obj.args_start is not None:
            args = t[obj.args_start:obj.args_end if obj.args_end is not None else len(t)]
        calls.append((obj.name, args))
        if obj.bad:
            return "stop"
        if obj.end is None:
            return "wait"
        i, first = _skip(t, obj.end), False


# ---------------------------------------------------------------------- Qwen3-Coder XML

def _convert(value: str, schema) -> str:
    """A parameter's text as JSON, by its schema's type: a string unless the schema allows a
    non-string type and the text is JSON of one (or Python's True/False for a boolean)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if set(types) - {"string"}:
        try:
            v = json.loads(value)
        except ValueError:
            v = {"True": True, "False": False}.get(value.strip(), value) if "boolean" in types else value
        if not isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _strip_nl(v: str) -> str:
    v = v[1:] if v.startswith("\n") else v
    return v[:-1] if v.endswith("\n") else v


def _qwen3_coder(t: str, final: bool, parallel: bool, tools, memo=None) -> tuple[str, list]:
    calls, content, p, memo = [], "", 0, {} if memo is None else memo
    while True:
        at = t.find(XML_OPEN, p)
        if at < 0:
            if not calls:
                content += t[p:_held(t, p, XML_OPEN, final)]
            return content, calls
        i = _skip(t, at + len(XML_OPEN))
        if not t.startswith(FN_OPEN, i):
            if (i >= len(t) or FN_OPEN.startswith(t[i:])) and not final:
                if not calls:
                    content += t[p:at]
                return content, calls
            if calls:                                # after a call: the text between is dropped
                p = at + len(XML_OPEN)
                continue
            content += t[p:at + len(XML_OPEN)]
            p = at + len(XML_OPEN)
            continue
        gt = t.find(">", i + len(FN_OPEN))
        name = t[i + len(FN_OPEN):gt if gt >= 0 else len(t)]
        if gt < 0 or not _NAME.fullmatch(name):      # the name is complete at its `>`
            if gt < 0 and not final and (not name or _NAME.fullmatch(name)):
                if not calls:
                    content += t[p:at]
                return content, calls
            if calls:
                p = at + len(XML_OPEN)
                continue
            content += t[p:at + len(XML_OPEN)]
            p = at + len(XML_OPEN)
            continue
        if not calls:
            content += t[p:at]
        if calls and not parallel:
            return content, calls
        schema = (tools or {}).get(name) or {}
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        parts, j, closed = [], gt + 1, False
        while True:
            j = _skip(t, j)
            if t.startswith(FN_CLOSE, j):
                j, closed = j + len(FN_CLOSE), True
                break
            if not t.startswith(P_OPEN, j):
                break
            pg = t.find(">", j + len(P_OPEN))
            if pg < 0:
                break
            end = t.find(P_CLOSE, pg + 1)
            if end < 0:
                break
            part = memo.get(("param", j, end))   # a complete parameter is converted once
            if part is None:
                key = t[j + len(P_OPEN):pg]
                part = memo[("param", j, end)] = (f"{json.dumps(key, ensure_ascii=False)}: "
                                                  f"{_convert(_strip_nl(t[pg + 1:end]), props.get(key))}")
            parts.append(part)
            j = end + len(P_CLOSE)
        calls.append((name, "{" + ", ".join(parts) + ("}" if closed else "")))
        if not closed:
            return content, calls
        c = t.find(XML_CLOSE, j)
        if c < 0:
            return content, calls
        p = c + len(XML_CLOSE)


# ---------------------------------------------------------------------- pythonic

def _py_value_end(t: str, i: int, memo: dict) -> int | None:
    """End of a Python literal at i (the `,` or `)` that follows it at depth 0), or None when the
    text ends first. Resumed where the last scan of the same value stopped (memo); strings and runs
    of plain characters are skipped by regex."""
    start = i
    i, depth = memo.get(("py", start), (i, 0))
    while i < len(t):
        c = t[i]
        if c in "\"'":
            m = (_DQ if c == '"' else _SQ).match(t, i)
            if m is None:               # resumed at the string's start once more of it is here
                break
            i = m.end()
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                memo[("py", start)] = (i, depth)
                return i
            depth -= 1
        elif c == ",":
            if depth == 0:
                memo[("py", start)] = (i, depth)
                return i
        else:
            i = _PLAIN.match(t, i).end()
            continue
        i += 1
    memo[("py", start)] = (i, depth)
    return None


def _py_json(text: str) -> str:
    with warnings.catch_warnings():                # "invalid escape sequence" in a model's string
        warnings.simplefilter("ignore")
        v = ast.literal_eval(text.strip())
    return json.dumps(v, ensure_ascii=False)       # tuples -> lists; a set or bytes raises TypeError


def _pythonic(t: str, final: bool, parallel: bool, tools, memo=None) -> tuple[str, list]:
    calls, memo = [], {} if memo is None else memo
    i = _skip(t, 0)
    if t.startswith(PYTHON_START, i):
        i = _skip(t, i + len(PYTHON_START))
    elif PYTHON_START.startswith(t[i:]) and i < len(t):
        return (t if final else ""), []
    if i >= len(t):
        return (t if final else ""), []
    if t[i] != "[":
        return t, []
    i = _skip(t, i + 1)
    while True:
        m = _IDENT.match(t, i)
        j = _skip(t, m.end()) if m else i
        if m is None or j >= len(t) or t[j] != "(":
            if not calls and ((m is None and i < len(t)) or (j < len(t) and t[j] != "(") or final):
                return t, []
            return "", calls
        if calls and not parallel:
            return "", calls
        name, parts, k, closed = m.group(0), [], _skip(t, j + 1), False
        while True:
            if k < len(t) and t[k] == ")":
                k, closed = k + 1, True
                break
            a = _IDENT.match(t, k)
            eq = _skip(t, a.end()) if a else k
            if a is None or eq >= len(t) or t[eq] != "=":
                break
            end = _py_value_end(t, eq + 1, memo)
            if end is None:
                break
            part = memo.get(("arg", eq, end))      # a complete argument is evaluated once
            if part is None:
                try:
                    part = f"{json.dumps(a.group(0))}: {_py_json(t[eq + 1:end])}"
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    part = False
                memo[("arg", eq, end)] = part
            if part is False:
                calls.append((name, "{" + ", ".join(parts)))
                return "", calls
            parts.append(part)
            k = _skip(t, end + 1) if t[end] == "," else end
        calls.append((name, "{" + ", ".join(parts) + ("}" if closed else "")))
        if not closed:
            return "", calls
        k = _skip(t, k)
        if k >= len(t) or t[k] != ",":
            return "", calls
        i = _skip(t, k + 1)


_PARSERS = {MISTRAL: _mistral, QWEN3_CODER: _qwen3_coder, PYTHONIC: _pythonic}


class SnapshotStream:
    """`CallStream`'s interface over a monotone whole-text scan (see the module doc)."""

    def __init__(self, fmt: str, parallel: bool = True, tools: dict | None = None):
        if fmt not in _PARSERS:
            raise ValueError(f"tool-call format must be one of {sorted(_PARSERS)}; got {fmt!r}")
        self._parse, self.parallel, self.tools = _PARSERS[fmt], parallel, tools
        self.text, self._content = "", ""
        self.calls: list[dict] = []
        self._memo: dict = {}   # the scan's work on complete pieces and where incomplete ones stopped

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        content, calls = self._parse(self.text, final, self.parallel, self.tools, self._memo)
        if not self.parallel:
            calls = calls[:1]
        out, new = [], ""
        if content.startswith(self._content):     # always, the scan being monotone
            new, self._content = content[len(self._content):], content
        for k, (name, args) in enumerate(calls):
            if k == len(self.calls):
                call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": name, "arguments": ""}}
                self.calls.append(call)
                out.append({"index": k, "id": call["id"], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            sent = self.calls[k]["function"]["arguments"]
            if len(args) > len(sent) and args.startswith(sent):
                self.calls[k]["function"]["arguments"] = args
                out.append({"index": k, "function": {"arguments": args[len(sent):]}})
        return new, out

    def content_and_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole output's (content, calls): the stream fed everything at once."""
        content, _ = self.feed(text, final=True)
        if not self.calls:
            return text, []
        return (content if content.strip() else None), self.calls
