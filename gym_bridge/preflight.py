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
holding one line per failed endpoint. An endpoint's answers are untrusted: every field read is type-checked (token
ids are ints in ``[0, 2**31)``, never bools, one per logprob; logprobs finite numbers <= 0; a known finish reason; a
``max_model_len`` a positive int; names strings), and a wrong one is a failed
check naming the field (:attr:`EndpointProblem.BAD_ANSWER`); anything else that goes wrong while reading an answer
is a failed check too, never a traceback. ``api_key`` is sent as ``Authorization: Bearer`` on every request
(an endpoint that needs none ignores it, as vLLM without ``--api-key`` does) and appears in no line.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx
from pydantic import SecretStr

from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymBridgeError
from gym_bridge.generation.upstream_answer import FINISH_REASONS
from gym_bridge.json_types import JsonMapping, JsonObject

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
_MAX_DETAIL_CHARS = 300
_MAX_BODY_BYTES = 4 << 20
"""The most of one answer a check reads: an endpoint that streams without end must not fill memory."""
_MAX_NAMES = 10
"""Served model names listed in a message (a server may serve thousands)."""
_TOKEN_ID_LIMIT = 2**31
"""Token ids lie in ``[0, 2**31)``: vLLM's are 32-bit, and no vocabulary comes near."""
_TOKEN_ID_PREFIX = "token_id:"


class EndpointProblem(StrEnum):
    """What a failed endpoint lacks; the first one found is reported."""

    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    KEY_REFUSED = "key_refused"
    HTTP_ERROR = "http_error"
    MODEL_NOT_SERVED = "model_not_served"
    NO_LOGPROBS = "no_logprobs"
    NO_TOKEN_IDS = "no_token_ids"
    NO_TOKENIZE = "no_tokenize"
    TOOLS_REFUSED = "tools_refused"
    BAD_ANSWER = "bad_answer"


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


class _Failed(GymBridgeError):
    def __init__(self, problem: EndpointProblem, detail: str, served: tuple[str, ...] = ()) -> None:
        super().__init__(detail)
        self.problem = problem
        self.detail = detail
        self.served = served


def rows_use_tools(rows: Sequence[JsonMapping]) -> bool:
    """True when a Gym row offers tools (so its agent's chats carry ``tools``)."""
    return any((row.get("responses_create_params") or {}).get("tools") for row in rows)


def _short(text: str) -> str:
    """One printable line of at most ``_MAX_DETAIL_CHARS``: whitespace runs become one space, and control or other
    unprintable characters their escapes (an endpoint's text must not split the line or drive the terminal)."""
    text = " ".join(text.split())
    text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return text if len(text) <= _MAX_DETAIL_CHARS else text[: _MAX_DETAIL_CHARS - 3] + "..."


def _error_message(response: httpx.Response) -> str:
    """The server's own message from an error body (OpenAI/vLLM ``error.message``, FastAPI ``detail``)."""
    try:
        body = response.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or an integer too long to convert
        return _short(response.text) or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            return _short(error["message"])
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str) and body[key]:
                return _short(body[key])
    return _short(response.text)


def _shown(value: object) -> str:
    """A short, printable picture of a JSON value from an answer (a 5,000-digit integer has no ``str``)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _short(repr(value[:40] + ("..." if len(value) > 40 else "")))
    return "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else type(value).__name__


def _bad(what: str, field: str, value: object, wanted: str) -> _Failed:
    """The failure of an answer whose ``field`` holds ``value`` where ``wanted`` belongs."""
    return _Failed(EndpointProblem.BAD_ANSWER, f"{what} answered {field} = {_shown(value)}, not {wanted}")


def _is_token_id(value: object) -> bool:
    """An int in ``[0, 2**31)`` that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _TOKEN_ID_LIMIT


