"""Request models of the OpenAI-compatible endpoints (vLLM's dialect).

Every model accepts unknown fields (``extra="allow"``) like vLLM does, so clients
that send vendor fields (Gym's ``extra_body``, ``mm_processor_kwargs`` …) are not
refused. Responses are plain dicts built in :mod:`gym_bridge.serving.app`.

The sampling fields are bounded where they enter: a bool is not a number (``"temperature": true`` is a 400
naming it), and every integer fits a signed 64-bit int, as vLLM's engine carries them (``"top_k": 2**70`` is a
400). Within those bounds the engine applies vLLM's rules (:mod:`gym_bridge.generation.hf_rows`): a ``top_k``
of at least the vocabulary means every token, a temperature below ``1e-2`` (but above 0) samples at ``1e-2``.
Strings and floats anywhere in a body are checked before these models see it (:mod:`~gym_bridge.serving.bodies`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from gym_bridge.failures.errors import SettingError
from gym_bridge.json_types import JsonObject

#: Extra fields Gym puts on assistant messages of earlier turns; stripped before rendering.
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")

#: The chat roles the OpenAI API defines; any other role is a 400, as from vLLM.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_roles(messages: list[JsonObject] | None) -> None:
    """Refuse a message whose ``role`` is missing or not one of :data:`CHAT_ROLES` (naming its index).

    A :class:`SettingError` is a ``ValueError``, so pydantic reports it as a validation error of ``messages``."""
    for i, message in enumerate(messages or ()):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise SettingError(f"message {i} has role {role!r}; the roles are {', '.join(CHAT_ROLES)}")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The bounds of every integer sampling field (vLLM's engine carries them as signed 64-bit ints)."""


def not_bool(value: object) -> object:
    """Refuse a JSON ``true`` / ``false`` where a number belongs (pydantic would read it as 1 or 0)."""
    if isinstance(value, bool):
        raise SettingError(f"a number is required, got {str(value).lower()}")
    return value


#: A float or int field that refuses booleans.
type Real = Annotated[float, BeforeValidator(not_bool)]
type Integer = Annotated[int, BeforeValidator(not_bool)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingFields(_Request):
    """Sampling fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: Integer | None = Field(None, ge=1, le=INT64_MAX)
    temperature: Real | None = Field(None, ge=0.0, le=100.0)
    top_p: Real | None = Field(None, gt=0.0, le=1.0)
    top_k: Integer | None = Field(None, ge=-1, le=INT64_MAX)
    """-1 or 0: every token; at least the vocabulary: every token too (vLLM clamps it)."""
    seed: Integer | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    """vLLM's per-request seed (a signed 64-bit int): the request samples from its own generator."""
    stop: str | list[str] | None = None
    n: Integer = Field(1, ge=1, le=INT64_MAX)
    stream: bool = False
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        """The non-empty stop strings, each once, in the order sent (de-duplicated in linear time)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return list(dict.fromkeys(s for s in stops if s))


class ChatCompletionRequest(SamplingFields):
    messages: list[JsonObject] = Field(min_length=1)
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    max_completion_tokens: Integer | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: Integer | None = Field(None, ge=0, le=20)
    chat_template_kwargs: JsonObject | None = None
    required_prefix_token_ids: list[int] | None = None

    @field_validator("messages")
    @classmethod
    def _known_roles(cls, messages: list[JsonObject]) -> list[JsonObject]:
        check_roles(messages)
        return messages

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True


class TokenizeRequest(_Request):
    """Either ``prompt`` (text) or ``messages`` (a chat, rendered like chat completions)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[JsonObject] | None = None
    tools: list[JsonObject] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template_kwargs: JsonObject | None = None
    required_prefix_token_ids: list[int] | None = None

    @field_validator("messages")
    @classmethod
    def _known_roles(cls, messages: list[JsonObject] | None) -> list[JsonObject] | None:
        check_roles(messages)
        return messages


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
