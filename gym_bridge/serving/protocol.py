"""Request models of the OpenAI-compatible endpoints (vLLM's dialect).

Every model accepts unknown fields (``extra="allow"``) like vLLM does, so clients
that send vendor fields (Gym's ``extra_body``, ``mm_processor_kwargs`` …) are not
refused. Responses are plain dicts built in :mod:`gym_bridge.serving.app`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

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


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingFields(_Request):
    """Sampling fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    """vLLM's per-request seed (a signed 64-bit int): the request samples from its own generator."""
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
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
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
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
