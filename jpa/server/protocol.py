"""OpenAI request bodies (pydantic), how a raw body becomes one, and OpenAI-style error objects.

Lenient on unknown fields, strict on known ones (as vLLM): a field no model here declares is
ignored (the app logs its name once), so what SDKs and routers add (vllm-router's `no_stop_trim`,
`skip_special_tokens`, `separate_reasoning`, ...) does not fail the request. A declared field is
strict (no "5" for 5, no true for 1, no NaN or Infinity): a bad type or value is a 400 naming it.
Fields that OpenAI or vLLM define and jpa does not implement are declared too, and accepted only
at their neutral value (`NEUTRAL`); any other value is a 400 naming the field, never a silent
default, since it would change the result.

`parse_body` turns raw bytes into a model: JSON (NaN/Infinity read as floats so the field that
holds one is named), then a scan for lone UTF-16 surrogates (`"\\ud800"` is valid JSON but not
Unicode: tokenizers and the response encoder fail on it), then validation.
"""

import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jpa.engine.sampling import MAX_TEMPERATURE  # the engine's bound (logits / temperature stay finite)

# What each field may be, for error messages about union-typed fields.
FIELD_TYPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of up to 16 non-empty strings",
    "messages": "a non-empty list of {role, content} objects (assistant: or tool_calls; tool: with tool_call_id)",
    "content": "a string or a list of {type: 'text', text} parts",
}
MAX_STOP = 16
# Ids and names in messages are stored and echoed whether or not a chat template renders them: bounded.
MAX_ID_CHARS = 256     # a tool call's id, a tool message's tool_call_id (OpenAI's are about 30 characters)
MAX_NAME_CHARS = 256   # a message's name, a called function's name (tools declare names of at most 64)
SEED_LIMIT = 2 ** 31   # the engine's seeds are in [0, 2**31); choice j of n uses seed + j
SEED_MIN, SEED_END = -2 ** 63, 2 ** 64   # a request's seed: any signed or unsigned 64-bit integer (vLLM: int64)


class APIError(Exception):
    """An error answered as an OpenAI error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the field of the first pydantic validation error."""
    if not errors:
        return APIError(400, "invalid request body")
    e = errors[0]
    loc = list(e.get("loc", ()))
    if not loc:
        return APIError(400, "the request body must be a JSON object")
    field = str(loc[0])
    # The path (e.g. messages.2.content) without pydantic's union-member tags ("str", "list[int]",
    # "TextPart"): field names are lower-case words.
    path = ".".join(str(x) for x in loc if isinstance(x, int) or not _is_union_tag(str(x)))
    if e.get("type") == "missing":
        return APIError(400, f"'{path}' is required", param=field)
    same_field = [x for x in errors if list(x.get("loc", ()))[:1] == [loc[0]]]
    last = path.split(".")[-1]
    if len(same_field) > 1 and (field in FIELD_TYPES or last in FIELD_TYPES):
        what = FIELD_TYPES.get(last, FIELD_TYPES.get(field))
        return APIError(400, f"'{path}' must be {what}", param=field)
    got = e.get("input")
    return APIError(400, f"'{path}': {e.get('msg', 'invalid value')}; got {got!r}"[:500], param=field)


def _is_union_tag(x: str) -> bool:
    return x in ("str", "int", "float", "bool", "none") or "[" in x or x[:1].isupper()


# ---------------------------------------------------------------------- raw body -> model

_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(obj, path: list) -> list | None:
    """Path of the first string (key or value) holding a lone surrogate, or None."""
    if isinstance(obj, str):
        return path if not obj.isascii() and _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not k.isascii() and _SURROGATE.search(k):
                return path + [k]
            found = _find_surrogate(v, path + [k])
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _find_surrogate(v, path + [i])
            if found is not None:
                return found
    return None


