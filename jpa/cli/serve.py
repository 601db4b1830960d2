"""`jpa serve`: an OpenAI-compatible server on jpa's engine (FastAPI + uvicorn).

Examples:
  jpa serve --model tiny-llama                    # (from a clone: ./run serve)
  ./run serve                                     # SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1
  ./run serve --model tiny-llama --port 8001      # random tiny model: fast, nonsense text
  ./run serve --api-key secret --max-seqs 32

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET
/v1/models, POST /tokenize, POST /detokenize, GET /version, GET /health, GET /metrics (Prometheus).
The model's name in requests is --served-model-name (default: the --model preset). The server binds
127.0.0.1 unless --host says otherwise; with --api-key (or $JPA_API_KEY) every endpoint but /health
needs `Authorization: Bearer <key>`. It listens at once and loads the model in the background:
/health answers 503 until the engine is ready (and compiled, unless --no-warmup), then 200.
`--port 0` picks a free port; the line "[jpa] serving ... on http://HOST:PORT" on stderr says
which, "[jpa] model ready" when requests are served. Bad flags or values print one line on stderr
and exit with code 2.
"""

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time

from jpa.args import EngineArgs, Parser, UsageError, enable_compile_cache, join_processes


def parse_args(argv=None):
    ap = Parser(prog="jpa serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served-model-name", default=None, help="the `model` requests must name (default: --model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    ap.add_argument("--api-key", default=os.environ.get("JPA_API_KEY") or None,
                    help="require `Authorization: Bearer KEY` (default: $JPA_API_KEY, else no key)")
    EngineArgs.add_cli_args(ap, steps_per_call=4, steps_help="decode steps per engine round (tokens stream once per "
                    "round: fewer = smoother streaming, more = higher throughput)")
    ap.add_argument("--max-waiting", type=int, default=256, help="most requests waiting for a slot; beyond "
                    "it new requests get 503 with Retry-After")
    ap.add_argument("--max-n", type=int, default=16, help="largest `n` (choices per request)")
    ap.add_argument("--no-warmup", action="store_true", help="do not compile with a first request before serving")
    ap.add_argument("--max-request-bytes", type=int, default=8 * 2 ** 20, help="largest request body in bytes "
                    "(default 8 MiB); a larger one is answered 413 before it is read")
    ap.add_argument("--max-response-logprobs", type=int, default=1_000_000, help="most logprob entries (a token "
                    "or one of its alternatives) one response may hold: n x prompts x (prompt tokens reported + "
                    "max_tokens) x (1 + logprobs), prompt_logprobs counted the same way (default 1000000, about "
                    "30-80 MB of JSON); a larger request is a 400 before it runs")
    ap.add_argument("--response-store-bytes", type=int, default=128 * 2 ** 20, help="bytes of stored Responses "
                    "(store: true, for previous_response_id) kept in memory, least recently used dropped first "
                    "(default 128 MiB; at most 1000 responses)")
    ap.add_argument("--timeout-keep-alive", type=float, default=5, help="seconds an idle keep-alive connection "
                    "stays open after a response (default 5)")
    ap.add_argument("--timeout-header", type=float, default=20, help="seconds a connection has to send a "
                    "complete request head, from opening or from its previous response (default 20); "
                    "slower ones are closed")
    ap.add_argument("--timeout-body", type=float, default=30, help="seconds a request has to send its body once "
                    "its head arrived (default 30); slower ones get 408 and are closed")
    ap.add_argument("--timeout-write", type=float, default=60, help="seconds a client may leave its answer "
                    "unread while the server waits to send more (default 60); then it is disconnected and its "
                    "request aborted, freeing what the answer held")
    ap.add_argument("--shutdown-timeout", type=float, default=30, help="seconds requests in flight may finish in "
                    "after SIGTERM (new ones get 503) before they are ended with an error (default 30)")
    ap.add_argument("--grammar-compile-timeout", type=float, default=10, help="seconds a structured-output "
                    "constraint may take to compile (then 400; default 10)")
    ap.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"], help="split chat "
                    "outputs' <think>...</think> into reasoning_content (deepseek_r1: the output starts inside the "
                    "think block; qwen3: only an output that opens one); a constraint (response_format, "
                    "structured_outputs, a forced or required tool) then applies to the answer after it; default: none")
    ap.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "qwen3_coder",
                    "pythonic"], help="the format of the model's tool calls (tool_choice auto); default: from "
                    "the chat template (Qwen3-Coder XML, Mistral [TOOL_CALLS], Llama-3.1 JSON, else Hermes)")
    ap.add_argument("--limit-concurrency", type=int, default=1024, help="open connections or requests in "
                    "flight beyond which new requests get 503 (default 1024)")
    ap.add_argument("--allowed-origins", default=None, help="origins browsers may call the API from (CORS): "
                    "comma-separated or a JSON list, '*' for any (default: none, no CORS headers)")
    ap.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH", help="LoRA adapters to serve "
                    "from the start (with --enable-lora): a request's `model` names one (PEFT adapter directories)")
    ap.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn's log level (default warning: no line per request)")
    args = ap.parse_args(argv)
    args.engine = EngineArgs.from_cli_args(args)
    check_args(args)
    return args


