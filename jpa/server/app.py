"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (over the chat
pipeline: `jpa.server.responses`), GET /v1/models, POST /tokenize and /detokenize, GET
/tokenizer_info (vLLM's shapes), GET /version, GET /health, GET /metrics (Prometheus text), and the RL
rollout endpoints of `jpa.server.admin` (POST /pause, /resume, /update_weights). Errors are
OpenAI error objects: 400 for bad input (naming the field), 401 for a missing/wrong API key, 404
for an unknown model or route, 413 for a body over `max_request_bytes` (refused before it is
read), 503 with Retry-After while the model loads, when the waiting queue is full or the engine is
down.

The app can exist before its engine: `build_app(None, None, ...)` answers /health (and every
request) with 503 until `attach(app, engine, tokenizer)`, so a server can listen while it loads
the model and routers see it come up.

Request bodies are parsed, validated, tokenized and rendered (chat template) on a worker thread,
not on the event loop, so a huge prompt does not stall /health or other clients' streams. So are
answers built and JSON-encoded, in pieces (`jpa.server.payload`); how many logprob entries one
answer may hold is bounded up front (`max_response_logprobs`), and a prompt's echoed logprobs and
prompt_logprobs are built once for its n choices.

`n` choices of a prompt are one engine request with n samples: the prompt is prefilled once and
its pages are shared (parallel sampling); sample j draws with seed + j (a random base seed when
the request has none). Greedy choices are therefore identical.

A client that disconnects (streaming or not) has its requests aborted; the engine applies the
abort before its next round, which releases the pages.
"""

import asyncio
import functools
import hmac
import itertools
import json
import logging
import math
import random
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jpa.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, RequestGroup
from jpa.engine.sampling import SamplingParams
from jpa.server.logprobs import ChoiceTokens, TokenBytes, prompt_pieces

# Request fields passed to jpa.engine.SamplingParams as they are (vLLM's names).
CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens",
                  "stop_token_ids", "top_logprobs")
from jpa.engine.structured import Grammars, Reasoning, StructuredOutputs
from jpa.server.limits import CompileGuard, ConstraintLimits, check_constraint, first_mask_allows_something
from jpa.server.metrics import ServerMetrics, Timing
from jpa.server.payload import DEFAULT_MAX_RESPONSE_LOGPROBS, logprob_entries, send_json
from jpa.server.reasoning import END, START, ReasoningParser, ReasoningStream
from jpa.server import admin, responses as responses_api
from jpa.server.toolparsers import MISTRAL
from jpa.server.tools import (TOOL_CALL_PARSERS, ToolStream, constraint_field, parse_output, parser_format,
                              request_constraint, tool_mode)
from jpa.server.protocol import (SEED_LIMIT, APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                 DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, chat_messages,
                                 check_messages, check_unsupported, engine_seed, error_body, parse_body, parse_json,
                                 stop_strings,
                                 unknown_fields, validation_error)

log = logging.getLogger("jpa.server")

DEFAULT_MAX_REQUEST_BYTES = 8 * 2 ** 20
MAX_UNKNOWN_LOGGED = 1000   # unknown field names remembered (and logged once each)
_REQUEST_ID_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def build_app(engine: AsyncEngine | None, tokenizer, *, model_name: str, api_key: str | None = None,
              max_n: int = 16, retry_after: int = 1, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              allowed_origins=(), version: str | None = None,
              constraint_limits: ConstraintLimits | None = None, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None,
              max_response_logprobs: int = DEFAULT_MAX_RESPONSE_LOGPROBS,
              response_store_bytes: int = responses_api.DEFAULT_STORE_BYTES) -> FastAPI:
    """The FastAPI app serving `engine` (started by the caller) under the name `model_name`.

    Args:
      engine: a started AsyncEngine, or None while the model loads (then `attach` it).
      tokenizer: the engine's tokenizer (encode, decode, render_chat), or None with engine None.
      model_name: the `model` value requests must name (else 404).
      api_key: if set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
      max_n: largest `n` accepted (larger: 400).
      retry_after: seconds in the Retry-After header of 503 answers.
      max_request_bytes: largest request body; a larger one is answered 413 without being read.
      allowed_origins: origins browsers may call from (CORS; "*" for any); empty: no CORS headers.
      version: what GET /version reports (default: jpa's version).
      constraint_limits: bounds on structured-output constraints and their compile (default:
        `jpa.server.limits.ConstraintLimits()`); beyond them a request is a 400 naming the field.
      reasoning_parser: None, or a `jpa.server.reasoning` format ("deepseek_r1", "qwen3"): chat
        outputs' think blocks become `reasoning_content` (see that module).
      tool_call_parser: the format "auto" tool calls are parsed in (`jpa.server.tools.TOOL_CALL_PARSERS`:
        "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"); None: from the chat template.
      max_response_logprobs: most logprob entries (a token or one of its alternatives) one response may
        hold (`jpa.server.payload.logprob_entries`); beyond it a request is a 400 naming the fields.
      response_store_bytes: bytes of stored Responses (`jpa.server.responses.ResponseStore`) kept.
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1; got {max_request_bytes!r}")
    if max_response_logprobs < 1:
        raise ValueError(f"max_response_logprobs must be >= 1; got {max_response_logprobs!r}")
    if response_store_bytes < 1:
        raise ValueError(f"response_store_bytes must be >= 1; got {response_store_bytes!r}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be None or one of {', '.join(TOOL_CALL_PARSERS)}; "
                         f"got {tool_call_parser!r}")
    app = FastAPI(title="jpa", docs_url=None, redoc_url=None, openapi_url=None)
    api = _API(model_name, max_n, retry_after, constraint_limits or ConstraintLimits(), response_store_bytes)
    api.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser is not None else None
    api.tool_call_parser = tool_call_parser
    api.max_response_logprobs = max_response_logprobs
    metrics = api.metrics
    app.state.jpa = api
    if version is None:
        import jpa
        version = jpa.__version__
    if engine is not None:
        api.attach(engine, tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return api.error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return api.error(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return api.error(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.get("/health")
    async def health():
        if api.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503, headers=api.retry_headers)
        if api.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers=api.retry_headers)
        if not api.engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503, headers=api.retry_headers)
        return {"status": "ok"}

    @app.get("/version")
    async def get_version():
        return {"version": version}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.ready().model_card(), *api.lora_cards()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        lora = api.ready().check_model(model_id)
        return api.model_card() if lora is None else api.lora_card(lora)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await api.load_lora(parse_json(await request.body()))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await api.unload_lora(parse_json(await request.body()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.serve(request, api.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.serve(request, api.prepare_chat)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await api.serve_responses(request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw = await request.body()
        return await asyncio.to_thread(api.ready().tokenize, raw)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return api.ready().tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        raw = await request.body()
        return await asyncio.to_thread(api.ready().detokenize, raw)

    admin.register(app, api)   # POST /pause, /resume, /update_weights (RL rollouts)
    app.add_middleware(_Gate, api=api, api_key=api_key, max_request_bytes=max_request_bytes)
    origins = list(allowed_origins)
    if origins:   # outermost: a browser's preflight (OPTIONS) carries no key
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])
    return app


def attach(app: FastAPI, engine: AsyncEngine, tokenizer) -> None:
    """Gives an app built with engine None its (started) engine: it starts serving requests."""
    app.state.jpa.attach(engine, tokenizer)


class _BodyTooLarge(APIError):
    def __init__(self, limit: int):
        # Connection: close: the rest of the body is never read, so the connection cannot carry more.
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes)",
                         code="request_too_large", headers={"Connection": "close"})


class _Gate:
    """ASGI middleware in front of every route: the request id (X-Request-Id, taken from the
    request or made, echoed on the response), the API key, and the body size limit (a declared
    Content-Length over it is refused before the body is read; a chunked body is counted)."""

    def __init__(self, app, *, api: "_API", api_key: str | None, max_request_bytes: int):
        self.app, self.api, self.api_key, self.limit = app, api, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not (0 < len(rid) <= 128 and set(rid) <= _REQUEST_ID_OK):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        error = None
        if self.api.draining:   # shutting down (jpa.server.run): admit nothing new
            error = APIError(503, "the server is shutting down; try again shortly", type="server_error",
                             code="shutting_down", headers={**self.api.retry_headers, "Connection": "close"})
        elif self.api_key is not None and scope["path"] != "/health":
            # The scheme is case-insensitive (RFC 9110: "bearer" = "Bearer"); the key is not.
            scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
            if not (scheme.lower() == b"bearer"
                    and hmac.compare_digest(given.strip(), self.api_key.encode())):
                error = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                 type="authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if error is None and length is not None and length.isdigit() and int(length) > self.limit:
            error = _BodyTooLarge(self.limit)
        if error is not None:
            return await self.api.error(error)(scope, receive, send_with_id)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        try:
            await self.app(scope, limited_receive, send_with_id)
        except ClientDisconnect:   # the client left during its upload: nobody to answer, not our error
            log.info("request %s: the client disconnected before its body arrived", rid)
        except Exception as e:
            # A bug: the client gets a 500 with the request id, never the exception text (the log
            # has it). Past the response's start nothing can be sent: the connection is dropped.
            log.error("request %s failed", rid, exc_info=e)
            if started:
                raise
            await self.api.error(APIError(500, f"internal server error (request id {rid})",
                                          type="server_error"))(scope, receive, send_with_id)


class _API:
    def __init__(self, model_name: str, max_n: int, retry_after: int, limits: ConstraintLimits,
                 store_bytes: int = responses_api.DEFAULT_STORE_BYTES):
        self.engine: AsyncEngine | None = None
        self.limits = limits
        self.draining = False   # set on SIGTERM (jpa.server.run): new requests get 503
        self.guard = CompileGuard(limits)
        self.grammars: Grammars | None = None   # the server's own (validation only; the engine has one)
        self._grammars_lock = threading.Lock()
        self.response_store = responses_api.ResponseStore(max_bytes=store_bytes)
        self.reasoning: ReasoningParser | None = None   # `--reasoning-parser` (set by build_app)
        self._thought_spec: Reasoning | None = None    # its think block as a grammar prefix (`_thought`)
        self.tok = None
        self.model_name, self.max_n, self.retry_after = model_name, max_n, retry_after
        self.retry_headers = {"Retry-After": str(retry_after)}
        self.metrics = ServerMetrics(lambda: self.engine, model_name)
        self.created = int(time.time())
        self._unknown_logged: set[str] = set()   # at most MAX_UNKNOWN_LOGGED names
        self._lock = threading.Lock()

    def attach(self, engine: AsyncEngine, tokenizer) -> None:
        if self.engine is not None:
            raise RuntimeError("the app already has an engine")
        self.tok = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.token_bytes_special = TokenBytes(tokenizer, skip_special_tokens=False)  # skip_special_tokens: false
        self.vocab_size = engine.engine.model.config.vocab_size
        # The most samples one engine request may have (one decode slot each).
        self.max_samples = engine.engine.config.max_seqs
        # No token stands for more text than the longest token's (special tokens spelled out), so a
        # text of more than max_model_len x that many characters cannot fit; the factor 2 leaves
        # room for normalizers that compose characters (NFC) before tokenizing.
        longest = max(max(len(tokenizer.decode([t])), len(self.token_bytes(t)))
                      for t in range(min(self.vocab_size, tokenizer.vocab_size)))
        self.max_prompt_chars = 2 * engine.max_model_len * max(longest, 1)
        self.grammars = Grammars(tokenizer, self.vocab_size, engine.stop_ids)
        self.engine = engine   # last: requests see a complete API once this is set

    def ready(self) -> "_API":
        if self.engine is None:
            raise APIError(503, "the model is loading; try again shortly", type="server_error",
                           code="model_loading", headers=self.retry_headers)
        return self

    def error(self, e: APIError) -> Response:
        self.metrics.errors.labels(str(e.status)).inc()
        # ASCII JSON: an error message never fails to encode, whatever it quotes.
        return Response(json.dumps(e.body(), ensure_ascii=True), status_code=e.status, headers=e.headers,
                        media_type="application/json")

    def separates_reasoning(self, body) -> bool:
        """A chat request's output is split by the reasoning parser (one is on, and the request does not
        turn it off with vllm-router's separate_reasoning: false)."""
        return self.reasoning is not None and getattr(body, "separate_reasoning", None) is not False

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jpa",
                "max_model_len": self.engine.max_model_len}

    def check_model(self, name: str):
        """None for the base model's name, the LoRARequest of a loaded adapter's name (`--enable-lora`), else 404."""
        if name == self.model_name:
            return None
        lora = self.loras().get(name)
        if lora is None:
            more = f" or one of its LoRA adapters {sorted(self.loras())}" if self.loras() else ""
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}{more}",
                           param="model", type="not_found_error", code="model_not_found")
        return lora

    def loras(self) -> dict:
        """{name: LoRARequest} of the adapters the engine has loaded (empty without --enable-lora)."""
        slots = self.engine.engine.loras if self.engine is not None else None
        return {} if slots is None else {r.lora_name: r for r, _ in list(slots.known.values())}

    def lora_card(self, lora) -> dict:
        return {"id": lora.lora_name, "object": "model", "created": self.created, "owned_by": "jpa",
                "root": lora.lora_path, "parent": self.model_name, "max_model_len": self.engine.max_model_len}

    def lora_cards(self) -> list:
        return [self.lora_card(r) for _, r in sorted(self.loras().items())]

    def _lora_engine(self):
        self.ready()
        if self.engine.engine.loras is None:
            raise APIError(400, "this server does not serve LoRA adapters (start it with --enable-lora)",
                           code="lora_disabled")
        return self.engine

    @staticmethod
    def _name(body, field: str) -> str:
        v = body.get(field) if isinstance(body, dict) else None
        if not isinstance(v, str) or not v:
            raise APIError(400, f"'{field}' must be a non-empty string", param=field)
        return v

    async def load_lora(self, body):
        """POST /v1/load_lora_adapter {lora_name, lora_path[, load_inplace]} (vLLM's): the adapter read on the
        engine thread between rounds (no compile); with load_inplace true, a loaded adapter's weights replaced
        (`LLMEngine.update_lora`). 400 naming the rule for a bad adapter (missing or corrupt files, rank above
        --max-lora-rank, a target the model lacks), a name already loaded, or an update while requests use it."""
        from jpa.engine.lora import LoRARequest

        engine = self._lora_engine()
        name, path = self._name(body, "lora_name"), self._name(body, "lora_path")
        if body.get("load_inplace") is True and name in self.loras():   # vLLM's in-place update (RL)
            await self._engine_call(engine, lambda eng: eng.update_lora(name, path), "load_lora_adapter",
                                    "lora_path", "invalid_lora")
            return PlainTextResponse(f"Success: LoRA adapter '{name}' updated in place.")
        if name == self.model_name or name in self.loras():
            raise APIError(400, f"the name {name!r} is taken (the base model's or a loaded adapter's)",
                           param="lora_name", code="lora_name_taken")

        def load(eng):
            ids = [r.lora_int_id for r, _ in eng.loras.known.values()]
            eng.load_lora(LoRARequest(name, max(ids, default=0) + 1, path))
        await self._engine_call(engine, load, "load_lora_adapter", "lora_path", "invalid_lora")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, body):
        """POST /v1/unload_lora_adapter {lora_name}: 404 for an adapter not loaded, 400 while requests use it."""
        engine = self._lora_engine()
        name = self._name(body, "lora_name")
        if name not in self.loras():
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.loras())})",
                           param="lora_name", type="not_found_error", code="lora_not_found")
        await self._engine_call(engine, lambda eng: eng.unload_lora(name), "unload_lora_adapter", "lora_name",
                                "lora_in_use")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _engine_call(self, engine, fn, what: str, param: str, code: str):
        """fn(LLMEngine) on the engine thread (`AsyncEngine.call`); its ValueError a 400, a dead engine a 503."""
        try:
            return await asyncio.to_thread(engine.call, fn)
        except ValueError as e:
            raise APIError(400, f"{what}: {e}", param=param, code=code) from None
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None

    def note_unknown(self, body, endpoint: str) -> None:
        """Logs each ignored field name once per server (as vLLM warns about ignored fields): the first
        MAX_UNKNOWN_LOGGED names (each cut to 100 characters), then one line saying no more are logged,
        so a client sending new names forever grows neither the memory nor the log."""
        names = unknown_fields(body)
        if not names:
            return
        with self._lock:
            room = MAX_UNKNOWN_LOGGED - len(self._unknown_logged)
            new = [n for n in dict.fromkeys(x[:100] for x in names) if n not in self._unknown_logged]
            full = 0 < room <= len(new)   # this request fills the set
            new = new[:max(room, 0)]
            self._unknown_logged.update(new)
        for name in new:
            log.warning("ignoring the unknown request field %r (first seen on %s; logged once per name)",
                        name, endpoint)
        if full:
            log.warning("%d unknown request field names logged; further new ones are ignored without a log line",
                        MAX_UNKNOWN_LOGGED)

    # ------------------------------------------------------------------ request -> engine requests
    # (these run on a worker thread: parsing and tokenizing a big body must not stall the loop)

    def _encode_plain(self, text: str, param: str) -> list[int]:
        """Token ids of `text` without the special tokens the tokenizer adds (a BOS): /tokenize with
        add_special_tokens false, as lm-eval's remote tokenizer asks for its contexts and continuations."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:     # the byte tokenizer adds none
            return self._encode(text, param)
        self._check_length(text, param)
        try:
            return backend.encode_batch([text], add_special_tokens=False)[0].ids   # releases the lock
        except Exception as e:
            raise APIError(400, f"'{param}' could not be tokenized: {type(e).__name__}", param=param) from None

    def _check_length(self, text: str, param: str) -> None:
        # A text far longer than any prompt that fits is refused before it is tokenized: tokenizing
        # megabytes takes seconds (and tokenizers' encode holds the GIL, stalling every other request).
        self._check_chars(len(text), param)

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens; the "
                                f"{param} has {chars} characters, more than that many tokens can hold",
                           param="prompt")

    def _encode(self, text: str, param: str) -> list[int]:
        self._check_length(text, param)
        try:
            return self.tok.encode(text)
        except Exception as e:  # a tokenizer that cannot take this text
            raise APIError(400, f"'{param}' could not be tokenized: {type(e).__name__}", param=param) from None

    def _prompts(self, prompt) -> list[list[int]]:
        """Token ids of each prompt of a completion request (str, [str], [int] or [[int]])."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        out = []
        limit = self.engine.max_model_len
        for p in prompt:
            ids = self._encode(p, "prompt") if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "'prompt' is empty: nothing to condition on", param="prompt")
            if len(ids) >= limit:   # before the id check: a huge prompt is refused in O(1)
                raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                    f"{len(ids)} tokens and no room is left for the completion", param="prompt")
            self._check_ids(ids, "prompt")
            out.append(ids)
        return out

    def _check_ids(self, ids: list[int], param: str) -> None:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            raise APIError(400, f"'{param}' token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param=param)

    def _thought(self) -> Reasoning:
        """The reasoning parser's think block as the grammar's free prefix (`StructuredOutputs.reasoning`):
        optional for qwen3 (an output may answer at once), required for deepseek_r1; the tags are
        named as special tokens where the tokenizer (as llguidance reads it) has each as one."""
        if self._thought_spec is not None:
            return self._thought_spec
        llt = self.grammars.llg_tokenizer()

        def special(tag):
            ids = llt.tokenize_str(tag, parse_special=True)
            return len(ids) == 1 and llt.is_special_token(ids[0])

        self._thought_spec = Reasoning(START, END, optional=self.reasoning.kind == "qwen3",
                                       special=special(START) and special(END))
        return self._thought_spec

    def _constraint(self, param: str, reasoning: bool = False, **fields) -> StructuredOutputs:
        """A request's StructuredOutputs (`jpa.server.tools.request_constraint`'s build): limits checked
        first, then compiled (grammar, matcher over the tokenizer, first mask) on the CompileGuard's
        large-stack workers within the compile deadline; any failure is a 400 naming the field.
        reasoning: the constraint applies to the answer after the reasoning parser's think block."""
        (kind, value), = fields.items()
        check_constraint(param, kind, value, self.limits)
        with self._grammars_lock:   # built once (about 0.5 s for a 49k vocabulary), outside the deadline
            self.grammars.llg_tokenizer()
        thought = self._thought() if reasoning else None

        def compile_():
            spec = StructuredOutputs(**fields, reasoning=thought)
            # After a thought the first mask allows any text: the answer's own first mask is checked.
            error = first_mask_allows_something(self.grammars, StructuredOutputs(**fields) if thought else spec)
            if not error and thought:
                error = first_mask_allows_something(self.grammars, spec)
            if error:
                raise ValueError(f"structured.{spec.kind}: {error}")
            return spec

        try:
            return self.guard.run(param, compile_)
        except ValueError as e:
            raise APIError(400, f"'{param}': {e}"[:600], param=param.split(".")[0]) from None
        except RecursionError:
            raise APIError(400, f"'{param}': nested too deeply", param=param.split(".")[0]) from None
        except APIError:
            raise
        except Exception as e:   # llguidance raises plain exceptions (and Rust panics) on some inputs
            log.warning("constraint %s failed to compile: %s: %s", param, type(e).__name__, str(e)[:300])
            raise APIError(400, f"'{param}': the constraint could not be compiled", param=param.split(".")[0]) \
                from None

    def _render(self, messages, add_generation_prompt: bool = True, tools=None, template_kwargs=None) -> str:
        # Tools go to the chat template (Hugging Face templates take `tools`).
        extra = {"tools": [t.model_dump(exclude_none=True, by_alias=True) for t in tools]} if tools else {}
        if template_kwargs:
            extra.update(template_kwargs)
            try:
                return self.tok.render_chat(chat_messages(messages), add_generation_prompt=add_generation_prompt,
                                            **extra)
            except TypeError:   # jpa's ChatML renderers (GGUF, byte tokenizers) take no template variables
                raise APIError(400, "'chat_template_kwargs': this model's chat template takes no extra variables",
                               param="chat_template_kwargs") from None
            except Exception as e:
                raise APIError(400, f"'messages': {e}"[:500], param="messages") from None
        try:
            return self.tok.render_chat(chat_messages(messages), add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # ValueError, or a template's own raise_exception (jinja2 TemplateError)
            raise APIError(400, f"'messages': {e}"[:500], param="messages") from None

    def _params(self, body, prompts: list[list[int]], max_tokens: int | None, default_max: int | None,
                structured=None):
        """[(prompt ids, SamplingParams, LoRARequest | None)]: per prompt, one request with n samples, or n
        requests, with the LoRA adapter the body's `model` names (None: the base model); structured: the
        request's constraint (`jpa.server.tools.request_constraint`), or None."""
        lora = self.check_model(body.model)
        if body.n > self.max_n:
            raise APIError(400, f"'n' must be <= {self.max_n}; got {body.n}", param="n")
        if len(prompts) * body.n > self.engine.max_waiting:
            raise APIError(400, f"{len(prompts)} prompts x n = {body.n} is more requests than this server ever "
                                f"queues at once ({self.engine.max_waiting})", param="n")
        stop = stop_strings(body.stop)
        controls = {k: getattr(body, k, None) for k in CONTROL_FIELDS if getattr(body, k, None) is not None}
        # vLLM: echo with logprobs k scores the prompt with k alternatives (prompt_logprobs k);
        # max_tokens 0 with echo generates one token that the response leaves out.
        echo = bool(getattr(body, "echo", None))
        controls["prompt_logprobs"] = body.prompt_logprobs
        controls["structured"] = structured
        if controls["prompt_logprobs"] is None and echo:
            controls["prompt_logprobs"] = body.logprobs
        if echo and max_tokens == 0:
            max_tokens = 1
        # include_stop_str_in_output (vLLM) wins over no_stop_trim (SGLang's name; vllm-router sends false).
        controls["include_stop_str_in_output"] = bool(body.no_stop_trim if body.include_stop_str_in_output is None
                                                      else body.include_stop_str_in_output)
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            controls[name] = True if getattr(body, name) is None else getattr(body, name)
        # Chat: logprobs true + top_logprobs k; completions: logprobs k (the sampled token's and k alternatives).
        controls["top_logprobs"] = (body.top_logprobs or 0) if isinstance(body.logprobs, bool) else (body.logprobs or 0)
        if "logit_bias" in controls:
            try:
                controls["logit_bias"] = {int(t): b for t, b in controls["logit_bias"].items()}
            except ValueError:
                raise APIError(400, f"'logit_bias' keys must be token ids; got {list(body.logit_bias)[:5]}",
                               param="logit_bias") from None
        if "stop_token_ids" in controls:
            controls["stop_token_ids"] = tuple(controls["stop_token_ids"])
        vocab = self.vocab_size
        bad = [t for t in [*controls.get("logit_bias", {}), *controls.get("stop_token_ids", ())] if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}",
                           param="logit_bias" if any(t in controls.get("logit_bias", {}) for t in bad) else "stop_token_ids")
        limit = self.engine.max_model_len
        # Seeds the engine can take are used as given; other 64-bit seeds are folded (engine_seed).
        base = engine_seed(body.seed, body.n) if body.seed is not None else random.randrange(SEED_LIMIT - body.n + 1)
        wants = []
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
            wants.append(want)
        self._check_response_size(body, [len(ids) for ids in prompts], wants)
        out = []
        for ids, want in zip(prompts, wants):
            # n choices of one prompt are one engine request with n samples (sample j: seed base + j),
            # prefilled once on shared pages, when the engine has a slot for each; else n requests.
            shared = body.n <= self.max_samples
            for j in range(1 if shared else body.n):
                try:
                    sp = SamplingParams(max_new_tokens=want, temperature=1.0 if body.temperature is None
                                        else float(body.temperature), top_k=max(body.top_k or 0, 0),
                                        top_p=1.0 if body.top_p is None else float(body.top_p),
                                        seed=base + j, stop=stop, ignore_eos=body.ignore_eos,
                                        n=body.n if shared else 1, **controls)
                except ValueError as e:
                    msg = str(e).replace("max_new_tokens", "max_tokens")
                    field = msg.split(" ", 1)[0]
                    raise APIError(400, msg, param=field if field in CONTROL_FIELDS else None) from None
                out.append((ids, sp, lora))
        return out

    def _check_response_size(self, body, prompt_lens: list[int], wants: list[int]) -> None:
        chat = isinstance(body, ChatCompletionRequest)
        entries, field = logprob_entries(body, prompt_lens, wants, chat)
        if entries > self.max_response_logprobs:
            what = "(1 + top_logprobs)" if chat else "(1 + logprobs)"
            raise APIError(400, f"the response would hold {entries} logprob entries (n {body.n} x {len(prompt_lens)} "
                                f"prompt(s) x (prompt tokens reported + max_tokens) x {what}, prompt_logprobs "
                                f"{body.prompt_logprobs}); this server sends at most {self.max_response_logprobs}: "
                                f"lower n, max_tokens, logprobs or prompt_logprobs", param=field,
                           code="response_too_large")

    def prepare_completion(self, raw: bytes):
        body = parse_body(raw, CompletionRequest)
        self.note_unknown(body, "/v1/completions")
        self.check_model(body.model)
        check_unsupported(body)
        prompts = self._prompts(body.prompt)
        texts = body.prompt if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str) \
            else [body.prompt] if isinstance(body.prompt, str) else None
        if body.echo:   # the echoed text: the prompt as given, token-id prompts decoded
            skip = body.skip_special_tokens is not False
            texts = texts or [self.tok.decode(ids, skip_special_tokens=skip) for ids in prompts]
        fmt = functools.partial(_CompletionFormat, prompts=list(zip(texts or [None] * len(prompts), prompts)))
        structured = request_constraint(body, chat=False, build=self._constraint)
        return body, self._params(body, prompts, body.max_tokens, 16, structured), len(prompts), fmt

    def prepare_chat(self, raw: bytes, earlier=None):
        """earlier: (where, messages): validated messages (a stored conversation) put in the body's
        messages at index `where` (they are not parsed again)."""
        body = parse_body(raw, ChatCompletionRequest)
        self.note_unknown(body, "/v1/chat/completions")
        if earlier is not None:
            where, msgs = earlier
            body = body.model_copy(update={"messages": [*body.messages[:where], *msgs, *body.messages[where:]]})
        self.check_model(body.model)
        check_unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
        # With a reasoning parser, the constraint applies to the answer after the think block.
        build = functools.partial(self._constraint, reasoning=True) if self.separates_reasoning(body) \
            else self._constraint
        structured = request_constraint(body, chat=True, build=build)   # also checks tool_choice against tools
        if body.skip_special_tokens is None and tool_mode(body) == "auto" and \
                (self.tool_call_parser or parser_format(self.tok)) == MISTRAL:
            # [TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers: keep them in the
            # text the parser reads (vLLM's mistral parser does the same).
            body = body.model_copy(update={"skip_special_tokens": False})
        tools = body.tools if body.tool_choice != "none" else None
        # The template renders every message's text: more of it than the context holds is refused before
        # rendering (a long stored conversation is not rendered only to be refused).
        self._check_chars(sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content)
                              for m in body.messages if m.content), "messages")
        prompts = [self._encode(self._render(body.messages, tools=tools, template_kwargs=body.chat_template_kwargs),
                                "messages")]
        return body, self._params(body, prompts, body.max_completion_tokens or body.max_tokens, None,
                                  structured), 1, _ChatFormat

    def tokenize(self, raw: bytes) -> dict:
        obj = parse_json(raw)
        chat = isinstance(obj, dict) and "messages" in obj
        body = parse_body(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        self.note_unknown(body, "/tokenize")
        if body.model is not None:
            self.check_model(body.model)
        if chat:
            for name, ok in (("add_special_tokens", not body.add_special_tokens),
                             ("continue_final_message", not body.continue_final_message),
                             ("chat_template", body.chat_template is None),
                             ("chat_template_kwargs", not body.chat_template_kwargs),
                             ("tools", not body.tools)):
                if not ok:
                    raise APIError(400, f"'{name}' is not supported here (only its default: what "
                                        f"/v1/chat/completions does)", param=name)
            check_messages(body.messages)
            ids = self._encode(self._render(body.messages, body.add_generation_prompt), "messages")
        else:
            ids = (self._encode if body.add_special_tokens else self._encode_plain)(body.prompt, "prompt")
        out = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [self._token_str(t) for t in ids]
        return out

    def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: the tokenizer's configuration (special tokens, chat template,
        limits), what lm-eval's `tokenizer_backend=remote` reads before it calls /tokenize."""
        tok = self.tok
        special = getattr(tok, "_special_tokens", None) or {}

        def spelled(token_id):
            return None if token_id is None else tok.decode([token_id], skip_special_tokens=False)

        info = {"tokenizer_class": type(tok).__name__, "model_max_length": self.engine.max_model_len,
                "vocab_size": self.vocab_size, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                "bos_token": spelled(tok.bos_token_id), "eos_token": spelled(tok.eos_token_id),
                "stop_token_ids": sorted(self.engine.stop_ids),
                "chat_template": getattr(tok, "chat_template", None), "add_bos_token": bool(getattr(tok, "_add_bos",
                                                                                                   False))}
        for name in ("pad_token", "unk_token"):
            v = special.get(name)
            info[name] = v if isinstance(v, str) else (v.get("content") if isinstance(v, dict) else None)
        return info

    def _token_str(self, t: int) -> str:
        """The vocabulary's spelling of a token (vLLM: convert_ids_to_tokens)."""
        piece = self.tok.id_to_token(t) if hasattr(self.tok, "id_to_token") else None
        if isinstance(piece, str):
            return piece
        b = self.token_bytes(t)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"<0x{x:02X}>" for x in b)

    def detokenize(self, raw: bytes) -> dict:
        body = parse_body(raw, DetokenizeRequest)
        self.note_unknown(body, "/detokenize")
        if body.model is not None:
            self.check_model(body.model)
        if body.tokens:
            self._check_ids(body.tokens, "tokens")
        return {"prompt": self.tok.decode(body.tokens)}

    # ------------------------------------------------------------------ serving

    def _submit(self, requests) -> RequestGroup:
        try:
            return self.engine.submit(requests)
        except EngineOverloaded as e:
            raise APIError(503, str(e), type="overloaded_error", code="overloaded",
                           headers=self.retry_headers) from None
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable",
                           headers=self.retry_headers) from None

    async def serve(self, request: Request, prepare):
        self.ready()
        try:
            raw = await request.body()
        except ClientDisconnect:   # gone during the upload (or its body timed out): nobody reads an answer
            return Response(status_code=499)
        body, reqs, num_prompts, fmt_class = await asyncio.to_thread(prepare, raw)
        fmt = fmt_class(self, body, request.scope["state"]["request_id"])
        group = self._submit(reqs)
        per_prompt = len(reqs) // num_prompts   # 1 (n samples in one request) or n
        prompt_tokens = sum(len(reqs[i * per_prompt][0]) for i in range(num_prompts))
        timing = Timing(self.metrics, group.arrival)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            # The background task runs after the stream ends, however it ends: if the client left
            # before the first chunk (the generator never started), this is what aborts the requests.
            firsts = {i * per_prompt for i in range(num_prompts)}   # one request per prompt counts its cache hits
            return StreamingResponse(self._stream(group, fmt, timing, prompt_tokens, include_usage,
                                                  body, request.scope["state"]["request_id"], firsts),
                                     media_type="text/event-stream", background=BackgroundTask(group.abort),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results = await self._collect(group, timing, request)
        if results is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        bad = [o for o in results.values() if o.finish_reason not in ("stop", "length")]
        if bad:
            o = bad[0]
            if o.finish_reason == "error":
                raise self._generation_error(body, o.error, request.scope["state"]["request_id"])
            raise APIError(503, "the server is shutting down", type="server_error", headers=self.retry_headers)
        outs = [results[i] for i in range(len(group))]
        completion_tokens = 0 if fmt.score_only else sum(len(o.token_ids) for o in outs)
        cached = sum(outs[i * per_prompt].num_cached_tokens for i in range(num_prompts))
        # Built and encoded on a worker thread (jpa.server.payload): a big answer never stalls the loop.
        return await send_json(lambda: fmt.response([fmt.choice(i, o) for i, o in enumerate(outs)],
                                                    _usage(prompt_tokens, completion_tokens, cached), outs))

    def _generation_error(self, body, error: str | None, rid: str) -> APIError:
        """The error of a request the engine failed: under a constraint, a 400 naming the constraint's
        field without the grammar library's text (logged); else the engine's message (bad input)."""
        field = constraint_field(body)
        if field is not None:
            log.warning("request %s: constrained generation failed: %s", rid, (error or "")[:500])
            return APIError(400, f"the output could not be continued under the constraint in '{field}' (request "
                                 f"id {rid})", param=field)
        return APIError(400, error or "invalid request", param="prompt")

    async def serve_responses(self, request: Request):
        """POST /v1/responses: translated into a chat completion (`jpa.server.responses`)."""
        self.ready()
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        rid_header = request.scope["state"]["request_id"]

        def prepare():
            obj = parse_json(raw)
            chat, parent, num_input = responses_api.to_chat(obj, self.response_store)
            if chat.get("seed") is None:
                chat.pop("seed", None)
            # The stored conversation is put in as it was validated: a chain is never re-encoded or re-parsed.
            earlier = None if parent is None else (len(chat["messages"]) - num_input, parent.conversation())
            body, reqs, num_prompts, fmt_class = self.prepare_chat(json.dumps(chat).encode(), earlier)
            return obj, (parent, body.messages[len(body.messages) - num_input:]), body, reqs

        obj, conversation, body, reqs = await asyncio.to_thread(prepare)
        fmt = _ChatFormat(self, body, rid_header)
        group = self._submit(reqs)
        prompt_tokens = len(reqs[0][0])
        timing = Timing(self.metrics, group.arrival)
        resp_id = f"resp_{uuid.uuid4().hex}"
        store = obj.get("store") is not False
        if body.stream:
            return StreamingResponse(self._responses_stream(group, fmt, timing, prompt_tokens, obj, conversation,
                                                            resp_id, store, body, rid_header),
                                     media_type="text/event-stream", background=BackgroundTask(group.abort),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results = await self._collect(group, timing, request)
        if results is None:
            return Response(status_code=499)
        out = results[0]
        if out.finish_reason not in ("stop", "length"):
            if out.finish_reason == "error":
                raise self._generation_error(body, out.error, rid_header)
            raise APIError(503, "the server is shutting down", type="server_error", headers=self.retry_headers)
        message = fmt.choice(0, out)["message"]
        usage = _usage(prompt_tokens, len(out.token_ids), out.num_cached_tokens)
        r = responses_api.response_object(resp_id, obj, self.model_name, responses_api.output_items(message), usage,
                                          out.finish_reason, time.time())
        if store:
            self._store(resp_id, conversation, message)
        return JSONResponse(r)

    def _store(self, resp_id: str, conversation, message: dict) -> None:
        """Stores a Responses answer: its input messages and answer after the response it continued."""
        parent, inputs = conversation
        answer = ChatMessage.model_validate(responses_api.stored_answer(message), strict=False)
        self.response_store.put(resp_id, parent, [*inputs, answer])

    async def _responses_stream(self, group, fmt, timing, prompt_tokens, obj, conversation, resp_id, store, body,
                                rid):
        events = responses_api.EventStream(resp_id, obj, self.model_name)

        def sse(e):
            return f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False, allow_nan=False)}\n\n"

        completion_tokens = cached = 0
        reason = None
        try:
            for e in events.start():
                yield sse(e)
            async for i, out in group:
                timing.on_output(i, out)
                completion_tokens += len(out.new_token_ids)
                if out.finished:
                    reason = out.output.finish_reason
                    cached = out.output.num_cached_tokens
                    if reason not in ("stop", "length"):
                        e = (self._generation_error(body, out.output.error, rid) if reason == "error" else
                             APIError(503, "the server is shutting down", type="server_error"))
                        yield sse(events._event("error", code=e.code, message=e.message, param=e.param))
                        return
                chunk = fmt.chunk(i, out)
                if chunk is not None:
                    for e in events.delta(chunk["choices"][0]["delta"]):
                        yield sse(e)
            closing, final = events.finish(reason or "stop", _usage(prompt_tokens, completion_tokens, cached))
            for e in closing:
                yield sse(e)
            if store:
                self._store(resp_id, conversation, events.message())
        except EngineDead as e:
            yield sse(events._event("error", code="engine_unavailable", message=str(e), param=None))
        finally:
            if group.num_unfinished:
                self.metrics.finished.labels("abort").inc(group.num_unfinished)
                group.abort()

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
        gone = True
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            gone = not consumer.done()
            if gone:  # the client went away (or this handler was cancelled)
                # cancel() only asks: the task is not cancelled (nor has a result) until it runs again.
                consumer.cancel()
                self.metrics.finished.labels("abort").inc(group.num_unfinished)
                group.abort()
        if gone:
            return None
        try:
            return consumer.result()
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error") from None

    async def _stream(self, group: RequestGroup, fmt, timing: Timing, prompt_tokens: int, include_usage: bool,
                      body=None, rid: str = "", firsts=frozenset({0})):
        """Server-sent events in OpenAI's chunk format, ending with [DONE]."""
        completion_tokens = cached = version = 0
        try:
            for chunk in fmt.first_chunks(len(group)):
                yield _sse(chunk)
            async for i, out in group:
                timing.on_output(i, out)
                completion_tokens += 0 if fmt.score_only else len(out.new_token_ids)
                if out.finished:
                    reason = out.output.finish_reason
                    cached += out.output.num_cached_tokens if i in firsts else 0
                    version = max(version, out.output.weight_version)
                    if reason not in ("stop", "length"):
                        if reason == "error":
                            e = self._generation_error(body, out.output.error, rid)
                            yield _sse(error_body(e.message, param=e.param))
                        else:
                            yield _sse(error_body("the server is shutting down", type="server_error"))
                        continue
                chunk = fmt.chunk(i, out)
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**fmt.usage_chunk(_usage(prompt_tokens, completion_tokens, cached)),
                            "weight_version": version})
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


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(x: float):
    return x if math.isfinite(x) else None


