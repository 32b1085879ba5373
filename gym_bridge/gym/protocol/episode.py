"""Gym 0.7's episode protocol: where a materialized row goes, the request it is sent as, the record its reply becomes.

A materialized row (``task_id`` an object ``{taskset, task_id}`` beside ``task_input``) goes to the environment server
its taskset names in Gym's ``environment_server_routes`` (:class:`EpisodeRoutes`), as the episode request
:func:`episode_request_body` builds, exactly where Gym's own collection sends it
(``rollout_collection._environment_server_for_config_row`` / ``_episode_request_body``). Its reply is made the record
Gym's collection stores (:func:`episode_record`, Gym's ``_episode_record``): a ``result`` as the environment server
returned it, or a handled ``failure`` as Gym's failure row, which :func:`episode_failure` types.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gym_bridge.failures import GymResultError, GymRunError, GymTransportError, InvalidGymRow, RolloutFailure, shorten
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.protocol.rows import ENVIRONMENT_SERVER_KEY, check_materialized, is_materialized, stamped_index
from gym_bridge.gym_versions import ATTEMPT_INDEX_KEY, ROLLOUT_ID_KEY, ROLLOUT_INDEX_KEY, TASK_INDEX_KEY, installed_gym
from gym_bridge.json_types import JsonMapping, JsonObject

_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""Gym's rollout id pattern."""
FAILURE_CLASS_KEY = "_ng_failure_class"
"""Gym's failure-routing sentinel on a record that is no rollout (``rollout_collection.NG_FAILURE_CLASS_KEY``)."""
ENVIRONMENT_SERVER_FAILED = "environment_server_failed"
"""Gym's ``_ng_failure_class`` of an episode the environment server answered with a handled ``failure``."""
TERMINAL_KEY = "_ng_failure_terminal"
TASK_ID_KEY = "_ng_task_id"
_RESERVED_RESULT_KEYS = ("ng_trajectory", "ng_model_call_capture", "ng_perf")


@dataclass(frozen=True)
class EpisodeRoutes(GymRoutes):
    """:class:`GymRoutes` plus the taskset routes of Gym's episode protocol: a materialized row goes to the environment
    server ``environment_server_routes`` names for its ``task_id.taskset`` (Gym's
    ``_environment_server_for_config_row``); every other row routes as before. Read from the launched config."""

    tasksets: Mapping[str, str] = field(default_factory=dict)
    """taskset -> the running environment server its rows go to."""
    taskset_errors: Mapping[str, str] = field(default_factory=dict)
    """taskset -> why its route names no running environment server."""

    def environment_server_of(self, row: JsonMapping, *, where: str) -> str:
        """The environment server a materialized row goes to; :class:`InvalidGymRow` naming the taskset and the routes
        there are (Gym's ``No environment server route is configured for taskset ...``)."""
        taskset = row["task_id"].get("taskset")
        if taskset in self.tasksets:
            return self.tasksets[taskset]
        if taskset in self.taskset_errors:
            raise InvalidGymRow(f"{where}: taskset {taskset!r} routes nowhere: {self.taskset_errors[taskset]}")
        known = ", ".join(f"{name} -> {server}" for name, server in sorted(self.tasksets.items())) or "(none)"
        raise InvalidGymRow(
            f"{where}: no environment server route is configured for taskset {taskset!r} (Gym's "
            f"environment_server_routes of the launched config: {known})"
        )

    def agent_of(self, row: JsonMapping, *, where: str) -> str:
        if is_materialized(row):
            raise InvalidGymRow(
                f"{where}: a materialized row goes to an environment server (taskset "
                f"{row['task_id'].get('taskset')!r}), not to an agent"
            )
        return super().agent_of(row, where=where)

    def routed(self, row: JsonObject, *, where: str) -> JsonObject:
        """A materialized row with Gym's ``_ng_environment_server`` stamp (a copy when it changes; no ``agent_ref``:
        Gym's materialized tasks carry none by design); any other row as :meth:`GymRoutes.routed` routes it."""
        if not is_materialized(row):
            return super().routed(row, where=where)
        server = self.environment_server_of(row, where=where)
        return row if row.get(ENVIRONMENT_SERVER_KEY) == server else {**row, ENVIRONMENT_SERVER_KEY: server}


def episode_target(row: Any, position: int, routes: GymRoutes) -> tuple[int, str]:
    """``(row index, environment server)`` of a stamped materialized row about to be sent (:func:`dispatch_target`'s
    counterpart); :class:`InvalidGymRow` where the routes have no taskset routes or none for its taskset."""
    rowidx = stamped_index(row, position)
    where = f"row {position} ({ROW_INDEX_KEY}={rowidx}, task_id={row.get('task_id')!r})"
    if not installed_gym().episode_protocol:
        check_materialized(row, where)  # names the version
    if not isinstance(routes, EpisodeRoutes):
        raise InvalidGymRow(f"{where}: a materialized row, but this Gym server set has no taskset routes")
    return rowidx, routes.environment_server_of(row, where=where)