def parse_json(raw: bytes):
    """The JSON value of a request body; 400 for malformed JSON and for lone surrogates."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="json_invalid") from None
    except UnicodeDecodeError:
        raise APIError(400, "malformed JSON body: not UTF-8", code="json_invalid") from None
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}", code="json_invalid") from None
    bad = _find_surrogate(obj, [])
    if bad is not None:
        # The path itself may hold the surrogate (a key): spelled with escapes, never raw.
        where = ".".join(str(x) for x in bad).encode("ascii", "backslashreplace").decode()
        head = str(bad[0]) if bad else ""
        param = head if head and not _SURROGATE.search(head) else None
        raise APIError(400, f"'{where}' holds a lone UTF-16 surrogate (an escape such as \\ud800 without its "
                            f"pair): not valid Unicode text", param=param)
    return obj


def parse_body(raw: bytes, model: type["_Lenient"]) -> "_Lenient":
    """The request model of a raw body (any failure: an APIError 400 naming the field)."""
    obj = parse_json(raw)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def unknown_fields(m: BaseModel, prefix: str = "") -> list[str]:
    """Names (dotted, list items as []) of the fields of `m` and its nested models that no model
    declares: they were ignored."""
    out = [f"{prefix}{k}" for k in (m.model_extra or {})]
    for name in type(m).model_fields:
        v = getattr(m, name)
        items = v if isinstance(v, list) else [v]
        for item in items:
            if isinstance(item, BaseModel):
                out += unknown_fields(item, f"{prefix}{name}{'[]' if isinstance(v, list) else ''}.")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------- request models

class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def _finite(default=None, **kw):
    return Field(default, allow_inf_nan=False, **kw)


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    """OpenAI's response_format.json_schema."""
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Lenient):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object)."""
    json_: Any = Field(None, alias="json")                 # a JSON schema (object) or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                             # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None
    # Declared so that they are refused (400), not ignored: jpa does not implement them.
    structural_tag: Any = None
    whitespace_pattern: str | None = None


class _Sampling(_Lenient):
    """Parameters shared by /v1/completions and /v1/chat/completions."""
    model: str
    temperature: float | None = _finite(ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = _finite(gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)                 # extension (vLLM); 0 or -1 = off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=SEED_MIN, lt=SEED_END)   # folded into the engine's 31 bits: engine_seed()
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False                               # extension (vLLM)
    # Accepted, with no effect on generation: jpa stores nothing (OpenAI's `store`, `metadata`).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None          # text, json_object, json_schema (structured outputs)
    # Sampling controls, run on the device (ranges checked by jpa.engine.SamplingParams).
    presence_penalty: float | None = _finite()
    frequency_penalty: float | None = _finite()
    repetition_penalty: float | None = _finite()
    min_p: float | None = _finite()
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's extras: the prompt tokens' logprobs (with k alternatives), detokenization options.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None                       # SGLang's name for the same (vllm-router sends it)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    # Declared so that values other than the neutral one are refused (see NEUTRAL), not ignored.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = _finite()
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs (vLLM's field and its older guided_* names); see jpa.server.tools.
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)             # default 16, as OpenAI; 0 only with echo (score the prompt)
    logprobs: int | None = Field(None, ge=0, le=20)        # the sampled tokens' logprobs and this many alternatives
    echo: bool | None = None                               # the prompt first (with logprobs: its tokens' too)
    suffix: str | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Lenient):
    name: str = Field(max_length=MAX_NAME_CHARS)
    arguments: str                                         # JSON text, as OpenAI returns it


class ToolCall(_Lenient):
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None            # None only for an assistant's turn (as "")
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[ToolCall] | None = None               # assistant: calls it made
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS)   # tool: the call this result answers


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None                         # a JSON schema (object); None: no arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)             # default: the rest of the context
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)    # alternatives per token (with logprobs: true)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None                # false: at most one call
    functions: list[dict] | None = None                    # OpenAI's older tools: only empty
    function_call: str | dict | None = None                # only "none"
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None               # template variables (e.g. enable_thinking)
    separate_reasoning: bool | None = None                 # vllm-router's: false keeps reasoning in content


class TokenizeCompletionRequest(_Lenient):
    """vLLM's /tokenize body for a prompt."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True                        # False: without the BOS encode adds (lm-eval's)
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Lenient):
    """vLLM's /tokenize body for a conversation (rendered by the chat template first)."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False                   # only False
    add_special_tokens: bool = False                       # only False: what /v1/chat/completions does
    chat_template: str | None = None                       # only the model's own
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None                        # only empty


class DetokenizeRequest(_Lenient):
    """vLLM's /detokenize body."""
    model: str | None = None
    tokens: list[int]


