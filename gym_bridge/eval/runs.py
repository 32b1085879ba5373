"""A finished run folder read strictly, for the commands that read runs rather than write them
(``compare``, ``rescore``, the trace viewer): every ``results.jsonl`` line is checked, and a problem
is one :class:`RunReadError` line naming the folder, the line and the field.

Unlike :func:`~gym_bridge.eval.store.read_jsonl` (the writer's resume path), a torn last line is an
error here: it is a run killed mid-write, and ``gym-bridge eval --resume`` repairs it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gym_bridge.eval.records import ROW_ID_KEY
from gym_bridge.eval.store import LOCK_FILE, RESULTS_FILE, RUN_FILE, writer_active
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject


class RunReadError(GymBridgeError, ValueError):
    """A run folder cannot be read: missing, still being written, or a malformed line (named)."""


@dataclass
class RunGroup:
    """One finished prompt group of a run."""

    key: str
    """The row's identity in this run: its ``row_id``, with ``#k`` for the k-th repeat of an identical row."""
    prompt_idx: int
    line: int
    """The line in ``results.jsonl`` (1-based)."""
    agent: str
    rewards: list[float]
    record: JsonObject


@dataclass
class LoadedRun:
    dir: Path
    run: JsonObject
    """``run.json``."""
    groups: list[RunGroup]
    by_key: dict[str, RunGroup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_key = {g.key: g for g in self.groups}

    @property
    def config(self) -> JsonObject:
        config: JsonObject = self.run.get("config") or {}
        return config

    @property
    def fingerprint(self) -> JsonObject:
        fingerprint: JsonObject = self.run.get("fingerprint") or {}
        return fingerprint

    @property
    def pass_threshold(self) -> float:
        return float(self.config.get("pass_threshold", 1.0))


def load_run(run_dir: str | Path, *, need_row_ids: bool = True) -> LoadedRun:
    """Read ``run.json`` and every ``results.jsonl`` line of ``run_dir``, in file order.

    Raises:
        RunReadError: the folder or ``run.json`` is missing or unreadable, an eval is still writing the
            folder (it holds ``run.lock``), or a line is torn, not a JSON object, or lacks a field
            (``row_id`` too, when ``need_row_ids``).
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        raise RunReadError(f"{folder}: no such run folder")
    run_path = folder / RUN_FILE
    try:
        run = json.loads(run_path.read_text())
    except FileNotFoundError:
        raise RunReadError(f"{run_path}: missing; {folder} is not a gym-bridge eval run folder") from None
    except (OSError, ValueError) as exc:
        raise RunReadError(f"{run_path}: not readable JSON ({exc})") from None
    if not isinstance(run, dict):
        raise RunReadError(f"{run_path}: not a JSON object")
    if writer_active(folder):
        raise RunReadError(f"{folder}: still being written (a process holds {LOCK_FILE}); read it when it ends")
    path = folder / RESULTS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RunReadError(f"{path}: missing; the run has no finished prompt group") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        raise RunReadError(
            f"{path}:{len(lines)}: torn last line (the run was killed mid-write); `gym-bridge eval --resume` repairs it"
        )
    groups: list[RunGroup] = []
    seen: Counter[str] = Counter()
    for number, raw in enumerate(lines, start=1):
        group = _parse_line(path, number, raw, need_row_ids=need_row_ids)
        repeat = seen[group.key]
        seen[group.key] += 1
        if repeat:
            group.key = f"{group.key}#{repeat}"
        groups.append(group)
    if not groups:
        raise RunReadError(f"{path}: empty; the run has no finished prompt group")
    return LoadedRun(dir=folder, run=run, groups=groups)


def _parse_line(path: Path, number: int, raw: bytes, *, need_row_ids: bool) -> RunGroup:
    where = f"{path}:{number}"
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RunReadError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise RunReadError(f"{where}: not a JSON object")

    def need[T](key: str, kind: type[T], what: str) -> T:
        if key not in record:
            raise RunReadError(f"{where}: field {key!r} is missing")
        value = record[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RunReadError(f"{where}: field {key!r} is not {what} ({value!r:.60})")
        return value

    prompt_idx = need("prompt_idx", int, "an integer")
    agent = need("agent", str, "a string")
    if need_row_ids:
        if ROW_ID_KEY not in record:
            raise RunReadError(
                f"{where}: field {ROW_ID_KEY!r} is missing (written before rows had identities); run the eval again"
            )
        key = need(ROW_ID_KEY, str, "a string")
    else:
        key = str(record.get(ROW_ID_KEY, f"idx:{prompt_idx}"))
    completions = need("completions", list, "a list")
    if not completions:
        raise RunReadError(f"{where}: field 'completions' is empty")
    rewards = []
    for i, completion in enumerate(completions):
        reward = completion.get("reward") if isinstance(completion, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            missing = not isinstance(completion, dict) or "reward" not in completion
            raise RunReadError(
                f"{where}: field 'completions[{i}].reward' is {'missing' if missing else f'not a number ({reward!r})'}"
            )
        rewards.append(float(reward))
    return RunGroup(key=key, prompt_idx=prompt_idx, line=number, agent=agent, rewards=rewards, record=record)