def episode_request_body(row: JsonMapping) -> JsonObject:
    """The episode request a materialized row is sent as, Gym 0.7's ``_episode_request_body``:
    ``{"episode_id": {"rollout_id", "attempt"}, "task": {"task_id", "task_input"}}``.

    ``rollout_id``: the row's ``_ng_rollout_id`` (Gym's ``maybe_rollout_id_from_run_body`` of the row at attempt 0),
    else ``"<task index>-<rollout index>"``; ``attempt``: its ``_ng_attempt_index`` (0 on a first send). Nothing
    else of the row is sent: sampling, seeds and verifier fields live in ``task_input``, which Gym sends unchanged.
    :class:`InvalidGymRow` where Gym raises ``ValueError`` (a bad attempt or rollout id) or ``KeyError`` (no indices).
    """
    attempt = row.get(ATTEMPT_INDEX_KEY, 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise InvalidGymRow(f"invalid episode attempt: {attempt!r}")
    rollout_id = row.get(ROLLOUT_ID_KEY)
    if rollout_id is not None:
        if not isinstance(rollout_id, str) or not _ROLLOUT_ID.fullmatch(rollout_id):
            raise InvalidGymRow(
                f"{ROLLOUT_ID_KEY} must be a string of letters, digits, dots, dashes or underscores starting with a "
                f"letter or digit; got {rollout_id!r}"
            )
    elif TASK_INDEX_KEY in row and ROLLOUT_INDEX_KEY in row:
        rollout_id = f"{row[TASK_INDEX_KEY]}-{row[ROLLOUT_INDEX_KEY]}"
    else:
        raise InvalidGymRow(
            f"a materialized row needs its rollout identity ({TASK_INDEX_KEY} and {ROLLOUT_INDEX_KEY}, or "
            f"{ROLLOUT_ID_KEY}) to name its episode"
        )
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "task": {"task_id": row["task_id"], "task_input": row["task_input"]},
    }


def is_episode_response(result: Any) -> bool:
    """Gym's ``_is_episode_response``: a ``BaseEpisodeResponse``-shaped reply (``episode_id`` and ``task_id``
    objects, plus ``result`` or ``failure``). Applied only to the reply to a materialized row, as Gym applies it."""
    return (
        isinstance(result, Mapping)
        and isinstance(result.get("episode_id"), Mapping)
        and isinstance(result.get("task_id"), Mapping)
        and ("result" in result or "failure" in result)
    )


def episode_record(response: JsonMapping) -> JsonObject:
    """The record Gym's collection stores for an episode reply (``rollout_collection._episode_record``).

    A handled ``failure`` becomes Gym's failure row (``_ng_failure_class`` = ``environment_server_failed``,
    ``_ng_failure_terminal``, ``_ng_failure_message``, ``_ng_failure_stage``, ``_ng_failure_partial_response``); a
    ``result`` is kept as the environment server returned it, plus ``_ng_task_id``: scored by its top-level
    ``reward`` like any ``/run`` result. :class:`GymResultError` where Gym raises ``ValueError``: a failure or result
    that is no object, a result using keys reserved for the collection (``_ng_*``, ``ng_trajectory``, ...)."""
    task_id = response.get("task_id")
    failure = response.get("failure")
    if failure is not None:
        if not isinstance(failure, Mapping):
            raise GymResultError(
                f"environment server reply for task {task_id!r} carries a non-object failure: {shorten(repr(failure))}"
            )
        record: JsonObject = {
            TASK_ID_KEY: task_id,
            FAILURE_CLASS_KEY: ENVIRONMENT_SERVER_FAILED,
            TERMINAL_KEY: bool(failure.get("terminal", False)),
            "_ng_failure_message": failure.get("failure_reason"),
        }
        if failure.get("stage") is not None:
            record["_ng_failure_stage"] = failure["stage"]
        if failure.get("partial_response") is not None:
            record["_ng_failure_partial_response"] = failure["partial_response"]
        return record
    result = response.get("result")
    if not isinstance(result, Mapping):
        raise GymResultError(
            f"environment server reply for task {task_id!r} carries a non-object result: {shorten(repr(result))}"
        )
    reserved = sorted(key for key in result if key.startswith("_ng_") or key in _RESERVED_RESULT_KEYS)
    if reserved:
        raise GymResultError(
            f"environment server result for task {task_id!r} uses keys reserved for rollout collection: {reserved}"
        )
    return {**result, TASK_ID_KEY: task_id}


def episode_failure(record: JsonMapping, where: str) -> RolloutFailure:
    """The typed failure of Gym's ``environment_server_failed`` row (:func:`episode_record`).

    Gym re-dispatches a non-terminal one (with the next ``_ng_attempt_index``) and never a terminal one
    (``is_terminal_failure``): a non-terminal failure is :class:`GymTransportError`, infrastructure, re-sent like a
    lost row while ``max_gym_row_attempts`` lasts; a terminal one :class:`GymRunError`, data, never re-sent."""
    terminal = bool(record.get(TERMINAL_KEY))
    stage = record.get("_ng_failure_stage")
    detail = shorten(str(record.get("_ng_failure_message") or "(no failure_reason)"))
    message = (
        f"{where}: Gym's _ng_failure_class {ENVIRONMENT_SERVER_FAILED} ("
        f"{'terminal' if terminal else 'not terminal: Gym retries it'}"
        f"{f', stage {stage}' if stage is not None else ''}): {detail}"
    )
    return GymRunError(message) if terminal else GymTransportError(message)
