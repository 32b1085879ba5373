"""The errors the serving layer raises on purpose, and the OpenAI-style JSON body of a refusal.

    ServingError            a request the server refuses; ``status`` is the HTTP status
     ├── 400  invalid_request_error   bad fields, context length, off-policy sampling, splice failure
     ├── 404  model not served
     ├── 413  body too large
     └── 503  the generation engine is shut down
    IncompleteGeneration    an engine ended a call without every row it was given (an engine bug: a 500)

Anything else escaping a route is a bug and becomes a 500 with the same body shape.
"""

from __future__ import annotations

from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject


class ServingError(GymBridgeError):
    """A refused request: ``message`` is shown to the client, ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class IncompleteGeneration(GymBridgeError, RuntimeError):
    """An engine's ``generate_async`` ended without yielding every row of the call (the message names them)."""


def error_body(message: str, status: int, *, param: str | None = None) -> JsonObject:
    """The body vLLM (and OpenAI) return for an error."""
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
