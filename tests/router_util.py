"""vllm-router in the tests: skip without it, start it (alone or under `jpa serve-dp`), always stop it.

The start/wait/stop code itself is `jpa serve-dp`'s (jpa/cli/serve_dp.py) (the tests drive what users run).
"""

import contextlib
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).parents[1]
from jpa.cli import serve_dp


def require_router():
    """Skips the calling test when vllm-router cannot be imported."""
    pytest.importorskip("vllm_router", reason="vllm-router is not installed: the `router` extra "
                                              "(pip install -e '.[router]'; ./run setup installs it)")


@contextlib.contextmanager
def router(worker_urls: list[str], *, policy: str = "round_robin", extra=()):
    """vllm-router in front of `worker_urls` on a free loopback port; yields its URL; always stops it."""
    require_router()
    port = serve_dp.free_port()
    with tempfile.TemporaryFile("w+") as log:   # a file, not a pipe: a full pipe would block the router
        proc = subprocess.Popen(serve_dp.router_command(worker_urls, host="127.0.0.1", port=port, policy=policy,
                                                        extra=extra),
                                env=serve_dp.router_env(), stdout=log, stderr=subprocess.STDOUT, text=True)

        def check():
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"the router exited with code {proc.returncode}: {log.read()[-1000:]}")

        try:
            serve_dp.wait_healthy(f"http://127.0.0.1:{port}", timeout=60, check=check, what="the router")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve_dp.stop([proc], grace=15)


@contextlib.contextmanager
def serve_dp_running(argv: list[str], *, log_path, env=None, timeout: float = 120):
    """`jpa serve-dp` with `argv` (its own process group, output in log_path); yields (process,
    router URL, replica URLs) once the router is up; always stops the whole group."""
    require_router()
    proc = serve_dp.start(argv, log_path=str(log_path), env=env)
    try:
        router_url, replicas = serve_dp.wait_started(proc, str(log_path), timeout)
        yield proc, router_url, replicas
    finally:
        serve_dp.stop_group(proc)