def _logprob(x: float):
    """A reported logprob: -inf (a token a constraint or filter forbids) as -9999, vLLM's value (OpenAI's
    schema has a number; jpa's prompt_logprobs do the same)."""
    return max(x, -9999.0) if not math.isnan(x) else None


class _Format:
    """OpenAI's response and chunk shapes for one endpoint, and each choice's logprob tokens."""

    score_only = False   # completions with echo and max_tokens 0: no completion tokens are reported

    def __init__(self, api: _API, body, request_id: str):
        self.api, self.body = api, body
        self.id = f"{self.PREFIX}-{request_id}"   # as vLLM: the X-Request-Id when the client sent one
        self.created = int(time.time())
        self._choice_tokens: dict[int, ChoiceTokens] = {}
        self.skip_special = body.skip_special_tokens is not False
        self.include_stop = bool(body.no_stop_trim if body.include_stop_str_in_output is None
                                 else body.include_stop_str_in_output)

    @property
    def token_bytes(self) -> TokenBytes:
        return self.api.token_bytes if self.skip_special else self.api.token_bytes_special

    def _kept(self, token_ids, logprobs, final_reason) -> tuple[list, list]:
        """Token ids and logprobs to report: a final stop token (EOS, stop_token_ids) is not part of the text
        (unless include_stop_str_in_output keeps it, as the engine keeps its text)."""
        ids, lps = list(token_ids), list(logprobs)
        if final_reason == "stop" and ids and not self.include_stop and (
                (ids[-1] in self.api.engine.stop_ids and not self.body.ignore_eos)
                or ids[-1] in (self.body.stop_token_ids or ())):
            ids, lps = ids[:-1], lps[:-1]
        return ids, lps

    def _choice_base(self, index: int) -> int:
        """Characters of the choice's text before its first completion token's (an echoed prompt)."""
        return 0

    def prompt_logprobs_json(self, prompt_ids, plp) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: {logprob,
        rank, decoded_token}} holding the prompt token and its top-k alternatives (-inf clamped to
        -9999, as vLLM)."""
        if plp is None:
            return None
        tok = self.api.tok
        entry = lambda t, lp, rank: {"logprob": max(lp, -9999.0), "rank": rank,  # noqa: E731
                                     "decoded_token": tok.decode([t])}
        out = [None]
        for t, e in zip(prompt_ids[1:], plp[1:]):
            d = {str(t): entry(t, e.logprob, e.rank)}
            for rank, (a, v) in enumerate(e.top, 1):
                d.setdefault(str(a), entry(a, v, rank))
            out.append(d)
        return out

    def _alternatives(self, top) -> list:
        """(text, bytes, logprob) of a token's top alternatives ((id, logprob) pairs)."""
        return [(self.api.tok.decode([t]), self.api.token_bytes(t), lp) for t, lp in top]

    def _tokens(self, index: int, token_ids, logprobs, reason, new_text: str, tops=()) -> list[tuple]:
        """(text, bytes, (logprob, top alternatives), text_offset) of the tokens whose text the
        client now has."""
        tops = list(tops) or [()] * len(token_ids)
        ids, lps = self._kept(token_ids, list(zip(logprobs, tops)), reason)
        ct = self._choice_tokens.get(index)
        if ct is None:
            ct = self._choice_tokens[index] = ChoiceTokens(self.api.tok, self.token_bytes,
                                                           base=self._choice_base(index))
        return ct.feed(ids, lps, new_text, reason is not None)

    def _head(self, obj: str) -> dict:
        # the name the request gave, checked (`check_model`): the served model's, or a LoRA adapter's (as vLLM)
        return {"id": self.id, "object": obj, "created": self.created, "model": self.body.model}

    def response(self, choices: list, usage: dict, outs=()) -> dict:
        """The answer; `weight_version` (an extension, as SGLang's meta_info has it): the newest weights any of its
        tokens was sampled with (`update_weights`; 0 before the first update)."""
        out = {**self._head(self.OBJECT), "choices": choices, "usage": usage}
        if outs:
            out["weight_version"] = max(o.weight_version for o in outs)
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.CHUNK), "choices": [], "usage": usage}

    def first_chunks(self, n: int) -> list:
        return []


