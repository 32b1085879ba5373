"""Preflight: check every OpenAI-compatible endpoint in seconds, before Ray or Gym start.

For each ``base_url`` (``http://host:port/v1``), in order, stopping at the first problem:

1. it answers ``GET /v1/models`` (connection refused / timeout / an HTTP error is said so; a 401 or 403
   is "refused the API key", whether a wrong key or none was sent);
2. ``model_name`` is among the served models (else the served names are listed);
3. a one-token chat completion with ``logprobs`` and ``return_token_ids`` returns token
   ids and logprobs, as Gym's ``vllm_model`` and our HTTP engine need;
4. ``POST /tokenize`` (outside ``/v1``) renders the chat: Gym reads prompt token ids there;
5. with ``tools=True``: a chat that offers a tool is accepted (vLLM refuses it with a 400
   unless started with :data:`VLLM_TOOL_FLAGS`).

Each endpoint gives an :class:`EndpointCheck`; :func:`preflight_endpoints` raises :class:`PreflightError`
holding one line per failed endpoint. An endpoint's answers are untrusted (:mod:`gym_bridge.preflight_answers`
reads them): a wrong field is a failed check naming it (:attr:`EndpointProblem.BAD_ANSWER`); anything else that
goes wrong while reading an answer is a failed check too, never a traceback. ``api_key`` is sent as
``Authorization: Bearer`` on every request (an endpoint that needs none ignores it, as vLLM without ``--api-key``
does) and appears in no line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import SecretStr

from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonMapping
from gym_bridge.preflight_answers import (
    EndpointProblem,
    ProbeFailed,
    check_ids,
    check_token_data,
    describe,
    error_message,
    json_body,
    send,
    served_models,
    short,
)

#: The flags a vLLM server needs before it accepts chats that offer tools (Hermes-style tool calls).
VLLM_TOOL_FLAGS = "--enable-auto-tool-choice --tool-call-parser hermes"

_PROBE_MESSAGES = [{"role": "user", "content": "Say OK."}]
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_MAX_NAMES = 10
"""Served model names listed in a message (a server may serve thousands)."""


@dataclass(frozen=True)
class EndpointCheck:
    """The outcome of checking one endpoint: ``problem`` is None when it passed."""

    base_url: str
    model_name: str
    served_models: tuple[str, ...] = ()
    problem: EndpointProblem | None = None
    detail: str = ""
    tools_checked: bool = False
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def line(self) -> str:
        """One line for a person: ``<base_url>: <what is wrong>`` or ``<base_url>: ok (...)``, every string from the
        config or the endpoint escaped (:func:`~gym_bridge.boundary.text.shown`)."""
        if self.problem is None:
            tools = ", tools accepted" if self.tools_checked else ""
            return (
                f"{shown(self.base_url)}: ok (serves {shown(repr(self.model_name))}, token ids and logprobs{tools}; "
                f"{self.elapsed_s:.2f} s)"
            )
        if self.problem is EndpointProblem.KEY_REFUSED:
            return f"{shown(self.base_url)} {shown(self.detail)}"
        return f"{shown(self.base_url)}: {shown(self.detail)}"


class PreflightError(GymBridgeError, RuntimeError):
    """At least one endpoint failed its preflight; ``str()`` is one line per failed endpoint."""

    def __init__(self, checks: Sequence[EndpointCheck]) -> None:
        self.checks = list(checks)
        self.failed = [check for check in self.checks if not check.ok]
        lines = "\n".join(f"endpoint {check.line}" for check in self.failed)
        super().__init__(lines or "no endpoint to check: base_urls is empty")

    def __reduce__(self) -> tuple[type[PreflightError], tuple[list[EndpointCheck]]]:
        return (PreflightError, (self.checks,))


def rows_use_tools(rows: Sequence[JsonMapping]) -> bool:
    """True when a Gym row offers tools (so its agent's chats carry ``tools``)."""
    return any((row.get("responses_create_params") or {}).get("tools") for row in rows)


async def _check(client: httpx.AsyncClient, base_url: str, model_name: str, tools: bool) -> tuple[str, ...]:
    """The served model names, once every check passed; raises :class:`ProbeFailed` at the first problem."""
    base = base_url.rstrip("/")
    served = served_models(json_body(await send(client, "GET", f"{base}/models", "GET /v1/models"), "GET /v1/models"))
    if model_name not in served:
        names = short(", ".join(repr(name) for name in served[:_MAX_NAMES])) or "no model"
        if len(served) > _MAX_NAMES:
            names += f" and {len(served) - _MAX_NAMES} more"
        raise ProbeFailed(
            EndpointProblem.MODEL_NOT_SERVED,
            f"does not serve model {short(repr(model_name))}; it serves {names} (set model_name to the served name)",
            served,
        )
    chat = {
        "model": model_name,
        "messages": _PROBE_MESSAGES,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    what = "a one-token chat completion"
    check_token_data(json_body(await send(client, "POST", f"{base}/chat/completions", what, body=chat), what))
    what = "POST /tokenize"
    response = await send(
        client,
        "POST",
        f"{base.removesuffix('/v1')}/tokenize",
        what,
        body={"model": model_name, "messages": _PROBE_MESSAGES},
    )
    if response.status_code in (404, 405):
        raise ProbeFailed(
            EndpointProblem.NO_TOKENIZE,
            f"the server has no /tokenize (HTTP {response.status_code}); Gym's vllm_model reads prompt token ids there",
        )
    body = json_body(response, what)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not tokens:
        raise ProbeFailed(EndpointProblem.NO_TOKENIZE, "POST /tokenize answered without a 'tokens' list")
    check_ids(what, "tokens", tokens)
    if tools:
        what = "a chat completion with tools"
        response = await send(client, "POST", f"{base}/chat/completions", what, body={**chat, "tools": [_PROBE_TOOL]})
        if 400 <= response.status_code < 500:
            raise ProbeFailed(
                EndpointProblem.TOOLS_REFUSED,
                f"refuses chats with tools (HTTP {response.status_code}: {error_message(response)}); "
                f"start vLLM with {VLLM_TOOL_FLAGS}",
            )
        json_body(response, what)
    return served


async def check_endpoint_async(
    base_url: str,
    model_name: str,
    *,
    tools: bool = False,
    timeout_s: float = 20.0,
    api_key: SecretStr | str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> EndpointCheck:
    """Check one endpoint within ``timeout_s`` (every request and the whole check), sending ``api_key``.

    Never raises for the server's faults: they are the returned check's ``problem``, whatever its answers hold
    (an exception while reading them is a :attr:`EndpointProblem.BAD_ANSWER`).
    """
    started = time.perf_counter()
    served: tuple[str, ...] = ()
    problem: EndpointProblem | None = None
    detail = ""
    key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport, trust_env=False, headers=headers) as client:
        try:
            async with asyncio.timeout(timeout_s):
                served = await _check(client, base_url, model_name, tools)
        except ProbeFailed as failed:
            problem, detail, served = failed.problem, failed.detail, failed.served
        except TimeoutError:
            problem, detail = EndpointProblem.TIMEOUT, f"the checks did not finish within {timeout_s:g} s"
        except Exception as exc:  # a fault of the endpoint's answer that no check above names: still one line
            problem, detail = EndpointProblem.BAD_ANSWER, f"the check failed on its answer: {describe(exc)}"
    return EndpointCheck(
        base_url=base_url,
        model_name=model_name,
        served_models=served,
        problem=problem,
        detail=detail,
        tools_checked=tools,
        elapsed_s=time.perf_counter() - started,
    )


async def check_endpoints_async(
    base_urls: Sequence[str],
    model_name: str,
    *,
    tools: bool = False,
    timeout_s: float = 20.0,
    api_key: SecretStr | str | None = None,
) -> list[EndpointCheck]:
    """Check every endpoint concurrently; one result per URL, in order."""
    return list(
        await asyncio.gather(
            *(
                check_endpoint_async(url, model_name, tools=tools, timeout_s=timeout_s, api_key=api_key)
                for url in base_urls
            )
        )
    )


def _run[T](coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from synchronous code, on a helper thread when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="preflight") as pool:
        return pool.submit(asyncio.run, coro).result()


def check_endpoint(
    base_url: str,
    model_name: str,
    *,
    tools: bool = False,
    timeout_s: float = 20.0,
    api_key: SecretStr | str | None = None,
) -> EndpointCheck:
    """:func:`check_endpoint_async` from synchronous code (runs its own event loop)."""
    return _run(check_endpoint_async(base_url, model_name, tools=tools, timeout_s=timeout_s, api_key=api_key))


def check_endpoints(
    base_urls: Sequence[str],
    model_name: str,
    *,
    tools: bool = False,
    timeout_s: float = 20.0,
    api_key: SecretStr | str | None = None,
) -> list[EndpointCheck]:
    """:func:`check_endpoints_async` from synchronous code (runs its own event loop)."""
    return _run(check_endpoints_async(base_urls, model_name, tools=tools, timeout_s=timeout_s, api_key=api_key))


def preflight_endpoints(
    base_urls: Sequence[str],
    model_name: str,
    *,
    tools: bool = False,
    timeout_s: float = 20.0,
    api_key: SecretStr | str | None = None,
) -> list[EndpointCheck]:
    """Check every endpoint; raise :class:`PreflightError` (one line per failed endpoint) unless all pass."""
    if not base_urls:
        raise PreflightError([])
    checks = check_endpoints(base_urls, model_name, tools=tools, timeout_s=timeout_s, api_key=api_key)
    if any(not check.ok for check in checks):
        raise PreflightError(checks)
    return checks