def check_args(args):
    args.engine.check({name: getattr(args, name) for name in ("max_waiting", "max_n", "max_request_bytes",
                                                               "limit_concurrency", "max_response_logprobs",
                                                               "response_store_bytes")})
    for name in ("timeout_keep_alive", "timeout_header", "timeout_body", "timeout_write", "grammar_compile_timeout"):
        v = getattr(args, name)
        if not v > 0 or v == float("inf"):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds; got {v}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise UsageError(f"--shutdown-timeout must be a number of seconds >= 0; got {args.shutdown_timeout}")
    args.allowed_origins = parse_origins(args.allowed_origins)
    args.lora_modules = parse_lora_modules(args.lora_modules, args.engine.enable_lora)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535]; got {args.port}")
    if args.api_key is not None and not args.api_key:
        raise UsageError("--api-key must not be empty")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"the server needs the `serve` extra (pip install -e '.[serve]'): {e}") from None


def parse_origins(value: str | None) -> list[str]:
    """--allowed-origins as a list: a JSON list (vLLM's form) or comma-separated origins."""
    if value is None:
        return []
    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError as e:
            raise UsageError(f"--allowed-origins: not a JSON list: {e}") from None
        if not (isinstance(origins, list) and all(isinstance(o, str) and o for o in origins)):
            raise UsageError(f"--allowed-origins must be a list of origin strings; got {value!r}")
    else:
        origins = [o.strip() for o in value.split(",") if o.strip()]
    if not origins:
        raise UsageError("--allowed-origins must name at least one origin (or '*')")
    return origins


