"""Tool calls parsed as they are generated ("auto" and "required"): each call's name as soon as it is
complete, then its arguments piece by piece, exactly as the model writes them.

One incremental parser (`CallStream`) serves streaming and non-streaming alike: a non-streamed
answer is the stream fed the whole text at once, so the two are equal by construction, for any
chunking and when max_tokens cuts a call (then the call holds the arguments written so far).

Formats:
- Hermes (Qwen2.5, Qwen3, the ChatML models here): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks. Text before the first block is the content; text between or after blocks
  is dropped. A block whose JSON does not start as a call (name first, then arguments/parameters)
  is content.
- Llama-3.1 JSON: the output (after an optional `<|python_tag|>`) is `{"name": ..., "parameters":
  {...}}` objects separated by `;`; an output that does not start with `{` is content.
- "required" (jpa's grammar): a JSON array of `{"name", "parameters"}` objects.
With parallel_tool_calls false only the first call is kept.
"""

import json
import re
import uuid

HERMES, LLAMA3_JSON, REQUIRED = "hermes", "llama3_json", "required"
OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_ARG_KEYS = ("arguments", "parameters")


def _skip(s: str, i: int, chars: str = _WS) -> int:
    while i < len(s) and s[i] in chars:
        i += 1
    return i


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


_PLAIN_JSON = re.compile(r'[^"{}\[\]]+')
_STRING_CHARS = re.compile(r'[^"\\]*')


