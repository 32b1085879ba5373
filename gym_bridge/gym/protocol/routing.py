"""Which agent a Gym row goes to, by Gym 0.7's rules, without importing Gym on the driver.

Two steps, as Gym's own collection takes them:

1. :class:`RowRouting` (the user's ``agent_name`` / ``agent_map`` / ``fan_out``) is applied to the dataset's
   rows where they enter (:meth:`RowRouting.apply`): a row whose ``agent_ref.name`` or ``task_source`` has an
   ``agent_map`` entry, or any row when there is a ``_default``, gets that agent in ``agent_ref``; a row that
   ``fan_out`` lists becomes one row per agent. Precedence, Gym's:
   ``agent_map[<row value>] > agent_map._default > agent_ref > task_source``.
2. :class:`GymRoutes` (what the launched config says, computed by Gym's own resolver in the launcher:
   :mod:`gym_bridge.gym.servers._gym_routes`) resolves a row that still names only its ``task_source`` and says
   which server a row for each agent is posted to (:meth:`GymRoutes.agent_of`, :meth:`GymRoutes.routed`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gym_bridge.failures import InvalidGymRow, SettingError
from gym_bridge.gym_versions import installed_gym
from gym_bridge.json_types import JsonMapping, JsonObject

TASK_SOURCE_KEY = "task_source"
DEFAULT_KEY = "_default"


def check_agent(name: Any, known_agents: Collection[str], *, where: str) -> None:
    """Raise :class:`InvalidGymRow` unless ``name`` is one of the running agents (listed in the message)."""
    if name not in known_agents:
        raise InvalidGymRow(
            f"{where}: agent_ref.name {name!r} is not a running agent; "
            f"known agents: {', '.join(sorted(known_agents)) or '(none)'}"
        )


def row_agent(row: JsonMapping) -> str | None:
    """The agent a row names in ``agent_ref.name``, or None."""
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None


def routing_basis(row: JsonMapping) -> str | None:
    """What a row routes by as written in the data: its ``agent_ref.name``, else its ``task_source``."""
    source = row.get(TASK_SOURCE_KEY)
    return row_agent(row) or (source if isinstance(source, str) else None)


class RowRouting(BaseModel):
    """Gym's routing keys of a collection (``RolloutCollectionConfig``), as settings of a run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent_name: str | None = None
    """Every row goes to this agent: shorthand for ``agent_map={_default: <agent_name>}``."""
    agent_map: dict[str, str] = Field(default_factory=dict)
    """``{row value: agent}``, the row value being its ``agent_ref.name`` or ``task_source``; ``_default``
    applies to every row without an entry."""
    fan_out: dict[str, list[str]] = Field(default_factory=dict)
    """``{row value: [agents]}``: each such row runs once per agent (one prompt group each), all one Gym task whose
    rollout index continues across the agents, as Gym numbers them
    (:func:`gym_bridge.gym.protocol.numbering.number_tasks`)."""

    @model_validator(mode="after")
    def _consistent(self) -> RowRouting:
        default = self.agent_map.get(DEFAULT_KEY)
        if self.agent_name is not None and default is not None and default != self.agent_name:
            raise SettingError(
                f"agent_name ({self.agent_name!r}) and agent_map._default ({default!r}) both "
                "route every row: set one of them"
            )
        empty = sorted(key for key, agents in self.fan_out.items() if not agents)
        if empty:
            raise SettingError(f"fan_out lists no agent for {empty}")
        repeated = {key: sorted({a for a in agents if agents.count(a) > 1}) for key, agents in self.fan_out.items()}
        repeated = {key: agents for key, agents in repeated.items() if agents}
        if repeated:
            raise SettingError(
                f"fan_out lists an agent more than once: {repeated} (Gym refuses it; each listed agent already runs "
                "every matching row once per sample)"
            )
        return self

    @property
    def is_empty(self) -> bool:
        return self.agent_name is None and not self.agent_map and not self.fan_out

    def _mapped(self, row: JsonMapping) -> str | None:
        source = row.get(TASK_SOURCE_KEY)
        for key in (row_agent(row), source if isinstance(source, str) else None):
            if key is not None and key in self.agent_map:
                return self.agent_map[key]
        return self.agent_map.get(DEFAULT_KEY, self.agent_name)

    def apply(self, row: Any) -> list[Any]:
        """The rows ``row`` becomes: itself re-routed, one copy per ``fan_out`` agent, or itself unchanged.

        A re-routed row is a shallow copy with ``agent_ref = {"name": agent}`` (the caller's row is kept);
        anything that is not a dict is returned as it is, for the row validator to name. ``fan_out`` is keyed by
        the row's value as written in the data and wins over ``agent_map``, as in Gym's ``preprocess_examples``."""
        if self.is_empty or not isinstance(row, dict):
            return [row]
        basis = routing_basis(row)
        if basis is not None and basis in self.fan_out:
            return [_with_agent(row, agent) for agent in self.fan_out[basis]]
        mapped = self._mapped(row)
        return [row if mapped is None else _with_agent(row, mapped)]


