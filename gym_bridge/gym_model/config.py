"""The model server's settings: the keys of its Gym config entry, read from the env Gym starts it with."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject

CONFIG_DICT_ENV = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_ENV = "NEMO_GYM_CONFIG_PATH"
_SERVER_TYPE = "responses_api_models"


class GymModelConfigError(GymBridgeError, RuntimeError):
    """The environment does not hold the config NeMo-Gym's launcher gives the servers it starts."""


class GymModelConfig(BaseModel):
    """``vllm_model``'s keys (same names, same meaning) plus what the local render needs.

    Gym adds ``entrypoint``, ``host``, ``port`` and others to every server entry;
    keys this server does not use are ignored.
    """

    model_config = ConfigDict(extra="ignore")

    name: str = "policy_model"
    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)
    base_url: list[str] = Field(min_length=1)
    """OpenAI-compatible endpoints, each ending in ``/v1`` (a string is one endpoint)."""
    api_key: SecretStr = SecretStr("dummy_key")
    """Sent to the endpoints as a ``Bearer`` token (Gym's ``policy_api_key``); never logged."""
    model: str
    """The name sent upstream (Gym's ``policy_model_name``)."""
    return_token_id_information: bool = True
    uses_reasoning_parser: bool = False
    """``<think>`` in a generation becomes a reasoning item (and is moved out of earlier turns)."""
    uses_interleaved_reasoning: bool = True
    replace_developer_role_with_system: bool = False
    chat_template_kwargs: JsonObject | None = None
    extra_body: JsonObject | None = None
    tokenizer: str | None = None
    """Tokenizer path or hub id for the local chat-template render; None: the upstream's ``/v1/models`` ``root``."""
    max_model_len: int | None = Field(None, gt=0)
    """None: the upstream's ``/v1/models`` ``max_model_len``."""
    max_connections: int = Field(1024, gt=0)
    """Connections per upstream."""
    request_timeout_s: float = Field(1800.0, gt=0)
    retry_budget_s: float = Field(300.0, ge=0)
    """How long unreachable / overloaded upstreams are retried before the turn fails (Gym retries forever)."""
    session_affinity: bool = True
    """Keep every model call of one rollout on one ``base_url`` while it is healthy (its prefix cache stays warm);
    False sends each call to the least-loaded one, as a router without sessions does (what
    ``benchmarks/workplace_assistant.py --no-affinity`` measures)."""
    session_affinity_header: str | None = Field("X-Session-ID", pattern=r"^[A-Za-z0-9-]{1,64}$")
    """The header every model call of one rollout carries with the rollout's session key (Gym 0.7's rollout id, else
    this server's session cookie), as Gym #2570 proposes, so a router in front of several replicas keeps a rollout on
    one; None sends none. This server's own routing over ``base_url`` follows ``session_affinity`` either way."""

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        urls = [value] if isinstance(value, str) else value
        return [u.rstrip("/") for u in urls] if isinstance(urls, list) else urls


def load_from_gym_env(environ: dict[str, str] | None = None) -> GymModelConfig:
    """This server's entry of the config Gym passes to every server it starts (``NEMO_GYM_CONFIG_*``)."""
    from omegaconf import DictConfig, OmegaConf

    env = os.environ if environ is None else environ
    try:
        text, name = env[CONFIG_DICT_ENV], env[CONFIG_PATH_ENV]
    except KeyError as exc:
        raise GymModelConfigError(f"{exc.args[0]} is not set: this server is started by NeMo-Gym's launcher") from None
    config = OmegaConf.create(text)
    if not isinstance(config, DictConfig):
        raise GymModelConfigError(f"{CONFIG_DICT_ENV} is not a mapping of server names to configs")
    entry = config.get(name)
    if entry is None or _SERVER_TYPE not in entry or not entry[_SERVER_TYPE]:
        raise GymModelConfigError(f"the Gym config has no {name}.{_SERVER_TYPE} entry")
    impl = next(iter(entry[_SERVER_TYPE]))
    values = OmegaConf.to_container(entry[_SERVER_TYPE][impl], resolve=True)
    assert isinstance(values, dict)
    values.setdefault("name", name)
    return GymModelConfig.model_validate(values)
