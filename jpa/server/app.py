"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). Errors are OpenAI error objects: 400 for bad input (naming the
field), 401 for a missing/wrong API key, 404 for an unknown model or route, 503 with Retry-After
when the waiting queue is full or the engine is down.

`n` choices are n engine requests with seeds seed, seed + 1, ... (a random base seed when the
request has none), grouped into one response; they share nothing on the device (prefix-sharing
parallel sampling is a later step). Greedy choices are therefore identical.

A client that disconnects (streaming or not) has its requests aborted; the engine applies the
abort before its next round, which releases the pages.
"""

import asyncio
import hmac
import json
import math
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpa.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, RequestGroup
from jpa.engine.sampling import SamplingParams
from jpa.server.metrics import ServerMetrics, Timing
from jpa.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_messages,
                                 check_unsupported, error_body, stop_strings, validation_error)

SEED_MOD = 2 ** 31   # the engine's seed range


def build_app(engine: AsyncEngine, tokenizer, *, model_name: str, api_key: str | None = None,
              max_n: int = 16, retry_after: int = 1) -> FastAPI:
    """The FastAPI app serving `engine` (started by the caller) under the name `model_name`.

    Args:
      engine: a started AsyncEngine.
      tokenizer: the engine's tokenizer (encode, decode, render_chat).
      model_name: the `model` value requests must name (else 404).
      api_key: if set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
      max_n: largest `n` accepted (larger: 400).
      retry_after: seconds in the Retry-After header of 503 answers.
    """
    app = FastAPI(title="jpa", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine)
    api = _API(engine, tokenizer, model_name, metrics, max_n, retry_after)
    app.state.metrics = metrics

    def error(e: APIError) -> JSONResponse:
        metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error(APIError(500, f"internal server error: {type(e).__name__}: {e}", type="server_error"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                      type="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        api.check_model(model_id)
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat(body, request)

    return app


class _API:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, metrics: ServerMetrics, max_n: int,
                 retry_after: int):
        self.engine, self.tok, self.model_name, self.metrics = engine, tokenizer, model_name, metrics
        self.max_n, self.retry_after = max_n, retry_after
        # The most samples one engine request may have (one decode slot each).
        self.max_samples = engine.engine.config.max_seqs if engine.engine.config.chunked_prefill else 1
        self.created = int(time.time())
        self.vocab_size = engine.engine.model.config.vocab_size

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jpa",
                "max_model_len": self.engine.max_model_len}

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", type="not_found_error", code="model_not_found")

    # ------------------------------------------------------------------ request -> engine requests

    def _prompts(self, prompt) -> list[list[int]]:
        """Token ids of each prompt of a completion request (str, [str], [int] or [[int]])."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        out = []
        for p in prompt:
            ids = self.tok.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "'prompt' is empty: nothing to condition on", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"'prompt' token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                               param="prompt")
            out.append(ids)
        return out

    def _params(self, body, prompts: list[list[int]], max_tokens: int | None, default_max: int | None):
        """[(prompt ids, SamplingParams)] for every choice: prompt-major, n per prompt."""
        check_unsupported(body)
        if body.n > self.max_n:
            raise APIError(400, f"'n' must be <= {self.max_n}; got {body.n}", param="n")
        if len(prompts) * body.n > self.engine.max_waiting:
            raise APIError(400, f"{len(prompts)} prompts x n = {body.n} is more requests than this server ever "
                                f"queues at once ({self.engine.max_waiting})", param="n")
        stop = stop_strings(body.stop)
        limit = self.engine.max_model_len
        base = body.seed if body.seed is not None else random.randrange(SEED_MOD)
        out = []
        for ids in prompts:
            room = limit - len(ids)
            if room < 1:
                raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                    f"{len(ids)} tokens and no room is left for the completion", param="prompt")
            want = max_tokens if max_tokens is not None else min(default_max or room, room)
            if len(ids) + want > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens; you asked for "
                                    f"{len(ids) + want} ({len(ids)} in the prompt, {want} for the completion): "
                                    f"lower max_tokens to at most {room}", param="max_tokens")
            # n choices of one prompt are one engine request with n samples (sample j: seed base + j),
            # prefilled once on shared pages, when the engine has a slot for each; else n requests.
            shared = body.n <= self.max_samples and base + body.n - 1 < SEED_MOD
            for j in range(1 if shared else body.n):
                try:
                    sp = SamplingParams(max_new_tokens=want, temperature=1.0 if body.temperature is None
                                        else float(body.temperature), top_k=body.top_k or 0,
                                        top_p=1.0 if body.top_p is None else float(body.top_p),
                                        seed=(base + j) % SEED_MOD, stop=stop, ignore_eos=body.ignore_eos,
                                        n=body.n if shared else 1)
                except ValueError as e:
                    raise APIError(400, str(e).replace("max_new_tokens", "max_tokens")) from None
                out.append((ids, sp))
        return out

    def _submit(self, requests) -> RequestGroup:
        try:
            return self.engine.submit(requests)
        except EngineOverloaded as e:
            raise APIError(503, str(e), type="overloaded_error", code="overloaded",
                           headers={"Retry-After": str(self.retry_after)}) from None
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable",
                           headers={"Retry-After": str(self.retry_after)}) from None

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        prompts = self._prompts(body.prompt)
        reqs = self._params(body, prompts, body.max_tokens, 16)
        fmt = _CompletionFormat(self, body)
        return await self._serve(body, reqs, len(prompts), fmt, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
        try:
            text = self.tok.render_chat(chat_messages(body))
        except Exception as e:  # ValueError, or a template's own raise_exception (jinja2 TemplateError)
            raise APIError(400, f"'messages': {e}", param="messages") from None
        prompts = [self.tok.encode(text)]
        reqs = self._params(body, prompts, body.max_completion_tokens or body.max_tokens, None)
        fmt = _ChatFormat(self, body)
        return await self._serve(body, reqs, 1, fmt, request)

    async def _serve(self, body, reqs, num_prompts: int, fmt, request: Request):
        group = self._submit(reqs)
        per_prompt = len(reqs) // num_prompts   # 1 (n samples in one request) or n
        prompt_tokens = sum(len(reqs[i * per_prompt][0]) for i in range(num_prompts))
        timing = Timing(self.metrics, group.arrival)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            # The background task runs after the stream ends, however it ends: if the client left
            # before the first chunk (the generator never started), this is what aborts the requests.
            return StreamingResponse(self._stream(group, fmt, timing, prompt_tokens, include_usage),
                                     media_type="text/event-stream", background=BackgroundTask(group.abort),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results = await self._collect(group, timing, request)
        if results is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        bad = [o for o in results.values() if o.finish_reason not in ("stop", "length")]
        if bad:
            o = bad[0]
            if o.finish_reason == "error":
                raise APIError(400, o.error or "invalid request", param="prompt")
            raise APIError(503, "the server is shutting down", type="server_error",
                           headers={"Retry-After": str(self.retry_after)})
        outs = [results[i] for i in range(len(group))]
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return JSONResponse(fmt.response([fmt.choice(i, o) for i, o in enumerate(outs)],
                                         _usage(prompt_tokens, completion_tokens)))

    async def _collect(self, group: RequestGroup, timing: Timing, request: Request):
        """Finished outputs by index, or None if the client disconnected first (then aborted)."""
        async def consume():
            done = {}
            async for i, out in group:
                timing.on_output(i, out)
                if out.finished:
                    done[i] = out.output
            return done

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():  # the client went away (or this handler was cancelled)
                consumer.cancel()
                self.metrics.finished.labels("abort").inc(group.num_unfinished)
                group.abort()
        if consumer.cancelled():
            return None
        try:
            return consumer.result()
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error") from None

    async def _stream(self, group: RequestGroup, fmt, timing: Timing, prompt_tokens: int, include_usage: bool):
        """Server-sent events in OpenAI's chunk format, ending with [DONE]."""
        completion_tokens = 0
        try:
            for chunk in fmt.first_chunks(len(group)):
                yield _sse(chunk)
            async for i, out in group:
                timing.on_output(i, out)
                completion_tokens += len(out.new_token_ids)
                if out.finished:
                    reason = out.output.finish_reason
                    if reason not in ("stop", "length"):
                        msg = out.output.error if reason == "error" else "the server is shutting down"
                        yield _sse(error_body(msg or "request failed", type="server_error"))
                        continue
                chunk = fmt.chunk(i, out)
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage:
                yield _sse(fmt.usage_chunk(_usage(prompt_tokens, completion_tokens)))
            yield "data: [DONE]\n\n"
        except EngineDead as e:
            yield _sse(error_body(str(e), type="server_error"))
            yield "data: [DONE]\n\n"
        finally:
            # Reached on a disconnect too (the response task is cancelled): abort what still runs.
            if group.num_unfinished:
                self.metrics.finished.labels("abort").inc(group.num_unfinished)
                group.abort()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(x: float):
    return x if math.isfinite(x) else None


class _Format:
    """OpenAI's response and chunk shapes for one endpoint."""

    def __init__(self, api: _API, body):
        self.api, self.body = api, body
        self.id = f"{self.PREFIX}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _tokens(self, token_ids, logprobs, final_reason) -> tuple[list, list]:
        """Token ids and logprobs to report: a final stop token (EOS) is not part of the text."""
        ids, lps = list(token_ids), list(logprobs)
        if final_reason == "stop" and ids and ids[-1] in self.api.engine.stop_ids and not self.body.ignore_eos:
            ids, lps = ids[:-1], lps[:-1]
        return ids, lps

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.api.model_name}

    def response(self, choices: list, usage: dict) -> dict:
        return {**self._head(self.OBJECT), "choices": choices, "usage": usage}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.CHUNK), "choices": [], "usage": usage}

    def first_chunks(self, n: int) -> list:
        return []


