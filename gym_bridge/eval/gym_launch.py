"""What an eval run starts Gym with (its launch spec, its logs in the run folder's ``gym-logs``), the endpoints'
preflight, and every row routed by that Gym."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from gym_bridge.eval.config import EvalConfig
from gym_bridge.eval.dataset import DatasetError, DatasetRow
from gym_bridge.gym.protocol.rows import ValidGymRow
from gym_bridge.gym.servers.log_folder import gym_log_dir

if TYPE_CHECKING:
    from gym_bridge.config.launch_spec import GymLaunchSpec
    from gym_bridge.types import ActorHandle

logger = logging.getLogger(__name__)


def launch_spec(config: EvalConfig, base_urls: list[str], pending: list[DatasetRow]) -> GymLaunchSpec:
    """What :func:`gym_bridge.recipes.launch.start_nemo_gym` starts for this run: one actor on ``base_urls``, with its
    own Gym server set, or (``gym_head``) using the running Gym there, which it neither starts nor stops."""
    from gym_bridge.config.launch_spec import GymLaunchSpec
    from gym_bridge.failures import RolloutTimeouts
    from gym_bridge.gym.transport.actor_config import NemoGymConfig
    from gym_bridge.preflight import rows_use_tools
    from gym_bridge.rollout.nemo_gym import NemoGymOptions

    config_paths = [str(Path(p).resolve()) if Path(p).exists() else p for p in config.config_paths]
    key = SecretStr("dummy_key") if config.embedded else config.api_key()  # the embedded server needs none
    gym_config = NemoGymConfig(
        **({"api_key": key} if key is not None else {}),
        model_name=config.model_name,
        base_urls=base_urls,
        config_paths=config_paths,
        overrides=dict(config.gym_overrides),
        gym_head=config.gym_head,
        model_server=config.model_server,
        startup_timeout_s=config.startup_timeout_s,
        request_timeout_s=config.request_timeout_s,
        log_dir=gym_log_dir(config.output_dir),
        actor_options={"num_cpus": 0},
    )
    return GymLaunchSpec(
        gym=gym_config,
        num_generations_per_prompt=config.num_generations_per_prompt,
        max_seq_len=config.max_seq_len,
        generation_config=config.generation_config(),
        uses_tools=rows_use_tools([item.row for item in pending]),
        preflight=False,  # run by preflight_policy, with the API key
        preflight_timeout_s=config.preflight_timeout_s,
        ray_num_cpus=os.cpu_count() or 2,
        timeouts=RolloutTimeouts(rollout_s=config.rollout_timeout_s),
        retry_policy=config.retry_policy(),
        manager_options=NemoGymOptions(seed=config.seed, admission=config.admission),
    )


def preflight_policy(config: EvalConfig, base_urls: list[str], pending: list[DatasetRow]) -> None:
    """Check every endpoint of the run (``base_urls``: the configured ones, or the embedded server) with the run's
    API key (None for the embedded server, or when none is set, so a refusal says so); raises ``PreflightError``."""
    from gym_bridge.preflight import rows_use_tools
    from gym_bridge.recipes.gym_pre_start import preflight

    preflight(
        base_urls,
        config.model_name,
        tools=rows_use_tools([item.row for item in pending]),
        timeout_s=config.preflight_timeout_s,
        api_key=None if config.embedded else config.api_key(),
    )


def routed(pending: list[DatasetRow], actor: ActorHandle) -> list[DatasetRow]:
    """Each row with the agent the launched Gym config routes it to
    (:func:`~gym_bridge.recipes.gym_pre_start.route_on_gym`); :class:`DatasetError` naming every row that routes
    nowhere, before any row is sent."""
    from gym_bridge.recipes.gym_pre_start import route_on_gym

    rows, problems = route_on_gym(
        [item.row for item in pending], actor, [f"line {i.line}: prompt_idx={i.prompt_idx}" for i in pending]
    )
    if problems:
        raise DatasetError(
            f"{len(problems)} row(s) route nowhere in the launched Gym config:\n" + "\n".join(problems[:20])
        )
    return [
        item if row is item.row else replace(item, row=ValidGymRow(row))
        for item, row in zip(pending, rows, strict=True)
    ]


def check_agents(config: EvalConfig, rows: list[DatasetRow]) -> None:
    """The agents the rows and the routing keys name against those the run's ``config_paths`` and ``gym_overrides``
    define (:func:`~gym_bridge.gym.servers.config_files.unknown_agents`), read from the configs in seconds, before
    anything starts (rows routed by ``task_source`` are resolved by Gym once it is up; a config that cannot be read
    is left to the launch, which names it).

    Raises:
        DatasetError: one line naming each unknown agent, where it is named, and the agents that exist.
    """
    from gym_bridge.gym.protocol.routing import row_agent
    from gym_bridge.gym.servers.config_files import defined_agents, routing_agents, unknown_agents

    if config.gym_head is not None or not config.config_paths:
        return
    agents = defined_agents(config.config_paths, config.gym_overrides)
    if not agents:
        return
    named: list[tuple[str, str | None]] = [*routing_agents(config.routing)]
    named += [(f"line {row.line}", row_agent(row.row)) for row in rows]
    unknown = unknown_agents(named, agents)
    if unknown:
        listed = "; ".join(
            f"{agent!r} (named by {', '.join(places[:5])}{', ...' if len(places) > 5 else ''})"
            for agent, places in unknown.items()
        )
        raise DatasetError(
            f"no config in config_paths defines the agent(s) {listed}; they define: {', '.join(sorted(agents))}"
        )
