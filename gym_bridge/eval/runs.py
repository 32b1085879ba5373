"""The one reader of run folders, for every command that opens one (``report``, ``compare``, ``rescore``,
``eval --resume``, the trace viewer), and the one place that tells an eval run folder from a training one
(:func:`run_folder_kind`, for ``gym-bridge report``). A training folder's JSONL files are read by
:func:`gym_bridge.training.metrics.iter_jsonl`, the same loop under the same caps with the same error lines (the
layer table keeps ``training/`` from importing this tool; ``tests/eval/test_hostile_reports.py`` holds the two equal).

A run folder is data that people send each other, and model text in it is attacker-controlled, so reading one
goes through the trust boundary (:mod:`gym_bridge.boundary`) and is bounded and typed: only regular files are read
(a FIFO, a device or a link to one is refused before anything blocks), each under a size cap (:class:`ReadLimits`,
the message says how to raise it); JSONL is streamed line by line (:func:`iter_lines`), each line under
:attr:`ReadLimits.max_line_bytes`, split on ``\\n`` only (never ``str.splitlines()``, which also splits on U+2028,
U+2029 and U+0085 inside a valid row), a NUL byte an error at its line; every line is decoded by
:func:`~gym_bridge.boundary.json_io.loads_object` (finite numbers, bounded nesting) and checked against the models
of :mod:`gym_bridge.eval.records`, ``run.json`` too. A ``prompt_idx`` given twice is refused, naming both lines,
and one outside the dataset ``run.json`` records (``prompts_total``); a ``row_id`` that could equal a reader's key
for a repeated row (``x#1``) is refused (:data:`~gym_bridge.eval.records.REPEAT_MARK`): no line is counted as a
prompt that is not there, or as another.

What a reader keeps is bounded by what it uses, not by the file: :func:`load_run` keeps per prompt its numbers
and where its line is (:class:`~gym_bridge.eval.line_stream.LineRef`), read again when asked for
(:attr:`RunGroup.record`); a caller that needs more of each line sees each once as it streams by (``visit``).

Any problem is one :class:`RunReadError` line naming the folder, the file, the line and the field. A torn last
line is an error for a finished run (``gym-bridge eval --resume`` repairs it); a run still being written (its
``run.lock`` held: :mod:`gym_bridge.eval.run_lock`) is refused.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import read_bytes
from gym_bridge.boundary.json_io import (
    MAX_DEPTH,
    jsonl_lines as jsonl_lines,  # the store's and the rescore's splitter
    loads_object,
)
from gym_bridge.boundary.jsonl import iter_lines as boundary_lines
from gym_bridge.boundary.text import shown
from gym_bridge.eval.line_stream import LineRef, collector_paused
from gym_bridge.eval.line_text import field_problem, prompt_preview
from gym_bridge.eval.records import NO_ROW_ID, REPEAT_MARK, ROW_ID_KEY, FailureLine, PromptLine, ResultLine, RunFile
from gym_bridge.eval.run_lock import LOCK_FILE, writer_active
from gym_bridge.gym.protocol.eval_run import ROLLOUTS_FILE
from gym_bridge.json_types import JsonObject

RUN_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
FAILURES_FILE = "failures.jsonl"
TRAINING_METRICS_FILE = "metrics.jsonl"
"""A training run folder's one required file (``gym-bridge train``: one line per step and per validation)."""
MAX_BYTES_ENV = "GYM_BRIDGE_RUN_MAX_BYTES"
"""The environment variable that raises (or lowers) :attr:`ReadLimits.max_jsonl_bytes`."""
MAX_RUN_JSON_DEPTH = MAX_DEPTH
"""How deeply ``run.json`` and each JSONL line may nest (the boundary's default): the writers nest a few levels,
and their copies (``json.dump`` with an indent, ``copy.deepcopy``) recurse once per level."""


