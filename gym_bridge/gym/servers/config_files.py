"""Gym's config files as Gym resolves them, read without importing Gym: paths against the installed nemo-gym wheel,
the server instances they define, each agent's datasets, the routing keys of a collection, and the agents check.

Every reader of a Gym config before Gym starts (training's and eval's pre-start checks, ``gym-bridge rescore`` and its
trust boundary, the test helpers) reads it here, so a relative path resolves one way: from the working directory,
then inside the installed nemo-gym (as Gym's own loader does). The YAML is read through the boundary's loader. A
problem is a :class:`GymConfigError`; the front ends name their own keys around it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.text import shown
from gym_bridge.boundary.yaml_io import read_yaml_file
from gym_bridge.failures import GymBridgeError
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.servers.server_config import deep_merge
from gym_bridge.json_types import JsonObject

SERVER_TYPES = ("responses_api_models", "resources_servers", "responses_api_agents", "environment_servers")
"""Gym's server types: a top-level key of a Gym config whose value has one of these is a server instance."""
AGENT_TYPE = "responses_api_agents"
MODEL_TYPE = "responses_api_models"
LOCAL_VLLM_FOLDERS = frozenset({"local_vllm_model", "genrm_model"})
"""Gym's model servers that start vLLM in their own process on the GPUs (any model server configured with
``vllm_serve_kwargs`` is counted with them)."""
COHORT_KEY = "num_rollouts_per_prompt"
"""A resources server's count of one prompt's samples it scores together (``genrm_compare``): it must equal
``grpo.num_generations_per_prompt``."""
CONTAINER_KEYS = ("container_formatter", "container_image", "container_folder_path", "apptainer_memory_limit_mb")
"""Server keys of Gym's environments that run each rollout in a container image (Apptainer, SWE-bench's images)."""
ROUTING_KEYS = ("agent_name", "agent_map", "fan_out")
"""Gym's collection keys (``RolloutCollectionConfig``): which agent each row goes to (:func:`routing_from`)."""


class GymConfigError(GymBridgeError, ValueError):
    """A Gym config, or a setting read from one, that Gym would refuse (the message names the path or key)."""


class GymConfigNotFound(GymConfigError, FileNotFoundError):
    """A Gym config path that is not in the installed nemo-gym wheel (or nemo-gym is not installed)."""


def gym_root() -> Path | None:
    """The installed nemo-gym's site-packages folder (where its config paths are relative to), without importing it."""
    spec = importlib.util.find_spec("nemo_gym")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def wheel_config_path(relative: str | Path) -> Path:
    """The absolute path of ``relative`` inside the installed nemo-gym wheel's site-packages.

    Example: ``wheel_config_path("responses_api_models/vllm_model/configs/vllm_model_for_training.yaml")``.

    Raises:
        GymConfigNotFound: nemo-gym is not installed, or the wheel has no such file.
    """
    root = gym_root()
    if root is None:
        raise GymConfigNotFound("nemo_gym is not installed")
    path = root / relative
    if not path.exists():
        raise GymConfigNotFound(f"{relative} is not in the installed nemo-gym wheel ({path})")
    return path


