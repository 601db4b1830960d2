"""The HTTP server under the app: uvicorn with the limits a public endpoint needs.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but
it has no timeout for the request itself: a connection that never sends a request, or sends its
headers a byte at a time (slowloris), stays open for ever and holds a file descriptor. The
protocol here adds one: a connection must deliver a complete request head within
`timeout_header` seconds of opening (or of its previous response), else it is closed. With
`limit_concurrency`, uvicorn answers 503 once that many connections or requests are open.
"""

import asyncio

from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_TIMEOUT_KEEP_ALIVE = 5      # seconds (uvicorn's and vLLM's default)
DEFAULT_TIMEOUT_HEADER = 20         # seconds to deliver a request head (nginx 60, Apache 20-40)
DEFAULT_LIMIT_CONCURRENCY = 1024    # open connections + requests in flight, then 503


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections that do not deliver a request head in time."""

    timeout_header: float = DEFAULT_TIMEOUT_HEADER

    def connection_made(self, transport) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._waiting_cycle = self.cycle   # a new request head replaces self.cycle
        self._header_timer = self.loop.call_later(self.timeout_header, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _check_head(self) -> None:
        if self._header_timer is not None and self.cycle is not self._waiting_cycle:
            self._disarm()

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_head()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()              # the next request head has timeout_header seconds too
        super().on_response_complete()   # may start a pipelined request at once
        self._check_head()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def server_config(app, *, timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
                  timeout_header: float = DEFAULT_TIMEOUT_HEADER,
                  limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY, log_level: str = "warning",
                  timeout_graceful_shutdown: int | None = 5) -> Config:
    """A uvicorn Config serving `app` with the limits above (run it with `uvicorn.Server(config)`).

    Args:
      timeout_keep_alive: seconds an idle keep-alive connection stays open after a response.
      timeout_header: seconds a connection has to deliver a complete request head.
      limit_concurrency: open connections or requests in flight beyond which uvicorn answers 503
        (None: no limit).
    """
    for name, v in (("timeout_keep_alive", timeout_keep_alive), ("timeout_header", timeout_header)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0 seconds; got {v!r}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"limit_concurrency must be >= 1 or None; got {limit_concurrency!r}")
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"timeout_header": float(timeout_header)})
    return Config(app, http=protocol, timeout_keep_alive=timeout_keep_alive, limit_concurrency=limit_concurrency,
                  log_level=log_level, timeout_graceful_shutdown=timeout_graceful_shutdown)
