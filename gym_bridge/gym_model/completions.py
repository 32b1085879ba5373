"""Token-id generation through OpenAI-compatible ``/v1/completions`` endpoints (stock vLLM or ours).

One ``POST {base_url}/completions`` per model turn: the prompt is token ids, the answer
carries the generated ids (``return_token_ids``, or ``token_id:<n>`` labels) and each
one's logprob. aiohttp + orjson, no torch: this runs once per turn of every rollout.
Requests go to the least-loaded healthy endpoint, sticky per rollout
(:class:`~gym_bridge.generation.routing.SessionRouter`). Unreachable or overloaded
endpoints (connection errors, 408/429/5xx) are retried with capped backoff for
``retry_budget_s``; any other 4xx fails at once, keeping its status and message. Answers are untrusted: read
under a size cap (raw and decompressed) and checked field by field (:mod:`~gym_bridge.generation.upstream_answer`);
a bad one is a 502 naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass

import aiohttp
import orjson
from pydantic import SecretStr

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymBridgeError, http_status_is_infra
from gym_bridge.generation.routing import SessionRouter
from gym_bridge.generation.upstream_answer import (
    check_max_model_len,
    completion_choice,
    decode_answer,
    read_body_async,
)
from gym_bridge.json_types import JsonMapping

logger = logging.getLogger(__name__)

_BODY_LIMIT = 300


class CompletionsError(GymBridgeError):
    """A turn the upstream did not generate: ``status`` is handed on to Gym's agent."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[CompletionsError], tuple[str, int]]:
        return type(self), (str(self), self.status)


class ClientNotStarted(GymBridgeError, RuntimeError):
    """:meth:`CompletionsClient.generate` was called before :meth:`CompletionsClient.start`."""


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class Discovered:
    """What an upstream's ``GET /v1/models`` says about its first model."""

    name: str
    root: str | None
    max_model_len: int | None


async def discover(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> Discovered:
    """The served name, model path and context length from ``{base_url}/models`` (vLLM reports all three), each
    checked: a bad answer is a :class:`CompletionsError` (503) naming the field."""
    where = f"{shown(base_url)}/models answer"
    try:
        async with session.get(f"{base_url}/models", headers=headers) as response:
            status, raw = response.status, await _read(response, where)
        if status >= 400:
            raise CompletionsError(f"{shown(base_url)}/models returned HTTP {status}", 503)
        answer = decode_answer(raw, where)
        cards = answer.get("data") if isinstance(answer, dict) else None
        card = cards[0] if isinstance(cards, list) and cards else None
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise UntrustedInputError(f"{where} lists no model")
        root = card.get("root")
        if root is not None and not isinstance(root, str):
            raise UntrustedInputError(f"{where}: data[0].root is not a model path (a string)")
        return Discovered(card["id"], root, check_max_model_len(card.get("max_model_len"), where))
    except UntrustedInputError as exc:
        raise CompletionsError(str(exc), 503) from None


async def _read(response: aiohttp.ClientResponse, where: str) -> bytes:
    """The body of an answer under :data:`MAX_ANSWER_BYTES`, raw and decompressed (the session does not decode)."""
    return await read_body_async(response.headers, response.content.iter_any(), where)


class CompletionsClient:
    """Generation over ``base_urls``; :meth:`start` and :meth:`close` on the serving loop."""

    def __init__(
        self,
        base_urls: list[str],
        model: str,
        *,
        api_key: SecretStr | str | None = None,
        max_connections: int = 1024,
        request_timeout_s: float = 1800.0,
        retry_budget_s: float = 300.0,
        cooldown_s: float = 5.0,
        session_header: str | None = None,
        sticky: bool = True,
    ) -> None:
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.sticky = sticky
        """Route each session to one URL while it is healthy (False: every call least-loaded)."""
        self.session_header = session_header
        """Sent with each call's session key (when it has one), for a session-aware router upstream."""
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.retry_budget_s = retry_budget_s
        self.router = SessionRouter(len(self.base_urls), cooldown_s=cooldown_s)
        self.session: aiohttp.ClientSession | None = None
        self.vocab_size: int | None = None
        """When known, the bound of the token ids an answer may hold (else int64)."""

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.max_connections, ttl_dns_cache=None)
        # sock_connect, not connect: aiohttp's connect also counts the wait for a free pooled connection.
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=10.0)
        # auto_decompress off: :class:`BodyReader` decodes under its cap.
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, json_serialize=_dumps, auto_decompress=False
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def generate(self, prompt: list[int], sampling: JsonMapping, session: Hashable | None) -> Generated:
        """Generate one turn for the token-id ``prompt``; ``sampling`` holds completions fields (max_tokens ...)."""
        if self.session is None:
            raise ClientNotStarted("CompletionsClient.start() was not called")
        body = orjson.dumps(
            {
                **sampling,
                "model": self.model,
                "prompt": prompt,
                "logprobs": 1,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "n": 1,
                "stream": False,
            }
        )
        deadline = time.monotonic() + self.retry_budget_s
        attempt = 0
        while True:
            idx = self.router.acquire(session if self.sticky else None)
            url = self.base_urls[idx]
            try:
                status, raw = await self._post(url, body, session)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                self.router.mark_unhealthy(idx)
                problem, status = f"{url}/completions: {type(exc).__name__}: {exc}", 503
            except UntrustedInputError as exc:
                raise CompletionsError(str(exc), 502) from None
            else:
                if status < 400:
                    return _parse(raw, url, self.vocab_size)
                problem = f"{url}/completions returned HTTP {status}: {_short(raw)}"
                if not http_status_is_infra(status):
                    raise CompletionsError(problem, status)
            finally:
                self.router.release(idx)
            attempt += 1
            pause = min(0.1 * 2 ** (attempt - 1), 2.0)
            if time.monotonic() + pause > deadline:
                raise CompletionsError(f"generation failed after {attempt} attempts: {problem}", status)
            logger.warning("attempt %d failed (%s); retrying", attempt, problem)
            await asyncio.sleep(pause)

    async def _post(self, url: str, body: bytes, session: Hashable | None) -> tuple[int, bytes]:
        assert self.session is not None
        headers = self.headers
        if self.session_header is not None and session is not None:
            headers = {**headers, self.session_header: str(session)}
        async with self.session.post(f"{url}/completions", data=body, headers=headers) as response:
            return response.status, await _read(response, f"{url}/completions answer")


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


def _short(raw: bytes) -> str:
    text = shown(" ".join(raw.decode("utf-8", errors="replace").split()))
    return text if len(text) <= _BODY_LIMIT else text[: _BODY_LIMIT - 3] + "..."


def _parse(raw: bytes, url: str, vocab_size: int | None) -> Generated:
    """The generated turn of a ``/completions`` answer, every field checked (a bad one is a 502 naming it)."""
    where = f"{url}/completions answer"
    try:
        ids, logprobs, finish = completion_choice(decode_answer(raw, where), where, vocab_size)
    except UntrustedInputError as exc:
        raise CompletionsError(str(exc), 502) from None
    return Generated(ids, logprobs, finish)
