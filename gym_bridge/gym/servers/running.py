"""A NeMo-Gym that is already running, read from its head server: its server list, its global config, and the policy
endpoint its model server calls.

Every read is one bounded ``GET`` of the head server (Gym serves JSON; its config as a YAML string inside it), read
under a size cap through the boundary's JSON and YAML loaders. A failure is a :class:`GymStartupError` naming the head
server and the path. :class:`~gym_bridge.gym.servers.attached.AttachedGym` attaches with these readers, and a training
run reads
:func:`read_policy_endpoint` before it starts the server that Gym's model server will call.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.json_io import loads
from gym_bridge.boundary.yaml_io import MAX_CONFIG_BYTES, load_yaml
from gym_bridge.failures import GymStartupError
from gym_bridge.gym.servers.server_config import HeadServerAddress, head_address
from gym_bridge.json_types import JsonObject

HEAD_READ_TIMEOUT_S = 30.0
"""The bound on one read of the head server's config or server list."""


@dataclass(frozen=True)
class GlobalConfig:
    """A running Gym's global config as its head server serves it: the mapping (interpolations such as
    ``${policy_base_url}`` left as Gym wrote them) and the YAML text it was read from."""

    config: JsonObject
    yaml: str


@dataclass(frozen=True)
class RunningGymPolicy:
    """The policy endpoint a running Gym's model server calls, from its global config."""

    head: HeadServerAddress
    base_urls: tuple[str, ...]
    """``policy_base_url``: one URL (Gym's string form) or several (its list form), as written."""
    model_name: str | None
    """``policy_model_name``: the model Gym's model server asks for (None: its config names none)."""


def read_head(head: HeadServerAddress, path: str, timeout_s: float = HEAD_READ_TIMEOUT_S) -> Any:
    """``GET path`` of the head server as JSON, bounded in time and size; :class:`GymStartupError` naming it
    otherwise."""
    where = f"{path} of the NeMo-Gym head server at {head.url}"
    try:
        with urllib.request.urlopen(f"{head.url}{path}", timeout=timeout_s) as response:
            body = response.read(MAX_CONFIG_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise GymStartupError(f"could not read {path} from the NeMo-Gym head server at {head.url}: {exc}") from None
    if len(body) > MAX_CONFIG_BYTES:
        raise GymStartupError(f"{where} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return loads(body, where)
    except UntrustedInputError as exc:
        raise GymStartupError(str(exc)) from None


def read_global_config(head: HeadServerAddress, timeout_s: float = HEAD_READ_TIMEOUT_S) -> GlobalConfig:
    """The head server's global config (``GET /global_config_dict_yaml``: YAML inside a JSON string), as plain data
    read through the boundary's YAML loader."""
    text = read_head(head, "/global_config_dict_yaml", timeout_s)
    where = f"the global config of the head server at {head.url}"
    try:
        config = load_yaml(text, where) if isinstance(text, str) else None
    except UntrustedInputError as exc:
        raise GymStartupError(str(exc)) from None
    if not isinstance(config, dict):
        raise GymStartupError(f"the head server at {head.url} served no global config mapping")
    return GlobalConfig(config, text)


def read_policy_endpoint(head_url: str, timeout_s: float = HEAD_READ_TIMEOUT_S) -> RunningGymPolicy:
    """The endpoint the model server of the Gym whose head server is ``head_url`` calls: its global config's
    ``policy_base_url`` (a string or a list of strings) and ``policy_model_name``.

    Raises:
        SettingError: ``head_url`` is not ``http://host:port``.
        GymStartupError: the head server did not answer in ``timeout_s``, or its config names no ``policy_base_url``
            (or one that is not a string or a list of strings).
    """
    head = head_address(head_url)
    config = read_global_config(head, timeout_s).config
    urls = config.get("policy_base_url")
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, list) or not urls or not all(isinstance(url, str) for url in urls):
        raise GymStartupError(
            f"the running NeMo-Gym at {head.url} names no policy endpoint: its global config's policy_base_url is "
            f"{urls!r}, not a URL or a list of URLs"
        )
    model = config.get("policy_model_name")
    return RunningGymPolicy(head, tuple(urls), model if isinstance(model, str) and model else None)
