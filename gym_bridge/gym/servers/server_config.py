"""What a GymServers set starts (:class:`GymServersConfig`), or the running Gym it attaches to, and where the head
server listens (Gym's config files are read in :mod:`gym_bridge.gym.servers.config_files`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from gym_bridge.failures import SettingError
from gym_bridge.json_types import JsonObject

logger = logging.getLogger(__name__)


class HeadServerAddress(NamedTuple):
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def head_address(url: str) -> HeadServerAddress:
    """The address of a running Gym's head server given as ``http://host:port`` (what ``gym eval run --no-serve``
    reaches: Gym's ``head_server.host`` / ``head_server.port``); :class:`SettingError` in one line otherwise."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (
        parts is None
        or parts.scheme != "http"
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username
    ):
        raise SettingError(
            f"a running Gym's head server is given as http://host:port (Gym's head_server.host and .port), got {url!r}"
        )
    return HeadServerAddress(parts.hostname, port)


class GymServersConfig(BaseModel):
    """What to start. ``overrides`` is merged last, over everything this class sets."""

    model_config = ConfigDict(extra="forbid")

    config_paths: list[str] = Field(default_factory=list)
    """Gym YAML configs; a relative path is tried in the cwd, then in the wheel (as Gym does)."""
    overrides: JsonObject = Field(default_factory=dict)
    """Merged into Gym's global config, like ``initial_global_config_dict``."""
    policy_base_urls: list[str] = Field(default_factory=list)
    """OpenAI-compatible endpoints, each ending in ``/v1``; Gym's ``policy_base_url``."""
    policy_model_name: str = ""
    policy_api_key: SecretStr = SecretStr("dummy_key")
    host: str = "127.0.0.1"
    """Gym's ``default_host`` and the head server's host."""
    startup_timeout_s: float = Field(120.0, gt=0)
    shutdown_timeout_s: float = Field(30.0, gt=0)
    """How long SIGTERM may take before SIGKILL."""
    max_restarts: int = Field(3, ge=0, le=100)
    """How often each server of a ready set is started again after it exits; one more exit stops the run
    (:class:`~gym_bridge.failures.errors.GymServerCrashLoop`). 0: a dead server stops the run."""
    log_dir: Path | None = None
    """Per-server log files; default ``./gym-logs/<timestamp>-<pid>-<n>``."""
    ray_address: str | None = None
    """Ray GCS address the servers join; None: the running Ray's, else the servers skip Ray."""
    use_ray: bool = True
    """False: the servers neither start nor join a Ray cluster (fine for servers that never use Ray)."""
    fork_servers: bool = True
    """Fork each server from one process that imported NeMo-Gym's dependencies once (``gym/servers/_forkserver.py``)
    instead of a fresh ``python app.py`` each; False for servers that need a fresh interpreter."""
    load_env_yaml: bool = False
    """Whether Gym also reads ``env.yaml`` from the cwd or the wheel."""
    server_dirs: dict[str, Path] = Field(default_factory=dict)
    """Extra server folders, ``"<server_type>/<impl>" -> folder``, for Gym's cwd-first lookup: Gym then
    runs in a private folder linking these and the caller's own ``<server_type>/<impl>`` folders."""
    head_url: str | None = None
    """The head server of a NeMo-Gym that is already running (``http://host:port``, as ``gym env start`` serves it):
    attach to it instead of starting a set. Its servers and its config (read from the head server) are used as they
    are; none is started and none is stopped. ``config_paths``, ``overrides`` and ``server_dirs`` are refused with it
    (the running Gym's config is its own); the policy fields are those that Gym was started with, not these."""

    @model_validator(mode="after")
    def _attach_takes_no_config(self) -> GymServersConfig:
        if self.head_url is None:
            return self
        head_address(self.head_url)
        given = [name for name in ("config_paths", "overrides", "server_dirs") if getattr(self, name)]
        if given:
            raise SettingError(
                f"head_url: a running Gym keeps the config it was started with; {', '.join(given)} would change it "
                "(give them to the command that starts that Gym instead)"
            )
        return self

    @model_validator(mode="after")
    def _policy_fields_win(self) -> GymServersConfig:
        """Gym's ``policy_base_url``, ``policy_model_name`` and ``policy_api_key`` come from the fields above
        whenever they are set, whatever ``overrides`` say: NeMo-RL's NemoGym actor overwrites the same three
        keys of the global config from its own config (``environments/nemo_gym.py``). ``policy_api_key`` is
        always set. An override that differs is dropped with a warning naming the key, never its value."""
        ours: JsonObject = {"policy_api_key": self.policy_api_key.get_secret_value()}
        if self.policy_base_urls:
            ours["policy_base_url"] = list(self.policy_base_urls)
        if self.policy_model_name:
            ours["policy_model_name"] = self.policy_model_name
        shadowed = [key for key in ours if key in self.overrides]
        if not shadowed:
            return self
        differ = sorted(key for key in shadowed if _as_global(key, self.overrides[key]) != ours[key])
        if differ:
            logger.warning(
                "Gym global config %s ignored: the actor config sets %s (as NeMo-RL's NemoGym actor does)",
                ", ".join(differ),
                "it" if len(differ) == 1 else "them",
            )
        self.overrides = {key: value for key, value in self.overrides.items() if key not in shadowed}
        return self


def _as_global(key: str, value: object) -> object:
    """An override's value as the global config would hold it (a secret's text, one URL as a one-item list)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if key == "policy_base_url" and isinstance(value, str):
        return [value]
    return list(value) if isinstance(value, tuple) else value


def deep_merge(base: JsonObject, extra: JsonObject) -> JsonObject:
    """``base`` with ``extra`` merged in, dicts recursively, ``extra`` winning (Gym's config layering)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
