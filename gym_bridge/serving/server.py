"""``OpenAIServer``: start and stop the OpenAI-compatible server over a generation engine.

The listening socket is bound before uvicorn starts, so the URL (and port, with
``port=0``) is known at once and there is no rebind gap. Either run it on the
caller's event loop (``await start()`` / ``await stop()``, or ``async with``) or on
a private thread with its own loop (``start_in_thread()`` / ``stop_thread()``),
which suits tests, scripts and Ray actors.

Stalled and flooding clients are bounded (:class:`~gym_bridge.serving.state.ServerLimits`): every request's headers
must arrive within ``header_timeout_s`` (pipelined ones too) and hold at most ``max_header_bytes`` (else a 431), a
body must arrive within ``body_timeout_s``, and connections beyond ``max_connections`` are closed on arrival
(:mod:`~gym_bridge.serving.connections`, which also says why the HTTP parser is always h11).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import TYPE_CHECKING

import uvicorn
from pydantic import SecretStr

from gym_bridge.failures import GymBridgeError
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonMapping
from gym_bridge.models.vocab import vocab_size_of
from gym_bridge.serving.app import build_app
from gym_bridge.serving.auth import ApiKeyMiddleware, open_port_warning
from gym_bridge.serving.connections import (
    ACCEPT_ERROR_FILTER,
    default_max_connections,
    guarded_protocol,
    raise_open_file_limit,
)
from gym_bridge.serving.engine import EngineProfile
from gym_bridge.serving.listen import listening_socket
from gym_bridge.serving.state import ServerFeatures, ServerLimits, ServingState
from gym_bridge.types import Tokenizer

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger(__name__)


class ServerStateError(GymBridgeError, RuntimeError):
    """The server was used out of order: its URL asked for before :meth:`OpenAIServer.start`, or started twice."""


class ServerStartError(GymBridgeError, RuntimeError):
    """uvicorn stopped during start-up without raising (its log says why)."""


class _AccessFilter(logging.Filter):
    """Drop access-log lines of successful requests (as NeMo-RL's server does); in the others the query string
    is redacted, so a key sent as ``?api_key=...`` is never written to a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 5):
            return True
        if isinstance(args[4], int) and 200 <= args[4] < 300:
            return False
        if isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def redact_query(path: str) -> str:
    """``path`` with its query string replaced by ``<redacted>``: a key may be a value or a bare name there."""
    base, sep, _ = path.partition("?")
    return base + "?<redacted>" if sep else path


_ACCESS_FILTER = _AccessFilter()
"""One filter for every server of the process (``addFilter`` adds an instance once)."""


