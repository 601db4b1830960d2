"""OpenAI's Responses API (`POST /v1/responses`) over the chat pipeline.

A request is translated into a chat completion (`to_chat`): `input` (a string, or items: messages
with text parts, `function_call`, `function_call_output`; `reasoning` items are dropped),
`instructions` (a system message first), `previous_response_id` (the stored conversation before it),
`max_output_tokens`, `temperature`, `top_p`, `seed` (extension), function `tools`, `tool_choice`,
`parallel_tool_calls`, `text.format` (text, json_object, json_schema). The chat answer (tool calls,
reasoning with a reasoning parser, constraints) becomes output items (`output_items`), streamed as
the Responses event sequence (`EventStream`). Stored responses (`store`, default true) live in an
in-memory LRU bounded by count and by bytes (`ResponseStore`): a restart forgets them. A response
continuing another is stored as its own input and answer and a reference to the one it continued,
so a chain is never copied, re-encoded or re-parsed; an answer with no text and no call is stored as
empty text, so every stored answer can be continued. Ids and names in `input` items are at most
256 characters (`jpa.server.protocol.MAX_ID_CHARS`): stored, rendered by the template or not.

Not supported (400 naming the field): built-in tools (web search, file search, ...), `background`,
`conversation`, `prompt`, `include`, `truncation: "auto"`, `top_logprobs`, non-text input parts.
"""

import collections
import sys
import threading
import time
import uuid

from jpa.server.protocol import MAX_ID_CHARS, MAX_NAME_CHARS, APIError

MAX_STORED = 1000                     # stored responses (each also counts its bytes)
DEFAULT_STORE_BYTES = 128 * 2 ** 20   # bytes of their messages (`--response-store-bytes`)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_bytes(m) -> int:
    """Memory held by a stored chat message (`jpa.server.protocol.ChatMessage`): its strings as
    Python holds them (sys.getsizeof), every field counted, rendered by the template or not."""
    strings = [m.content] if isinstance(m.content, str) else [p.text for p in m.content or ()]
    strings += [m.name, m.tool_call_id, m.role]
    for c in m.tool_calls or ():
        strings += [c.id, c.function.name, c.function.arguments]
    return 256 + sum(sys.getsizeof(x) for x in strings if isinstance(x, str))


class _Entry:
    """One stored response: the messages its request added (input and answer) and the entry it
    continued (a reference: a chain is never copied)."""
    __slots__ = ("parent", "messages", "nbytes", "refs")

    def __init__(self, parent, messages: list, nbytes: int):
        self.parent, self.messages, self.nbytes, self.refs = parent, messages, nbytes, 0

    def conversation(self) -> list:
        """The messages of the whole chain, oldest first (a new list; the messages are shared)."""
        parts, e = [], self
        while e is not None:
            parts.append(e.messages)
            e = e.parent
        return [m for part in reversed(parts) for m in part]


