"""What a training config's data, Gym configs and model say before anything starts, and the checks on them.

Read in seconds, before Ray, the engine or Gym start (``gym-bridge train`` runs :func:`check_before_start` first):
the rows of every data file (how many, which agents they name, the first prompt's tokens of its longest rows under
the model's chat template, tools included, rendered as Gym's ``vllm_model`` sends it), the server instances that
``env.nemo_gym.config_paths`` define (read from the installed nemo-gym, as Gym resolves a relative path: the working
directory, then the wheel), and the model's own context. The checks, each problem one line naming the key to change:

- the batch against the dataset: ``grpo.num_prompts_per_step`` prompts per step from ``data.train.data_path``;
- the longest prompt against ``policy.max_total_sequence_length`` (a problem when it leaves no room), and with
  ``policy.generation.max_new_tokens`` (a warning: the run's server cuts max_tokens to the room left, as NeMo-RL's
  training server does);
- the Gym configs against the installed nemo-gym, and the agents the rows name against those the configs define
  (not with ``env.nemo_gym.gym_head``: a running Gym's agents are its own, and the rows are routed against it once
  the run has attached).

:func:`smoke_facts` reads the same things for ``--smoke`` (:mod:`gym_bridge.config.smoke`). A file or model that
cannot be read is left to the reader that owns it (``grpo_run_settings`` names the key); these checks skip it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.json_io import ROW_DEPTH, loads
from gym_bridge.boundary.text import shown
from gym_bridge.boundary.yaml_io import read_yaml_file
from gym_bridge.config.keys import TrainingConfigError, config_section, config_value
from gym_bridge.config.smoke import SmokeFacts
from gym_bridge.config.training import ROUTING_KEYS
from gym_bridge.gym.protocol.routing import TASK_SOURCE_KEY, RowRouting, row_agent
from gym_bridge.gym.protocol.row_file import read_row_text
from gym_bridge.json_types import JsonMapping, JsonObject

logger = logging.getLogger(__name__)

TRAIN_KEY = "data.train.data_path"
VALIDATION_KEY = "data.validation.data_path"
EXTRA_SETS_KEY = "data.validation.extra_sets"
SERVER_TYPES = ("responses_api_models", "resources_servers", "responses_api_agents", "environment_servers")
"""Gym's server types: a top-level key of a Gym config whose value has one of these is a server instance."""
_MAX_SHOWN = 5


# ---------------------------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class RowFile:
    """One data file's rows as the run routes them (``env.nemo_gym.agent_name`` / ``agent_map`` / ``fan_out``)."""

    key: str
    """The config key that names it (``data.train.data_path``, ``data.validation.extra_sets.<name>``, ...)."""
    path: Path
    rows: tuple[Any, ...]

    @property
    def where(self) -> str:
        return f"{self.key} ({shown(self.path)})"

    def agents(self) -> set[str]:
        """The agents the rows name (``agent_ref.name``)."""
        return {name for row in self.rows if isinstance(row, dict) and (name := row_agent(row)) is not None}

    def unrouted(self) -> int:
        """Rows that name no agent and no ``task_source``."""
        return sum(
            1 for row in self.rows if isinstance(row, dict) and row_agent(row) is None and not row.get(TASK_SOURCE_KEY)
        )


def data_paths(config: JsonMapping) -> dict[str, str]:
    """Every data file the config names: its key -> its path (training, validation, each extra set)."""
    found: dict[str, str] = {}
    train = config_value(config, TRAIN_KEY, None) or config_value(config, "data.path", None)
    if isinstance(train, str) and train:
        found[TRAIN_KEY if config_value(config, TRAIN_KEY, None) else "data.path"] = train
    validation = config_value(config, VALIDATION_KEY, None)
    if isinstance(validation, str) and validation:
        found[VALIDATION_KEY] = validation
    extra = config_value(config, EXTRA_SETS_KEY, None)
    if isinstance(extra, Mapping):
        found.update({f"{EXTRA_SETS_KEY}.{name}": path for name, path in extra.items() if isinstance(path, str)})
    return found


def _routing(config: JsonMapping) -> RowRouting:
    section = config_section(config, "env.nemo_gym")
    try:
        return RowRouting(**{k: section[k] for k in ROUTING_KEYS if section.get(k) is not None})
    except Exception:  # a bad routing key is named by grpo_run_settings
        return RowRouting()