def _with_agent(row: JsonObject, agent: str) -> JsonObject:
    if row_agent(row) == agent:
        return row
    return {**row, "agent_ref": {"name": agent}}


@dataclass(frozen=True)
class GymRoutes:
    """Where one launched Gym server set sends rows (read from the launcher's status file)."""

    agents: tuple[str, ...]
    dispatch: Mapping[str, str] = field(default_factory=dict)
    """agent -> the server a row for it is posted to: the environment server in front of it, or itself."""
    dispatch_errors: Mapping[str, str] = field(default_factory=dict)
    scorers: Mapping[str, str] = field(default_factory=dict)
    """agent -> the server whose ``/aggregate_metrics`` scores its rollouts (the environment server in front of it,
    a relay too, else the agent itself)."""
    task_sources: Mapping[str, str] | None = None
    """instance -> the agent its datasets' rows go to; None where the installed Gym cannot resolve them."""
    task_source_errors: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: JsonMapping, agents: list[str]) -> GymRoutes:
        """Routes from the launcher's JSON; ``agents`` (the running agent servers) where it says nothing."""
        sources = data.get("task_sources")
        return cls(
            agents=tuple(sorted(data.get("agents") or agents)),
            dispatch=dict(data.get("dispatch") or {name: name for name in agents}),
            dispatch_errors=dict(data.get("dispatch_errors") or {}),
            scorers=dict(data.get("scorers") or {name: name for name in agents}),
            task_sources=dict(sources) if isinstance(sources, dict) else None,
            task_source_errors=dict(data.get("task_source_errors") or {}),
        )

    def agent_of(self, row: JsonMapping, *, where: str) -> str:
        """The running agent ``row`` goes to; :class:`InvalidGymRow` naming the row, the value and the agents."""
        agent = row_agent(row)
        if agent is None:
            agent = self._resolve_task_source(row.get(TASK_SOURCE_KEY), where)
        else:
            check_agent(agent, self.agents, where=where)
        if agent in self.dispatch_errors:
            raise InvalidGymRow(f"{where}: {self.dispatch_errors[agent]}")
        return agent

    def routed(self, row: JsonObject, *, where: str) -> JsonObject:
        """``row`` with ``agent_ref`` naming its agent (a copy when it had to be stamped, as Gym stamps it)."""
        return _with_agent(row, self.agent_of(row, where=where))

    def route_all(self, rows: Sequence[JsonObject], wheres: Sequence[str]) -> tuple[list[JsonObject], list[str]]:
        """Every row :meth:`routed` (``wheres`` names each in a message), and one problem per row that routes nowhere:
        what a run checks of its whole dataset right after Gym starts, before any row is sent."""
        routed, problems = [], []
        for row, where in zip(rows, wheres, strict=True):
            try:
                routed.append(self.routed(row, where=where))
            except InvalidGymRow as exc:
                problems.append(str(exc))
        return routed, problems

    def _resolve_task_source(self, source: Any, where: str) -> str:
        if source is None:
            raise InvalidGymRow(
                f"{where}: the row has neither agent_ref nor task_source; set agent_name or agent_map._default "
                f"to route it; {self._known()}"
            )
        if self.task_sources is None:
            raise InvalidGymRow(_no_task_source_routing(where, source))
        if source in self.task_sources:
            return self.task_sources[source]
        if source in self.task_source_errors:
            raise InvalidGymRow(f"{where}: task_source {source!r} routes nowhere: {self.task_source_errors[source]}")
        raise InvalidGymRow(
            f"{where}: task_source {source!r} routes nowhere: it is not an agent or resources server of the "
            f"launched Gym config (instances with datasets: {', '.join(sorted(self.task_sources)) or '(none)'}); "
            f"{self._known()}"
        )

    def _known(self) -> str:
        return f"known agents: {', '.join(self.agents) or '(none)'}"


def _no_task_source_routing(where: str, source: Any) -> str:
    gym = installed_gym()
    return (
        f"{where}: task_source {source!r} without agent_ref needs nemo-gym >= 0.6 to resolve it ({gym.label} "
        "is installed): give the row agent_ref.name, or route it with agent_name / agent_map"
    )


def check_routable(row: JsonMapping, *, where: str) -> None:
    """Refuse, where a row enters, a row that no installed Gym can route: no agent and no (resolvable) source."""
    if row_agent(row) is not None:
        return
    source = row.get(TASK_SOURCE_KEY)
    if source is None:
        raise InvalidGymRow(
            f"{where}: invalid Gym row: agent_ref: Field required (or task_source, which Gym 0.6+ resolves to the "
            "agent that declared the row's dataset; or set agent_name / agent_map._default)"
        )
    if not isinstance(source, str) or not source:
        raise InvalidGymRow(f"{where}: invalid Gym row: task_source must be a non-empty string, got {source!r}")
    if not installed_gym().task_source_routing:
        raise InvalidGymRow(_no_task_source_routing(where, source))
