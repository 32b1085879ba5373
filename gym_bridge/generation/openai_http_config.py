"""``OpenAIHTTPGenerationConfig``: the settings of :class:`~gym_bridge.generation.openai_http.OpenAIHTTPGeneration`.

Apart from the client so that the wire format (:mod:`gym_bridge.generation.completions_wire`) can read
them without importing the client.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from gym_bridge.failures import backoff_delay


class OpenAIHTTPGenerationConfig(BaseModel):
    """Settings of :class:`OpenAIHTTPGeneration`; ``api_key`` never appears in repr or logs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_urls: list[str] = Field(min_length=1, description="Each including the /v1 suffix.")
    model: str = Field(description="The served model name.")
    max_new_tokens: int = Field(256, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, description="None: not sent.")
    stop_token_ids: list[int] | None = Field(None, description="None: not sent (the server's default).")
    stop_strings: list[str] | None = None
    pad_token_id: int = 0
    request_timeout_s: float = Field(300.0, gt=0.0, description="Bound on one attempt of one request.")
    connect_timeout_s: float = Field(5.0, gt=0.0)
    max_connections: int = Field(64, ge=1, description="Concurrent requests per base URL.")
    max_retries: int = Field(3, ge=0, description="Retries after the first attempt, infra failures only.")
    backoff_base_s: float = Field(0.5, ge=0.0)
    max_backoff_s: float = Field(10.0, ge=0.0)
    unhealthy_cooldown_s: float = Field(10.0, ge=0.0, description="How long a URL that refused connections is avoided.")
    max_sessions: int = Field(100_000, ge=1, description="Size of the LRU session table.")
    api_key: SecretStr | None = None

    @field_validator("base_urls")
    @classmethod
    def _strip_slash(cls, urls: list[str]) -> list[str]:
        return [u.rstrip("/") for u in urls]

    def backoff_for(self, retry: int) -> float:
        """Sleep before retry number ``retry`` (1-based): ``min(base * 2**(retry-1), max)``."""
        return backoff_delay(retry, self.backoff_base_s, self.max_backoff_s)