class _JsonEnd:
    """Where the JSON object (or array) that starts at `start` ends, found incrementally: each call
    of `scan` reads only the text added since the last (brackets counted outside strings), and the
    object is parsed once, when its brackets balance. Same answer as `json.JSONDecoder().raw_decode`
    on the text so far: the end once the value is complete and valid; never one when it is not JSON."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_str = start, 0, False
        self.start, self.end, self.bad = start, None, False

    def scan(self, t: str) -> int | None:
        if self.end is not None or self.bad:
            return self.end
        i, depth, in_str, n = self.pos, self.depth, self.in_str, len(t)
        while i < n:
            if in_str:
                i = _STRING_CHARS.match(t, i).end()
                if i >= n:
                    break
                if t[i] == "\\":
                    if i + 1 >= n:      # the escaped character is not here yet
                        break
                    i += 2
                    continue
                in_str, i = False, i + 1
                continue
            c = t[i]
            if c == '"':
                in_str, i = True, i + 1
            elif c in "{[":
                depth, i = depth + 1, i + 1
            elif c in "}]":
                depth, i = depth - 1, i + 1
                if depth <= 0:
                    try:
                        _, e = json.JSONDecoder().raw_decode(t, self.start)
                    except ValueError:
                        e = None
                    self.end, self.bad = e, e is None   # not JSON: never complete (as raw_decode)
                    break
            else:
                i = _PLAIN_JSON.match(t, i).end()
        self.pos, self.depth, self.in_str = i, depth, in_str
        return self.end


def _json_end(t: str, start: int, memo: dict) -> int | None:
    """_JsonEnd of the value at `start`, kept in memo across calls on longer texts."""
    tracker = memo.get(("json", start))
    if tracker is None:
        tracker = memo[("json", start)] = _JsonEnd(start)
    return tracker.scan(t)


class _Obj:
    """Scan of one call object's text so far (its `{` at s[at]); offsets are absolute. memo: kept
    across scans of the same growing text (the arguments are read incrementally, `_JsonEnd`)."""

    def __init__(self, s: str, at: int = 0, memo: dict | None = None):
        self.name = None        # the name, once its string is complete
        self.args_start = None  # where the arguments value starts (once a character of it exists)
        self.args_end = None    # where it ends (once it parses as a complete JSON object)
        self.end = None         # just past the object's closing brace
        self.bad = False        # not a call of this shape
        self._scan(s, at, {} if memo is None else memo)

    def _string(self, s, i):
        """(value, end) of a JSON string at i; (None, None) when incomplete; raises ValueError when bad."""
        if i >= len(s):
            return None, None
        if s[i] != '"':
            raise ValueError
        m = _STRING.match(s, i)
        if m is None:
            return None, None
        return json.loads(m.group(0)), m.end()

    def _scan(self, s, at, memo):
        try:
            i = _skip(s, at + 1)
            key, i = self._string(s, i)
            if key is None:
                return
            if key != "name":
                raise ValueError
            i = _skip(s, i)
            if i >= len(s):
                return
            if s[i] != ":":
                raise ValueError
            name, i = self._string(s, _skip(s, i + 1))
            if name is None:
                return
            self.name = name
            i = _skip(s, i)
            if i >= len(s):
                return
            if s[i] == "}":     # a call without arguments
                self.args_start = self.args_end = i
                self.end = i + 1
                return
            if s[i] != ",":
                raise ValueError
            key, i = self._string(s, _skip(s, i + 1))
            if key is None:
                return
            if key not in _ARG_KEYS:
                raise ValueError
            i = _skip(s, i)
            if i >= len(s):
                return
            if s[i] != ":":
                raise ValueError
            i = _skip(s, i + 1)
            if i >= len(s):
                return
            if s[i] != "{":
                raise ValueError
            self.args_start = i
            j = _json_end(s, i, memo)
            if j is None:
                return          # not complete yet (or never: the text so far is the arguments)
            self.args_end = i = j
            i = _skip(s, i)
            if i < len(s):
                if s[i] != "}":
                    raise ValueError
                self.end = i + 1
        except ValueError:
            self.bad = True


class CallStream:
    """Text deltas of one choice -> (content delta, tool-call deltas); `calls` holds the calls so far
    ({"id", "type", "function": {"name", "arguments"}})."""

    def __init__(self, fmt: str, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.text = ""
        self.pos = 0                 # text before pos is handled
        # lead (content before any call), between (after a call), open (Hermes: after <tool_call>),
        # call (inside a call's object), closing (Hermes: after a call, before </tool_call>),
        # junk (Hermes: a block that is not a call), content_all (Llama-3: not calls), done.
        self.state = "lead"
        self.calls: list[dict] = []
        self._sent_args = 0          # characters of the current call's arguments sent
        self._call_at = None         # where the current call's object starts (its `{`)
        self._current = None         # _call_at of the call last announced
        self._block_at = None        # Hermes: where the current block's <tool_call> starts
        self._memo: dict = {}        # the arguments' scans, resumed on each delta (`_JsonEnd`)

    def _new_call(self, name: str) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        self._sent_args = 0
        return {"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args(self, piece: str, out: list) -> None:
        if piece:
            self.calls[-1]["function"]["arguments"] += piece
            self._sent_args += len(piece)
            out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        content, out = "", []
        for _ in range(4 * len(self.text) + 16):   # each step consumes text or changes state
            progressed, c = self._step(final, out)
            content += c
            if not progressed:
                break
        return content, out

    def _step(self, final: bool, out: list) -> tuple[bool, str]:
        """One transition: (made progress, content emitted)."""
        t, p = self.text, self.pos
        lead = not self.calls
        if self.state == "done":
            self.pos = len(t)
            return False, ""
        if self.state == "content_all":
            self.pos = len(t)
            return False, t[p:]
        if self.state in ("lead", "between"):
            if self.fmt == HERMES:
                at = t.find(OPEN, p)
                if at < 0:
                    end = len(t) if final else len(t) - _partial_suffix(t[p:], OPEN)
                    self.pos = max(end, p)
                    return False, (t[p:self.pos] if lead else "")
                self._block_at, self.pos, self.state = at, at + len(OPEN), "open"
                return True, (t[p:at] if lead else "")
            # JSON formats: calls start with `{` (Llama-3: after <|python_tag|>; required: inside `[`).
            i = p
            if self.fmt == LLAMA3_JSON and self.state == "lead":
                i = _skip(t, i)
                if t.startswith(PYTHON_TAG, i):
                    i = _skip(t, i + len(PYTHON_TAG))
                elif i < len(t) and PYTHON_TAG.startswith(t[i:]) and not final:
                    return False, ""
            if self.fmt == REQUIRED:
                extra = "[" if self.state == "lead" else ",]"
            else:
                extra = "" if self.state == "lead" else ";"
            i = _skip(t, i, _WS + extra)
            if i >= len(t):
                if final and lead and self.fmt == LLAMA3_JSON:
                    self.state, self.pos = "content_all", 0
                    return True, ""
                return False, ""
            if t[i] == "{" and (self.parallel or not self.calls):
                self._call_at, self.pos, self.state = i, i, "call"
                return True, ""
            return self._not_a_call()
        if self.state == "open":
            i = _skip(t, p)
            if i >= len(t):
                return self._not_a_call() if final else (False, "")
            if t[i] != "{" or not (self.parallel or not self.calls):
                return self._not_a_call()
            self._call_at, self.pos, self.state = i, i, "call"
            return True, ""
        if self.state == "junk":
            close = t.find(CLOSE, p)
            if close >= 0:
                end = close + len(CLOSE)
                self.pos, self.state = end, ("lead" if lead else "between")
                return True, (t[p:end] if lead else "")
            end = len(t) if final else len(t) - _partial_suffix(t[p:], CLOSE)
            self.pos = max(end, p)
            return False, (t[p:self.pos] if lead else "")
        if self.state == "closing":
            close = t.find(CLOSE, p)
            if close < 0:
                if final:
                    self.pos, self.state = len(t), "done"
                return False, ""
            self.pos, self.state = close + len(CLOSE), "between"
            return True, ""
        # state "call": scan the object so far
        obj = _Obj(t, self._call_at, self._memo)
        if obj.name is None:
            if obj.bad or final:
                return self._not_a_call()
            return False, ""
        if self._current != self._call_at:
            self._current = self._call_at
            out.append(self._new_call(obj.name))
        if obj.args_start is not None:
            end = obj.args_end if obj.args_end is not None else len(t)
            self._args(t[obj.args_start + self._sent_args:end], out)
        if obj.end is not None or obj.bad or final:
            if self.fmt == HERMES:
                self.state = "closing"
                self.pos = obj.end if obj.end is not None else len(t)
            elif obj.end is not None and not obj.bad:
                self.pos, self.state = obj.end, "between"
            else:
                self.pos, self.state = len(t), "done"
            return True, ""
        self.pos = len(t)
        return False, ""

    def _not_a_call(self) -> tuple[bool, str]:
        """The current block is not a call: before any call its text is content; after one, dropped."""
        if self.fmt == HERMES:
            self.state, self.pos = "junk", self._block_at
            return True, ""
        if not self.calls and self.fmt == LLAMA3_JSON:
            self.state, self.pos = "content_all", 0
            return True, ""
        self.state, self.pos = "done", len(self.text)
        return True, ""

    def content_and_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole output's (content, calls): the stream fed everything at once."""
        content, _ = self.feed(text, final=True)
        if not self.calls:
            return text, []
        return (content if content.strip() else None), self.calls