class RunReadError(UntrustedInputError):
    """A run folder cannot be read: missing, still being written, not a regular file, too large, or a malformed
    line or field (named). An :class:`~gym_bridge.boundary.UntrustedInputError` (so a ``GymBridgeError`` and a
    ``ValueError``): every refusal of the boundary met while reading a run folder is raised as this class."""


@contextlib.contextmanager
def refusals_as_run_errors() -> Iterator[None]:
    """Raise the boundary's refusals inside the block as :class:`RunReadError` (the same one line)."""
    try:
        yield
    except RunReadError:
        raise
    except UntrustedInputError as exc:
        raise RunReadError(str(exc)) from None


class ReadLimits(BaseModel):
    """How much of a run folder a reader takes in; a file past its cap is refused, not read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_run_json_bytes: PositiveInt = 16 << 20
    max_jsonl_bytes: PositiveInt = 2 << 30
    """``results.jsonl``, ``failures.jsonl``, ``metrics.jsonl``, ``val_results.jsonl`` and a rescore's dataset
    file each."""
    max_line_bytes: PositiveInt = 128 << 20
    """One line of a JSONL file: a line is held whole while it is decoded (an eval's line is tens of KB)."""

    @classmethod
    def from_env(cls) -> ReadLimits:
        """The default limits, with ``$GYM_BRIDGE_RUN_MAX_BYTES`` as :attr:`max_jsonl_bytes` when it is set.

        Raises:
            RunReadError: the variable is not a positive integer.
        """
        raw = os.environ.get(MAX_BYTES_ENV, "").strip()
        if not raw:
            return cls()
        if not raw.isdigit() or int(raw) == 0:
            raise RunReadError(f"{MAX_BYTES_ENV}={shown(raw)} is not a positive number of bytes")
        return cls(max_jsonl_bytes=int(raw))


def run_folder_kind(run_dir: str | Path) -> Literal["eval", "training"]:
    """Whether ``run_dir`` is an eval run folder (it has ``run.json``, or is one ``gym eval run`` wrote: a
    ``rollouts.jsonl``) or a training run folder (no ``run.json``, a ``metrics.jsonl``). Anything at the name counts
    (a FIFO, a link): the reader then refuses it by name.

    Raises:
        RunReadError: ``run_dir`` is not a folder, or is neither kind (both files named).
    """
    folder = Path(run_dir)
    if not folder.is_dir():
        raise RunReadError(f"{shown(folder)}: no such run folder")
    if os.path.lexists(folder / RUN_FILE) or os.path.lexists(folder / ROLLOUTS_FILE):
        return "eval"
    if os.path.lexists(folder / TRAINING_METRICS_FILE):
        return "training"
    raise RunReadError(
        f"{shown(folder)}: neither an eval run folder (no {RUN_FILE}) nor a training run folder "
        f"(no {TRAINING_METRICS_FILE})"
    )


def _hint(path: Path) -> str:
    return f"; set {MAX_BYTES_ENV} to read a larger one" if path.name != RUN_FILE else ""


def read_file(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` (None when it does not exist): a regular file of at most ``max_bytes``, links
    followed (:func:`~gym_bridge.boundary.files.read_bytes`). For small files and callers that need the whole
    file at once (a dataset's hash); a JSONL file is streamed with :func:`iter_lines`.

    Raises:
        RunReadError: not a regular file, over ``max_bytes``, or unreadable.
    """
    with refusals_as_run_errors():
        try:
            return read_bytes(path, max_bytes, hint=_hint(Path(path)))
        except FileNotFoundError:
            return None


def iter_lines(path: Path, limits: ReadLimits) -> Iterator[tuple[int, int, bytes, bool]]:
    """:func:`gym_bridge.boundary.jsonl.iter_lines` under ``limits``, its refusals as :class:`RunReadError`."""
    with refusals_as_run_errors():
        yield from boundary_lines(
            path, max_bytes=limits.max_jsonl_bytes, max_line=limits.max_line_bytes, hint=_hint(path)
        )


def decode_line(raw: bytes, where: str, *, max_depth: int = MAX_RUN_JSON_DEPTH) -> JsonObject:
    """One JSONL line (or ``run.json``) as a JSON object (:func:`~gym_bridge.boundary.json_io.loads_object`), its
    refusals as :class:`RunReadError`."""
    with refusals_as_run_errors():
        return loads_object(raw, where, max_depth=max_depth)


def iter_objects(
    path: Path, limits: ReadLimits, *, finished: bool, skip_blank: bool = False
) -> Iterator[tuple[int, int, bytes, JsonObject]]:
    """Each line of the JSONL file ``path`` decoded: (line number, byte offset, the line's bytes, the object).
    A torn last line is an error when ``finished``, else skipped (a run killed mid-write, or still writing).

    Raises:
        RunReadError: as :func:`iter_lines`, or a line that is not a JSON object (``file:line``), or a torn last
            line when ``finished``; a blank line too unless ``skip_blank``.
    """
    where = shown(path)
    for number, offset, raw, complete in iter_lines(path, limits):
        if not complete:
            if finished:
                raise RunReadError(
                    f"{where}:{number}: torn last line (the run was killed mid-write); "
                    "`gym-bridge eval --resume` repairs it"
                )
            return
        if skip_blank and not raw.strip():
            continue
        yield number, offset, raw, decode_line(raw, f"{where}:{number}")


# ---- the files --------------------------------------------------------------------------------


def read_run_json(folder: Path, limits: ReadLimits) -> tuple[JsonObject, RunFile]:
    """``run.json`` as read, and typed.

    Raises:
        RunReadError: missing, not a regular file, too large, not a JSON object, nested too deeply, or a field of
            the wrong type (named).
    """
    path = folder / RUN_FILE
    data = read_file(path, limits.max_run_json_bytes)
    if data is None:
        raise RunReadError(f"{shown(path)}: missing; {shown(folder)} is not a gym-bridge eval run folder")
    where = shown(path)
    run = decode_line(data, where)
    try:
        return run, RunFile.model_validate(run)
    except ValidationError as exc:
        raise RunReadError(f"{where}: {field_problem(exc)}") from None


def read_result_lines[L: PromptLine](
    folder: Path, limits: ReadLimits, model: type[L], *, need_row_ids: bool, finished: bool
) -> Iterator[tuple[int, JsonObject, L]]:
    """Each line of ``results.jsonl`` in file order, streamed: (line number, the record as read, typed as
    ``model``). A repeated ``prompt_idx`` is refused, and one outside the dataset ``run.json`` records
    (:func:`recorded_total`); a torn last line too when ``finished``, else skipped (a run killed mid-write).

    Raises:
        RunReadError: the file is missing (when ``finished``), not regular or too large, or a line is not valid
            JSON, not an object, lacks a field or has one of the wrong type, or repeats a ``prompt_idx`` (both
            lines named) or has one outside the dataset; ``run.json`` is malformed.
    """
    total = recorded_total(folder, limits)
    lines = _result_lines(folder, limits, model, need_row_ids=need_row_ids, finished=finished, prompts_total=total)
    for ref, record, result in lines:
        yield ref.number, record, result


def recorded_total(folder: Path, limits: ReadLimits) -> int | None:
    """How many prompts the run's dataset holds, as ``run.json`` records it (``prompts_total``); None when the
    folder has no ``run.json`` yet or it records none.

    Raises:
        RunReadError: ``run.json`` is not a regular file, too large or malformed (named).
    """
    if not os.path.lexists(folder / RUN_FILE):
        return None
    return read_run_json(folder, limits)[1].prompts_total


def _in_dataset(prompt_idx: int, prompts_total: int | None, where: str) -> None:
    """Refuse a ``prompt_idx`` past the dataset ``run.json`` records: it would be counted as a prompt that is not
    there."""
    if prompts_total is not None and prompt_idx >= prompts_total:
        raise RunReadError(
            f"{where}: field 'prompt_idx': {prompt_idx} is outside the dataset ({RUN_FILE} records "
            f"prompts_total {prompts_total}, so 0 to {prompts_total - 1})"
        )


def _result_lines[L: PromptLine](
    folder: Path, limits: ReadLimits, model: type[L], *, need_row_ids: bool, finished: bool, prompts_total: int | None
) -> Iterator[tuple[LineRef, JsonObject, L]]:
    path = folder / RESULTS_FILE
    if finished and not os.path.lexists(path):
        raise RunReadError(f"{shown(path)}: missing; the run has no finished prompt group")
    first_line: dict[int, int] = {}
    for number, offset, raw, record in iter_objects(path, limits, finished=finished):
        where = f"{shown(path)}:{number}"
        result = typed_line(model, record, where)
        if need_row_ids and record.get(ROW_ID_KEY) is None:
            raise RunReadError(
                f"{where}: field {ROW_ID_KEY!r} is missing (written before rows had identities); run the eval again"
            )
        _in_dataset(result.prompt_idx, prompts_total, where)
        earlier = first_line.setdefault(result.prompt_idx, number)
        if earlier != number:
            raise RunReadError(
                f"{where}: field 'prompt_idx': {result.prompt_idx} is also on line {earlier}; "
                "a run holds one result per prompt"
            )
        yield LineRef(path, number, offset, len(raw), zlib.crc32(raw)), record, result


def typed_line[M: BaseModel](model: type[M], record: JsonObject, where: str) -> M:
    try:
        return model.model_validate(record)
    except ValidationError as exc:
        raise RunReadError(f"{where}: {field_problem(exc)}") from None


MAX_FAILURE_MESSAGE = 2000
"""Characters of a failure's message a reader keeps (the writer stores at most this many)."""


def read_failure_lines(folder: Path, limits: ReadLimits, prompts_total: int | None = None) -> list[FailureLine]:
    """The lines of ``failures.jsonl``, typed, streamed: the last failure of each prompt, in the order of those
    last lines, each message cut to :data:`MAX_FAILURE_MESSAGE` characters (none when the file is missing; a
    torn last line is skipped).

    Raises:
        RunReadError: the file is not regular or too large, or a line is malformed or has a ``prompt_idx``
            outside ``prompts_total`` (named).
    """
    path = folder / FAILURES_FILE
    latest: dict[int, FailureLine] = {}
    for number, _, _, record in iter_objects(path, limits, finished=False):
        where = f"{shown(path)}:{number}"
        failure = typed_line(FailureLine, record, where)
        _in_dataset(failure.prompt_idx, prompts_total, where)
        if len(failure.message) > MAX_FAILURE_MESSAGE:
            failure = failure.model_copy(update={"message": failure.message[:MAX_FAILURE_MESSAGE]})
        latest.pop(failure.prompt_idx, None)
        latest[failure.prompt_idx] = failure
    return list(latest.values())


# ---- a run ------------------------------------------------------------------------------------


@dataclass
class RunGroup:
    """One finished prompt group of a run: what the readers use of its line, and where the line is."""

    key: str
    """The row's identity in this run: its ``row_id``, with ``#k`` for the k-th repeat of an identical row."""
    line: int
    """The line in ``results.jsonl`` (1-based)."""
    prompt_idx: int
    agent: str
    rewards: list[float]
    dataset_line: int | None = None
    """The row's line in the dataset (the result line's ``line``)."""
    prompt: str = ""
    """The last user message of the row's prompt, on one line, cut to 160 characters (:func:`prompt_preview`)."""
    source: LineRef | None = None
    """Where the line is, to read it again (:attr:`record`)."""
    held: JsonObject | None = None
    """The record itself, for a group of a folder ``gym eval run`` wrote (:mod:`gym_bridge.eval.gym_runs`)."""

    @property
    def record(self) -> JsonObject:
        """The line as read (every key), read again from the file each time it is asked for: a run of 200,000
        prompts keeps no line in memory.

        Raises:
            RunReadError: the line cannot be read again or changed since (named).
        """
        if self.held is not None:
            return self.held
        if self.source is None:
            raise RunReadError(f"results.jsonl:{self.line}: no longer available to read again")
        limits = ReadLimits.from_env()
        with refusals_as_run_errors():
            return self.source.read(limits.max_jsonl_bytes, _hint(self.source.path))

    @cached_property
    def result(self) -> ResultLine:
        """The line, typed (read again on first use, then kept)."""
        where = shown(self.source.path) if self.source else RESULTS_FILE
        return typed_line(ResultLine, self.record, f"{where}:{self.line}")


@dataclass
class LoadedRun:
    dir: Path
    run: JsonObject
    """``run.json`` as read."""
    meta: RunFile
    """``run.json``, typed."""
    groups: list[RunGroup]
    failures: list[FailureLine] = field(default_factory=list)
    """``failures.jsonl``, when it was asked for: the last failure of each prompt."""
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
        return self.meta.config.pass_threshold


type LineVisitor = Callable[[RunGroup, JsonObject, ResultLine], None]
"""Called with each group as its line streams by: the group, the line as read and the line typed."""


def load_run(
    run_dir: str | Path,
    *,
    need_row_ids: bool = True,
    finished: bool = True,
    failures: bool = False,
    limits: ReadLimits | None = None,
    visit: LineVisitor | None = None,
) -> LoadedRun:
    """Read ``run.json`` and stream every ``results.jsonl`` line of ``run_dir``, in file order (and
    ``failures.jsonl`` when ``failures``), keeping of each line its :class:`RunGroup`; ``visit`` sees each line
    as it passes. (A folder ``gym eval run`` wrote: :func:`gym_bridge.eval.gym_runs.load_eval_run`.)

    ``finished`` (``compare``, ``rescore``): the run is not being written, has no torn last line and holds at
    least one group. Without it (``report``), a torn last line is skipped and an empty run is read as empty.

    Raises:
        RunReadError: the folder or ``run.json`` is missing or malformed, an eval is still writing the folder (it
            holds ``run.lock``), a file is not regular or too large, or a line is torn, malformed, lacks a field
            (``row_id`` too, when ``need_row_ids``) or repeats a ``prompt_idx``.
    """
    folder = Path(run_dir)
    limits = limits or ReadLimits.from_env()
    if not folder.is_dir():
        raise RunReadError(f"{shown(folder)}: no such run folder")
    run, meta = read_run_json(folder, limits)
    if finished and writer_active(folder):
        raise RunReadError(f"{shown(folder)}: still being written (a process holds {LOCK_FILE}); read it when it ends")
    groups: list[RunGroup] = []
    seen: Counter[str] = Counter()
    lines = _result_lines(
        folder, limits, ResultLine, need_row_ids=need_row_ids, finished=finished, prompts_total=meta.prompts_total
    )
    with collector_paused():
        for ref, record, result in lines:
            key = result.row_id if result.row_id is not None else f"{NO_ROW_ID}{result.prompt_idx}"
            repeat = seen[key]
            seen[key] += 1
            group = RunGroup(
                key=f"{key}{REPEAT_MARK}{repeat}" if repeat else key,
                line=ref.number,
                prompt_idx=result.prompt_idx,
                agent=result.agent,
                rewards=[c.reward for c in result.completions],
                dataset_line=result.line,
                prompt=prompt_preview(record),
                source=ref,
            )
            if visit is not None:
                visit(group, record, result)
            groups.append(group)
    if finished and not groups:
        raise RunReadError(f"{shown(folder / RESULTS_FILE)}: empty; the run has no finished prompt group")
    found = read_failure_lines(folder, limits, meta.prompts_total) if failures else []
    return LoadedRun(dir=folder, run=run, meta=meta, groups=groups, failures=found)