class _CompletionFormat(_Format):
    """Completions, with OpenAI's echo: the prompt's text before the completion's, and with
    logprobs its tokens first in the logprobs object (the first token's logprob null; text_offset
    runs on into the completion's tokens); with max_tokens 0 only the prompt (vLLM generates one
    token and leaves it out; so does jpa)."""
    PREFIX, OBJECT, CHUNK = "cmpl", "text_completion", "text_completion"

    def __init__(self, api: _API, body, request_id: str, prompts=()):
        super().__init__(api, body, request_id)
        self.prompts = prompts       # per prompt: (its text (None unless echo), its token ids)
        self.echo = bool(body.echo)
        self.score_only = self.echo and body.max_tokens == 0
        self._echoed: set[int] = set()
        # Per prompt, built once and shared by its n choices: the echoed prompt's logprobs, its
        # prompt_logprobs (the engine computes them once per prompt too).
        self._echo_heads: dict[int, dict] = {}
        self._prompt_lps: dict[int, list] = {}

    def _prompt(self, index: int):
        return self.prompts[index // self.body.n]

    def _choice_base(self, index: int) -> int:
        return len(self._prompt(index)[0]) if self.echo else 0

    def _logprobs(self, index, token_ids, lps, reason, text, tops):
        if self.body.logprobs is None:
            return None
        toks = [] if self.score_only else self._tokens(index, token_ids, lps, reason, text, tops)
        top = None
        if self.body.logprobs:   # OpenAI's shape: {token text: logprob} per token
            top = [self._top_dict(t[2][1]) for t in toks]
        return {"tokens": [t[0] for t in toks], "token_logprobs": [_logprob(t[2][0]) for t in toks],
                "top_logprobs": top, "text_offset": [t[3] for t in toks]}

    def _top_dict(self, top) -> dict:
        """OpenAI's {token text: logprob} of a token's alternatives (best first). Tokens that decode
        to the same text (byte pieces of characters, unused ids) share a key: it keeps the most
        likely one's logprob."""
        out = {}
        for a, _, v in self._alternatives(top):
            out.setdefault(a, _logprob(v))
        return out

    def _echo(self, index: int, plp, text: str, lp):
        """(prompt text + text, the prompt tokens' logprobs + lp): the choice's echo, once."""
        self._echoed.add(index)
        ptext, ids = self._prompt(index)
        if lp is None:
            return ptext + text, None
        head = self._echo_heads.get(index // self.body.n)
        if head is None:
            pieces = prompt_pieces(self.api.tok, ids, self.skip_special)
            offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0))
            entries = [None] + list(plp[1:]) if plp is not None else [None] * len(ids)
            head = self._echo_heads[index // self.body.n] = {
                "tokens": pieces, "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
                "top_logprobs": None if lp["top_logprobs"] is None else [
                    None if e is None else self._top_dict(e.top) for e in entries],
                "text_offset": offsets}
        return ptext + text, {k: head[k] + (lp[k] or []) if head[k] is not None else None for k in head}

    def choice(self, index: int, out) -> dict:
        text = "" if self.score_only else out.completion
        lp = self._logprobs(index, out.token_ids, out.logprobs, out.finish_reason, text, out.top_logprobs)
        if self.echo:
            text, lp = self._echo(index, out.prompt_logprobs, text, lp)
        choice = {"index": index, "text": text, "logprobs": lp,
                  "finish_reason": "length" if self.score_only else out.finish_reason}
        if out.prompt_logprobs is not None:   # asked for (prompt_logprobs, or echo with logprobs): vLLM's field
            p = index // self.body.n
            if p not in self._prompt_lps:
                self._prompt_lps[p] = self.prompt_logprobs_json(self._prompt(index)[1], out.prompt_logprobs)
            choice["prompt_logprobs"] = self._prompt_lps[p]
        return choice

    def chunk(self, index: int, out):
        reason = out.output.finish_reason if out.finished else None
        new_text = out.new_text
        if self.score_only:
            reason, new_text = ("length" if out.finished else None), ""
        lp = self._logprobs(index, out.new_token_ids, out.new_logprobs, reason, new_text, out.new_top_logprobs)
        if self.echo and index not in self._echoed:
            new_text, lp = self._echo(index, out.prompt_logprobs, new_text, lp)
        if not (new_text or reason or (lp and lp["tokens"])):
            return None
        return {**self._head(self.CHUNK), "choices": [
            {"index": index, "text": new_text, "logprobs": lp, "finish_reason": reason}]}


