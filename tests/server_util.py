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
