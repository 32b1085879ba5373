"""gym-bridge's NeMo-Gym model server: Responses API in, token-faithful generation out.

Gym's agents call it as they call ``vllm_model`` (``POST /v1/responses``). Each turn
is rendered here with the tokenizer's chat template, earlier turns' exact token ids
spliced in (:func:`~gym_bridge.serving.chat.build_chat_prompt`, as the proxy does),
generated through the endpoint's ``/v1/completions`` with a token-id prompt, and
answered with ``vllm_model``'s output items and token fields. One hop fewer than
``vllm_model`` -> proxy -> vLLM, exact tokens with stock vLLM, and a raw ASGI app:
no middleware, no per-request task groups, orjson.

Started by Gym's launcher as ``python app.py`` in its server dir (see
:mod:`gym_bridge.gym_model`), which calls :func:`main`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from typing import TYPE_CHECKING, cast

import aiohttp
import orjson

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.chat_template import off_the_loop
from gym_bridge.failures import GymBridgeError
from gym_bridge.gym_model.completions import CompletionsClient, CompletionsError, discover
from gym_bridge.gym_model.config import GymModelConfig, load_from_gym_env
from gym_bridge.gym_model.translate import (
    TranslationError,
    empty_output_items,
    output_items,
    response_body,
    responses_to_chat,
)
from gym_bridge.json_types import JsonObject
from gym_bridge.models.vocab import vocab_size_of
from gym_bridge.serving.chat import build_chat_prompt
from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.parsers import parse_tool_calls

if TYPE_CHECKING:  # gym_bridge.types imports torch, which this server does without
    from starlette.types import Receive, Scope, Send

    from gym_bridge.types import Tokenizer


logger = logging.getLogger(__name__)

_COOKIE = "gym_bridge_session"
_MAX_BODY = 64 * 1024 * 1024
_JSON = [(b"content-type", b"application/json")]
_STARTUP_DISCOVERY_S = 60.0
_CONTEXT_MARKERS = ("context length", "max_tokens")


_ROLLOUT_PREFIX = re.compile(r"^/ng-rollout/(?P<rollout>[^/]+)(?:/training-token-capture)?(?=/)")
_SESSION_TEXT = re.compile(r"[A-Za-z0-9._~:-]{1,128}")
"""What a session key sent upstream in a header may hold: a rollout id or our hex cookie, never a peer's raw bytes."""


def served_path(path: str) -> str:
    """``path`` without Gym 0.7's ``/ng-rollout/<rollout id>[/training-token-capture]`` prefix, which agents add
    for observability or token capture; served as ``vllm_model`` serves it: the same route (our responses
    always carry token ids, so there is nothing to capture)."""
    return _ROLLOUT_PREFIX.sub("", path, count=1)