def _is_logprob(value: object) -> bool:
    """A finite number <= 0 that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value <= 0


def _describe(exc: BaseException) -> str:
    """``<type>: <message>`` as one short line, whatever the exception's ``str`` does."""
    try:
        text = str(exc)
    except Exception:  # an exception whose message cannot be rendered still names its type
        text = ""
    return _short(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _send(
    client: httpx.AsyncClient, method: str, url: str, what: str, *, body: JsonObject | None = None
) -> httpx.Response:
    """``method url`` with ``body`` as JSON; a transport failure or a refused key is a :class:`_Failed` naming it."""
    try:
        response = await _bounded(client, method, url, what, body)
    except httpx.ConnectError as exc:
        reason = "connection refused" if _refused(exc) else _short(str(exc) or type(exc).__name__)
        raise _Failed(EndpointProblem.UNREACHABLE, f"nothing answers ({reason})") from exc
    except httpx.TimeoutException as exc:
        raise _Failed(
            EndpointProblem.TIMEOUT, f"no answer to {what} within the timeout ({type(exc).__name__})"
        ) from exc
    except httpx.HTTPError as exc:
        raise _Failed(EndpointProblem.UNREACHABLE, f"{what} failed: {_short(str(exc) or type(exc).__name__)}") from exc
    if response.status_code in (401, 403):
        sent = "authorization" in client.headers
        detail = f"refused the API key ({response.status_code})" + ("" if sent else ": no key was sent")
        raise _Failed(EndpointProblem.KEY_REFUSED, detail)
    return response


async def _bounded(
    client: httpx.AsyncClient, method: str, url: str, what: str, body: JsonObject | None
) -> httpx.Response:
    """The response with its body read, up to ``_MAX_BODY_BYTES``: a longer answer is a :class:`_Failed`."""
    async with client.stream(method, url, json=body) as streamed:
        content = bytearray()
        async for chunk in streamed.aiter_bytes():
            content += chunk
            if len(content) > _MAX_BODY_BYTES:
                raise _Failed(
                    EndpointProblem.HTTP_ERROR,
                    f"{what} answered more than {_MAX_BODY_BYTES >> 20} MiB (HTTP {streamed.status_code}); an "
                    "OpenAI-compatible server's answer to it is a few KiB",
                )
    return httpx.Response(
        streamed.status_code, headers=streamed.headers, content=bytes(content), request=streamed.request
    )


def _json(response: httpx.Response, what: str) -> object:
    if response.status_code != 200:
        raise _Failed(
            EndpointProblem.HTTP_ERROR, f"{what} answered HTTP {response.status_code}: {_error_message(response)}"
        )
    try:
        return response.json()
    except RecursionError:
        raise _Failed(EndpointProblem.HTTP_ERROR, f"{what} answered HTTP 200 with JSON nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer too long to convert
        raise _Failed(
            EndpointProblem.HTTP_ERROR, f"{what} answered HTTP 200 with a body that is not JSON ({_describe(exc)})"
        ) from exc


def _served_models(body: object) -> tuple[str, ...]:
    """The ``id`` of every model card, each checked to be a string."""
    what = "GET /v1/models"
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise _Failed(EndpointProblem.HTTP_ERROR, f"{what} answered without a 'data' list of models")
    names = []
    for i, card in enumerate(data):
        if not isinstance(card, dict):
            raise _bad(what, f"data[{i}]", card, "a model card (an object)")
        if not isinstance(card.get("id"), str):
            raise _bad(what, f"data[{i}].id", card.get("id"), "a model name (a string)")
        length = card.get("max_model_len")
        if length is not None and not (_is_token_id(length) and length > 0):
            raise _bad(what, f"data[{i}].max_model_len", length, "a positive context length")
        names.append(card["id"])
    return tuple(names)


def _check_token_data(body: object) -> None:
    """A one-token chat answer must carry logprobs (``token_id:<int>`` labels) and ``token_ids``, each checked."""
    what = "the one-token chat completion"
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Failed(EndpointProblem.HTTP_ERROR, "the chat completion answer has no choices")
    choice = choices[0]
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if content is None or content == []:
        raise _Failed(
            EndpointProblem.NO_LOGPROBS,
            "the server returns no logprobs (choices[0].logprobs.content is empty for logprobs=true); "
            "Gym needs per-token logprobs: serve the model with vLLM or `gym-bridge serve`",
        )
    if not isinstance(content, list):
        raise _bad(what, "choices[0].logprobs.content", content, "a list of token entries")
    for i, item in enumerate(content):
        where = f"choices[0].logprobs.content[{i}]"
        if not isinstance(item, dict):
            raise _bad(what, where, item, "a token entry (an object)")
        if not _is_logprob(item.get("logprob")):
            raise _bad(what, f"{where}.logprob", item.get("logprob"), "a finite number <= 0")
        if not isinstance(item.get("token"), str):
            raise _bad(what, f"{where}.token", item.get("token"), "a string")
    token_ids = choice.get("token_ids")
    if token_ids is None or token_ids == []:
        raise _Failed(
            EndpointProblem.NO_TOKEN_IDS,
            "the server returns no token ids "
            "(no choices[0].token_ids for return_token_ids=true; vLLM >= 0.10.2 has it)",
        )
    _check_ids(what, "choices[0].token_ids", token_ids)
    if len(token_ids) != len(content):
        raise _bad(what, "choices[0].token_ids", token_ids, f"{len(content)} token ids, one per logprob entry")
    finish = choice.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise _bad(what, "choices[0].finish_reason", finish, "a finish reason (stop, length, ...)")
    if not all(item["token"].startswith(_TOKEN_ID_PREFIX) for item in content):
        raise _Failed(
            EndpointProblem.NO_TOKEN_IDS,
            "the server ignores return_tokens_as_token_ids (logprob tokens are not 'token_id:<int>'); "
            "Gym reads generated token ids from them",
        )
    for i, item in enumerate(content):
        label = item["token"].removeprefix(_TOKEN_ID_PREFIX)
        if not (label.isascii() and label.isdigit() and len(label) <= 10 and int(label) < _TOKEN_ID_LIMIT):
            raise _bad(what, f"choices[0].logprobs.content[{i}].token", item["token"], "'token_id:<a token id>'")


def _check_ids(what: str, field: str, ids: object) -> None:
    """``ids`` must be a list of token ids (ints in ``[0, 2**31)``, no bools); the first wrong one is named."""
    if not isinstance(ids, list):
        raise _bad(what, field, ids, "a list of token ids")
    for i, value in enumerate(ids):
        if not _is_token_id(value):
            raise _bad(what, f"{field}[{i}]", value, f"a token id (an int in [0, {_TOKEN_ID_LIMIT}))")


async def _check(client: httpx.AsyncClient, base_url: str, model_name: str, tools: bool) -> tuple[str, ...]:
    """The served model names, once every check passed; raises :class:`_Failed` at the first problem."""
    base = base_url.rstrip("/")
    served = _served_models(_json(await _send(client, "GET", f"{base}/models", "GET /v1/models"), "GET /v1/models"))
    if model_name not in served:
        names = _short(", ".join(repr(name) for name in served[:_MAX_NAMES])) or "no model"
        if len(served) > _MAX_NAMES:
            names += f" and {len(served) - _MAX_NAMES} more"
        raise _Failed(
            EndpointProblem.MODEL_NOT_SERVED,
            f"does not serve model {_short(repr(model_name))}; it serves {names} (set model_name to the served name)",
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
    _check_token_data(_json(await _send(client, "POST", f"{base}/chat/completions", what, body=chat), what))
    what = "POST /tokenize"
    response = await _send(
        client,
        "POST",
        f"{base.removesuffix('/v1')}/tokenize",
        what,
        body={"model": model_name, "messages": _PROBE_MESSAGES},
    )
    if response.status_code in (404, 405):
        raise _Failed(
            EndpointProblem.NO_TOKENIZE,
            f"the server has no /tokenize (HTTP {response.status_code}); Gym's vllm_model reads prompt token ids there",
        )
    body = _json(response, what)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not tokens:
        raise _Failed(EndpointProblem.NO_TOKENIZE, "POST /tokenize answered without a 'tokens' list")
    _check_ids(what, "tokens", tokens)
    if tools:
        what = "a chat completion with tools"
        response = await _send(client, "POST", f"{base}/chat/completions", what, body={**chat, "tools": [_PROBE_TOOL]})
        if 400 <= response.status_code < 500:
            raise _Failed(
                EndpointProblem.TOOLS_REFUSED,
                f"refuses chats with tools (HTTP {response.status_code}: {_error_message(response)}); "
                f"start vLLM with {VLLM_TOOL_FLAGS}",
            )
        _json(response, what)
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
        except _Failed as failed:
            problem, detail, served = failed.problem, failed.detail, failed.served
        except TimeoutError:
            problem, detail = EndpointProblem.TIMEOUT, f"the checks did not finish within {timeout_s:g} s"
        except Exception as exc:  # a fault of the endpoint's answer that no check above names: still one line
            problem, detail = EndpointProblem.BAD_ANSWER, f"the check failed on its answer: {_describe(exc)}"
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
