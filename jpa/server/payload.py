"""How big a response may get, and how a big one is sent without stalling the event loop.

Why: with logprobs, one small request can ask for a response of any size. `n: 16`, `echo`,
`logprobs: 20` and `prompt_logprobs: 20` over a 3000-token prompt (16 kB of token ids) is 2 million
logprob entries, 100 MB of JSON built and encoded while every other client waits. Two guards:

1. `logprob_entries` counts, before anything runs, the logprob entries (a token and each of its
   alternatives) a response would hold: per choice `max_tokens x (1 + logprobs)`, with `echo` the
   prompt's tokens too, and the `prompt_logprobs` field `prompt x (1 + prompt_logprobs)` (per choice
   in a completion, as vLLM reports them; once in a chat response; `echo` with `logprobs` k returns
   it with k too), summed over prompts and n. Past
   `max_response_logprobs` the request is a 400 naming the fields (vLLM bounds logprobs per token,
   `--max-logprobs`; this bounds their product). A stream holds one chunk at a time: only its
   echoed prompt (one chunk per choice) counts.
2. `json_pieces` encodes a response piece by piece (each a bounded slice of a list), on a worker
   thread: between pieces the interpreter switches threads, so /health and other streams are served
   while a big answer is encoded; `send_json` sends the pieces as they are made (chunked transfer)
   when the answer is large, so a client that reads slowly holds the encoder, not the whole text.
"""

import asyncio
import json

from starlette.responses import Response, StreamingResponse

DEFAULT_MAX_RESPONSE_LOGPROBS = 1_000_000   # logprob entries in one response (about 30-80 bytes of JSON each)
_PIECE = 256              # list items encoded at once
_SMALL = 512              # a container with at most this many scalars below it is encoded at once
_INLINE_BYTES = 1 << 20   # answers up to this size are sent whole, with a Content-Length

_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def logprob_entries(body, prompt_lens: list[int], wants: list[int], chat: bool) -> tuple[int, str | None]:
    """(logprob entries the response to `body` would hold, the field that asks for most of them).

    prompt_lens / wants: per prompt, its tokens and the tokens it may generate (max_tokens)."""
    n = body.n
    if chat:
        top = (body.top_logprobs or 0) if body.logprobs else None
        echo = False
    else:
        top = body.logprobs
        echo = bool(body.echo)
    plp = body.prompt_logprobs
    if plp is None and echo:     # echo with logprobs scores the prompt (vLLM)
        plp = top
    gen = prompt = 0
    for length, want in zip(prompt_lens, wants):
        if top is not None and not body.stream:
            gen += n * want * (1 + top)
        if top is not None and echo:
            prompt += n * length * (1 + top)          # the echoed prompt's tokens in each choice's logprobs
        if plp is not None and not body.stream:   # the prompt_logprobs field (echo + logprobs returns it too)
            prompt += (1 if chat else n) * length * (1 + plp)
    field = "prompt_logprobs" if prompt > gen and body.prompt_logprobs is not None else "logprobs"
    # (echo with logprobs: "logprobs" asks for the prompt's entries too)
    return gen + prompt, (field if gen + prompt else None)


def _scalars(x, budget: int) -> int:
    """Scalars below x, counted up to just past budget (a cheap "is this small?")."""
    count, todo = 0, [x]
    while todo and count <= budget:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.values())
            count += len(v)
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
            count += 1
        else:
            count += 1
    return count


def json_pieces(obj):
    """The JSON text of obj (as json.dumps with ensure_ascii=False, no NaN, compact) in pieces, none
    holding more than about `_PIECE` small list items: a big dict or list is opened and its parts
    encoded one by one."""
    if isinstance(obj, dict):
        if _scalars(obj, _SMALL) <= _SMALL:
            yield _dumps(obj)
            return
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            yield ("," if i else "") + _dumps(str(k)) + ":"
            yield from json_pieces(v)
        yield "}"
    elif isinstance(obj, (list, tuple)):
        if _scalars(obj, _SMALL) <= _SMALL:
            yield _dumps(obj)
            return
        yield "["
        for start in range(0, len(obj), _PIECE):
            part = obj[start:start + _PIECE]
            sep = "," if start else ""
            if all(_scalars(x, _SMALL) <= _SMALL // 4 for x in part):
                yield sep + _dumps(list(part))[1:-1]
            else:
                for j, x in enumerate(part):
                    yield sep if j == 0 else ","
                    yield from json_pieces(x)
        yield "]"
    else:
        yield _dumps(obj)


def _batches(pieces, size: int = 1 << 16):
    """The pieces joined into byte strings of about `size` bytes (fewer, bigger writes)."""
    buf, held = [], 0
    for p in pieces:
        buf.append(p)
        held += len(p)
        if held >= size:
            yield "".join(buf).encode()
            buf, held = [], 0
    if buf:
        yield "".join(buf).encode()


async def send_json(build, status_code: int = 200, headers: dict | None = None) -> Response:
    """The response of `build()` (a function making the JSON-able answer), built and encoded on a
    worker thread; an answer over `_INLINE_BYTES` is streamed (chunked) as it is encoded."""
    def start():
        batches = _batches(json_pieces(build()))
        head, held = [], 0
        for b in batches:
            head.append(b)
            held += len(b)
            if held > _INLINE_BYTES:
                return b"".join(head), batches
        return b"".join(head), None

    head, rest = await asyncio.to_thread(start)
    if rest is None:
        return Response(head, status_code=status_code, headers=headers, media_type="application/json")

    def chunks():
        yield head
        yield from rest   # each next() runs on a worker thread (Starlette iterates sync iterators so)

    return StreamingResponse(chunks(), status_code=status_code, headers=headers, media_type="application/json")
