"""How the server runs under uvicorn: its limits (`jpa.server.transport`) and a graceful shutdown.

uvicorn's own shutdown (SIGTERM/SIGINT) closes the listener, waits `timeout_graceful_shutdown`
seconds (5 by default) and then cancels the handlers: a non-streamed request got a text/plain
`500 Internal Server Error`, a stream was cut without an error event or `[DONE]`. `DrainingServer`
shuts down in three phases instead:

1. drain: the app stops admitting (`draining`: every new request, /health included, is answered 503
   with Retry-After and `Connection: close`; the listener stays open so clients get that answer
   rather than a refused connection) while the requests in flight go on, for up to
   `shutdown_timeout` seconds or until none is left;
2. end: the engine is shut down, which ends each request still running: a non-streamed one is
   answered 503 with an OpenAI error object ("the server is shutting down"), a stream gets a final
   error event and `data: [DONE]`; their handlers get a few seconds to send that;
3. uvicorn's own shutdown: listener and connections closed.

`build_server(app, ...)` makes the uvicorn Server; `run_server(server, sock)` runs it on a bound
socket until a signal (uvicorn re-raises the signal afterwards, as usual).
"""

import asyncio
import logging
import threading
import time

import uvicorn

from jpa.server.transport import (DEFAULT_LIMIT_CONCURRENCY, DEFAULT_TIMEOUT_BODY, DEFAULT_TIMEOUT_HEADER,
                                  DEFAULT_TIMEOUT_KEEP_ALIVE, DEFAULT_TIMEOUT_WRITE, server_config)

log = logging.getLogger("jpa.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0     # seconds in-flight requests may take to finish after SIGTERM
_END_GRACE = 10.0                   # seconds their handlers get to send the final error, after the drain


class DrainingServer(uvicorn.Server):
    """uvicorn.Server with the three-phase shutdown of the module doc (the app: `build_app`'s)."""

    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT

    def _api(self):
        app = self.config.app
        seen = set()
        while app is not None and id(app) not in seen:   # through middleware wrappers to the FastAPI app
            seen.add(id(app))
            state = getattr(app, "state", None)
            api = getattr(state, "jpa", None) if state is not None else None
            if api is not None:
                return api
            app = getattr(app, "app", None)
        return None

    def _busy(self) -> int:
        return len(self.server_state.tasks)

    async def shutdown(self, sockets=None) -> None:
        api = self._api()
        if api is not None and not self.force_exit:
            api.draining = True
            t0 = time.monotonic()
            if self._busy():
                log.warning("shutting down: draining %d request(s) for up to %g s", self._busy(),
                            self.shutdown_timeout)
            while self._busy() and time.monotonic() - t0 < self.shutdown_timeout and not self.force_exit:
                await asyncio.sleep(0.05)
            engine = api.engine
            if engine is not None:
                left = self._busy()
                if left:
                    log.warning("shutting down: ending %d request(s) still running after %g s", left,
                                self.shutdown_timeout)
                # The engine ends what still runs ("the server is shutting down"); join off the loop.
                await asyncio.to_thread(engine.shutdown)
                t1 = time.monotonic()
                while self._busy() and time.monotonic() - t1 < _END_GRACE and not self.force_exit:
                    await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def build_server(app, *, log_level: str = "warning", timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
                 timeout_header: float = DEFAULT_TIMEOUT_HEADER, timeout_body: float = DEFAULT_TIMEOUT_BODY,
                 timeout_write: float = DEFAULT_TIMEOUT_WRITE, limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> DrainingServer:
    """The uvicorn server for `app` (from `build_app`) with jpa's limits and graceful shutdown.

    Args:
      timeout_keep_alive / timeout_header / timeout_body / timeout_write / limit_concurrency: see
        `jpa.server.transport.server_config`.
      shutdown_timeout: seconds requests in flight may run on after SIGTERM/SIGINT before they are
        ended with an error (new requests get 503 meanwhile).
    """
    if not (isinstance(shutdown_timeout, (int, float)) and 0 <= shutdown_timeout < float("inf")):
        raise ValueError(f"shutdown_timeout must be a number of seconds >= 0; got {shutdown_timeout!r}")
    # uvicorn's own grace (phase 3) only has connections left to close by then.
    config = server_config(app, log_level=log_level, timeout_keep_alive=timeout_keep_alive,
                           timeout_header=timeout_header, timeout_body=timeout_body, timeout_write=timeout_write,
                           limit_concurrency=limit_concurrency, timeout_graceful_shutdown=5)
    server = DrainingServer(config)
    server.shutdown_timeout = float(shutdown_timeout)
    return server


def run_server(server: uvicorn.Server, sock) -> None:
    """Serves on the bound, listening socket until SIGINT/SIGTERM (then drains, see the module doc)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_server must run on the main thread (it handles the signals)")
    server.run(sockets=[sock])