class OpenAIServer:
    """An OpenAI-compatible HTTP server (vLLM dialect) over ``generation`` + ``tokenizer``."""

    def __init__(
        self,
        generation: GenerationInterface,
        tokenizer: Tokenizer,
        served_model_name: str = "tiny",
        host: str = "127.0.0.1",
        port: int = 0,
        reasoning_parser: bool = False,
        *,
        model_path: str | None = None,
        max_model_len: int | None = None,
        limits: ServerLimits | None = None,
        stop_timeout_s: float = 10.0,
        token_id_correction: bool = True,
        features: ServerFeatures | None = None,
        api_key: SecretStr | str | None = None,
        sock: socket.socket | None = None,
        default_chat_template_kwargs: JsonMapping | None = None,
    ) -> None:
        """``token_id_correction=False`` ignores carried token ids and re-tokenises the history,
        as stock vLLM does (drift is still measured: ``/metrics``); ``features`` turns off what a
        misconfigured vLLM lacks (tools, logprobs, token ids). ``api_key`` (None or empty: none)
        is required as a ``Bearer`` token on ``/v1/*``, as vLLM's ``--api-key`` is
        (:class:`~gym_bridge.serving.auth.ApiKeyMiddleware`). ``sock``: a socket from :func:`listening_socket` on
        ``host``, bound before the engine was built (a busy port fails at once), served on instead of binding.
        ``default_chat_template_kwargs``: every chat renders with them, a request's own over them (vLLM's setting)."""
        if isinstance(api_key, str):
            api_key = SecretStr(api_key)
        self.api_key = api_key if api_key is not None and api_key.get_secret_value() else None
        self.host = host
        self.port = port
        self.stop_timeout_s = stop_timeout_s
        self.state = ServingState(
            generation=generation,
            tokenizer=tokenizer,
            served_model_name=served_model_name,
            model_path=model_path or str(getattr(tokenizer, "name_or_path", "") or served_model_name),
            reasoning_parser=reasoning_parser,
            profile=EngineProfile.of(generation, tokenizer, max_model_len),
            limits=limits or ServerLimits(),
            vocab_size=int(getattr(generation, "vocab_size", None) or vocab_size_of(tokenizer)),
            token_id_correction=token_id_correction,
            features=features or ServerFeatures(),
            default_chat_template_kwargs=dict(default_chat_template_kwargs or {}),
        )
        self.fastapi = build_app(self.state)
        self.app: ASGIApp = self.fastapi if self.api_key is None else ApiKeyMiddleware(self.fastapi, self.api_key)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self._bound = sock
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self.base_url: str | None = None

    @property
    def root_url(self) -> str:
        """The URL without ``/v1`` (where ``/tokenize`` lives)."""
        if self.base_url is None:
            raise ServerStateError("the server is not started: call start() or start_in_thread() first")
        return self.base_url.removesuffix("/v1")

    async def start(self) -> str:
        """Bind (unless built with ``sock``), start serving on the running loop, and return the base URL
        (``http://host:port/v1``)."""
        if self._task is not None:
            raise ServerStateError("the server is already started")
        sock = self._bound if self._bound is not None else listening_socket(self.host, self.port)
        self._bound = None
        self._sock = sock
        port = sock.getsockname()[1]
        raise_open_file_limit()
        limits = self.state.limits
        protocol = guarded_protocol(
            limits.header_timeout_s, limits.max_connections or default_max_connections(), limits.max_header_bytes
        )
        config = uvicorn.Config(
            self.app, http=protocol, log_config=None, timeout_keep_alive=120, lifespan="off", access_log=True
        )
        logging.getLogger("uvicorn.access").addFilter(_ACCESS_FILTER)
        logging.getLogger("asyncio").addFilter(ACCEPT_ERROR_FILTER)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="openai-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up failure
                raise ServerStartError("the server exited during start-up")
            await asyncio.sleep(0.01)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{host}:{port}/v1"
        warning = open_port_warning(self.host, port, self.api_key)
        if warning is not None:
            logger.warning(warning)
        logger.info("OpenAI-compatible server for %r listening on %s", self.state.served_model_name, self.base_url)
        return self.base_url

    async def stop(self) -> None:
        """Stop serving; waits at most ``stop_timeout_s`` for open requests, then cancels."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.stop_timeout_s)
        except TimeoutError:
            logger.warning("server did not stop within %.1f s; forcing it", self.stop_timeout_s)
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(BaseException):  # we are shutting down; nothing to hand back
                await asyncio.wait_for(self._task, 2.0)
        finally:
            if self._sock is not None:
                self._sock.close()
            self._server = self._task = self._sock = None
            logger.info("OpenAI-compatible server stopped")

    async def __aenter__(self) -> OpenAIServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ thread variant

    def start_in_thread(self, timeout_s: float = 30.0) -> str:
        """Serve on a daemon thread with its own event loop; return the base URL."""
        if self._thread is not None:
            raise ServerStateError("the server is already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._thread_loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # handed to the starting thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_until_complete(self._task_done())
            loop.close()

        self._thread = threading.Thread(target=run, name="openai-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"the server did not start within {timeout_s} s")
        if failure:
            self._thread = None
            raise failure[0]
        assert self.base_url is not None
        return self.base_url

    async def _task_done(self) -> None:
        if self._task is not None:
            with contextlib.suppress(BaseException):  # stop() handles and logs
                await asyncio.shield(self._task)
        while self._server is not None:  # stop() is still tidying up on this loop
            await asyncio.sleep(0.01)

    def stop_thread(self) -> None:
        """Stop a server started with :meth:`start_in_thread` (bounded wait)."""
        thread, loop = self._thread, self._thread_loop
        if thread is None or loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self.stop(), loop)
        try:
            future.result(self.stop_timeout_s + 5.0)
        finally:
            thread.join(self.stop_timeout_s + 5.0)
            self._thread = self._thread_loop = None
