"""What every route of the OpenAI server reads: :class:`ServingState` (engine, tokenizer, names, limits, features,
counters), and the request limits and server features it carries."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonObject
from gym_bridge.serving.drift import DriftCounter
from gym_bridge.serving.engine import EngineProfile
from gym_bridge.types import Tokenizer


@dataclass(frozen=True)
class ServerLimits:
    """Request limits; anything over them is refused with a 4xx."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    max_prompts: int = 64
    max_stop_strings: int = 4
    """vLLM's cap (``VLLM_MAX_STOP_STRINGS``, 4 by default): more ``stop`` entries are a 400 naming ``stop``."""
    max_json_depth: int = 64
    """Deepest nesting of objects and arrays a body may have; deeper is a 400 (JSON nested 100,000 deep
    would otherwise exhaust the parser's recursion)."""
    body_timeout_s: float = 60.0
    """How long a request's body may take to arrive; a body still incomplete then is a 408 and its connection is
    closed (a client that sends half a body and stops would otherwise hold its connection for ever)."""
    header_timeout_s: float = 30.0
    """How long a connection may take to send a request's headers, from when it opens, starts the request, or (a
    next request begun on a kept-alive or pipelined connection) from the previous response's end; a connection still
    short of them then is closed (:mod:`~gym_bridge.serving.connections`)."""
    max_header_bytes: int = 64 * 1024
    """The largest a request's head (request line and headers) may be; past it the server answers 431 and closes
    the connection, having read at most this plus one socket read of it (h11's ``max_incomplete_event_size``)."""
    max_connections: int | None = None
    """Open connections beyond this are closed as soon as they are accepted, so a flood of clients cannot use up
    the process's file descriptors. None: three quarters of the open-file limit."""


#: vLLM's exact 400 message for a chat with tools when started without a tool-call parser.
AUTO_TOOL_CHOICE_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ServerFeatures:
    """What the server supports; turning one off makes it answer like a vLLM set up without it
    (for preflight tests and for people who want to see the failure before a run)."""

    auto_tool_choice: bool = True
    """False: a chat offering tools with ``tool_choice`` auto gets vLLM's 400 :data:`AUTO_TOOL_CHOICE_REFUSED`."""
    logprobs: bool = True
    """False: ``logprobs`` is null in every answer, as from a server that does not compute them."""
    token_ids: bool = True
    """False: ``return_token_ids`` and ``return_tokens_as_token_ids`` are ignored and no token-id fields are sent."""
    clamp_max_tokens: bool = False
    """True: a chat's ``max_tokens`` beyond the room its prompt leaves is cut to that room, as NeMo-RL's training
    server does (``vllm_worker_async``); False: vLLM's 400."""


@dataclass
class ServingState:
    """What every route reads: the engine, its tokenizer, the names it is served under, limits and counters."""

    generation: GenerationInterface
    tokenizer: Tokenizer
    served_model_name: str
    model_path: str
    reasoning_parser: bool
    profile: EngineProfile
    limits: ServerLimits
    vocab_size: int
    token_id_correction: bool = True
    features: ServerFeatures = field(default_factory=ServerFeatures)
    default_chat_template_kwargs: JsonObject = field(default_factory=dict)
    """Every chat renders with these, a request's own ``chat_template_kwargs`` over them (vLLM's
    ``default_chat_template_kwargs``; NeMo-RL's ``http_server_serving_chat_kwargs``)."""
    drift: DriftCounter = field(default_factory=DriftCounter)
    rows_generating: int = 0
    """Rows the routes are generating now (changed on the event loop only): the running gauge of ``/metrics``
    for an engine that does not count its own."""

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may give: the served name and the model path."""
        return (self.served_model_name, self.model_path)


def serving_state(request: Request) -> ServingState:
    """The :class:`ServingState` of the app serving ``request`` (set by :func:`~gym_bridge.serving.app.build_app`)."""
    state: ServingState = request.app.state.serving
    return state