def parse_lora_modules(values, enabled: bool) -> list[tuple[str, str]]:
    """[(name, path)] of --lora-modules NAME=PATH ... (UsageError for another form, a name given twice, or
    adapters without --enable-lora)."""
    if not values:
        return []
    if not enabled:
        raise UsageError("--lora-modules needs --enable-lora")
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--lora-modules takes NAME=PATH pairs; got {v!r}")
        if name in dict(out):
            raise UsageError(f"--lora-modules names {name!r} twice")
        out.append((name, path))
    return out


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one), so the port is known before serving."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def main(argv=None):
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        args = parse_args(argv)
        if args.coordinator is not None and args.process_id != 0:
            return follow(args)   # several processes: process 0 serves HTTP, this one follows its device calls
        sock = bind(args.host, args.port)  # fail on a busy port before loading anything
        join_processes(args.engine)
        return run(args, sock)
    except UsageError as e:
        print(f"jpa serve: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Stop):  # stopped while loading
        return 0


def run(args, sock):
    from jpa.server import ConstraintLimits, build_app, build_server, run_server

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = build_app(None, None, model_name=name, api_key=args.api_key, max_n=args.max_n,
                    max_request_bytes=args.max_request_bytes, allowed_origins=args.allowed_origins,
                    constraint_limits=ConstraintLimits(compile_timeout=args.grammar_compile_timeout),
                    reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                    max_response_logprobs=args.max_response_logprobs, response_store_bytes=args.response_store_bytes)
    server = build_server(app, log_level=args.log_level, timeout_keep_alive=args.timeout_keep_alive,
                          timeout_header=args.timeout_header, timeout_body=args.timeout_body,
                          timeout_write=args.timeout_write,
                          limit_concurrency=args.limit_concurrency, shutdown_timeout=args.shutdown_timeout)
    loader = _Loader(args, app, server)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    print(f"[jpa] serving {name!r} on http://{host}:{port} (OpenAI API at /v1; /health, /metrics); /health "
          f"answers 503 until the model is loaded{'; API key required' if args.api_key else ''}",
          file=sys.stderr, flush=True)
    thread = threading.Thread(target=loader.run, name="jpa-loader", daemon=True)
    try:
        thread.start()
        run_server(server, sock)  # until SIGINT/SIGTERM: drains (jpa.server.run), then re-raises the signal
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        loader.stop()
    if loader.error is not None:
        raise loader.error
    if thread.is_alive():
        # Stopped while the model loads: the loader is inside JAX (loading, compiling) and cannot be
        # interrupted, and finalizing the interpreter under it aborts the process. Nothing is held
        # yet (no engine thread was started), so leave at once.
        print("[jpa] server stopped (while loading the model)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    print("[jpa] server stopped", file=sys.stderr)
    return 0


def build_engine(args):
    """(LLMEngine, tokenizer) of the flags: the model (and a draft model) loaded and wired."""
    from jpa.llm import engine_from_args

    if args.engine.compile_cache:
        enable_compile_cache()
    return engine_from_args(args.engine)


def follow(args) -> int:
    """A process other than 0 of a multi-process server: the same engine, driven by process 0."""
    join_processes(args.engine)
    engine, _ = build_engine(args)
    ok = engine.follow()
    print(f"[jpa] process {args.process_id}: process 0 {'stopped' if ok else 'stopped on an error'}", file=sys.stderr)
    return 0 if ok else 1


class _Loader:
    """Loads the model, builds and warms up the engine and attaches it to the app, on a thread
    of its own while the server already answers (/health: 503, then 200 once attached). A failure
    stops the server; `run` then re-raises it on the main thread."""

    def __init__(self, args, app, server):
        self.args, self.app, self.server = args, app, server
        self.error: Exception | None = None
        self.aengine = None
        self.engine = None
        self._lock = threading.Lock()
        self._stopped = False

    def run(self):
        try:
            self._load()
        except Exception as e:
            self.error = e if isinstance(e, UsageError) else UsageError(f"loading failed: {type(e).__name__}: {e}")
            self.server.should_exit = True

    def _load(self):
        args = self.args
        from jpa.engine import AsyncEngine, SamplingParams
        from jpa.server import attach

        t0 = time.perf_counter()
        engine, tok = build_engine(args)
        self.engine = engine
        if args.lora_modules:
            from jpa.engine import LoRARequest

            for i, (name, path) in enumerate(args.lora_modules):
                try:
                    engine.load_lora(LoRARequest(name, i + 1, path))
                except ValueError as e:
                    raise UsageError(f"--lora-modules {name}={path}: {e}") from None
        if not args.no_warmup:  # compile the engine's program (the unified step) before the first client waits
            engine.generate(["Hello"], SamplingParams(max_new_tokens=2, greedy=True))
        with self._lock:
            if self._stopped:   # the server stopped while we loaded
                return
            self.aengine = AsyncEngine(engine, max_waiting=args.max_waiting).start()
            attach(self.app, self.aengine, tok)
        compiled = ("" if args.no_warmup else
                    f"; unified step compiled in {engine.runner.compile_seconds:.1f} s"
                    + {"persistent cache": " (from the persistent compilation cache)",
                       "process": " (an earlier engine's of this process)"}.get(engine.runner.step_source, ""))
        print(f"[jpa] model ready in {time.perf_counter() - t0:.1f} s{compiled}; KV cache: "
              f"{engine.cache_config.describe()}; max_model_len {engine.max_model_len}", file=sys.stderr, flush=True)
        print(f"[jpa] {engine.cache_report()}", file=sys.stderr, flush=True)

    def stop(self):
        with self._lock:
            self._stopped = True
            if self.aengine is not None:
                self.aengine.shutdown()
                self.engine.close()   # several processes: the others stop following


class _Stop(Exception):
    """SIGTERM, turned into an exception so the engine thread is shut down on the way out."""


def _on_sigterm(signum, frame):
    raise _Stop()

