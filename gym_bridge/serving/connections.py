"""Connections that stall or flood: bounded at the HTTP protocol, below the app.

uvicorn times out only an idle connection after a complete response (``timeout_keep_alive``). A client that
opens a connection and sends nothing, or half of a request's headers, would hold it (and a file descriptor) for
ever, and enough of them use up the process's descriptors: asyncio then logs a traceback for every failed
``accept``. Three guards, each cheap:

- :func:`guarded_protocol` wraps uvicorn's HTTP protocol: a connection that opened, or began its next request,
  must finish the request's headers within ``header_timeout_s`` or it is closed (a half-sent body is the app's
  ``body_timeout_s``, :mod:`~gym_bridge.serving.bodies`); beyond ``max_connections`` open ones, a new connection
  is closed as soon as it is accepted (one warning line per ``WARN_EVERY_S``).
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


def guarded_protocol(base: type[Any], header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``base`` (h11 or httptools) with a deadline on request headers and a connection cap.

    The deadline is armed when a connection opens and when bytes arrive while no request is being served (the
    next request's start); it is disarmed once uvicorn starts the request (its ``cycle``), i.e. once the headers
    are complete. It relies only on uvicorn's ``connections``, ``transport`` and ``cycle`` attributes, which both
    of its HTTP/1.1 protocols have."""
    refusals = _RefusalLog()

    class GuardedProtocol(base):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
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

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_request(self) -> bool:
            """No request is being served: bytes now are (part of) the next request's headers."""
            cycle = self.cycle
            return cycle is None or bool(cycle.response_complete)

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

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
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
