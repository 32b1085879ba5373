"""A folder ``gym eval run`` wrote, read as a run, so ``gym-bridge report`` and ``compare`` take it beside
gym-bridge's own (a Gym baseline against a gym-bridge run, paired where the tasks match).

Such a folder holds ``rollouts.jsonl`` (one record per rollout) and no ``run.json``. Each task (its
``_ng_task_index``) becomes one prompt group: its rollouts' rewards in rollout order, its agent the rollouts'
``agent_ref.name``, its key the :func:`~gym_bridge.eval.records.row_id` of its row in
``rollouts_materialized_inputs.jsonl`` (the dataset row without Gym's stamps: the key a gym-bridge run gives the
same row), else ``task:<index>``. Both files are read through the same boundary and under the same caps as a
gym-bridge run folder (:mod:`gym_bridge.eval.runs`); a record without a finite ``reward`` or an integer task or
rollout index is refused, naming the file, the line and the field. Gym records no grader config or dataset hash,
so ``compare`` checks neither for such a run and pairs the tasks both runs hold.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field, NonNegativeInt

from gym_bridge.boundary.text import shown
from gym_bridge.eval.line_text import prompt_preview
from gym_bridge.eval.records import REPEAT_MARK, FiniteFloat, ResultLine, RunFile, RunFingerprint, _OnDisk, row_id
from gym_bridge.eval.runs import (
    RUN_FILE,
    LineVisitor,
    LoadedRun,
    ReadLimits,
    RunGroup,
    RunReadError,
    iter_objects,
    load_run,
    typed_line,
)
from gym_bridge.gym.protocol.eval_run import AGENT_REF_KEY, ROLLOUTS_FILE, materialized_inputs_name
from gym_bridge.gym_versions import ROLLOUT_INDEX_KEY, TASK_INDEX_KEY
from gym_bridge.json_types import JsonObject

GYM_RUN_MODEL = "gym eval run"
"""What ``run.json``'s ``model`` says of such a run: Gym's rollouts record no model."""
_TASK_KEY = "task:"


class _Rollout(_OnDisk):
    """A rollouts-file record, the fields read here."""

    reward: FiniteFloat
    task: NonNegativeInt = Field(alias=TASK_INDEX_KEY)
    rollout: NonNegativeInt = Field(alias=ROLLOUT_INDEX_KEY)


def is_gym_run(folder: str | Path) -> bool:
    """Whether ``folder`` is one ``gym eval run`` wrote: a rollouts file and no ``run.json``."""
    path = Path(folder)
    return not os.path.lexists(path / RUN_FILE) and os.path.lexists(path / ROLLOUTS_FILE)


def load_eval_run(
    run_dir: str | Path,
    *,
    need_row_ids: bool = True,
    finished: bool = True,
    failures: bool = False,
    visit: LineVisitor | None = None,
) -> LoadedRun:
    """The eval run in ``run_dir``: a folder ``gym eval run`` wrote (:func:`load_gym_run`), else gym-bridge's
    (:func:`~gym_bridge.eval.runs.load_run`, with these arguments)."""
    if is_gym_run(run_dir):
        return load_gym_run(run_dir, ReadLimits.from_env(), visit=visit)
    return load_run(run_dir, need_row_ids=need_row_ids, finished=finished, failures=failures, visit=visit)


def load_gym_run(folder: str | Path, limits: ReadLimits, *, visit: LineVisitor | None = None) -> LoadedRun:
    """The run ``gym eval run`` wrote in ``folder``, one group per task in task order.

    Raises:
        RunReadError: a file is not regular, too large, torn or malformed, or a record lacks a field (named), or the
            rollouts file holds no rollout.
    """
    path = Path(folder)
    tasks: dict[int, list[tuple[int, JsonObject, int]]] = {}
    where_of = shown(path / ROLLOUTS_FILE)
    for number, record in _records(path / ROLLOUTS_FILE, limits):
        rollout = typed_line(_Rollout, record, f"{where_of}:{number}")
        tasks.setdefault(rollout.task, []).append((rollout.rollout, record, number))
    if not tasks:
        raise RunReadError(f"{where_of}: empty; the run has no rollout")
    keys = _task_keys(path, limits)
    seen: dict[str, int] = {}
    groups: list[RunGroup] = []
    for task in sorted(tasks):
        rollouts = [record for _, record, _ in sorted(tasks[task], key=lambda item: item[0])]
        record = _group_record(task, keys.get(task, f"{_TASK_KEY}{task}"), rollouts)
        key = str(record["row_id"])
        repeat = seen.setdefault(key, 0)
        seen[key] += 1
        result = ResultLine.model_validate(record)
        group = RunGroup(
            key=f"{key}{REPEAT_MARK}{repeat}" if repeat else key,
            line=min(number for _, _, number in tasks[task]),
            prompt_idx=task,
            agent=result.agent,
            rewards=[c.reward for c in result.completions],
            prompt=prompt_preview(record),
            held=record,
        )
        if visit is not None:
            visit(group, record, result)
        groups.append(group)
    repeats = max(len(rollouts) for rollouts in tasks.values())
    fingerprint: JsonObject = {"num_generations_per_prompt": repeats}
    run: JsonObject = {"model": GYM_RUN_MODEL, "gym_eval_run": True, "fingerprint": fingerprint}
    meta = RunFile(prompts_total=len(groups), model=GYM_RUN_MODEL, fingerprint=RunFingerprint(**fingerprint))
    return LoadedRun(dir=path, run=run, meta=meta, groups=groups)


def _records(path: Path, limits: ReadLimits) -> Iterator[tuple[int, JsonObject]]:
    for number, _, _, record in iter_objects(path, limits, finished=True, skip_blank=True):
        yield number, record


def _task_keys(folder: Path, limits: ReadLimits) -> dict[int, str]:
    """Each task's key from the materialized inputs: the ``row_id`` of its row (none when the file is absent)."""
    path = folder / materialized_inputs_name(ROLLOUTS_FILE)
    if not os.path.lexists(path):
        return {}
    keys: dict[int, str] = {}
    for number, record in _records(path, limits):
        task = record.get(TASK_INDEX_KEY)
        if not isinstance(task, int) or isinstance(task, bool):
            raise RunReadError(f"{shown(path)}:{number}: field {TASK_INDEX_KEY!r}: not an integer")
        keys.setdefault(task, row_id(record))
    return keys


def _group_record(task: int, key: str, rollouts: list[JsonObject]) -> JsonObject:
    """The result-line record of one task: what ``report`` and ``compare`` read of a gym-bridge result line."""
    ref = rollouts[0].get(AGENT_REF_KEY)
    agent = ref.get("name") if isinstance(ref, dict) else None
    return {
        "prompt_idx": task,
        "row_id": key,
        "agent": agent if isinstance(agent, str) else "(no agent_ref)",
        "completions": [_completion(rollout) for rollout in rollouts],
    }


def _completion(rollout: JsonObject) -> JsonObject:
    """A completion record of one rollout: its reward, its token counts and truncation where ``response`` says
    (``usage``, ``incomplete_details``), and the rollout itself as its Gym result."""
    response = rollout.get("response")
    response = response if isinstance(response, dict) else {}
    usage = response.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    incomplete = response.get("incomplete_details")
    completion: JsonObject = {
        "reward": rollout["reward"],
        "truncated": isinstance(incomplete, dict) and incomplete.get("reason") == "max_output_tokens",
        "gym_result": rollout,
    }
    for ours, gyms in (("generated_tokens", "output_tokens"), ("total_tokens", "total_tokens")):
        value = usage.get(gyms)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            completion[ours] = value
    return completion
