"""``gym-bridge serve``: one engine (or a token-faithful proxy) behind our OpenAI server until SIGINT or SIGTERM.

The port is claimed before a model or upstream is loaded, so a busy port is one line at once; the engine is built by
:func:`~gym_bridge.recipes.engine_server.build_engine_server`, the proxy by :func:`~gym_bridge.serving.build_proxy`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gym_bridge.generation.factory import EngineSpec
from gym_bridge.recipes.engine_server import ServeOptions, build_engine_server

if TYPE_CHECKING:
    from pydantic import SecretStr

    from gym_bridge.serving.server import OpenAIServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    """What ``gym-bridge serve`` serves and where (its options, one field each)."""

    model: str = "tiny"
    policy: Literal["hf", "scripted", "instant"] = "hf"
    answer_tokens: int = 16
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    reasoning_parser: bool = False
    upstream: list[str] | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    upstream_api_key_env: str = "OPENAI_API_KEY"


def serve(settings: ServeSettings) -> int:
    """Serve until SIGINT or SIGTERM, then stop the server and the engine; returns the exit code (0).

    Raises:
        ServerBindError: the port is taken or cannot be bound (before anything loads).
        SettingError: the model, the API key or an upstream is refused.
    """
    from gym_bridge.serving.auth import inbound_api_key
    from gym_bridge.serving.listen import listening_socket

    api_key = inbound_api_key(settings.api_key)
    sock = listening_socket(settings.host, settings.port)  # a busy port fails here, before a model or upstream loads
    try:
        if settings.upstream:
            server = _proxy_server(settings, api_key, sock)
            what = "a token-faithful proxy for " + ", ".join(settings.upstream)
        else:
            server = _local_server(settings, api_key, sock)
            what = settings.model
    except BaseException:
        sock.close()
        raise
    try:
        asyncio.run(_serve_until_signalled(server, what))
    finally:
        server.state.generation.shutdown()
    return 0


async def _serve_until_signalled(server: OpenAIServer, what: str) -> None:
    """Serve on this event loop until SIGINT or SIGTERM, then stop the server (bounded)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start()
    logger.info("serving %s at %s", what, url)
    try:
        await stop.wait()
    finally:
        logger.info("stopping")
        await server.stop()


def _proxy_server(settings: ServeSettings, api_key: SecretStr | None, sock: socket.socket) -> OpenAIServer:
    """The token-faithful proxy for the ``upstream`` endpoints, on ``sock``."""
    from gym_bridge.serving.upstream import build_proxy

    assert settings.upstream is not None
    return build_proxy(
        settings.upstream,
        settings.tokenizer,
        settings.served_model_name,
        host=settings.host,
        port=settings.port,
        reasoning_parser=settings.reasoning_parser,
        api_key=env_api_key(settings.upstream_api_key_env),
        inbound_api_key=api_key,
        sock=sock,
    )


def _local_server(settings: ServeSettings, api_key: SecretStr | None, sock: socket.socket) -> OpenAIServer:
    """Our server over the local model (or the scripted or instant policy on its tokenizer), on ``sock``."""
    spec = EngineSpec(
        policy=settings.policy,
        model=settings.model,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        answer_tokens=settings.answer_tokens,
        think=settings.reasoning_parser,
    )
    options = ServeOptions(
        served_model_name=settings.served_model_name or str(settings.model),
        host=settings.host,
        port=settings.port,
        sock=sock,
        reasoning_parser=settings.reasoning_parser,
        api_key=api_key,
    )
    return build_engine_server(spec, options).server


def env_api_key(name: str) -> SecretStr | None:
    """The API key in the environment variable ``name``; None when it is unset or empty."""
    from pydantic import SecretStr

    value = os.environ.get(name, "")
    return SecretStr(value) if value else None
