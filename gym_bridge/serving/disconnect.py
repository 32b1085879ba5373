"""A request whose client goes away is cancelled, and with it the engine's rows for it.

uvicorn does not cancel a handler when its client disconnects: a generation would run to its end for nobody,
taking a place in the engine's batch. NeMo-Gym 0.7 wraps every one of its servers in the same rule
(``nemo_gym.server_utils.ClientDisconnectCancellationMiddleware``), so a caller that gives up on a row (a
``/run`` deadline) cancels the agent, its model server's call, and, through this middleware, the generation
here: :meth:`~gym_bridge.generation.hf.HFGeneration.generate_async` withdraws the rows of a cancelled request.

:class:`CancelOnDisconnect` is the only reader of the server's ``receive`` channel: it hands the request's
messages to the app and, on ``http.disconnect`` before the answer was sent in full, cancels the app's task.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class CancelOnDisconnect:
    """ASGI middleware: an HTTP request is cancelled when its client disconnects before the answer is complete."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.cancelled = 0
        """Requests cancelled because their client went away."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        answered = asyncio.Event()

        async def app_receive() -> Message:
            return await inbox.get()

        async def app_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered.set()

        async def listen() -> None:
            while True:
                message = await receive()
                await inbox.put(message)
                if message["type"] == "http.disconnect":
                    return

        handler = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        listener = asyncio.ensure_future(listen())
        cancelled_here = False
        try:
            await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done() and not answered.is_set():
                handler.cancel()
                cancelled_here = True
                self.cancelled += 1
                logger.info("%s %s: the client disconnected; request cancelled", scope["method"], scope["path"])
            try:
                await handler
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not cancelled_here or (current is not None and current.cancelling()):
                    raise
        finally:
            for task in (handler, listener):
                task.cancel()
            await asyncio.gather(handler, listener, return_exceptions=True)
