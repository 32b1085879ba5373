"""A gym-bridge eval is also a Gym eval run: ``rollouts.jsonl`` and ``rollouts_aggregate_metrics.json`` beside
``results.jsonl``, as ``gym eval run`` names and fills them (:mod:`gym_bridge.gym.protocol.eval_run`), so Gym's own
``gym eval compare``, ``aggregate``, ``health-check``, ``profile``, ``export`` and ``reverify`` read the folder.

They are written at the end of every session that started Gym (finished or interrupted), over every group
``results.jsonl`` holds, earlier sessions' too, while Gym is still up: the aggregate metrics are each scoring server's
own ``/aggregate_metrics`` answer over the rollouts it ran, as Gym's collection asks for them. ``rollouts.jsonl``
holds the rollouts in the order they finished (Gym's readers sort on read). A server that does not answer leaves
the aggregate file out, with one warning naming it and the way to make it (``gym eval aggregate``); the eval's own
files are complete either way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from gym_bridge.boundary import json_io
from gym_bridge.boundary.files import write_atomic
from gym_bridge.eval.records import ResultLine
from gym_bridge.eval.runs import RESULTS_FILE, ReadLimits, read_result_lines
from gym_bridge.failures import GymMetricsError
from gym_bridge.gym.protocol.eval_run import (
    ROLLOUTS_FILE,
    aggregate_entry,
    aggregate_metrics_name,
    by_server,
    gym_rollout,
    materialized_input,
    materialized_inputs_name,
    metric_labels,
    metrics_row,
    rollout_order,
)
from gym_bridge.gym.protocol.rows import is_materialized
from gym_bridge.gym_versions import installed_gym
from gym_bridge.json_types import JsonObject

if TYPE_CHECKING:
    from gym_bridge.gym.protocol.routing import GymRoutes
    from gym_bridge.types import ActorHandle

logger = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 300.0
"""The bound on each server's ``/aggregate_metrics`` (Gym's collection waits without one)."""


@dataclass
class GymRunFiles:
    """What :func:`write_gym_run_files` wrote."""

    rollouts: Path
    rollouts_written: int
    aggregate_metrics: Path | None
    """None: no server scored the rollouts (the warning says why)."""


@dataclass(frozen=True)
class _Stamps:
    """How the launched Gym set names the servers behind each agent."""

    scorers: dict[str, str]
    """agent -> the server whose ``/aggregate_metrics`` scores its rollouts."""
    impls: dict[str, str | None]
    """server -> its implementation folder (Gym 0.7's ``_ng_result_type``)."""

    def rollout(self, result: JsonObject, row: JsonObject, agent: str) -> JsonObject:
        """A materialized row's record names its environment server already, and no agent (as Gym's does)."""
        if is_materialized(row):
            return gym_rollout(result, row, agent=None, server=None, result_type=None)
        gym = installed_gym()
        server = self.scorers.get(agent) if gym.eval_run_files.stamps_environment_server else None
        return gym_rollout(result, row, agent=agent, server=server, result_type=self.impls.get(server or ""))


def write_gym_run_files(
    run_dir: Path, actor: ActorHandle, rows: Mapping[int, JsonObject], *, timeout_s: float = METRICS_TIMEOUT_S
) -> GymRunFiles:
    """Write ``run_dir``'s Gym eval-run files from its ``results.jsonl`` (``rows``: each prompt's dataset row, by
    ``prompt_idx``), asking ``actor``'s running Gym set for the aggregate metrics.

    Raises:
        RunReadError: ``results.jsonl`` cannot be read (named).
        UntrustedInputError: a file cannot be written (named).
    """
    import ray

    routes: GymRoutes = ray.get(actor.routes.remote(), timeout=timeout_s)
    info = ray.get(actor.server_info.remote(), timeout=timeout_s)
    stamps = _Stamps(scorers=dict(routes.scorers), impls=dict(info.get("server_impls") or {}))
    files = GymRunFiles(rollouts=run_dir / ROLLOUTS_FILE, rollouts_written=0, aggregate_metrics=None)
    metrics_rows: list[JsonObject] = []
    identities: list[tuple[int, JsonObject]] = []

    def write_rollouts(out: IO[bytes]) -> None:
        for prompt_idx, rollout in _rollouts(run_dir, stamps, rows):
            out.write(json_io.dumps(rollout) + b"\n")
            metrics_rows.append(metrics_row(rollout))
            identities.append((prompt_idx, materialized_input({}, rollout)))  # its agent and identity

    def write_inputs(out: IO[bytes]) -> None:
        for prompt_idx, identity in identities:
            out.write(json_io.dumps(materialized_input(rows.get(prompt_idx, {}), identity)) + b"\n")

    write_atomic(files.rollouts, write_rollouts, root=run_dir)
    write_atomic(run_dir / materialized_inputs_name(ROLLOUTS_FILE), write_inputs, root=run_dir)
    files.rollouts_written = len(metrics_rows)
    gym = installed_gym().eval_run_files
    if gym.aggregate_metrics and metrics_rows:
        files.aggregate_metrics = _write_aggregate_metrics(run_dir, actor, stamps, metrics_rows, timeout_s)
    return files


def _write_aggregate_metrics(
    run_dir: Path, actor: ActorHandle, stamps: _Stamps, metrics_rows: list[JsonObject], timeout_s: float
) -> Path | None:
    """Each scoring server's ``/aggregate_metrics`` over its rollouts, as one file; None (one warning) when a
    server does not answer."""
    import ray

    gym = installed_gym().eval_run_files
    metrics_rows.sort(key=rollout_order)
    groups = by_server(metrics_rows, stamps.scorers)
    try:
        answers = ray.get(actor.aggregate_metrics.remote(groups, timeout_s), timeout=timeout_s + 30)
    except (GymMetricsError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        logger.warning(
            "%s: not written (%s); `gym eval aggregate --input-glob %s` makes it with Gym running",
            aggregate_metrics_name(ROLLOUTS_FILE), exc, run_dir / ROLLOUTS_FILE,
        )  # fmt: skip
        return None
    agent_of = {server: agent for agent, server in sorted(stamps.scorers.items())}
    labels = metric_labels({server: agent_of.get(server) for server in answers})
    entries = [
        aggregate_entry(labels[server], server, answer, stamp_server=gym.stamps_environment_server)
        for server, answer in answers.items()
    ]
    path = run_dir / aggregate_metrics_name(ROLLOUTS_FILE)
    write_atomic(path, json_io.dumps(entries, indent=True), root=run_dir)
    return path


def _rollouts(run_dir: Path, stamps: _Stamps, rows: Mapping[int, JsonObject]) -> Iterator[tuple[int, JsonObject]]:
    """Every completion of ``results.jsonl`` (earlier sessions' too) as its prompt and Gym's rollout record, in file
    order."""
    limits = ReadLimits.from_env()
    if not (run_dir / RESULTS_FILE).exists():
        return
    for _, _, result in read_result_lines(run_dir, limits, ResultLine, need_row_ids=False, finished=False):
        for completion in result.completions:
            if completion.gym_result is not None:
                row = rows.get(result.prompt_idx, {})
                yield result.prompt_idx, stamps.rollout(completion.gym_result, row, result.agent)
