"""The server's last line: an exception no route meant to raise becomes an OpenAI-shaped 500 and one log line.

Starlette's own catch-all (an ``Exception`` handler) answers, then raises the exception again, so uvicorn logs a
second traceback: every crash cost two. :class:`AnswerCrashes` sits inside the app's middleware instead and does
not raise again: the log gets ``<method> <path> failed: <type>: <message>`` (the traceback only at DEBUG), and a
client that disconnected while its body was read (Starlette's ``ClientDisconnect``) is an INFO line, not an error.

:func:`json_response` renders every error answer with ASCII escapes, so a message that quotes a request's text
can always be encoded.
"""

from __future__ import annotations

import json
import logging

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_bridge.json_types import JsonObject
from gym_bridge.serving.errors import error_body

logger = logging.getLogger("gym_bridge.serving.app")

_MAX_LOGGED_CHARS = 500
"""The most of an exception's message one log line carries."""


def json_response(body: JsonObject, status: int, headers: dict[str, str] | None = None) -> Response:
    """``body`` as a JSON response, non-ASCII characters escaped (a lone surrogate from a request stays encodable)."""
    return Response(json.dumps(body), status_code=status, media_type="application/json", headers=headers)


def one_line(exc: BaseException) -> str:
    """``<type>: <message>`` on one line, at most :data:`_MAX_LOGGED_CHARS` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= _MAX_LOGGED_CHARS else text[: _MAX_LOGGED_CHARS - 3] + "..."


class AnswerCrashes:
    """ASGI middleware: a route's unexpected exception is a 500 with the OpenAI error body and one log line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:
            logger.info("%s %s: the client disconnected before its request was read", scope["method"], scope["path"])
        except Exception as exc:
            logger.error("%s %s failed: %s", scope["method"], scope["path"], one_line(exc))
            logger.debug("the traceback of that failure", exc_info=exc)
            if not started:
                body = error_body(f"internal error: {one_line(exc)}", 500)
                await json_response(body, 500)(scope, receive, send)
