"""An endpoint's answers to :mod:`gym_bridge.preflight`, read as untrusted: bounded bodies, every field checked.

A request goes through :func:`send` (a transport failure or a refused key is a :class:`ProbeFailed` naming it;
an answer over ``_MAX_BODY_BYTES`` is one too), its body through :func:`json_body`, and each answer's fields are
type-checked (token ids ints in ``[0, 2**31)``, never bools, one per logprob; logprobs finite numbers <= 0; a known
finish reason; a positive ``max_model_len``; names strings), so a wrong one is a :class:`ProbeFailed` with
:attr:`EndpointProblem.BAD_ANSWER` naming the field. Every detail is one short printable line (:func:`short`).
"""

from __future__ import annotations

import json
import math
from enum import StrEnum

import httpx

from gym_bridge.failures import GymBridgeError
from gym_bridge.generation.upstream_answer import FINISH_REASONS
from gym_bridge.json_types import JsonObject

_MAX_DETAIL_CHARS = 300
_MAX_BODY_BYTES = 4 << 20
"""The most of one answer a check reads: an endpoint that streams without end must not fill memory."""
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


class ProbeFailed(GymBridgeError):
    """A preflight check failed: its problem, a one-line detail, and the served names when they were read."""

    def __init__(self, problem: EndpointProblem, detail: str, served: tuple[str, ...] = ()) -> None:
        super().__init__(detail)
        self.problem = problem
        self.detail = detail
        self.served = served


def short(text: str) -> str:
    """One printable line of at most ``_MAX_DETAIL_CHARS``: whitespace runs become one space, and control or other
    unprintable characters their escapes (an endpoint's text must not split the line or drive the terminal)."""
    text = " ".join(text.split())
    text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return text if len(text) <= _MAX_DETAIL_CHARS else text[: _MAX_DETAIL_CHARS - 3] + "..."


def error_message(response: httpx.Response) -> str:
    """The server's own message from an error body (OpenAI/vLLM ``error.message``, FastAPI ``detail``)."""
    try:
        body = response.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or an integer too long to convert
        return short(response.text) or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            return short(error["message"])
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str) and body[key]:
                return short(body[key])
    return short(response.text)


def _shown(value: object) -> str:
    """A short, printable picture of a JSON value from an answer (a 5,000-digit integer has no ``str``)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return short(repr(value[:40] + ("..." if len(value) > 40 else "")))
    return "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else type(value).__name__


def _bad(what: str, field: str, value: object, wanted: str) -> ProbeFailed:
    """The failure of an answer whose ``field`` holds ``value`` where ``wanted`` belongs."""
    return ProbeFailed(EndpointProblem.BAD_ANSWER, f"{what} answered {field} = {_shown(value)}, not {wanted}")


def _is_token_id(value: object) -> bool:
    """An int in ``[0, 2**31)`` that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _TOKEN_ID_LIMIT


