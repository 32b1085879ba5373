"""NeMo-Gym's nested error chains made readable, and the typed failure for a failed ``/run``.

Each Gym server answers an inner server's HTTP error with a 500 whose JSON body is the
string ``"Hit an exception in <Class>___<name> calling an inner server: b'<inner body>'"``,
the inner body written as a Python bytes literal; so the model endpoint's own error
(vLLM's JSON ``{"error": {"message": ..., "code": 404}}``) arrives escaped once per server.
:func:`unwrap_gym_error` peels the layers: the innermost message, its status when the
innermost is an OpenAI-style error, and the path of servers it came through.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gym_bridge.failures.classify import (
    AGENT_RUN_ERROR,
    gym_run_failure_class,
    gym_status_failure,
    http_status_is_infra,
    server_code_exception,
    shorten,
)
from gym_bridge.failures.errors import (
    EndpointConfigError,
    GymRunError,
    RolloutDataFailure,
    RolloutFailure,
)

_LAYER = re.compile(r"Hit an exception in (?P<server>\S+?) calling an inner server: (?P<rest>.*)", re.DOTALL)
_EXCEPTION_REPR = re.compile(r"(?P<type>[A-Za-z_][\w.]*)\((?P<arg>(?P<q>['\"]).*(?P=q))\)", re.DOTALL)
_MAX_LAYERS = 16
_MESSAGE_LIMIT = 1000

Kind = Literal["endpoint", "validation", "exception", "empty", "text"]


@dataclass(frozen=True)
class GymErrorChain:
    """One Gym error body, unwrapped: ``servers`` outermost first, the innermost ``message``."""

    servers: tuple[str, ...]
    """``"<name> (<Class>)"`` of each server the error passed through, consecutive repeats merged."""
    message: str
    """The innermost message: the endpoint's ``message``, a validation summary, or an exception."""
    kind: Kind
    """``endpoint``: an OpenAI-style JSON error; ``validation``: FastAPI's 422 ``detail``;
    ``exception``: a server's ``repr(exc)``; ``empty``: Gym kept no body; ``text``: anything else."""
    status: int | None = None
    """The innermost HTTP status when the innermost body states it (``code``), or 422 for ``detail``."""

    @property
    def path(self) -> str:
        """The servers the error came through, outermost first, ending at the model endpoint when it was one."""
        hops = list(self.servers) + (["model endpoint"] if self.kind == "endpoint" else [])
        return " > ".join(hops) if hops else "(no Gym server named)"

    def describe(self) -> str:
        """One readable line: the innermost status and message, then the path."""
        status = f"HTTP {self.status}: " if self.status is not None else ""
        return f"{status}{self.message} | via {self.path}"


def _server_label(key: str) -> str:
    cls, sep, name = key.partition("___")
    return f"{name} ({cls})" if sep else key


