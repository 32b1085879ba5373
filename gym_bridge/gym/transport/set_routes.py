"""Where a started Gym set sends rows: Gym's resolver's table, plus (Gym 0.7) the taskset routes of its episode
protocol, each checked to name a running environment server as Gym's collection checks it."""

from __future__ import annotations

from gym_bridge.gym.protocol.episode import EpisodeRoutes
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.servers.gym_set import GymSet
from gym_bridge.gym_versions import installed_gym

_ENVIRONMENT_TYPE = "environment_servers"


def set_routes(servers: GymSet, agents: list[str]) -> tuple[GymRoutes, dict[str, str]]:
    """The routes of the server set and environment server -> URL for the materialized rows its tasksets route to
    (empty before Gym 0.7)."""
    routes = GymRoutes.from_json(servers.routes, agents)
    if not installed_gym().episode_protocol:
        return routes, {}
    types, urls = servers.server_types, servers.server_urls
    episode_urls: dict[str, str] = {}
    tasksets: dict[str, str] = {}
    errors: dict[str, str] = {}
    for taskset, server in servers.environment_server_routes.items():
        if types.get(server) == _ENVIRONMENT_TYPE and server in urls:
            tasksets[taskset] = server
            episode_urls[server] = urls[server]
        else:
            running = sorted(name for name, kind in types.items() if kind == _ENVIRONMENT_TYPE)
            errors[taskset] = (
                f"environment_server_routes names {server!r}, which is not a running environment server of the "
                f"launched Gym config (environment servers: {', '.join(running) or '(none)'})"
            )
    episode_routes = EpisodeRoutes(
        agents=routes.agents,
        dispatch=routes.dispatch,
        dispatch_errors=routes.dispatch_errors,
        scorers=routes.scorers,
        task_sources=routes.task_sources,
        task_source_errors=routes.task_source_errors,
        tasksets=tasksets,
        taskset_errors=errors,
    )
    return episode_routes, episode_urls
