"""One engine behind our OpenAI server: built, listening and stopped the same way for every front end.

``gym-bridge serve``, eval's embedded policy and a training run each serve a generation engine through
:class:`~gym_bridge.serving.OpenAIServer`. :func:`build_engine_server` is the one place that does it: the listening
socket is claimed first (a busy port fails before a model loads), then the engine is built
(:func:`~gym_bridge.generation.factory.build_engine` from an :class:`EngineSpec`, or
:class:`~gym_bridge.generation.hf.HFGeneration` from a training run's ``HFGenerationConfig``), then the server over
it; a failure at any step releases what the earlier steps took. :func:`serve_engine` is the context-manager form,
serving on a thread for the block's duration.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from gym_bridge.generation.factory import EngineSpec

if TYPE_CHECKING:
    from pydantic import SecretStr

    from gym_bridge.generation.hf import HFGeneration
    from gym_bridge.generation.hf_config import HFGenerationConfig
    from gym_bridge.interfaces import GenerationInterface
    from gym_bridge.json_types import JsonMapping
    from gym_bridge.serving.server import OpenAIServer
    from gym_bridge.serving.state import ServerFeatures, ServerLimits


StopStep = Literal["server", "engine"]
"""The two steps of :meth:`EngineServer.close`, in order: the server stops, then the engine."""


@dataclass(frozen=True)
class ServeOptions:
    """Where and how the server serves the engine.

    ``sock``: a socket already listening on ``host`` (:func:`~gym_bridge.serving.listen.listening_socket`), claimed
    by the caller; the builder owns it from then on (closed on a failure). None: ``host``/``port`` are bound before
    the engine is built. ``api_key`` (None: none) is required as ``Authorization: Bearer`` on ``/v1/*``."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    sock: socket.socket | None = None
    reasoning_parser: bool = False
    max_model_len: int | None = None
    features: ServerFeatures | None = None
    limits: ServerLimits | None = None
    api_key: SecretStr | None = None
    chat_template_kwargs: JsonMapping | None = None
    """Every chat renders with these, a request's own over them (the server's ``default_chat_template_kwargs``)."""


@dataclass
class EngineServer[EngineT: GenerationInterface]:
    """An engine, the tokenizer it speaks, and our OpenAI server over it (started by :meth:`start`, or by the
    caller's own event loop through ``server.start()``); :meth:`close` stops both."""

    generation: EngineT
    tokenizer: Any
    """The Hugging Face tokenizer the engine speaks, as transformers types it."""
    model_path: Path | None
    """The model folder the engine came from (None: the engine's own configuration names it)."""
    server: OpenAIServer

    @property
    def base_url(self) -> str:
        """The server's ``http://host:port/v1`` once started."""
        return self.server.root_url + "/v1"

    def start(self) -> str:
        """Serve on a daemon thread (bounded start) and return the base URL."""
        return self.server.start_in_thread()

    def close(self, step: Callable[[StopStep], AbstractContextManager[object]] | None = None) -> None:
        """Stop the server (bounded: its stop timeout, then the thread's join), then the engine, each within
        ``step(name)`` (None: plainly); the engine is shut down even when stopping the server raised."""
        guard = step or (lambda _name: nullcontext())
        try:
            with guard("server"):
                self.server.stop_thread()
        finally:
            with guard("engine"):
                self.generation.shutdown()


@overload
def build_engine_server(engine: EngineSpec, options: ServeOptions) -> EngineServer[GenerationInterface]: ...


@overload
def build_engine_server(engine: HFGenerationConfig, options: ServeOptions) -> EngineServer[HFGeneration]: ...


def build_engine_server(engine: EngineSpec | HFGenerationConfig, options: ServeOptions) -> EngineServer[Any]:
    """The engine ``engine`` describes behind an unstarted :class:`OpenAIServer` on ``options``' socket.

    An :class:`EngineSpec` names a model checked before torch is imported (an unknown name is one line) and is built
    by :func:`~gym_bridge.generation.factory.build_engine`; an ``HFGenerationConfig`` is built as
    :class:`~gym_bridge.generation.hf.HFGeneration`. The socket is claimed before the engine is built, and
    released (with the engine) if a later step fails.

    Raises:
        ServerBindError: the address cannot be bound (a busy port), before any model loads.
        ModelNotFoundError: the model is neither a built-in name nor a folder (before torch is imported).
        SettingError: the policy is unknown, or the model folder is refused.
    """
    from gym_bridge.serving.listen import listening_socket

    sock = options.sock if options.sock is not None else listening_socket(options.host, options.port)
    generation: GenerationInterface | None = None
    try:
        generation, tokenizer, model_path = _built(engine)
        server = _server(generation, tokenizer, model_path, options, sock)
    except BaseException:
        sock.close()
        if generation is not None:
            generation.shutdown()
        raise
    return EngineServer(generation, tokenizer, model_path, server)


def _built(engine: EngineSpec | HFGenerationConfig) -> tuple[GenerationInterface, Any, Path | None]:
    """The engine, its tokenizer and its model folder (None for a training run's engine, which names its own)."""
    if isinstance(engine, EngineSpec):
        from gym_bridge.models.registry import check_model_reference

        check_model_reference(engine.model)  # an unknown model is one line before torch is imported
        from gym_bridge.generation.factory import build_engine

        built = build_engine(engine)
        return built.generation, built.tokenizer, built.model_path
    from gym_bridge.generation.hf import HFGeneration

    hf = HFGeneration(engine)
    return hf, hf.tokenizer, None


def _server(
    generation: GenerationInterface, tokenizer: Any, model_path: Path | None, options: ServeOptions, sock: socket.socket
) -> OpenAIServer:
    from gym_bridge.serving.server import OpenAIServer

    return OpenAIServer(
        generation,
        tokenizer,
        served_model_name=options.served_model_name,
        host=options.host,
        port=options.port,
        reasoning_parser=options.reasoning_parser,
        model_path=str(model_path) if model_path is not None else None,
        max_model_len=options.max_model_len,
        limits=options.limits,
        features=options.features,
        api_key=options.api_key,
        sock=sock,
        default_chat_template_kwargs=options.chat_template_kwargs,
    )


@overload
def serve_engine(
    engine: EngineSpec,
    options: ServeOptions,
    *,
    step: Callable[[StopStep], AbstractContextManager[object]] | None = None,
) -> AbstractContextManager[EngineServer[GenerationInterface]]: ...


@overload
def serve_engine(
    engine: HFGenerationConfig,
    options: ServeOptions,
    *,
    step: Callable[[StopStep], AbstractContextManager[object]] | None = None,
) -> AbstractContextManager[EngineServer[HFGeneration]]: ...


def serve_engine(
    engine: EngineSpec | HFGenerationConfig,
    options: ServeOptions,
    *,
    step: Callable[[StopStep], AbstractContextManager[object]] | None = None,
) -> AbstractContextManager[EngineServer[Any]]:
    """:func:`build_engine_server`, served on a thread for the block's duration; on exit (an error or Ctrl-C too)
    the server and then the engine stop, bounded, each within ``step(name)`` (:meth:`EngineServer.close`)."""
    return _serving(engine, options, step)


@contextmanager
def _serving(
    engine: EngineSpec | HFGenerationConfig,
    options: ServeOptions,
    step: Callable[[StopStep], AbstractContextManager[object]] | None,
) -> Iterator[EngineServer[Any]]:
    served = build_engine_server(engine, options)
    try:
        served.start()
        yield served
    finally:
        served.close(step)