def _is_logprob(value: object) -> bool:
    """A finite number <= 0 that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value <= 0


def describe(exc: BaseException) -> str:
    """``<type>: <message>`` as one short line, whatever the exception's ``str`` does."""
    try:
        text = str(exc)
    except Exception:  # an exception whose message cannot be rendered still names its type
        text = ""
    return short(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def send(
    client: httpx.AsyncClient, method: str, url: str, what: str, *, body: JsonObject | None = None
) -> httpx.Response:
    """``method url`` with ``body`` as JSON; a transport failure or a refused key is a :class:`ProbeFailed`."""
    try:
        response = await _bounded(client, method, url, what, body)
    except httpx.ConnectError as exc:
        reason = "connection refused" if _refused(exc) else short(str(exc) or type(exc).__name__)
        raise ProbeFailed(EndpointProblem.UNREACHABLE, f"nothing answers ({reason})") from exc
    except httpx.TimeoutException as exc:
        raise ProbeFailed(
            EndpointProblem.TIMEOUT, f"no answer to {what} within the timeout ({type(exc).__name__})"
        ) from exc
    except httpx.HTTPError as exc:
        raise ProbeFailed(
            EndpointProblem.UNREACHABLE, f"{what} failed: {short(str(exc) or type(exc).__name__)}"
        ) from exc
    if response.status_code in (401, 403):
        sent = "authorization" in client.headers
        detail = f"refused the API key ({response.status_code})" + ("" if sent else ": no key was sent")
        raise ProbeFailed(EndpointProblem.KEY_REFUSED, detail)
    return response


async def _bounded(
    client: httpx.AsyncClient, method: str, url: str, what: str, body: JsonObject | None
) -> httpx.Response:
    """The response with its body read, up to ``_MAX_BODY_BYTES``: a longer answer is a :class:`ProbeFailed`."""
    async with client.stream(method, url, json=body) as streamed:
        content = bytearray()
        async for chunk in streamed.aiter_bytes():
            content += chunk
            if len(content) > _MAX_BODY_BYTES:
                raise ProbeFailed(
                    EndpointProblem.HTTP_ERROR,
                    f"{what} answered more than {_MAX_BODY_BYTES >> 20} MiB (HTTP {streamed.status_code}); an "
                    "OpenAI-compatible server's answer to it is a few KiB",
                )
    return httpx.Response(
        streamed.status_code, headers=streamed.headers, content=bytes(content), request=streamed.request
    )


def json_body(response: httpx.Response, what: str) -> object:
    if response.status_code != 200:
        raise ProbeFailed(
            EndpointProblem.HTTP_ERROR, f"{what} answered HTTP {response.status_code}: {error_message(response)}"
        )
    try:
        return response.json()
    except RecursionError:
        raise ProbeFailed(EndpointProblem.HTTP_ERROR, f"{what} answered HTTP 200 with JSON nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer too long to convert
        raise ProbeFailed(
            EndpointProblem.HTTP_ERROR, f"{what} answered HTTP 200 with a body that is not JSON ({describe(exc)})"
        ) from exc


def served_models(body: object) -> tuple[str, ...]:
    """The ``id`` of every model card, each checked to be a string."""
    what = "GET /v1/models"
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ProbeFailed(EndpointProblem.HTTP_ERROR, f"{what} answered without a 'data' list of models")
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


def check_token_data(body: object) -> None:
    """A one-token chat answer must carry logprobs (``token_id:<int>`` labels) and ``token_ids``, each checked."""
    what = "the one-token chat completion"
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ProbeFailed(EndpointProblem.HTTP_ERROR, "the chat completion answer has no choices")
    choice = choices[0]
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if content is None or content == []:
        raise ProbeFailed(
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
        raise ProbeFailed(
            EndpointProblem.NO_TOKEN_IDS,
            "the server returns no token ids "
            "(no choices[0].token_ids for return_token_ids=true; vLLM >= 0.10.2 has it)",
        )
    check_ids(what, "choices[0].token_ids", token_ids)
    if len(token_ids) != len(content):
        raise _bad(what, "choices[0].token_ids", token_ids, f"{len(content)} token ids, one per logprob entry")
    finish = choice.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise _bad(what, "choices[0].finish_reason", finish, "a finish reason (stop, length, ...)")
    if not all(item["token"].startswith(_TOKEN_ID_PREFIX) for item in content):
        raise ProbeFailed(
            EndpointProblem.NO_TOKEN_IDS,
            "the server ignores return_tokens_as_token_ids (logprob tokens are not 'token_id:<int>'); "
            "Gym reads generated token ids from them",
        )
    for i, item in enumerate(content):
        label = item["token"].removeprefix(_TOKEN_ID_PREFIX)
        if not (label.isascii() and label.isdigit() and len(label) <= 10 and int(label) < _TOKEN_ID_LIMIT):
            raise _bad(what, f"choices[0].logprobs.content[{i}].token", item["token"], "'token_id:<a token id>'")


def check_ids(what: str, field: str, ids: object) -> None:
    """``ids`` must be a list of token ids (ints in ``[0, 2**31)``, no bools); the first wrong one is named."""
    if not isinstance(ids, list):
        raise _bad(what, field, ids, "a list of token ids")
    for i, value in enumerate(ids):
        if not _is_token_id(value):
            raise _bad(what, f"{field}[{i}]", value, f"a token id (an int in [0, {_TOKEN_ID_LIMIT}))")
