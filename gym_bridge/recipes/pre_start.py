"""``gym-bridge train``'s checks before anything starts: what a training config's data, Gym configs and model say,
read in seconds before Ray, the engine or Gym start, each problem one line naming the key to change. They run on
the typed settings (:class:`~gym_bridge.config.run_settings.GRPORunKeys`), before the rows are read into them:

- the batch against the dataset: ``grpo.num_prompts_per_step`` prompts per step from ``data.train.data_path``;
- the longest prompt (:mod:`gym_bridge.recipes.prompt_length`) against the run's context length
  (:func:`~gym_bridge.config.training.context_length`: a problem when it leaves no room), and with
  ``policy.generation.max_new_tokens`` (a warning: the run's server cuts max_tokens to the room left, as NeMo-RL's
  training server does);
- the Gym configs against the installed nemo-gym, and the agents the rows name against those the configs define
  (:mod:`gym_bridge.gym.servers.config_files`; not with ``env.nemo_gym.gym_head``: a running Gym's agents are its own,
  and the rows are routed against it once the run has attached).

A data file or model that cannot be read is left to the reader that owns it (``with_rows`` names the file); these
checks skip it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.json_io import ROW_DEPTH, loads
from gym_bridge.boundary.text import shown
from gym_bridge.config.data_files import GYM_SECTION, run_gym_configs
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.run_data import RunData
from gym_bridge.config.run_settings import GRPORunKeys
from gym_bridge.config.training import CONTEXT_LENGTH_KEY
from gym_bridge.gym.protocol.routing import TASK_SOURCE_KEY, RowRouting, row_agent
from gym_bridge.gym.protocol.row_file import read_row_text
from gym_bridge.gym.servers.config_files import GymConfigs, routing_agents, unknown_agents
from gym_bridge.json_types import JsonMapping
from gym_bridge.recipes.prompt_length import ModelFacts, longest_prompt, model_facts
from gym_bridge.training.loop_config import GRPOLoopConfig

logger = logging.getLogger(__name__)

_MAX_SHOWN = 5
_GYM_KEY = GYM_SECTION


@dataclass(frozen=True)
class RowFile:
    """One data file's rows as the run routes them (``env.nemo_gym.agent_name`` / ``agent_map`` / ``fan_out``)."""

    key: str
    """The config key that names it (``data.train.data_path``, ``data.validation.extra_sets.<name>``, ...)."""
    path: Path
    rows: tuple[object, ...]

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


def read_rows(key: str, path: str | Path, routing: RowRouting | None = None) -> RowFile | None:
    """``path``'s rows (each line's JSON, routed), or None when it cannot be read (the run's reader names it)."""
    path = Path(path)
    try:
        text = read_row_text(path)
    except (OSError, UntrustedInputError):
        return None
    routing = routing or RowRouting()
    rows: list[object] = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            rows += routing.apply(loads(line, "", max_depth=ROW_DEPTH))
        except UntrustedInputError:
            rows.append(None)
    return RowFile(key, path, tuple(rows))


def row_files(data: RunData) -> list[RowFile]:
    """The readable data files of the run, training first."""
    return [f for file in data.files if (f := read_rows(file.key, file.path, data.routing)) is not None]


def check_batch(loop: GRPOLoopConfig, train: RowFile | None) -> list[str]:
    """``grpo.num_prompts_per_step`` against the training rows: with ``grpo.max_num_epochs`` (absent: 1, NeMo-RL's
    default) an epoch is ``rows // num_prompts_per_step`` steps (NeMo-RL's dataloader drops the last partial batch),
    so fewer rows than one step's prompts leave no step."""
    prompts = loop.num_prompts_per_step
    if train is None or loop.max_num_epochs is None or len(train.rows) >= prompts:
        return []
    return [
        f"grpo.num_prompts_per_step={prompts} needs at least {prompts} prompts; {train.where} has {len(train.rows)} "
        f"(an epoch is rows // num_prompts_per_step steps, as NeMo-RL's dataloader drops the last partial batch): "
        f"set grpo.num_prompts_per_step={len(train.rows)} or less, or try the recipe with --smoke"
    ]


