"""OpenAI request bodies (pydantic) and their checks, and OpenAI-style error objects.

Every model forbids unknown fields and is strict (no "5" for 5, no true for 1), so a misspelled or
mistyped parameter is a 400 that names it rather than a silent default. Fields OpenAI defines that
jpa does not implement are accepted only at their neutral value (e.g. presence_penalty 0).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What each field may be, for error messages about union-typed fields.
FIELD_TYPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of up to 16 non-empty strings",
    "messages": "a non-empty list of {role, content} objects",
    "content": "a string or a list of {type: 'text', text} parts",
}
MAX_STOP = 16


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
    """A 400 naming the field of the first pydantic/FastAPI validation error."""
    if not errors:
        return APIError(400, "invalid request body")
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return APIError(400, f"malformed JSON body{': ' + str(detail) if detail else ''}", code="json_invalid")
    if not loc:
        return APIError(400, "the request body must be a JSON object")
    field = str(loc[0])
    # The path (e.g. messages.2.content) without pydantic's union-member tags ("str", "list[int]",
    # "TextPart"): field names are lower-case words.
    path = ".".join(str(x) for x in loc if isinstance(x, int) or not _is_union_tag(str(x)))
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"unknown parameter '{path}'", param=field)
    if e.get("type") == "missing":
        return APIError(400, f"'{path}' is required", param=field)
    same_field = [x for x in errors if [y for y in x.get("loc", ()) if y != "body"][:1] == [loc[0]]]
    last = path.split(".")[-1]
    if len(same_field) > 1 and (field in FIELD_TYPES or last in FIELD_TYPES):
        what = FIELD_TYPES.get(last, FIELD_TYPES.get(field))
        return APIError(400, f"'{path}' must be {what}", param=field)
    got = e.get("input")
    return APIError(400, f"'{path}': {e.get('msg', 'invalid value')}; got {got!r}"[:500], param=field)


def _is_union_tag(x: str) -> bool:
    return x in ("str", "int", "float", "bool", "none") or "[" in x or x[:1].isupper()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions."""
    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)                  # extension (vLLM); 0 = off
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False                               # extension (vLLM)
    presence_penalty: float | None = None                  # accepted only at 0: not implemented
    frequency_penalty: float | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)             # default 16, as OpenAI
    logprobs: int | None = Field(None, ge=0)               # only 0: the sampled tokens' logprobs
    echo: Literal[False] = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)             # default: the rest of the context
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)           # only 0: the sampled token's logprob


def stop_strings(stop) -> tuple[str, ...]:
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise APIError(400, f"'stop' must be {FIELD_TYPES['stop']}; got {stop!r}"[:500], param="stop")
    return stops


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as {role, content} dicts for the tokenizer's chat template ("developer" is OpenAI's
    new name for "system"; content parts are joined)."""
    out = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def check_unsupported(req: _Sampling) -> None:
    """400 for OpenAI parameters set to values jpa does not implement (they would change results)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v not in (None, 0):
            raise APIError(400, f"'{name}' is not supported (only 0); got {v!r}", param=name)
    name = "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs"
    v = getattr(req, name)
    if v not in (None, 0):
        raise APIError(400, f"'{name}' must be 0 or absent: this server returns the sampled token's "
                            f"log-probability only, not alternatives; got {v!r}", param=name)