class _CompletionFormat(_Format):
    PREFIX, OBJECT, CHUNK = "cmpl", "text_completion", "text_completion"

    def _logprobs(self, ids, lps, offset: int = 0):
        if self.body.logprobs is None:
            return None
        toks = [self.api.tok.decode([t]) for t in ids]
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": [_finite(x) for x in lps], "top_logprobs": None,
                "text_offset": offsets}

    def choice(self, index: int, out) -> dict:
        ids, lps = self._tokens(out.token_ids, out.logprobs, out.finish_reason)
        return {"index": index, "text": out.completion, "logprobs": self._logprobs(ids, lps),
                "finish_reason": out.finish_reason}

    def chunk(self, index: int, out):
        reason = out.output.finish_reason if out.finished else None
        ids, lps = self._tokens(out.new_token_ids, out.new_logprobs, reason)
        if not (out.new_text or reason or (ids and self.body.logprobs is not None)):
            return None
        return {**self._head(self.CHUNK), "choices": [
            {"index": index, "text": out.new_text, "logprobs": self._logprobs(ids, lps), "finish_reason": reason}]}


class _ChatFormat(_Format):
    PREFIX, OBJECT, CHUNK = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _logprobs(self, ids, lps):
        if not self.body.logprobs:
            return None
        content = []
        for t, lp in zip(ids, lps):
            s = self.api.tok.decode([t])
            content.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8")),
                            "top_logprobs": []})
        return {"content": content}

    def choice(self, index: int, out) -> dict:
        ids, lps = self._tokens(out.token_ids, out.logprobs, out.finish_reason)
        return {"index": index, "message": {"role": "assistant", "content": out.completion},
                "logprobs": self._logprobs(ids, lps), "finish_reason": out.finish_reason}

    def first_chunks(self, n: int) -> list:
        return [{**self._head(self.CHUNK), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(n)]

    def chunk(self, index: int, out):
        reason = out.output.finish_reason if out.finished else None
        ids, lps = self._tokens(out.new_token_ids, out.new_logprobs, reason)
        if not (out.new_text or reason or (ids and self.body.logprobs)):
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        return {**self._head(self.CHUNK), "choices": [
            {"index": index, "delta": delta, "logprobs": self._logprobs(ids, lps), "finish_reason": reason}]}