def _decode(text: str) -> Any:
    """``text`` as JSON, or as it is when it is not (nested past the interpreter's recursion limit included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _bytes_literal(rest: str) -> str | None:
    """The text inside a ``b'...'`` literal (Gym writes ``f"{bytes}"``), or None."""
    rest = rest.strip()
    if not (rest.startswith(("b'", 'b"')) and len(rest) >= 3):
        return None
    try:
        value = ast.literal_eval(rest)
    except (ValueError, SyntaxError):
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else None


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _innermost(value: Any) -> tuple[str, Kind, int | None]:
    if isinstance(value, dict):
        inner = value.get("error")
        error: dict[Any, Any] = inner if isinstance(inner, dict) else value
        if isinstance(error.get("message"), str):
            return error["message"], "endpoint", _int(error.get("code"))
        detail = value.get("detail")
        if isinstance(detail, list):
            parts = [
                f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
                for d in detail
            ]
            return "request rejected: " + "; ".join(parts), "validation", 422
        if isinstance(detail, str):
            return detail, "text", None
        return json.dumps(value)[:_MESSAGE_LIMIT], "text", None
    text = str(value).strip()
    if not text:
        return "the inner server's answer had no body (Gym does not keep it after its retries)", "empty", None
    match = _EXCEPTION_REPR.fullmatch(text)
    if match:
        try:
            arg = ast.literal_eval(match["arg"])
        except (ValueError, SyntaxError):
            arg = match["arg"]
        return f"{match['type']}: {arg}", "exception", None
    return text, "text", None


def unwrap_gym_error(body: bytes | str) -> GymErrorChain:
    """Peel Gym's nested error layers off a ``/run`` error body (see the module docstring)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    servers: list[str] = []
    value: Any = text
    for _ in range(_MAX_LAYERS):
        if isinstance(value, str):
            decoded = _decode(value)
            if decoded is not value and not isinstance(decoded, (int, float)) and decoded is not None:
                value = decoded
                if not isinstance(value, str):
                    break
            match = _LAYER.fullmatch(value.strip())
            if match is None:
                break
            label = _server_label(match["server"])
            if not servers or servers[-1] != label:
                servers.append(label)
            inner = _bytes_literal(match["rest"])
            value = inner if inner is not None else match["rest"]
            continue
        break
    message, kind, status = _innermost(value)
    return GymErrorChain(tuple(servers), shorten(message, _MESSAGE_LIMIT), kind, status)


def gym_run_failure(status: int, body: bytes | str, where: str) -> RolloutFailure:
    """The typed failure for Gym's ``/run`` answering ``status`` with ``body``; ``where`` names the call.

    The model endpoint's own 4xx (wrong model, rejected tools, bad request; 408 and 429
    excepted) is :class:`EndpointConfigError`: a configuration problem, never re-dispatched
    as infrastructure. A resources server's 422 (the row lacks a field it needs) is data.
    Anything else is classified by Gym's own status (:func:`gym_status_failure`), with the
    unwrapped chain as its message.
    """
    chain = unwrap_gym_error(body)
    inner = chain.status
    if chain.kind == "endpoint" and inner is not None and 400 <= inner < 500 and not http_status_is_infra(inner):
        return EndpointConfigError.build(inner, chain.message, chain.path, where)
    detail = f"{where}: {chain.describe()}"
    if chain.kind == "validation" and status >= 500:
        return RolloutDataFailure(f"NeMo-Gym /run failed with HTTP {status}: {detail}")
    return gym_status_failure(status, detail)


_LAYER_SERVER = re.compile(r"Hit an exception in (?P<server>\S+?) calling an inner server")


def agent_run_error(status: int, body: bytes | str, where: str) -> GymRunError | None:
    """The data failure for a ``/run`` that broke in Gym's own server code, as Gym's collection classes it
    (``agent_run_error``: a Gym server answered), or None when it is not one and stays infrastructure.

    A Gym server's 500 (not a gateway's 429/502/503/504) whose innermost message is an exception raised by server
    code (:func:`server_code_exception`: not a connection, timeout or cancellation) is data, with one exception:
    one raised inside the agent's model call (under two consecutive layers of one agent: its ``/run`` calling its
    own ``/v1/responses``, which called the model server) is the model server's check of the endpoint's answer
    (e.g. missing logprobs), which another endpoint may answer well: infrastructure, as before."""
    if gym_run_failure_class(status) != AGENT_RUN_ERROR or status < 500:
        return None
    chain = unwrap_gym_error(body)
    raised = server_code_exception(chain.message) if chain.kind in ("exception", "text") else None
    if raised is None:
        return None
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    layers = [match["server"] for match in _LAYER_SERVER.finditer(text)]
    if len(layers) >= 2 and layers[-1] == layers[-2]:
        return None
    return GymRunError(
        f"Gym's _ng_failure_class {AGENT_RUN_ERROR}: /run answered HTTP {status} with {raised} raised in Gym's "
        f"server code (deterministic for this row; not re-sent): {where}: {chain.describe()}"
    )
