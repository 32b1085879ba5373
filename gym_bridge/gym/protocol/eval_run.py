"""Gym's eval-run files: what ``gym eval run`` writes beside its rollouts, so Gym's own tools read a gym-bridge eval.

``rollouts.jsonl`` holds one record per rollout as Gym's collection writes it: the ``/run`` result with the
rollout's ``_ng_*`` identity and ``agent_ref`` (and, on Gym 0.7, the environment server that ran it and that
server's implementation). ``rollouts_materialized_inputs.jsonl`` holds each rollout's input row with the same
identity. ``rollouts_aggregate_metrics.json`` is a list with one entry per server that scores
rollouts (:attr:`~gym_bridge.gym_versions.GymVersion.metrics_server`), each computed by that server's own
``/aggregate_metrics`` from the rollouts it ran, stripped as Gym strips them. The names are derived as Gym's
``path_utils`` derives them from the rollouts file, so ``gym eval compare`` and ``health-check`` find them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from gym_bridge.gym.protocol.rows import ENVIRONMENT_SERVER_KEY
from gym_bridge.gym_versions import ROLLOUT_INDEX_KEY, TASK_INDEX_KEY
from gym_bridge.json_types import JsonMapping, JsonObject

ROLLOUTS_FILE = "rollouts.jsonl"
"""The rollouts file ``gym eval health-check RUN_DIR`` looks for by default."""
RESULT_TYPE_KEY = "_ng_result_type"
"""Gym 0.7's stamp of the implementation of the environment server that produced a record."""
AGENT_REF_KEY = "agent_ref"
_HEAVY_KEYS = frozenset(
    {"response", "responses_create_params", "ng_agent_observations", "ng_model_call_capture", "ng_trajectory"}
)
"""What Gym leaves out of a rollout it sends to ``/aggregate_metrics`` (keeping ``response.usage`` and
``response.incomplete_details``)."""
_KEPT_RESPONSE_KEYS = ("usage", "incomplete_details")


def aggregate_metrics_name(rollouts_name: str) -> str:
    """``rollouts.jsonl`` -> ``rollouts_aggregate_metrics.json`` (Gym's ``aggregate_metrics_path_for``)."""
    return f"{_stem(rollouts_name)}_aggregate_metrics.json"


def materialized_inputs_name(rollouts_name: str) -> str:
    """``rollouts.jsonl`` -> ``rollouts_materialized_inputs.jsonl`` (Gym's ``materialized_path_for``)."""
    return f"{_stem(rollouts_name)}_materialized_inputs.jsonl"


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def gym_rollout(
    result: JsonMapping, row: JsonMapping, *, agent: str | None, server: str | None, result_type: str | None
) -> JsonObject:
    """The rollouts-file record of one ``/run`` result for its dataset ``row``: the result with ``agent_ref`` as Gym
    copies it from the row (the row's own when it names ``agent``, else ``{"name": agent}``) and, when ``server`` is
    given (Gym 0.7), the environment server that ran it and that server's implementation. A shallow copy; a stamp
    the result already carries is kept."""
    record = dict(result)
    if agent is not None and not isinstance(record.get(AGENT_REF_KEY), dict):
        own = row.get(AGENT_REF_KEY)
        record[AGENT_REF_KEY] = own if isinstance(own, dict) and own.get("name") == agent else {"name": agent}
    if server is not None and ENVIRONMENT_SERVER_KEY not in record:
        record[ENVIRONMENT_SERVER_KEY] = server
        record[RESULT_TYPE_KEY] = result_type
    return record


def materialized_input(row: JsonMapping, rollout: JsonMapping) -> JsonObject:
    """The materialized-inputs record of one rollout: its dataset row with Gym's identity of the rollout (the
    ``_ng_*`` keys it carries) and, when the row names none, the rollout's ``agent_ref``: what ``gym eval profile``
    and ``reverify`` match rollouts to."""
    record = {key: value for key, value in row.items() if not key.startswith("_ng_")}
    if AGENT_REF_KEY in rollout:
        record.setdefault(AGENT_REF_KEY, rollout[AGENT_REF_KEY])  # the row's own, as Gym keeps it
    record.update({key: value for key, value in rollout.items() if key.startswith("_ng_") and key != RESULT_TYPE_KEY})
    return record


def metrics_row(rollout: JsonMapping) -> JsonObject:
    """What ``/aggregate_metrics`` is sent of a rollout: everything but the transcript, as Gym's collection sends it
    (``response`` keeps only ``usage`` and ``incomplete_details``)."""
    row = {key: value for key, value in rollout.items() if key not in _HEAVY_KEYS}
    response = rollout.get("response")
    if isinstance(response, dict):
        kept = {key: response[key] for key in _KEPT_RESPONSE_KEYS if response.get(key) is not None}
        if kept:
            row["response"] = kept
    return row


def rollout_order(rollout: JsonMapping) -> tuple[int, int]:
    """Gym's order of a rollouts file: task index, then rollout index."""
    task, rollout_index = rollout.get(TASK_INDEX_KEY), rollout.get(ROLLOUT_INDEX_KEY)
    return (task if isinstance(task, int) else -1, rollout_index if isinstance(rollout_index, int) else -1)


def metric_labels(server_agents: Mapping[str, str | None]) -> dict[str, str]:
    """Each scoring server's entry label: its agent's name where that agent is scored by this server alone, else the
    server's own name, so every label is unique (how Gym 0.7 labels one entry per environment server)."""
    servers_of: Counter[str] = Counter(agent for agent in server_agents.values() if agent is not None)
    labels = {
        server: agent if agent is not None and servers_of[agent] == 1 else server
        for server, agent in server_agents.items()
    }
    while clashing := [s for s, label in labels.items() if label != s and Counter(labels.values())[label] > 1]:
        for server in clashing:
            labels[server] = server
    return labels


def aggregate_entry(label: str, server: str, answer: JsonMapping, *, stamp_server: bool) -> JsonObject:
    """One entry of the aggregate-metrics file from a server's ``/aggregate_metrics`` answer."""
    entry: JsonObject = {AGENT_REF_KEY: {"name": label}}
    if stamp_server:
        entry[ENVIRONMENT_SERVER_KEY] = server
    for key in ("agent_metrics", "key_metrics", "group_level_metrics", "repeat_level_metrics"):
        entry[key] = answer.get(key, [] if key.endswith("level_metrics") else {})
    if answer.get("perf_summary") is not None:
        entry["perf_summary"] = answer["perf_summary"]
    return entry


def by_server(rows: Iterable[JsonObject], server_of: Mapping[str, str]) -> dict[str, list[JsonObject]]:
    """Metrics rows (:func:`metrics_row`) grouped by the server that scores them: the environment server a row
    names, else the one ``server_of`` gives its agent; a row that names neither is left out (it reaches no server)."""
    groups: dict[str, list[JsonObject]] = {}
    for rollout in rows:
        server = rollout.get(ENVIRONMENT_SERVER_KEY)
        if not isinstance(server, str):
            ref = rollout.get(AGENT_REF_KEY)
            agent = ref.get("name") if isinstance(ref, dict) else None
            server = server_of.get(agent) if isinstance(agent, str) else None
        if server is not None:
            groups.setdefault(server, []).append(rollout)
    return groups