def read_rows(key: str, path: str | Path, routing: RowRouting | None = None) -> RowFile | None:
    """``path``'s rows (each line's JSON, routed), or None when it cannot be read (the run's reader names it)."""
    path = Path(path)
    try:
        text = read_row_text(path)
    except (OSError, UntrustedInputError):
        return None
    routing = routing or RowRouting()
    rows: list[Any] = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            rows += routing.apply(loads(line, "", max_depth=ROW_DEPTH))
        except UntrustedInputError:
            rows.append(None)
    return RowFile(key, path, tuple(rows))


def row_files(config: JsonMapping) -> list[RowFile]:
    """The readable data files of ``config``, training first."""
    routing = _routing(config)
    return [f for key, path in data_paths(config).items() if (f := read_rows(key, path, routing)) is not None]


# ---------------------------------------------------------------------------------------------------------- Gym configs


def gym_root() -> Path | None:
    """The installed nemo-gym's site-packages folder (where its config paths are relative to), without importing it."""
    spec = importlib.util.find_spec("nemo_gym")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def resolve_gym_path(relative: str) -> Path | None:
    """A Gym config or data path as Gym resolves it: as given (absolute, or from the working directory), else inside
    the installed nemo-gym; None when neither exists."""
    path = Path(relative).expanduser()
    if path.exists():
        return path
    root = gym_root()
    if root is not None and not path.is_absolute() and (root / relative).exists():
        return root / relative
    return None


@dataclass(frozen=True)
class GymInstance:
    """One server instance a Gym config defines."""

    name: str
    config_path: str
    server_type: str
    body: JsonObject

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
                    path = resolve_gym_path(dataset["jsonl_fpath"])
                    if path is not None:
                        found.append((str(dataset.get("type")), path))
        return found


@dataclass(frozen=True)
class GymConfigs:
    """The server instances of a recipe's ``env.nemo_gym.config_paths``, in the order the configs define them."""

    config_paths: tuple[str, ...]
    instances: tuple[GymInstance, ...]
    missing: tuple[str, ...]
    """Config paths found neither from the working directory nor in the installed nemo-gym."""

    @property
    def complete(self) -> bool:
        return not self.missing

    def agents(self) -> list[str]:
        return [i.name for i in self.instances if i.server_type == "responses_api_agents"]

    def by_name(self) -> dict[str, GymInstance]:
        return {i.name: i for i in self.instances}

    def agent_declaring(self, path: Path) -> str | None:
        """The agent that declares ``path`` as one of its datasets."""
        target = path.resolve()
        for instance in self.instances:
            if instance.server_type == "responses_api_agents" and any(
                p.resolve() == target for _, p in instance.datasets()
            ):
                return instance.name
        return None

    def example_rows(self) -> tuple[str, Path] | None:
        """The first agent's example rows Gym ships (its ``type: example`` dataset), as (agent, file)."""
        for instance in self.instances:
            if instance.server_type == "responses_api_agents":
                for kind, path in instance.datasets():
                    if kind == "example":
                        return instance.name, path
        return None

    def needed(self, agents: Iterable[str]) -> tuple[list[str], list[str]]:
        """The config paths ``agents`` need (every model server's, the agents', what they call, and the environment
        servers in front of them) and the instances of the other paths: (paths kept, instances left out)."""
        named = self.by_name()
        keep = {i.name for i in self.instances if i.server_type == "responses_api_models"}
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


def gym_configs(config: JsonMapping) -> GymConfigs:
    """The instances ``env.nemo_gym.config_paths`` define (YAMLs read through the boundary)."""
    paths = config_value(config, "env.nemo_gym.config_paths", None) or []
    paths = [str(p) for p in paths] if isinstance(paths, list) else []
    instances: list[GymInstance] = []
    missing: list[str] = []
    for relative in paths:
        resolved = resolve_gym_path(relative)
        if resolved is None:
            missing.append(relative)
            continue
        try:
            document = read_yaml_file(resolved)
        except (OSError, UntrustedInputError):
            missing.append(relative)
            continue
        for name, body in (document or {}).items() if isinstance(document, Mapping) else []:
            if isinstance(body, Mapping):
                kind = next((t for t in SERVER_TYPES if t in body), None)
                if kind is not None:
                    instances.append(GymInstance(str(name), relative, kind, dict(body)))
    for name, body in config_section(config, "env.nemo_gym").items():  # an instance defined in the recipe itself
        if isinstance(body, Mapping) and name not in {i.name for i in instances}:
            kind = next((t for t in SERVER_TYPES if t in body), None)
            server = next(iter(body[kind].values()), None) if kind and isinstance(body[kind], Mapping) else None
            if kind is not None and isinstance(server, Mapping) and server.get("entrypoint"):
                instances.append(GymInstance(str(name), "env.nemo_gym", kind, dict(body)))
    return GymConfigs(tuple(paths), tuple(instances), tuple(missing))