# Known fields jpa does not implement -> the values that leave the result unchanged (None, i.e.
# absent or null, always does), for both endpoints and for each. Checked by `check_unsupported`.
NEUTRAL = {
    "bad_words": ([],),
    "allowed_token_ids": (), "use_beam_search": (False,), "length_penalty": (1,), "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
}
NEUTRAL_COMPLETION = {"suffix": ("",)}
NEUTRAL_CHAT = {
    "functions": ([],), "function_call": ("none",),
    "continue_final_message": (False,), "add_generation_prompt": (True,), "chat_template": (),
}
# chat_template_kwargs may not set what the server itself passes to the template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "special_tokens",
                                      "documents", "chat_template", "tokenize"})
_WHY = {
    "functions": "function calling is not supported (only an empty list)",
    "function_call": "function calling is not supported (only 'none')",
    "add_generation_prompt": "the chat endpoint always adds the generation prompt (only true)",
}


def _is_neutral(v, neutral) -> bool:
    # bool is an int in Python: False must not pass for 0, nor 0 for False.
    return v is None or any(isinstance(v, bool) == isinstance(x, bool) and v == x for x in neutral)


def check_unsupported(req: _Sampling) -> None:
    """400 naming the first known-but-unimplemented field set to a value that would change results."""
    chat = isinstance(req, ChatCompletionRequest)
    for name, neutral in {**NEUTRAL, **(NEUTRAL_CHAT if chat else NEUTRAL_COMPLETION)}.items():
        v = getattr(req, name)
        if _is_neutral(v, neutral):
            continue
        why = _WHY.get(name, "not supported")
        allowed = f" (only {', '.join(repr(x) for x in neutral)} or absent)" if neutral and name not in _WHY else ""
        raise APIError(400, f"'{name}': {why}{allowed}; got {v!r}"[:500], param=name)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"'best_of' is not supported (only equal to n, {req.n}); got {req.best_of}",
                       param="best_of")
    if chat and req.chat_template_kwargs:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs))
        if reserved:
            raise APIError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)} (the server does)",
                           param="chat_template_kwargs")
    if chat and req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not chat and req.max_tokens == 0 and not req.echo:
        raise APIError(400, "'max_tokens' 0 needs 'echo': true (it scores the prompt and generates nothing)",
                       param="max_tokens")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "'prompt_logprobs' are not available with 'stream': true (as in vLLM; echo with "
                            "logprobs streams the prompt's logprobs)", param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if chat:
        check_messages(req.messages)


def engine_seed(seed: int, n: int) -> int:
    """The engine's seed (in [0, 2**31 - n], choice j samples with it + j) of a request's 64-bit seed.

    A seed the engine can use as it is (0 <= seed and seed + n - 1 < 2**31) is used as it is, so those
    keep their outputs (and choice j of seed s equals choice 0 of seed s + j). Any other seed has all
    of its bits folded into the engine's 31 (a keyed hash of the 64-bit value, never a wrap-around:
    2**31 and 0 differ); two such seeds collide with probability about 2**-31.
    """
    if 0 <= seed and seed + n - 1 < SEED_LIMIT:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True), digest_size=8, person=b"jpa-seed").digest()
    return int.from_bytes(digest, "little") % (SEED_LIMIT - n + 1)


def check_messages(messages) -> None:
    """400 naming the message: tool calls only on assistant messages, content required but in an
    assistant message (an answer with no text, e.g. only reasoning, comes back with content null and
    must be continuable: it renders as empty text), a tool message names its call (tool_call_id)."""
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"'messages.{i}.tool_calls': only assistant messages make tool calls",
                           param="messages")
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"'messages.{i}.content' is required (only an assistant message may leave it "
                                f"out)", param="messages")
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(400, f"'messages.{i}.tool_call_id' is required in a tool message", param="messages")


def stop_strings(stop) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise APIError(400, f"'stop' must be {FIELD_TYPES['stop']}; got {stop!r}"[:500], param="stop")
    return stops


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as {role, content} dicts for the tokenizer's chat template ("developer" is OpenAI's
    new name for "system"; content parts are joined). An assistant's tool calls carry their
    arguments parsed (templates render them with tojson, as vLLM hands them over); a tool message
    its tool_call_id (and name)."""
    out = []
    for m in messages:
        # A tool-calling assistant turn without content gets "" (templates such as Qwen2.5's read
        # message.content, and None-valued keys are dropped before rendering, as transformers does).
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        d = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
        out.append(d)
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
