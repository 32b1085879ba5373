"""Where the launched Gym config sends rows, computed by NeMo-Gym's own code in the launcher process.

The launcher has Gym's merged config and has imported Gym already, so it answers here, once per
server set, what the driver needs and must not import Gym for: which agent each ``task_source``
resolves to (Gym's ``RolloutCollectionHelper.resolve_task_sources``, 0.6+), and which server a
row for each agent is posted to (the environment server in front of it, as Gym's collection does;
the agent itself behind a pass-through ``legacy_agent`` relay). The result is plain JSON for the
status file; :class:`gym_bridge.gym.protocol.routing.GymRoutes` reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gym_bridge.json_types import JsonObject

if TYPE_CHECKING:
    from omegaconf import DictConfig

_AGENT_TYPE = "responses_api_agents"
_RESOURCES_TYPE = "resources_servers"
_ENVIRONMENT_TYPE = "environment_servers"
RELAY_IMPL = "legacy_agent"
"""Gym's pass-through environment server: it forwards ``/run`` to its agent unchanged."""


def gym_routes(global_config_dict: DictConfig) -> JsonObject:
    """``{agents, dispatch, dispatch_errors, scorers, task_sources, task_source_errors}`` of one merged Gym config.

    ``dispatch``: agent -> the server its rows are posted to; ``scorers``: agent -> the server whose
    ``/aggregate_metrics`` scores its rollouts (the environment server in front of it, relay or not, as Gym's
    collection groups them; else the agent itself); ``task_sources``: instance -> agent, or None
    when the installed Gym has no task_source resolution (0.4, 0.5)."""
    from omegaconf import DictConfig

    blocks = {str(name): block for name, block in global_config_dict.items() if isinstance(block, DictConfig)}
    agents = sorted(name for name, block in blocks.items() if _AGENT_TYPE in block)
    fronting = _fronting(blocks)
    dispatch, dispatch_errors = _dispatch(fronting, agents)
    task_sources, task_source_errors = _task_sources(global_config_dict, blocks)
    return {
        "agents": agents,
        "dispatch": dispatch,
        "dispatch_errors": dispatch_errors,
        "scorers": _scorers(fronting, agents),
        "task_sources": task_sources,
        "task_source_errors": task_source_errors,
    }


def _fronting(blocks: JsonObject) -> dict[str, list[tuple[str, str]]]:
    """agent -> the environment servers in front of it, each as ``(name, impl)``."""
    fronting: dict[str, list[tuple[str, str]]] = {}
    for name, block in blocks.items():
        servers = block.get(_ENVIRONMENT_TYPE)
        if not servers:
            continue
        for impl, server in servers.items():
            for agent in _environment_server_agents(server):
                fronting.setdefault(agent, []).append((name, str(impl)))
    return fronting


def _scorers(fronting: dict[str, list[tuple[str, str]]], agents: list[str]) -> dict[str, str]:
    """Each agent's scoring server: its one environment server, else itself (none when several front it)."""
    scorers: dict[str, str] = {}
    for agent in agents:
        servers = fronting.get(agent, [])
        if len(servers) <= 1:
            scorers[agent] = servers[0][0] if servers else agent
    return scorers


def _dispatch(fronting: dict[str, list[tuple[str, str]]], agents: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each agent's entry point: its one working environment server, else the agent itself."""
    dispatch: dict[str, str] = {}
    errors: dict[str, str] = {}
    for agent in agents:
        servers = fronting.get(agent, [])
        if len(servers) > 1:
            errors[agent] = (
                f"agent {agent!r} is fronted by several environment servers ({sorted(n for n, _ in servers)}): "
                "rows routed to it cannot choose between them (Gym refuses the same)"
            )
        elif servers and servers[0][1] != RELAY_IMPL:
            dispatch[agent] = servers[0][0]
        else:
            dispatch[agent] = agent
    return dispatch, errors


def _environment_server_agents(server: Any) -> list[str]:
    """The agents an environment server config fronts: Gym's own reader where it has one."""
    try:
        from nemo_gym.global_config import environment_server_agent_names
    except ImportError:
        ref = server.get("agent_server") if hasattr(server, "get") else None
        name = ref.get("name") if ref is not None else None
        return [str(name)] if name else []
    return [str(name) for name in environment_server_agent_names(server)]


def _task_sources(global_config_dict: DictConfig, blocks: JsonObject) -> tuple[dict[str, str] | None, dict[str, str]]:
    """Every instance a dataset may be declared on, resolved to its agent by Gym's own resolver."""
    from nemo_gym.rollout_collection import RolloutCollectionHelper

    resolve = getattr(RolloutCollectionHelper, "resolve_task_sources", None)
    if resolve is None:
        return None, {}
    resolved: dict[str, str] = {}
    errors: dict[str, str] = {}
    for name, block in blocks.items():
        if _AGENT_TYPE not in block and _RESOURCES_TYPE not in block:
            continue
        row: JsonObject = {"task_source": name}
        try:
            resolve([row], global_config_dict)
        except ValueError as exc:
            errors[name] = str(exc)
        else:
            resolved[name] = str(row["agent_ref"]["name"])
    return resolved, errors