class ResponseStore:
    """response id -> the conversation it ended, as a chain of `_Entry`s; least recently used
    dropped first, bounded by count (capacity) and by bytes (max_bytes: every message of every
    entry still reachable, those only an ancestor of a stored one included).

    An entry is held by the index (its id) and by each entry continuing it; its bytes count while
    either holds it (a reference count), so dropping an id whose continuations are stored frees
    nothing until they go too."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = DEFAULT_STORE_BYTES):
        if capacity < 1 or max_bytes < 1:
            raise ValueError(f"ResponseStore capacity and max_bytes must be >= 1; got {capacity}, {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.nbytes = 0
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> _Entry | None:
        with self._lock:
            entry = self._items.get(rid)
            if entry is not None:
                self._items.move_to_end(rid)
            return entry

    def _hold(self, entry) -> None:
        while entry is not None:
            entry.refs += 1
            if entry.refs > 1:
                return
            self.nbytes += entry.nbytes      # newly held (or held again after being freed)
            entry = entry.parent

    def _release(self, entry) -> None:
        while entry is not None:
            entry.refs -= 1
            if entry.refs > 0:
                return
            self.nbytes -= entry.nbytes
            entry = entry.parent

    def put(self, rid: str, parent: _Entry | None, messages: list) -> None:
        """Stores the response rid: `messages` (ChatMessages: its input and answer) after parent's."""
        entry = _Entry(parent, list(messages), sum(message_bytes(m) for m in messages))
        with self._lock:
            self._hold(entry)
            self._items[rid] = entry
            while self._items and (len(self._items) > self.capacity or self.nbytes > self.max_bytes):
                _, old = self._items.popitem(last=False)
                self._release(old)

    def describe(self) -> str:
        return f"at most {self.capacity} responses and {self.max_bytes} bytes, the least recently used dropped first"


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}"[:500], param=param)


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("input", f"{where}.content must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise _bad("input", f"{where}.content.{j}: only text parts (input_text, output_text) are supported")
        out.append(part["text"])
    return "".join(out)


def _check_length(item: dict, key: str, limit: int, i: int) -> None:
    # Ids and names are stored with the conversation whether or not the chat template renders them.
    if len(item[key]) > limit:
        raise _bad("input", f"input.{i}.{key} has {len(item[key])} characters; at most {limit} are accepted")


def input_messages(items) -> list[dict]:
    """Chat messages of a Responses `input`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "must be a string or a non-empty list of items")
    msgs: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad("input", f"input.{i} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad("input", f"input.{i}.role must be user, system, developer or assistant; got {role!r}")
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"input.{i}")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad("input", f"input.{i}: a function_call needs call_id, name and arguments (strings)")
            _check_length(item, "call_id", MAX_ID_CHARS, i)
            _check_length(item, "name", MAX_NAME_CHARS, i)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise _bad("input", f"input.{i}: a function_call_output needs call_id")
            _check_length(item, "call_id", MAX_ID_CHARS, i)
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": output if isinstance(output, str) else _text_of(output, f"input.{i}")})
        elif kind == "reasoning":
            continue   # the templates drop earlier reasoning too
        else:
            raise _bad("input", f"input.{i}: item type {kind!r} is not supported")
    return msgs


def to_chat(obj, store: ResponseStore) -> tuple[dict, "_Entry | None", int]:
    """(chat completion body, the stored response it continues (previous_response_id) or None, how
    many of the body's messages are its input) of a Responses request body. The body holds the
    instructions (a system message) and the input, not the stored conversation: the caller puts
    that (already validated, `_Entry.conversation`) between them."""
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, neutral in (("background", (None, False)), ("conversation", (None,)), ("prompt", (None,)),
                          ("include", (None, [])), ("truncation", (None, "disabled")), ("top_logprobs", (None, 0))):
        if obj.get(name) not in neutral:
            raise _bad(name, f"not supported (only {' or '.join(repr(x) for x in neutral if x is not None) or 'absent'})")
    if "input" not in obj:
        raise APIError(400, "'input' is required", param="input")
    parent = None
    prev = obj.get("previous_response_id")
    if prev is not None:
        parent = store.get(prev) if isinstance(prev, str) else None
        if parent is None:
            raise APIError(404, f"previous response {str(prev)[:100]!r} not found (stored responses are kept in "
                                f"memory: {store.describe()})", param="previous_response_id",
                           type="not_found_error")
    conversation = input_messages(obj["input"])
    instructions = obj.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "must be a string")
    chat = {"model": obj.get("model"), "messages": ([{"role": "system", "content": instructions}] if instructions
                                                     else []) + conversation}
    for src, dst in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("seed", "seed"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("user", "user"), ("stream", "stream"), ("top_k", "top_k")):
        if obj.get(src) is not None:
            chat[dst] = obj[src]
    tools = obj.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("tools", "must be a list")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise _bad("tools", f"tools.{i}: only function tools are supported; got "
                                    f"{t.get('type') if isinstance(t, dict) else t!r}")
            chat["tools"].append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}})
    choice = obj.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice", "must be auto, none, required or {type: function, name}")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (obj.get("text") or {}).get("format") if isinstance(obj.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("text", "text.format must be {type: text}, {type: json_object} or {type: json_schema, ...}")
    return chat, parent, len(conversation)


def output_items(message: dict, ids: dict | None = None) -> list[dict]:
    """Responses output items of a chat message (reasoning, the text, function calls). ids: the item
    ids to use (a stream's), by kind."""
    ids = ids or {}
    items = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        items.append({"id": ids.get("reasoning") or _id("rs"), "type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"})
    if message.get("content"):
        items.append(_message_item(ids.get("message") or _id("msg"), message["content"], "completed"))
    for k, call in enumerate(message.get("tool_calls") or ()):
        items.append({"id": (ids.get("calls") or {}).get(k) or _id("fc"), "type": "function_call",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status ==
            "completed" else []}


def response_object(rid: str, obj: dict, model: str, items: list, usage: dict | None, finish_reason: str | None,
                    created: float, status: str | None = None) -> dict:
    """The Response object (status completed / incomplete (max_output_tokens) / in_progress)."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    out = {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
           "output": items, "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": obj.get("instructions"), "metadata": obj.get("metadata") or {},
           "max_output_tokens": obj.get("max_output_tokens"), "previous_response_id": obj.get("previous_response_id"),
           "temperature": obj.get("temperature", 1.0), "top_p": obj.get("top_p", 1.0),
           "parallel_tool_calls": obj.get("parallel_tool_calls") is not False,
           "tool_choice": obj.get("tool_choice") or "auto", "tools": obj.get("tools") or [],
           "text": obj.get("text") or {"format": {"type": "text"}}, "store": obj.get("store") is not False,
           "truncation": "disabled", "usage": None}
    if usage is not None:
        out["usage"] = {"input_tokens": usage["prompt_tokens"],
                        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                        "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": usage["total_tokens"]}
    return out


def stored_answer(message: dict) -> dict:
    """The answer to store as a chat message: its text and calls (reasoning dropped, as templates
    drop earlier turns' reasoning). An answer with neither (a thought cut by max_output_tokens, a
    required call cut before its name) is stored as empty text, so that it can always be continued."""
    answer = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        # A name is the model's text (an "auto" call may name anything): cut to what a message may hold.
        answer["tool_calls"] = [{"id": c["id"][:MAX_ID_CHARS], "type": "function", "function": {
            "name": c["function"]["name"][:MAX_NAME_CHARS], "arguments": c["function"]["arguments"]}}
            for c in message["tool_calls"]]
    elif not answer["content"]:
        answer["content"] = ""
    return answer


class EventStream:
    """Chat chunk deltas of one choice -> the Responses API's server-sent events."""

    def __init__(self, rid: str, obj: dict, model: str):
        self.rid, self.obj, self.model = rid, obj, model
        self.created = time.time()
        self.seq = 0
        self.items: list[dict] = []     # finished items, in output order
        self.open = None                # (kind, item dict, accumulated text) of the open item
        self.reasoning, self.content = "", ""
        self.calls: dict[int, dict] = {}   # chat tool-call index -> {"id", "name", "arguments", "item_id"}

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        r = response_object(self.rid, self.obj, self.model, [], None, None, self.created, status="in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, item, index = self.open
        self.open = None
        ev = []
        if kind == "message":
            text = self.content
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            ev += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
            done = _message_item(item["id"], text, "completed")
        elif kind == "reasoning":
            ev.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=self.reasoning))
            done = {"id": item["id"], "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": self.reasoning}], "status": "completed"}
        else:
            call = item["_call"]
            ev.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call["name"], arguments=call["arguments"]))
            done = {"id": item["id"], "type": "function_call", "call_id": call["id"], "name": call["name"],
                    "arguments": call["arguments"], "status": "completed"}
        self.items.append(done)
        ev.append(self._event("response.output_item.done", output_index=index, item=done))
        return ev

    def _open(self, kind: str, item: dict) -> list[dict]:
        ev = self._close()
        index = len(self.items)
        self.open = (kind, item, index)
        shown = {k: v for k, v in item.items() if k != "_call"}
        ev.append(self._event("response.output_item.added", output_index=index, item=shown))
        if kind == "message":
            ev.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return ev

    def delta(self, delta: dict) -> list[dict]:
        ev = []
        r = delta.get("reasoning_content")
        if r:
            if self.open is None or self.open[0] != "reasoning":
                ev += self._open("reasoning", {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                                               "status": "in_progress"})
            self.reasoning += r
            ev.append(self._event("response.reasoning_text.delta", item_id=self.open[1]["id"],
                                  output_index=self.open[2], content_index=0, delta=r))
        text = delta.get("content")
        if text:
            if self.open is None or self.open[0] != "message":
                ev += self._open("message", _message_item(_id("msg"), "", "in_progress"))
            self.content += text
            ev.append(self._event("response.output_text.delta", item_id=self.open[1]["id"],
                                  output_index=self.open[2], content_index=0, delta=text, logprobs=[]))
        for d in delta.get("tool_calls") or ():
            fn = d.get("function") or {}
            if "id" in d:   # a new call: its name is complete
                call = {"id": d["id"], "name": fn.get("name", ""), "arguments": ""}
                self.calls[d["index"]] = call
                item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": call["name"],
                        "arguments": "", "status": "in_progress", "_call": call}
                call["item_id"] = item["id"]
                ev += self._open("call", item)
            piece = fn.get("arguments") or ""
            if piece:
                call = self.calls[d["index"]]
                call["arguments"] += piece
                ev.append(self._event("response.function_call_arguments.delta", item_id=call["item_id"],
                                      output_index=self.open[2], delta=piece))
        return ev

    def finish(self, finish_reason: str, usage: dict) -> tuple[list[dict], dict]:
        """The closing events and the final Response object."""
        ev = self._close()
        r = response_object(self.rid, self.obj, self.model, self.items, usage, finish_reason, self.created)
        ev.append(self._event("response.incomplete" if r["status"] == "incomplete" else "response.completed",
                              response=r))
        return ev, r

    def message(self) -> dict:
        """The answer as a chat message (for the store)."""
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for _, c in sorted(self.calls.items())]
        return {"content": self.content or None, "tool_calls": calls or None}
