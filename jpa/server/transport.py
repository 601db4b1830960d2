"""The HTTP server under the app: uvicorn with the limits a public endpoint needs.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but
it has no timeout for the request itself: a connection that never sends a request, or sends its
headers a byte at a time (slowloris), stays open for ever and holds a file descriptor. The
protocol here adds one: a connection must deliver a complete request head within
`timeout_header` seconds of opening (or of its previous response), else it is closed; and a
request's body must arrive within `timeout_body` seconds of its head, else the client gets 408
(an OpenAI error object) and the connection is closed, so a client that sends a head and then
trickles its body, or stops, never holds a connection slot for long.

A client that stops reading its answer (the socket's send buffer stays full) for `timeout_write`
seconds is disconnected: the request is aborted and the answer it held is freed, so a client that
never reads cannot keep a big answer in memory.

With `limit_concurrency`, a request that arrives while that many connections or requests are open
is answered 503 with an OpenAI error object (uvicorn's own answer is plain text) and Retry-After,
except GET /health: it is always served (a reserved slot: it costs nothing and reads no body), so
an orchestrator probing a busy server sees it up, not dead.
"""

import asyncio
import json

import h11
from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_TIMEOUT_KEEP_ALIVE = 5      # seconds (uvicorn's and vLLM's default)
DEFAULT_TIMEOUT_HEADER = 20         # seconds to deliver a request head (nginx 60, Apache 20-40)
DEFAULT_TIMEOUT_BODY = 30           # seconds to deliver a request body once its head arrived
DEFAULT_TIMEOUT_WRITE = 60          # seconds a client may leave the send buffer full (not reading)
DEFAULT_LIMIT_CONCURRENCY = 1024    # open connections + requests in flight, then 503
_OVERLOADED = json.dumps({"error": {"message": "too many open connections or requests; try again shortly",
                                     "type": "server_error", "param": None, "code": "overloaded"}}).encode()
_ALWAYS_SERVED = frozenset({"/health"})   # served past limit_concurrency
_BODY_TIMEOUT = json.dumps({"error": {"message": "the request body did not arrive in time", "type":
                                      "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections that do not deliver a request head, or a
    request's body, in time."""

    timeout_header: float = DEFAULT_TIMEOUT_HEADER
    timeout_body: float = DEFAULT_TIMEOUT_BODY
    timeout_write: float = DEFAULT_TIMEOUT_WRITE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The limit is checked by _limited (JSON answer, /health exempt), not by uvicorn (plain text).
        self._limit, self.limit_concurrency = self.limit_concurrency, None
        if self._limit is not None:
            self._app, self.app = self.app, self._limited

    async def _limited(self, scope, receive, send) -> None:
        # This request's own task is in self.tasks already (uvicorn counted before adding it).
        if scope["type"] == "http" and scope["path"] not in _ALWAYS_SERVED and (
                len(self.connections) >= self._limit or len(self.tasks) > self._limit):
            self.logger.warning("Exceeded concurrency limit.")
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(_OVERLOADED)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": _OVERLOADED, "more_body": False})
            return
        await self._app(scope, receive, send)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.timeout_write, self._on_write_timeout)

    def resume_writing(self) -> None:
        self._disarm_write()
        super().resume_writing()

    def _disarm_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _on_write_timeout(self) -> None:
        # The buffer never drained: the client is not reading. abort(), not close(): close() would wait
        # for the buffer to drain. connection_lost then tells the app the client is gone.
        self._write_timer = None
        self.logger.info("closing a connection whose client did not read its answer for %g s", self.timeout_write)
        self.transport.abort()

    def connection_made(self, transport) -> None:
        self._write_timer: asyncio.TimerHandle | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_cycle = None
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
        self._check_body()

    def _check_body(self) -> None:
        """Arms the body timer when a request's head has arrived and its body has not (once per
        request: trickling bytes does not re-arm it); disarms it once the body is complete."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.disconnected:
            if self._body_cycle is not cycle:
                self._disarm_body()
                self._body_cycle = cycle
                self._body_timer = self.loop.call_later(self.timeout_body, self._on_body_timeout)
        elif self._body_timer is not None:
            self._disarm_body()

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or cycle is not self._body_cycle or not cycle.more_body or self.transport.is_closing():
            return
        if not cycle.response_started:   # 408 with an error object, then close
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(_BODY_TIMEOUT)).encode())])))
                self.transport.write(self.conn.send(h11.Data(data=_BODY_TIMEOUT)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
            cycle.response_started = cycle.response_complete = True
        # The app (waiting for the body) is told the client is gone; its answer goes nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

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
        self._disarm_write()
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)


def server_config(app, *, timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE,
                  timeout_header: float = DEFAULT_TIMEOUT_HEADER, timeout_body: float = DEFAULT_TIMEOUT_BODY,
                  timeout_write: float = DEFAULT_TIMEOUT_WRITE, limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY, log_level: str = "warning",
                  timeout_graceful_shutdown: int | None = 5) -> Config:
    """A uvicorn Config serving `app` with the limits above (run it with `uvicorn.Server(config)`).

    Args:
      timeout_keep_alive: seconds an idle keep-alive connection stays open after a response.
      timeout_header: seconds a connection has to deliver a complete request head.
      timeout_body: seconds a request has to deliver its body once its head arrived (then 408 and
        the connection is closed).
      timeout_write: seconds a client may not read while its answer waits to be sent (then it is
        disconnected and its request aborted).
      limit_concurrency: open connections or requests in flight beyond which a request is answered
        503 (an OpenAI error object; GET /health is always served; None: no limit).
    """
    for name, v in (("timeout_keep_alive", timeout_keep_alive), ("timeout_header", timeout_header),
                    ("timeout_body", timeout_body), ("timeout_write", timeout_write)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0 seconds; got {v!r}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"limit_concurrency must be >= 1 or None; got {limit_concurrency!r}")
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"timeout_header": float(timeout_header),
                                                                         "timeout_body": float(timeout_body),
                                                                         "timeout_write": float(timeout_write)})
    return Config(app, http=protocol, timeout_keep_alive=timeout_keep_alive, limit_concurrency=limit_concurrency,
                  log_level=log_level, timeout_graceful_shutdown=timeout_graceful_shutdown)