def check_context(
    context: int,
    max_new_tokens: int | None,
    files: list[RowFile],
    model: ModelFacts | None,
    template_kwargs: JsonMapping | None = None,
) -> tuple[list[str], list[str]]:
    """The longest first prompt plus ``max_new_tokens`` (``policy.generation.max_new_tokens``; None: not set) against
    the run's ``context`` length (problems), and the context against the model's own (a warning): (problems,
    warnings)."""
    if model is None:
        return [], []
    warnings = []
    if model.context is not None and context > model.context:
        warnings.append(
            f"{CONTEXT_LENGTH_KEY}={context} is over {model.name}'s own context ({model.context}, "
            "max_position_embeddings): positions past it are untrained"
        )
    longest = longest_prompt(files, model.tokenizer, template_kwargs=template_kwargs)
    if longest is None:
        return [], warnings
    budget = max_new_tokens if max_new_tokens is not None and max_new_tokens > 0 else None
    room = context - longest.tokens
    if room < 1:
        return [
            f"{longest.where} renders to {longest.tokens} prompt tokens with {model.name}'s chat template (tools "
            f"included), which leaves no room in {CONTEXT_LENGTH_KEY}={context}: raise "
            f"{CONTEXT_LENGTH_KEY} above {longest.tokens}"
            + (f" (the model's own context is {model.context})" if model.context else "")
            + " or leave the long rows out"
        ], warnings
    if budget is not None and budget > room:  # the run's server cuts max_tokens to the room, as NeMo-RL's does
        warnings.append(
            f"{longest.where} renders to {longest.tokens} prompt tokens with {model.name}'s chat template (tools "
            f"included); policy.generation.max_new_tokens={budget} leaves it {room} tokens to generate within "
            f"{CONTEXT_LENGTH_KEY}={context} (the server cuts max_tokens to the room left, as NeMo-RL's "
            f"does); set policy.generation.max_new_tokens={room} or {CONTEXT_LENGTH_KEY}="
            f"{longest.tokens + budget} to say so"
        )
    return [], warnings


def check_agents(routing: RowRouting, files: list[RowFile], gym: GymConfigs) -> list[str]:
    """The Gym configs against the installed nemo-gym, and the agents the rows name (or the ``routing`` keys set)
    against the agents those configs define (:meth:`~gym_bridge.gym.servers.config_files.GymConfigs.unknown_agents`);
    rows that name no agent, with the agent to set."""
    from gym_bridge.gym_versions import installed_gym

    if gym.missing:
        try:
            version = f"nemo-gym {installed_gym().version}"
        except Exception:
            version = "nemo-gym"
        return [
            f"{_GYM_KEY}.config_paths: {', '.join(gym.missing)} is neither a file (from the working directory) nor "
            f"a config of the installed {version}"
        ]
    problems = []
    agents = gym.agents()
    known = ", ".join(agents) or "none"
    named = [(f"{_GYM_KEY}.{key}", agent) for key, agent in routing_agents(routing)]
    unknown = gym.unknown_agents(named)
    for key, agent in named:
        if agent in unknown:
            problems.append(f"{key}={agent}: no config in {_GYM_KEY}.config_paths defines that agent ({known})")
    for file in files:
        named_here = unknown_agents([(file.where, agent) for agent in sorted(file.agents())], agents)
        if named_here:
            problems.append(
                f"{file.where} names agent(s) {', '.join(list(named_here)[:_MAX_SHOWN])} that no config in "
                f"{_GYM_KEY}.config_paths defines (they define: {known})"
            )
        unrouted = file.unrouted()
        if unrouted:
            suggestion = gym.agent_declaring(file.path) or (agents[0] if len(agents) == 1 else None)
            fix = (
                f"set +{_GYM_KEY}.agent_name={suggestion}"
                if suggestion
                else f"set +{_GYM_KEY}.agent_name=AGENT (one of: {known})"
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


def max_new_tokens(settings: GRPORunKeys) -> int | None:
    """The engine's ``max_new_tokens`` when the config sets it (``policy.generation.max_new_tokens``); None when it
    does not and the engine's default applies."""
    engine = settings.engine
    return engine.max_new_tokens if "max_new_tokens" in engine.model_fields_set else None


def check_before_start(settings: GRPORunKeys) -> EarlyReport:
    """Every check that can run before Ray starts, on the typed settings (the rows not yet read into them): every
    problem found is one line of one :class:`TrainingConfigError`; warnings are logged and returned."""
    files = row_files(settings.data)
    train = next((f for f in files if f.key == settings.data.train.key), None)
    problems = check_batch(settings.loop, train)
    model = model_facts(settings.served_model_name)
    context_problems, warnings = check_context(
        settings.max_model_len, max_new_tokens(settings), files, model, settings.chat_template_kwargs
    )
    problems += context_problems
    if not settings.gym_head:
        # a running Gym's agents are its own: the rows are routed against it once the run attaches (routed_rows)
        problems += check_agents(settings.data.routing, files, run_gym_configs(settings.rollout.launch.gym))
    if problems:
        raise TrainingConfigError("\n".join(problems))
    for warning in warnings:
        logger.warning("%s", warning)
    return EarlyReport(tuple(warnings))