# ---------------------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelFacts:
    """The model's tokenizer and own context (``max_position_embeddings``; None when its config has none)."""

    name: str
    tokenizer: Any
    context: int | None


@lru_cache(maxsize=4)
def model_facts(name: str) -> ModelFacts | None:
    """The tokenizer and context of ``name`` (a built-in model, built on first use, or a local folder); None when it
    names neither (``grpo_run_settings`` names ``policy.model_name``) or its tokenizer does not load."""
    from gym_bridge.models.registry import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(name)
    except ModelNotFoundError:
        return None
    from gym_bridge.models.folder_check import load_tokenizer, model_config

    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        logger.debug("early checks: no tokenizer from %s (%s)", path, exc)
        return None
    context = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        context = int(model_config(path)["max_position_embeddings"])
    return ModelFacts(name, tokenizer, context)


def first_prompt_tokens(row: object, tokenizer: Any) -> int | None:
    """The tokens of a row's first model call: its Responses input as Gym's ``vllm_model`` turns it into a chat,
    rendered with the tokenizer's chat template and the row's tools; None for a row that does not render."""
    from gym_bridge.gym_model.translate import responses_to_chat
    from gym_bridge.serving.chat import build_chat_prompt

    params = row.get("responses_create_params") if isinstance(row, Mapping) else None
    if not isinstance(params, dict):
        return None
    try:
        turn = responses_to_chat(params, uses_reasoning_parser=False)
        prompt = build_chat_prompt(
            tokenizer, turn.messages, tools=turn.tools, chat_template_kwargs=turn.chat_template_kwargs or None
        )
    except Exception as exc:  # a row the template cannot render is named by the rollout that sends it
        logger.debug("early checks: a row does not render (%s)", exc)
        return None
    return len(prompt.token_ids)


@dataclass(frozen=True)
class LongestPrompt:
    tokens: int
    where: str
    """``<key> (<file>) line <n>``."""


RENDERED_ROWS = 32
"""How many rows of a file are rendered through the chat template: the longest by characters (the chat and its
tools), so a dataset of thousands of rows with dozens of tools each is checked in seconds."""


def _chars(row: object) -> int:
    params = row.get("responses_create_params") if isinstance(row, Mapping) else None
    if not isinstance(params, Mapping):
        return 0
    return len(json.dumps([params.get("input"), params.get("tools"), params.get("instructions")], default=str))


def longest_prompt(files: Iterable[RowFile], tokenizer: Any, *, rendered: int = RENDERED_ROWS) -> LongestPrompt | None:
    """The longest first prompt of ``files`` in tokens: each file's ``rendered`` longest rows by characters rendered
    through the chat template (every row when a file has no more)."""
    best: LongestPrompt | None = None
    for file in files:
        ranked = sorted(range(len(file.rows)), key=lambda i: -_chars(file.rows[i]))[:rendered]
        for i in sorted(ranked):
            tokens = first_prompt_tokens(file.rows[i], tokenizer)
            if tokens is not None and (best is None or tokens > best.tokens):
                best = LongestPrompt(tokens, f"{file.where} row {i}")
    return best


# --------------------------------------------------------------------------------------------------------------- checks


