"""NemoGymConfig: what a NemoGym actor starts (Gym configs, endpoints, bounds) and how it talks to it.

Kept apart from the actor so that drivers, CLIs and configs import it without the
actor's HTTP stack; :func:`actor_configs` derives one config per actor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from gym_bridge.failures import SettingError
from gym_bridge.gym.protocol.convert import DEFAULT_INVALID_TOOL_CALL_PATTERNS, DEFAULT_THINKING_TAGS
from gym_bridge.gym.protocol.token_capture import capture_block
from gym_bridge.gym.servers.server_config import GymServersConfig, head_address
from gym_bridge.json_types import JsonObject

# NeMo-RL's defaults for Gym's own aiohttp pools (Gym's agents fan out to models and tools).
_GYM_CONNECTOR_DEFAULTS = {
    "global_aiohttp_connector_limit_per_host": 16384,
    "global_aiohttp_connector_limit": 65536,
}
_ROUTED_EXPERTS_DTYPES = ("int8", "int16", "int32")
# NeMo-RL's options that need model features this package cannot serve or check: refused when switched on.
_REFUSED_WHEN_SET = {
    "require_routed_experts": "router replay (R3) needs routed_experts from a vLLM MoE engine; gym-bridge does not "
    "carry them",
    "use_fastokens": "fastokens patches NeMo-RL's tokenizer; gym-bridge uses the tokenizer as given",
    "tokenizer_config": "a multimodal processor for NeMo-RL's VLM Gym path; gym-bridge's Gym path is text only",
    "pad_dynamic_image_shapes": "multimodal image padding; gym-bridge's Gym path is text only",
}
# NeMo-RL's NemoGym._spinup drops these from Gym's global config: they are its own training knobs.
_NOT_FOR_GYM = ("effort_levels", "pad_dynamic_image_shapes")


class NemoGymConfig(BaseModel):
    """What the NeMo-Gym actor starts and how it talks to it."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    """The served model name; Gym's ``policy_model_name``."""
    base_urls: list[str]
    """OpenAI-compatible endpoints (``http://host:port/v1``), one per data-parallel shard."""
    api_key_env_var: str = Field("OPENAI_API_KEY", min_length=1)
    """The environment variable holding the endpoints' API key, read on the process that builds this config.
    Unset: no key (Gym sends NeMo-RL's ``"dummy_key"``), unless this name was set explicitly, which then
    requires the variable."""
    api_key: SecretStr = SecretStr("dummy_key")
    """Sent by Gym's model server to the endpoints as a ``Bearer`` token (Gym's ``policy_api_key``); never logged.
    Default: ``$api_key_env_var``. Only a ``SecretStr`` is taken: a plain string is a key written into a config
    file, which gets copied into run folders and logs."""
    config_paths: list[str] = Field(default_factory=list)
    """Gym YAML configs; absolute, or relative to the actor's cwd, else to the nemo-gym wheel."""
    overrides: JsonObject = Field(default_factory=dict)
    """Merged into Gym's global config last."""
    host: str = "127.0.0.1"
    startup_timeout_s: float = Field(180.0, gt=0)
    shutdown_timeout_s: float = Field(30.0, gt=0)
    request_timeout_s: float | None = Field(1800.0, gt=0)
    """Bound on one ``/run`` call (Gym itself never times out); None waits forever."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Bound on connecting to an agent; a model endpoint refusing connections this long while rows
    are in flight fails the stream (``EndpointUnavailable``)."""
    health_poll_s: float = Field(1.0, gt=0)
    """How often Gym's processes are checked while rows are in flight."""
    max_gym_server_restarts: int = Field(3, ge=0, le=100)
    """How often each Gym server this actor started is started again after it exits (the rows it held are re-sent
    once it answers); one more exit stops the run naming the server and its log. 0: a dead server stops the run."""
    max_connections: int = Field(1024, gt=0)
    """Our client's connection pool towards the agent servers; rows beyond it wait for a free
    connection (under ``request_timeout_s``, not ``connect_timeout_s``)."""
    on_drift: Literal["raise", "truncate"] = "raise"
    invalid_tool_call_patterns: tuple[str, ...] = DEFAULT_INVALID_TOOL_CALL_PATTERNS
    thinking_tags: tuple[str, ...] = DEFAULT_THINKING_TAGS
    log_dir: Path | None = None
    server_dirs: dict[str, Path] = Field(default_factory=dict)
    """Gym server folders of your own, ``"<server_type>/<impl>" -> folder`` (an agent or resources server that
    is not in the nemo-gym wheel), visible to Gym's config lookup without copying anything into site-packages."""
    """Per-server Gym logs; default ``<cwd>/gym-logs/...``."""
    actor_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to ``ray.remote(NemoGym).options(...)`` (``num_cpus``, ``max_restarts``, ``scheduling_strategy``, ...);
    ``max_concurrency`` defaults to 65,536 (one call per group in flight), not Ray's 1,000."""
    on_restart: Literal["fail", "respin"] = "fail"
    """After Ray restarts the actor: raise :class:`~gym_bridge.failures.NemoGymRestarted` ("fail"),
    or start fresh Gym servers ("respin")."""
    model_server: Literal["vllm_model", "gym_bridge"] = "vllm_model"
    """Gym's model server: its own ``vllm_model`` as ``config_paths`` name it, or gym-bridge's
    (:mod:`gym_bridge.gym_model`: token-faithful, one hop, leaner), which replaces the ``vllm_model`` config."""
    gym_head: str | None = None
    """The head server of a NeMo-Gym that is already running (``http://host:port``; ``gym env start`` and ``ng_run``
    print it), as ``gym eval run --no-serve`` takes it: the actor uses that Gym's servers and config (read from its
    head server) and starts and stops none of them. That Gym's model server calls the endpoints its own config names
    (``policy_base_url``), so ``base_urls`` should be those (they are preflighted and watched; a difference is logged).
    ``config_paths``, ``overrides``, ``server_dirs``, ``model_server="gym_bridge"`` and a port range would change
    that Gym's config and are refused with it."""

    # ---- NeMo-RL's NemoGymConfig keys -------------------------------------------------------------
    initial_global_config_dict: JsonObject | None = None
    """NeMo-RL's name for Gym's global config: its ``config_paths`` join ours, the rest joins ``overrides``."""
    port_range_low: int | None = Field(None, ge=1, le=65535)
    """With ``port_range_high``: where Gym picks its servers' ports and ours the head server's (default: a free
    window of ours)."""
    port_range_high: int | None = Field(None, ge=1, le=65535)
    require_routed_experts: bool = False
    routed_experts_dtype: str = "int16"
    use_fastokens: bool = False
    tokenizer_config: JsonObject | None = None
    pad_dynamic_image_shapes: bool = False

    @field_validator("invalid_tool_call_patterns", "thinking_tags", mode="before")
    @classmethod
    def _none_is_the_default(cls, value: object, info: ValidationInfo) -> object:
        """NeMo-RL's ``None`` (or an empty list) means "the defaults"."""
        empty = value is None or (isinstance(value, (list, tuple)) and not value)
        return cls.model_fields[info.field_name].default if empty and info.field_name else value

    @field_validator("api_key", mode="before")
    @classmethod
    def _no_literal_key(cls, value: object) -> object:
        if isinstance(value, str):
            raise SettingError(
                "api_key is not taken as text (a config file is copied into run folders); put the key in an "
                "environment variable and name it with api_key_env_var (default OPENAI_API_KEY)"
            )
        return value

    @model_validator(mode="after")
    def _key_from_environment(self) -> NemoGymConfig:
        """``api_key`` from ``$api_key_env_var`` unless given; a variable named explicitly must be set."""
        if "api_key" in self.model_fields_set:
            return self
        value = os.environ.get(self.api_key_env_var, "")
        if value:
            self.api_key = SecretStr(value)
        elif "api_key_env_var" in self.model_fields_set:
            raise SettingError(f"api_key_env_var: the environment variable {self.api_key_env_var} is not set")
        return self

    @field_validator("routed_experts_dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in _ROUTED_EXPERTS_DTYPES:
            raise SettingError(
                f"routed_experts_dtype must be one of {', '.join(_ROUTED_EXPERTS_DTYPES)}, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _nemo_rl_keys(self) -> NemoGymConfig:
        """Refuse NeMo-RL's model-feature options when switched on; fold its global-config dict into ours."""
        for name, why in _REFUSED_WHEN_SET.items():
            if getattr(self, name):
                raise SettingError(f"{name} is not supported: {why}")
        if (self.port_range_low is None) != (self.port_range_high is None):
            raise SettingError("set port_range_low and port_range_high together")
        low, high = self.port_range_low, self.port_range_high
        if low is not None and high is not None and high <= low:
            raise SettingError(f"port_range_high ({self.port_range_high}) must exceed port_range_low ({low})")
        if self.initial_global_config_dict:
            initial = dict(self.initial_global_config_dict)
            if initial.get("pad_dynamic_image_shapes"):
                raise SettingError(
                    f"pad_dynamic_image_shapes is not supported: {_REFUSED_WHEN_SET['pad_dynamic_image_shapes']}"
                )
            for key in _NOT_FOR_GYM:
                initial.pop(key, None)
            paths = initial.pop("config_paths", None) or []
            self.config_paths = [*self.config_paths, *(p for p in paths if p not in self.config_paths)]
            self.overrides = {**initial, **self.overrides}
            self.initial_global_config_dict = None
        capture_block(self.overrides)  # refuses what the installed Gym cannot capture, in one line
        if self.gym_head is not None:
            head_address(self.gym_head)
            changes = [name for name in ("config_paths", "overrides", "server_dirs") if getattr(self, name)]
            changes += ["model_server"] if self.model_server != "vllm_model" else []
            changes += ["port_range_low", "port_range_high"] if self.port_range_low is not None else []
            if changes:
                raise SettingError(
                    f"gym_head: a running Gym keeps the config it was started with; {', '.join(changes)} would change "
                    "it (give them to the command that starts that Gym, or leave gym_head out to start one here)"
                )
        return self

    def servers_config(self) -> GymServersConfig:
        """The Gym server set this actor starts (or, with ``gym_head``, attaches to); with a port range, the launcher
        binds the head server's port in it (:func:`gym_bridge.gym.servers._launcher.claim_head_port`)."""
        common = {
            "policy_base_urls": list(self.base_urls),
            "policy_model_name": self.model_name,
            "policy_api_key": self.api_key,
            "host": self.host,
            "startup_timeout_s": self.startup_timeout_s,
            "shutdown_timeout_s": self.shutdown_timeout_s,
            "log_dir": self.log_dir,
            "max_restarts": self.max_gym_server_restarts,
        }
        if self.gym_head is not None:
            return GymServersConfig(head_url=self.gym_head, **common)
        overrides = {**_GYM_CONNECTOR_DEFAULTS, **self.overrides}
        if self.port_range_low is not None and self.port_range_high is not None:
            overrides.update(port_range_low=self.port_range_low, port_range_high=self.port_range_high)
        config_paths, server_dirs = list(self.config_paths), dict(self.server_dirs)
        if self.model_server == "gym_bridge":
            from gym_bridge import gym_model

            config_paths = gym_model.swap_model_config(config_paths)
            server_dirs[gym_model.SERVER_KEY] = gym_model.SERVER_DIR
        return GymServersConfig(config_paths=config_paths, server_dirs=server_dirs, overrides=overrides, **common)


def actor_configs(config: NemoGymConfig, num_actors: int, *, split_base_urls: bool = False) -> list[NemoGymConfig]:
    """One config per actor: its own log folder, and all endpoints or a round-robin share of them."""
    if num_actors < 1:
        raise SettingError(f"num_actors must be >= 1, got {num_actors}")
    if split_base_urls and len(config.base_urls) < num_actors:
        raise SettingError(
            f"split_base_urls needs at least one endpoint per actor: {len(config.base_urls)} base_urls "
            f"for {num_actors} actors"
        )
    if num_actors == 1:
        return [config]
    configs = []
    for i in range(num_actors):
        update: dict[str, object] = {}
        if config.log_dir is not None:
            update["log_dir"] = config.log_dir / f"actor-{i}"
        if split_base_urls:
            update["base_urls"] = config.base_urls[i::num_actors]
        configs.append(config.model_copy(update=update))
    return configs