class _ChatFormat(_Format):
    """Chat responses; with tools, tool calls by `jpa.server.tools` (parsed per choice, streamed by a
    ToolStream per choice)."""
    PREFIX, OBJECT, CHUNK = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, api: _API, body, request_id: str):
        super().__init__(api, body, request_id)
        self.tool_mode = tool_mode(body)
        self.tool_format = api.tool_call_parser or parser_format(api.tok)
        self.tool_name = body.tool_choice.function.name if self.tool_mode == "named" else None
        self.parallel = body.parallel_tool_calls is not False
        self._tool_streams: dict[int, ToolStream] = {}
        # With a reasoning parser, the think block is reasoning_content; tool calls are parsed from, and
        # a constraint (response_format, structured_outputs, a named or required tool) applies to, the
        # answer after it.
        self.reasoning = api.reasoning if api.separates_reasoning(body) else None
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def _reason(self, reason, calls):
        """finish_reason "tool_calls" when an auto/required output made calls (OpenAI's)."""
        return "tool_calls" if calls and reason == "stop" and self.tool_mode in ("auto", "required") else reason

    def response(self, choices: list, usage: dict, outs=()) -> dict:
        out = super().response(choices, usage, outs)
        if self.body.prompt_logprobs is not None and outs:   # vLLM's: once, for the (one) prompt
            out["prompt_logprobs"] = self.prompt_logprobs_json(outs[0].prompt_ids, outs[0].prompt_logprobs)
        return out

    def _logprobs(self, index, token_ids, lps, reason, text, tops):
        if not self.body.logprobs:
            return None
        toks = self._tokens(index, token_ids, lps, reason, text, tops)
        return {"content": [{"token": t, "logprob": _logprob(lp), "bytes": list(b),
                             "top_logprobs": [{"token": a, "logprob": _logprob(v), "bytes": list(ab)}
                                              for a, ab, v in self._alternatives(top)]}
                            for t, b, (lp, top), _ in toks]}

    def choice(self, index: int, out) -> dict:
        text, reasoning = out.completion, None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(out.completion)
            text = text or ""
        content, calls = parse_output(text, self.tool_mode, self.tool_format, self.tool_name, self.parallel,
                                      self.body.tools)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        if self.reasoning is not None:
            if not message["content"] and reasoning is not None:
                message["content"] = None
            message["reasoning_content"] = message["reasoning"] = reasoning   # vLLM's older and newer names
        return {"index": index, "message": message,
                "logprobs": self._logprobs(index, out.token_ids, out.logprobs, out.finish_reason, out.completion,
                                           out.top_logprobs),
                "finish_reason": self._reason(out.finish_reason, calls)}

    def first_chunks(self, n: int) -> list:
        return [{**self._head(self.CHUNK), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(n)]

    def chunk(self, index: int, out):
        reason = out.output.finish_reason if out.finished else None
        lp = self._logprobs(index, out.new_token_ids, out.new_logprobs, reason, out.new_text, out.new_top_logprobs)
        text, calls, reasoning = out.new_text, [], ""
        if self.reasoning is not None:
            rs = self._reasoning_streams.setdefault(index, ReasoningStream(self.reasoning))
            reasoning, text = rs.feed(out.new_text, out.finished)
        if self.tool_mode is not None:
            stream = self._tool_streams.setdefault(index, ToolStream(self.tool_mode, self.tool_format, self.tool_name,
                                                                     self.parallel, self.body.tools))
            text, calls = stream.feed(text, out.finished)
            if reason is not None:
                reason = self._reason(reason, stream.calls or calls)
        if not (text or calls or reason or reasoning or (lp and lp["content"])):
            return None
        delta = {"content": text} if text else {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if calls:
            delta["tool_calls"] = calls
        return {**self._head(self.CHUNK), "choices": [
            {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]}
