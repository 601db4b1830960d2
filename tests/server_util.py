"""Serving an app on a free loopback port in a thread (the server tests' harness)."""

import contextlib
import socket
import threading
import time

import uvicorn

from jpa.server import server_config


@contextlib.contextmanager
def serving(app, **config):
    """Serves `app` on a free 127.0.0.1 port in a thread (uvicorn configured as `jpa serve`
    does, `config` overriding); yields its base URL; always stops it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = uvicorn.Server(server_config(app, **{"log_level": "error", **config}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        while not server.started:
            assert thread.is_alive() and time.monotonic() - t0 < 30, "server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "the server thread did not stop"


@contextlib.contextmanager
def tiny_engine(*, max_seqs=4, num_pages=300, max_model_len=1024, max_waiting=16):
    """The server tests' engine: tiny-llama (seed 1) in a running AsyncEngine; yields (aengine, tokenizer)."""
    from jpa import models
    from jpa.engine import AsyncEngine, EngineConfig, LLMEngine

    model, tok = models.load("tiny-llama", seed=1)
    eng = LLMEngine(models.GPTForEngine(model), tok, EngineConfig(max_seqs=max_seqs, page_size=16, num_pages=num_pages,
                                                                  steps_per_call=4, max_model_len=max_model_len))
    with AsyncEngine(eng, max_waiting=max_waiting) as aengine:
        yield aengine, tok


@contextlib.contextmanager
def tiny_server(*, engine: dict | None = None, **app_options):
    """`tiny_engine` behind `build_app(..., model_name="tiny", **app_options)` on a loopback port; yields
    (url, aengine, tokenizer)."""
    from jpa.server import build_app

    with tiny_engine(**(engine or {})) as (aengine, tok):
        with serving(build_app(aengine, tok, **{"model_name": "tiny", **app_options})) as url:
            yield url, aengine, tok