def find_config_path(name: str | Path) -> Path | None:
    """A Gym config or data path as Gym resolves it: as given (absolute, or from the working directory), else inside
    the installed nemo-gym; None when neither exists."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    root = gym_root()
    if root is not None and not path.is_absolute() and (root / name).exists():
        return root / name
    return None


def config_path(name: str | Path) -> Path:
    """:func:`find_config_path`, or :class:`GymConfigNotFound` naming ``name`` when neither place has it."""
    found = find_config_path(name)
    return found if found is not None else wheel_config_path(name)


def read_config_blocks(path: Path) -> JsonObject:
    """One Gym config file's top-level blocks (read as plain YAML through the boundary).

    Raises:
        GymConfigError: the file cannot be read as YAML, or is not a mapping of Gym servers.
    """
    try:
        blocks = read_yaml_file(path) or {}
    except (OSError, UntrustedInputError) as exc:
        raise GymConfigError(f"{shown(path)} cannot be read as YAML ({shown(exc)})") from None
    if not isinstance(blocks, dict):
        raise GymConfigError(f"{shown(path)} is not a YAML mapping of Gym servers")
    return blocks


def merged_blocks(config_paths: Iterable[str | Path], overrides: JsonObject) -> JsonObject:
    """Gym's server blocks of ``config_paths`` (each found by :func:`config_path`) with ``overrides`` merged last,
    as Gym layers its global config.

    Raises:
        GymConfigNotFound: a path is neither from the working directory nor in the installed nemo-gym.
        GymConfigError: a file cannot be read as YAML or is not a mapping.
    """
    merged: JsonObject = {}
    for name in config_paths:
        merged = deep_merge(merged, read_config_blocks(config_path(name)))
    return deep_merge(merged, overrides)


def routing_from(keys: Mapping[str, object]) -> RowRouting:
    """Gym's routing keys (``agent_name``, ``agent_map``, ``fan_out``) from a section that holds them (others are
    ignored; a None value is absent).

    Raises:
        GymConfigError: the keys disagree or are malformed (each problem, as Gym names the keys).
    """
    given = {key: keys[key] for key in ROUTING_KEYS if keys.get(key) is not None}
    try:
        return RowRouting.model_validate(given)
    except ValidationError as exc:
        raise GymConfigError("; ".join(err["msg"].removeprefix("Value error, ") for err in exc.errors())) from None


def routing_agents(routing: RowRouting) -> list[tuple[str, str]]:
    """Every agent the routing keys name, with the key that names it (``agent_map.<value>``, ``fan_out.<value>``)."""
    named = [("agent_name", routing.agent_name)] if routing.agent_name is not None else []
    named += [(f"agent_map.{key}", agent) for key, agent in routing.agent_map.items()]
    named += [(f"fan_out.{key}", agent) for key, listed in routing.fan_out.items() for agent in listed]
    return named


@dataclass(frozen=True)
class GymInstance:
    """One server instance a Gym config defines."""

    name: str
    config_path: str
    server_type: str
    body: JsonObject

    def server(self) -> tuple[str, JsonObject] | None:
        """Its one server: (the folder it runs, e.g. ``vllm_model``, and that server's keys)."""
        servers = self.body.get(self.server_type)
        if not isinstance(servers, Mapping) or len(servers) != 1:
            return None
        folder, keys = next(iter(servers.items()))
        return (str(folder), dict(keys)) if isinstance(keys, Mapping) else None

    @property
    def starts_vllm(self) -> bool:
        """A model server that starts vLLM itself (:data:`LOCAL_VLLM_FOLDERS`): it needs GPUs and the ``vllm``
        package."""
        found = self.server()
        if self.server_type != MODEL_TYPE or found is None:
            return False
        folder, keys = found
        return folder in LOCAL_VLLM_FOLDERS or "vllm_serve_kwargs" in keys

    def container_keys(self) -> list[str]:
        """The :data:`CONTAINER_KEYS` it sets: each rollout runs in a container image, which a laptop does not
        have."""
        found = self.server()
        keys = found[1] if found is not None else {}
        return [key for key in CONTAINER_KEYS if keys.get(key) is not None]

    def refs(self) -> set[str]:
        """The instances it calls (every ``{type, name}`` reference inside it)."""
        found: set[str] = set()
        stack: list[object] = [self.body]
        while stack:
            node = stack.pop()
            if isinstance(node, Mapping):
                if node.get("type") in SERVER_TYPES and isinstance(node.get("name"), str):
                    found.add(node["name"])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        return found - {self.name}

    def datasets(self) -> list[tuple[str, Path]]:
        """An agent's declared datasets: (type, resolved path) for each whose file exists."""
        found = []
        servers = self.body.get(self.server_type)
        for server in servers.values() if isinstance(servers, Mapping) else []:
            for dataset in (server.get("datasets") or []) if isinstance(server, Mapping) else []:
                if isinstance(dataset, Mapping) and isinstance(dataset.get("jsonl_fpath"), str):
                    path = find_config_path(dataset["jsonl_fpath"])
                    if path is not None:
                        found.append((str(dataset.get("type")), path))
        return found


@dataclass(frozen=True)
class VllmSwap:
    """A kept server that starts vLLM (:attr:`GymInstance.starts_vllm`) and what answers for it on a CPU."""

    name: str
    config_path: str
    folder: str
    """The Gym folder it runs (``genrm_model``)."""
    callers: tuple[str, ...]
    """The kept servers that call it (none: it can be left out)."""
    block: JsonObject
    """The ``vllm_model`` block to the policy endpoint that answers for it (:func:`policy_endpoint_block`)."""


def _server_type(body: Mapping[str, object]) -> str | None:
    return next((t for t in SERVER_TYPES if t in body), None)


@dataclass(frozen=True)
class GymConfigs:
    """The server instances of a set of Gym config paths, in the order the configs define them."""

    config_paths: tuple[str, ...]
    instances: tuple[GymInstance, ...]
    missing: tuple[str, ...]
    """Config paths found neither from the working directory nor in the installed nemo-gym (or not readable)."""

    @property
    def complete(self) -> bool:
        return not self.missing

    def agents(self) -> list[str]:
        return [i.name for i in self.instances if i.server_type == AGENT_TYPE]

    def by_name(self) -> dict[str, GymInstance]:
        return {i.name: i for i in self.instances}

    def agent_declaring(self, path: Path) -> str | None:
        """The agent that declares ``path`` as one of its datasets."""
        target = path.resolve()
        for instance in self.instances:
            if instance.server_type == AGENT_TYPE and any(p.resolve() == target for _, p in instance.datasets()):
                return instance.name
        return None

    def example_rows(self) -> tuple[str, Path] | None:
        """The first agent's example rows Gym ships (its ``type: example`` dataset), as (agent, file)."""
        for instance in self.instances:
            if instance.server_type == AGENT_TYPE:
                for kind, path in instance.datasets():
                    if kind == "example":
                        return instance.name, path
        return None

    def needed(self, agents: Iterable[str]) -> tuple[list[str], list[str]]:
        """The config paths ``agents`` need (every model server's but those that start vLLM, the agents', what they
        call, and the environment servers in front of them) and the instances of the other paths: (paths kept,
        instances left out)."""
        named = self.by_name()
        keep = {i.name for i in self.instances if i.server_type == MODEL_TYPE and not i.starts_vllm}
        todo = [a for a in agents if a in named]
        while todo:
            name = todo.pop()
            if name not in keep:
                keep.add(name)
                todo += [ref for ref in named[name].refs() if ref in named]
        paths = {named[name].config_path for name in keep}
        fronts = [i for i in self.instances if i.server_type == "environment_servers" and i.refs() & keep]
        paths |= {i.config_path for i in fronts}
        kept = [p for p in self.config_paths if p in paths]
        left_out = [i.name for i in self.instances if i.config_path not in paths]
        return kept, left_out

    def unknown_agents(self, named: Iterable[tuple[str, str | None]]) -> dict[str, list[str]]:
        """:func:`unknown_agents` against the agents these configs define."""
        return unknown_agents(named, self.agents())

    def kept(self, kept_paths: Iterable[str], inline_name: str) -> list[GymInstance]:
        """The instances of ``kept_paths`` and of the recipe's own blocks (recorded under ``inline_name``)."""
        kept = set(kept_paths) | {inline_name}
        return [i for i in self.instances if i.config_path in kept]

    def vllm_swaps(self, kept_paths: Iterable[str], inline_name: str) -> tuple[VllmSwap, ...]:
        """Each server of ``kept_paths`` (and of the recipe's own blocks, recorded under ``inline_name``) that starts
        vLLM, with the other kept servers that call it and the block that answers for it."""
        instances = self.kept(kept_paths, inline_name)
        swaps = []
        for server in (i for i in instances if i.starts_vllm):
            callers = tuple(i.name for i in instances if not i.starts_vllm and server.name in i.refs())
            folder, keys = server.server() or ("?", {})
            swaps.append(VllmSwap(server.name, server.config_path, folder, callers, policy_endpoint_block(keys)))
        return tuple(swaps)

    def cohort_servers(self, kept_paths: Iterable[str], inline_name: str) -> list[str]:
        """The kept servers that score a prompt's samples together (:data:`COHORT_KEY`, GenRM's pairwise comparison),
        each as ``<instance>.<type>.<folder>``: their cohort must be the samples a prompt gets, or they wait for
        samples that never come."""
        found = []
        for instance in self.kept(kept_paths, inline_name):
            server = instance.server()
            if server is not None and COHORT_KEY in server[1]:
                found.append(f"{instance.name}.{instance.server_type}.{server[0]}")
        return found

    def judge_budgets(self, kept_paths: Iterable[str], inline_name: str) -> dict[str, int]:
        """The kept servers' own generation budgets (``judge_responses_create_params.max_output_tokens``,
        ``genrm_responses_create_params...``: what a judge may write), as ``<instance>.<type>.<folder>.<key>`` -> its
        value."""
        found = {}
        for instance in self.kept(kept_paths, inline_name):
            server = instance.server()
            if server is None:
                continue
            for key, params in server[1].items():
                budget = params.get("max_output_tokens") if isinstance(params, Mapping) else None
                if str(key).endswith("_responses_create_params") and isinstance(budget, int):
                    found[f"{instance.name}.{instance.server_type}.{server[0]}.{key}.max_output_tokens"] = budget
        return found

    def container_agents(self, agents: Iterable[str]) -> dict[str, list[str]]:
        """Each of ``agents`` whose rollouts run in a container image: the agent -> the container keys it, or a
        server it calls, sets (``swe_agents_train.container_formatter``)."""
        named = self.by_name()
        found: dict[str, list[str]] = {}
        for agent in agents:
            seen: set[str] = set()
            todo = [agent]
            while todo:
                name = todo.pop()
                if name in seen or name not in named:
                    continue
                seen.add(name)
                found.setdefault(agent, []).extend(f"{name}.{key}" for key in named[name].container_keys())
                todo += sorted(named[name].refs())
        return {agent: keys for agent, keys in found.items() if keys}


def policy_endpoint_block(server: Mapping[str, object]) -> JsonObject:
    """A ``vllm_model`` instance that sends its callers' requests to the policy endpoint, under Gym's own
    interpolations (``${policy_base_url}``, as ``vllm_model_for_training.yaml`` writes them): what answers for a
    model ``server`` that would start vLLM (a judge, a GenRM) where the policy's endpoint is the one model there
    is. It keeps the server's ``uses_reasoning_parser``; token ids are not asked for (nothing trains on a judge)."""
    return {
        MODEL_TYPE: {
            "vllm_model": {
                "entrypoint": "app.py",
                "base_url": "${policy_base_url}",
                "api_key": "${policy_api_key}",
                "model": "${policy_model_name}",
                "return_token_id_information": False,
                "uses_reasoning_parser": server.get("uses_reasoning_parser") is True,
            }
        }
    }


def unknown_agents(named: Iterable[tuple[str, str | None]], agents: Iterable[str]) -> dict[str, list[str]]:
    """The agents check: each agent of ``named`` (where it is named, and the agent or None) that is not one of
    ``agents`` -> the places that name it, in order."""
    known = set(agents)
    unknown: dict[str, list[str]] = {}
    for where, agent in named:
        if agent is not None and agent not in known:
            unknown.setdefault(agent, []).append(where)
    return unknown


def read_gym_configs(
    config_paths: Iterable[str], inline: Mapping[str, object] | None = None, *, inline_name: str = "inline"
) -> GymConfigs:
    """The instances ``config_paths`` define (each resolved by :func:`find_config_path`; one that is missing or not
    readable is listed in ``missing``), each with ``inline``'s block of its name merged over it as Gym merges its
    global config, then the instances ``inline`` defines beside them (a recipe's own server blocks, counted when
    their server names an ``entrypoint``, recorded under ``inline_name``)."""
    paths = [str(p) for p in config_paths]
    instances: list[GymInstance] = []
    missing: list[str] = []
    for relative in paths:
        resolved = find_config_path(relative)
        if resolved is None:
            missing.append(relative)
            continue
        try:
            document = read_config_blocks(resolved)
        except GymConfigError:
            missing.append(relative)
            continue
        for name, body in document.items():
            if isinstance(body, Mapping) and (kind := _server_type(body)) is not None:
                over = (inline or {}).get(name)
                merged = deep_merge(dict(body), dict(over)) if isinstance(over, Mapping) else dict(body)
                instances.append(GymInstance(str(name), relative, kind, merged))
    instances += _derived(instances, inline or {})
    for name, body in (inline or {}).items():
        if isinstance(body, Mapping) and name not in {i.name for i in instances}:
            kind = _server_type(body)
            servers = body.get(kind) if kind else None
            server = next(iter(servers.values()), None) if isinstance(servers, Mapping) else None
            if kind is not None and isinstance(server, Mapping) and server.get("entrypoint"):
                instances.append(GymInstance(str(name), inline_name, kind, dict(body)))
    return GymConfigs(tuple(paths), tuple(instances), tuple(missing))


DERIVE_KEYS = ("_inherit_from", "_copy")
"""Gym's directives that make a block from another instance (``rdkit_chemistry_agent: {_inherit_from:
litmus_agent_agent}``: the source's block with the section's keys merged over it)."""


def _derived(instances: list[GymInstance], inline: Mapping[str, object]) -> list[GymInstance]:
    """The recipe's sections that derive from a known instance (:data:`DERIVE_KEYS`): each an instance of the
    source's type and config path (it is needed, and left out, with the source's config), its body the source's
    with the section merged over it."""
    named = {i.name: i for i in instances}
    derived = []
    for name, body in inline.items():
        if not isinstance(body, Mapping) or name in named:
            continue
        source = next((body[k] for k in DERIVE_KEYS if isinstance(body.get(k), str) and body[k] in named), None)
        if source is not None:
            rest = {k: v for k, v in body.items() if k not in DERIVE_KEYS}
            base = named[source]
            derived.append(GymInstance(str(name), base.config_path, base.server_type, deep_merge(base.body, rest)))
    return derived


def defined_agents(config_paths: Iterable[str], overrides: Mapping[str, object]) -> set[str] | None:
    """The agents ``config_paths`` and the ``overrides`` merged over them define (any block with an agent server
    type); None when a config cannot be found or read."""
    configs = read_gym_configs(config_paths)
    if not configs.complete:
        return None
    agents = set(configs.agents())
    agents |= {str(k) for k, body in overrides.items() if isinstance(body, Mapping) and AGENT_TYPE in body}
    return agents