class _HTTPError(GymBridgeError):
    """A request this server answers with ``status`` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[_HTTPError], tuple[int, str]]:
        return type(self), (self.status, str(self))


class GymModelServer:
    """The ASGI app. ``tokenizer`` may be given (tests); otherwise it is loaded at start-up."""

    def __init__(self, config: GymModelConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len
        self.client = CompletionsClient(
            config.base_url,
            config.model,
            api_key=config.api_key,
            max_connections=config.max_connections,
            request_timeout_s=config.request_timeout_s,
            retry_budget_s=config.retry_budget_s,
            session_header=config.session_affinity_header,
            sticky=config.session_affinity,
        )
        self._ready: asyncio.Lock | None = None
        self._vocab_size: int | None = None

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        cookie_session, headers = _session(scope)
        rollout = _ROLLOUT_PREFIX.match(path)
        if rollout is not None and _SESSION_TEXT.fullmatch(rollout["rollout"]):
            cookie_session = rollout["rollout"]  # Gym 0.7 names the rollout: every call of it is one session
        try:
            if method == "GET" and path in ("/", "/health"):
                await _reply(send, 200, b'{"status":"ok"}')
                return
            if method != "POST" or served_path(path) != "/v1/responses":
                raise _HTTPError(404, f"{method} {path} is not served (this model server serves POST /v1/responses)")
            body = await _read_body(receive)
            answer = await self.responses(body, cookie_session)
        except _HTTPError as exc:
            await _reply(send, exc.status, _error(exc.status, str(exc)))
            return
        except Exception as exc:  # a bug: Gym's agent sees a 500 naming it, as with Gym's own servers
            logger.exception("%s %s failed", method, path)
            await _reply(send, 500, _error(500, f"{type(exc).__name__}: {exc}"))
            return
        await _reply(send, 200, orjson.dumps(answer), headers)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    logger.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        """Open the upstream pool and load the tokenizer (configured, or the upstream's) so turn 1 does not wait.

        An upstream that is not up yet is asked again at the first request.
        """
        self._ready = asyncio.Lock()
        await self.client.start()
        if self.tokenizer is None and self.config.tokenizer:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self.config.tokenizer)
        try:
            await asyncio.wait_for(self._ensure_ready(), _STARTUP_DISCOVERY_S)
        except (_HTTPError, TimeoutError) as exc:
            logger.warning("the upstream's model card is not available yet (%s); asking at the first request", exc)

    # ------------------------------------------------------------------ one turn

    async def responses(self, body: object, session: str) -> JsonObject:
        """One model turn for the Responses request ``body`` (parsed JSON)."""
        if not isinstance(body, dict):
            raise _HTTPError(400, "the body must be a JSON object")
        await self._ensure_ready()
        assert self.tokenizer is not None  # _ensure_ready set it or raised
        cfg = self.config
        try:
            turn = responses_to_chat(
                body,
                uses_reasoning_parser=cfg.uses_reasoning_parser,
                uses_interleaved_reasoning=cfg.uses_interleaved_reasoning,
                replace_developer_role_with_system=cfg.replace_developer_role_with_system,
                chat_template_kwargs=cfg.chat_template_kwargs,
                extra_body=cfg.extra_body,
            )
            rendered = await off_the_loop(  # a template renders under its bound on the render pool, others go on
                build_chat_prompt,
                self.tokenizer,
                turn.messages,
                tools=turn.tools,
                chat_template_kwargs=turn.chat_template_kwargs or None,
                vocab_size=self._vocab_size,
            )
            prompt = rendered.token_ids
        except (TranslationError, ServingError) as exc:
            raise _HTTPError(400, str(exc)) from None
        sampling = dict(turn.sampling)
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt)
            if room <= 0:  # vllm_model turns the engine's context-length 400 into an empty, cut turn
                return response_body(body, cfg.model, empty_output_items(), finish_reason="length", usage=None)
            sampling.setdefault("max_tokens", room)
        try:
            generated = await self.client.generate(prompt, sampling, session)
        except CompletionsError as exc:
            if exc.status == 400 and any(marker in str(exc) for marker in _CONTEXT_MARKERS):
                return response_body(body, cfg.model, empty_output_items(), finish_reason="length", usage=None)
            raise _HTTPError(exc.status, str(exc)) from None
        text = self.tokenizer.decode(generated.token_ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text) if turn.parse_tools else ((text or None), [])
        tokens = (
            {
                "prompt_token_ids": prompt,
                "generation_token_ids": generated.token_ids,
                "generation_log_probs": generated.logprobs,
            }
            if cfg.return_token_id_information
            else None
        )
        items = output_items(content, calls, uses_reasoning_parser=cfg.uses_reasoning_parser, token_fields=tokens)
        usage = (len(prompt), len(generated.token_ids))
        return response_body(body, cfg.model, items, finish_reason=generated.finish_reason, usage=usage)

    async def _ensure_ready(self) -> None:
        """Tokenizer and context length from the first upstream's ``/v1/models`` when not configured (once)."""
        if self.tokenizer is not None and self._vocab_size is not None:
            return
        assert self._ready is not None, "start() was not called"
        async with self._ready:
            if self._vocab_size is not None:
                return
            if self.tokenizer is None or self.max_model_len is None:
                assert self.client.session is not None
                try:
                    found = await discover(self.client.session, self.client.base_urls[0], self.client.headers)
                except (CompletionsError, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
                    if self.tokenizer is None:
                        raise _HTTPError(503, f"cannot learn the tokenizer from the upstream: {exc}") from None
                    logger.warning("the upstream's /v1/models did not answer (%s); no context length known", exc)
                else:
                    self.max_model_len = self.max_model_len or found.max_model_len
                    if self.tokenizer is None:
                        self.tokenizer = await asyncio.to_thread(_load_tokenizer, found.root or found.name)
            assert self.tokenizer is not None  # configured, or learnt above (else _HTTPError was raised)
            self._vocab_size = vocab_size_of(self.tokenizer)
            self.client.vocab_size = self._vocab_size


def _load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path`` (a folder or a hub id), loaded off the event loop by the caller."""
    from gym_bridge.models.folder_check import load_tokenizer

    logger.info("loading the tokenizer from %s", path)
    # transformers 5 types ``decode`` as returning ``str | list[str]``; for a list of ids it is a str.
    return cast("Tokenizer", load_tokenizer(path))


def _session(scope: Scope) -> tuple[str, list[tuple[bytes, bytes]]]:
    """The rollout's session id from our cookie, or a new one and the header that sets it."""
    for name, value in scope["headers"]:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, val = part.strip().partition("=")
                if key == _COOKIE and _SESSION_TEXT.fullmatch(val):
                    return val, list(_JSON)
    session = secrets.token_hex(8)
    return session, [*_JSON, (b"set-cookie", f"{_COOKIE}={session}; Path=/".encode())]


async def _read_body(receive: Receive) -> object:
    """The request body parsed as JSON: over :data:`_MAX_BODY` a 413, not JSON a 400."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            raise _HTTPError(413, f"request body exceeds {_MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        return json_io.loads(b"".join(chunks), "the body")
    except UntrustedInputError as exc:
        raise _HTTPError(400, str(exc)) from None


def _error(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


async def _reply(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or _JSON})
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    """Serve on the host and port Gym assigned, with the config Gym passed in the environment."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_from_gym_env()
    logger.info("gym-bridge model server %r on %s:%d over %s", config.name, config.host, config.port, config.base_url)
    uvicorn.run(
        GymModelServer(config),
        host=config.host,
        port=config.port,
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=120,
        backlog=4096,
        http="h11",  # h11 bounds a request head it buffers (a 431 past it); httptools buffers any size
        h11_max_incomplete_event_size=64 * 1024,
    )
