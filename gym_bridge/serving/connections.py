"""Connections that stall, flood or send too much: bounded at the HTTP protocol, below the app.

uvicorn times out only an idle connection after a complete response (``timeout_keep_alive``). A client that
opens a connection and sends nothing, or half of a request's headers, would hold it (and a file descriptor) for
ever, and enough of them use up the process's descriptors: asyncio then logs a traceback for every failed
``accept``. Four guards, each cheap:

- :func:`guarded_protocol` is uvicorn's h11 protocol with a deadline and a size bound on every request's head: a
  connection that opened, or began its next request (kept alive or pipelined behind an answer), must finish the
  request's headers within ``header_timeout_s`` or it is closed (a half-sent body is the app's ``body_timeout_s``,
  :mod:`~gym_bridge.serving.bodies`); a head past ``max_header_bytes`` is a 431 and the connection is closed,
  having held at most the bound plus one socket read (256 KiB) of it. h11, not httptools, whichever is installed:
  httptools' parser (llhttp) has no bound on a head and uvicorn's httptools protocol appends the URL and header
  values as they come, so a 256 MB header would be buffered whole; h11 keeps at most ``max_incomplete_event_size``
  of an incomplete head and says 431.
- Beyond ``max_connections`` open ones, a new connection is closed as soon as it is accepted (one warning line per
  ``WARN_EVERY_S``).
- :func:`raise_open_file_limit` lifts the soft limit on open files to the hard one (at most 65,536), as vLLM's
  server does at start.
- :class:`AcceptErrorFilter` turns asyncio's "socket.accept() out of system resource" tracebacks (should the
  descriptors run out all the same: a burst is accepted before any connection can be closed) into one line per
  ``WARN_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gym_bridge.boundary.json_io import dumps
from gym_bridge.serving.errors import error_body

logger = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
"""At most one warning about refused connections per this many seconds."""
OPEN_FILES_TARGET = 65536
"""The soft limit on open files :func:`raise_open_file_limit` asks for (vLLM's ``set_ulimit`` asks the same)."""


def default_max_connections() -> int:
    """Three quarters of the open-file limit: the rest stays for the model's files, Ray, Gym and logs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = OPEN_FILES_TARGET
    return max(16, soft * 3 // 4)


def raise_open_file_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Lift the soft limit on open files towards ``target`` (never above the hard limit); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            logger.info("could not raise the open-file limit from %d to %d: %s", soft, wanted, exc)
            return soft
        return wanted
    return soft


class _RefusalLog:
    """Counts connections refused for being over the limit and says so at most once per :data:`WARN_EVERY_S`."""

    def __init__(self) -> None:
        self.refused = 0
        self._unreported = 0
        self._last = -WARN_EVERY_S

    def note(self, open_now: int, limit: int) -> None:
        self.refused += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last >= WARN_EVERY_S:
            logger.warning(
                "%d connection(s) closed on arrival: %d are open and the limit is %d", self._unreported, open_now, limit
            )
            self._last, self._unreported = now, 0


class _BoundedHeadConnection(h11.Connection):
    """h11's server side of a connection with a bound on every request's head, keeping the status its last
    protocol error suggests (431: a head past the bound), which uvicorn's protocol would answer as a plain 400.

    h11 bounds a head still incomplete (``max_incomplete_event_size``); one that arrives whole in a single read
    is measured here, so the bound holds however the bytes were split."""

    refused_status = 400

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _head_size(event) > self.max_head_bytes:
                raise h11.RemoteProtocolError("request head too long", error_status_hint=431)
        except h11.RemoteProtocolError as exc:
            self.refused_status = exc.error_status_hint
            raise
        return event


def _head_size(request: h11.Request) -> int:
    """The size of ``request``'s head on the wire as h11 read it (spaces around values and folds not counted)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + len(b": \r\n") for name, value in request.headers) + len(b"\r\n")


def _refuse_large_head(transport: asyncio.Transport, conn: h11.Connection, body: bytes) -> None:
    """Answer 431 with ``body`` (a JSON error) on ``conn`` and close: the head h11 read is past the bound."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    response = h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large")
    for event in (response, h11.Data(data=body), h11.EndOfMessage()):
        transport.write(conn.send(event) or b"")
    transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int, max_header_bytes: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline and a size bound on every request's head, and a connection cap.

    The deadline is armed when a connection opens, when bytes arrive while no request is being served, and when a
    response completes with part of the next request's head already received (pipelined, or sent while the answer
    was being made); it is disarmed once uvicorn starts the request (its ``cycle``), i.e. once the head is complete.
    An idle kept-alive connection (nothing of a next request yet) stays under uvicorn's ``timeout_keep_alive``."""
    refusals = _RefusalLog()
    too_large = dumps(error_body(f"the request's headers exceed {max_header_bytes} bytes", 431))

    class GuardedProtocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head = _BoundedHeadConnection(max_header_bytes)
            self.conn = self._head

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]  # uvicorn's asks for a Transport
            if len(self.connections) > max_connections:
                refusals.note(len(self.connections), max_connections)
                self.transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._awaiting_request():
                self._disarm()
            elif self._header_deadline is None:
                self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._next_head_begun():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's 400 for a request h11 refused, or a 431 when it refused a head past the bound."""
            if self._head.refused_status != 431:
                super().send_400_response(msg)
                return
            _refuse_large_head(self.transport, self.conn, too_large)

        def _awaiting_request(self) -> bool:
            """No request is being served: bytes now are (part of) the next request's headers."""
            cycle = self.cycle
            return cycle is None or bool(cycle.response_complete)

        def _next_head_begun(self) -> bool:
            """Part of the next request's head is here and no more is being served: h11 holds bytes it could not
            make a request of yet."""
            if self.transport.is_closing() or not self._awaiting_request() or self.conn.their_state is not h11.IDLE:
                return False
            return bool(self.conn.trailing_data[0])

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = asyncio.get_running_loop().call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            self._header_deadline = None
            if self._awaiting_request() and not self.transport.is_closing():
                logger.debug("a connection sent no complete request headers within %g s; closed", header_timeout_s)
                self.transport.close()

    return GuardedProtocol


class AcceptErrorFilter(logging.Filter):
    """asyncio's "socket.accept() out of system resource" records as one line (the error, no traceback), at most
    one per :data:`WARN_EVERY_S`: asyncio retries the accept by itself a second later, and (CPython 3.13) logs the
    failure once for every connection still waiting in the backlog, thousands of times in one loop turn."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -WARN_EVERY_S
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self._last < WARN_EVERY_S:
            self._held += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        held = f" ({self._held} more in the last {WARN_EVERY_S:g} s)" if self._held else ""
        record.msg, record.args = "%s: %s%s", (message.splitlines()[0], error, held)
        record.exc_info, record.exc_text = None, None
        self._last, self._held = now, 0
        return True


ACCEPT_ERROR_FILTER = AcceptErrorFilter()
"""One filter for the process (``addFilter`` adds an instance once), so its window is the process's."""