def _int(config: JsonMapping, key: str) -> int | None:
    value = config_value(config, key, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_batch(config: JsonMapping, train: RowFile | None) -> list[str]:
    """``grpo.num_prompts_per_step`` against the training rows: with ``grpo.max_num_epochs`` (absent: 1, NeMo-RL's
    default) an epoch is ``rows // num_prompts_per_step`` steps (NeMo-RL's dataloader drops the last partial batch),
    so fewer rows than one step's prompts leave no step."""
    prompts = _int(config, "grpo.num_prompts_per_step")
    epochs = config_value(config, "grpo.max_num_epochs", 1)
    if train is None or prompts is None or epochs is None or len(train.rows) >= prompts:
        return []
    return [
        f"grpo.num_prompts_per_step={prompts} needs at least {prompts} prompts; {train.where} has {len(train.rows)} "
        f"(an epoch is rows // num_prompts_per_step steps, as NeMo-RL's dataloader drops the last partial batch): "
        f"set grpo.num_prompts_per_step={len(train.rows)} or less, or try the recipe with --smoke"
    ]


def check_context(config: JsonMapping, files: list[RowFile], model: ModelFacts | None) -> tuple[list[str], list[str]]:
    """The longest first prompt plus ``policy.generation.max_new_tokens`` against ``policy.max_total_sequence_length``
    (problems), and the context against the model's own (a warning): (problems, warnings)."""
    context = _int(config, "policy.max_total_sequence_length")
    if model is None or context is None:
        return [], []
    warnings = []
    if model.context is not None and context > model.context:
        warnings.append(
            f"policy.max_total_sequence_length={context} is over {model.name}'s own context ({model.context}, "
            "max_position_embeddings): positions past it are untrained"
        )
    longest = longest_prompt(files, model.tokenizer)
    if longest is None:
        return [], warnings
    budget = _int(config, "policy.generation.max_new_tokens")
    room = context - longest.tokens
    if room < 1:
        return [
            f"{longest.where} renders to {longest.tokens} prompt tokens with {model.name}'s chat template (tools "
            f"included), which leaves no room in policy.max_total_sequence_length={context}: raise "
            f"policy.max_total_sequence_length above {longest.tokens}"
            + (f" (the model's own context is {model.context})" if model.context else "")
            + " or leave the long rows out"
        ], warnings
    if budget is not None and budget > room:  # the run's server cuts max_tokens to the room, as NeMo-RL's does
        warnings.append(
            f"{longest.where} renders to {longest.tokens} prompt tokens with {model.name}'s chat template (tools "
            f"included); policy.generation.max_new_tokens={budget} leaves it {room} tokens to generate within "
            f"policy.max_total_sequence_length={context} (the server cuts max_tokens to the room left, as NeMo-RL's "
            f"does); set policy.generation.max_new_tokens={room} or policy.max_total_sequence_length="
            f"{longest.tokens + budget} to say so"
        )
    return [], warnings


def check_agents(config: JsonMapping, files: list[RowFile], gym: GymConfigs) -> list[str]:
    """The Gym configs against the installed nemo-gym, and the agents the rows name (or the routing keys set) against
    the agents those configs define; rows that name no agent, with the agent to set."""
    from gym_bridge.gym_versions import installed_gym

    problems = []
    if gym.missing:
        try:
            version = f"nemo-gym {installed_gym().version}"
        except Exception:
            version = "nemo-gym"
        problems.append(
            f"env.nemo_gym.config_paths: {', '.join(gym.missing)} is neither a file (from the working directory) nor "
            f"a config of the installed {version}"
        )
        return problems
    agents = gym.agents()
    known = ", ".join(agents) or "none"
    section = config_section(config, "env.nemo_gym")
    routed = [("env.nemo_gym.agent_name", section.get("agent_name"))]
    routed += [(f"env.nemo_gym.agent_map.{k}", v) for k, v in (section.get("agent_map") or {}).items()]
    routed += [(f"env.nemo_gym.fan_out.{k}", a) for k, v in (section.get("fan_out") or {}).items() for a in v or []]
    for key, agent in routed:
        if isinstance(agent, str) and agent not in agents:
            problems.append(f"{key}={agent}: no config in env.nemo_gym.config_paths defines that agent ({known})")
    for file in files:
        unknown = sorted(file.agents() - set(agents))
        if unknown:
            problems.append(
                f"{file.where} names agent(s) {', '.join(unknown[:_MAX_SHOWN])} that no config in "
                f"env.nemo_gym.config_paths defines (they define: {known})"
            )
        unrouted = file.unrouted()
        if unrouted:
            suggestion = gym.agent_declaring(file.path) or (agents[0] if len(agents) == 1 else None)
            fix = (
                f"set +env.nemo_gym.agent_name={suggestion}"
                if suggestion
                else f"set +env.nemo_gym.agent_name=AGENT (one of: {known})"
            )
            problems.append(
                f"{file.where}: {unrouted} of {len(file.rows)} rows name no agent (no agent_ref or task_source; Gym's "
                f"ng_prepare_data adds it): {fix}"
            )
    return problems


@dataclass(frozen=True)
class EarlyReport:
    """What :func:`check_before_start` found that does not stop the run."""

    warnings: tuple[str, ...]


def check_before_start(config: JsonMapping) -> EarlyReport:
    """Every check that can run before Ray starts, on a plain (resolved) config: every problem found is one line of
    one :class:`TrainingConfigError`; warnings are logged and returned."""
    files = row_files(config)
    train = next((f for f in files if f.key in (TRAIN_KEY, "data.path")), None)
    problems = check_batch(config, train)
    model_name = config_value(config, "policy.model_name", None)
    model = model_facts(str(model_name)) if isinstance(model_name, str) and model_name else None
    context_problems, warnings = check_context(config, files, model)
    problems += context_problems
    if not config_value(config, "env.nemo_gym.gym_head", None):
        # a running Gym's agents are its own: the rows are routed against it once the run attaches (routed_rows)
        problems += check_agents(config, files, gym_configs(config))
    if problems:
        raise TrainingConfigError("\n".join(problems))
    for warning in warnings:
        logger.warning("%s", warning)
    return EarlyReport(tuple(warnings))


# ---------------------------------------------------------------------------------------------------------------- smoke


def smoke_facts(config: JsonMapping, model: str, *, pinned: Iterable[str] = ()) -> SmokeFacts:
    """What :func:`~gym_bridge.config.smoke.smoke_config` needs for ``config`` and the smoke ``model``: the training
    rows (the recipe's file, or when it is missing and the command line did not name it, the example rows Gym ships
    for the recipe's first agent that has them), which validation files exist, the longest prompt under ``model``'s
    template, the model's own context, the agent for rows that name none, and the Gym configs those rows use."""
    pinned = tuple(pinned)
    gym = gym_configs(config)
    routing = _routing(config)
    paths = data_paths(config)
    train_key = next((k for k in paths if k in (TRAIN_KEY, "data.path")), TRAIN_KEY)
    train = read_rows(train_key, paths[train_key], routing) if train_key in paths else None
    train_path = paths.get(train_key) if train is not None else None
    example_agent = None
    if train is None and train_key not in pinned and TRAIN_KEY not in pinned:
        example = gym.example_rows()
        if example is not None:
            example_agent, example_path = example
            train = read_rows(TRAIN_KEY, example_path, routing)
            train_path = str(example_path) if train is not None else None
    validation: dict[str, str | None] = {}
    files = [train] if train is not None else []
    for key, path in paths.items():
        if key == train_key:
            continue
        found = read_rows(key, path, routing)
        validation[key] = path if found is not None else None
        if found is not None:
            files.append(found)
    route_to = None
    if routing.is_empty and any(f.unrouted() for f in files):
        agents = gym.agents()
        declared = gym.agent_declaring(train.path) if train is not None else None
        route_to = declared or (agents[0] if len(agents) == 1 else None)
    used: set[str] = set()
    for file in files:
        used |= file.agents()
    if route_to is not None:
        used.add(route_to)
    config_paths: tuple[str, ...] | None = None
    unused: tuple[str, ...] = ()
    if gym.complete and used and used <= set(gym.agents()):
        kept, left_out = gym.needed(sorted(used))
        if kept != list(gym.config_paths):
            config_paths = tuple(kept)
            recipe_sections = config_section(config, "env.nemo_gym")
            kept_names = {i.name for i in gym.instances if i.config_path in kept}
            unused = tuple(n for n in left_out if n in recipe_sections and n not in kept_names)
    facts = model_facts(model)
    longest = longest_prompt(files, facts.tokenizer) if facts is not None else None
    return SmokeFacts(
        train_path=train_path,
        train_rows=len(train.rows) if train is not None else None,
        validation_paths=validation,
        longest_prompt=longest.tokens if longest is not None else None,
        model_context=facts.context if facts is not None else None,
        route_to=route_to,
        example_agent=example_agent,
        config_paths=config_paths,
        unused_instances=unused,
    )
