"""The one reader of run folders, for every command that opens one (``report``, ``compare``, ``rescore``,
``eval --resume``, the trace viewer through :func:`~gym_bridge.eval.store.read_jsonl`).

A run folder is data that people send each other, and model text in it is attacker-controlled, so reading
one is bounded and typed:

- only regular files are read (a FIFO, a device or a link to one is refused before anything blocks), each
  under a size cap (:class:`ReadLimits`) with a message that says how to raise it;
- JSONL is split on ``\\n`` only (never ``str.splitlines()``, which also splits on U+2028, U+2029 and U+0085
  inside a valid row), and every line is checked against the models of :mod:`gym_bridge.eval.records`;
- ``run.json`` is typed too (a ``pass_threshold`` that is a string, a ``config`` that is not a mapping);
- a ``prompt_idx`` given twice is refused, naming both lines.

Any problem is one :class:`RunReadError` line naming the folder, the file, the line and the field. A torn last
line is an error for a finished run (it is a run killed mid-write; ``gym-bridge eval --resume`` repairs it), and
a run still being written (its ``run.lock`` held) is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import reprlib
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from gym_bridge.eval.records import ROW_ID_KEY, FailureLine, PromptLine, ResultLine, RunFile
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject

RUN_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
FAILURES_FILE = "failures.jsonl"
LOCK_FILE = "run.lock"
MAX_BYTES_ENV = "GYM_BRIDGE_RUN_MAX_BYTES"
"""The environment variable that raises (or lowers) :attr:`ReadLimits.max_jsonl_bytes`."""
MAX_RUN_JSON_DEPTH = 64
"""How deeply ``run.json`` may nest: the writers nest a few levels, and their copies (``json.dump`` with an indent,
``copy.deepcopy``) recurse once per level."""


_PREVIEW = reprlib.Repr(maxlevel=2, maxdict=3, maxlist=3, maxstring=40, maxother=40)
"""How much of a refused value an error line shows."""


class RunReadError(GymBridgeError, ValueError):
    """A run folder cannot be read: missing, still being written, not a regular file, too large, or a malformed
    line or field (named)."""


class ReadLimits(BaseModel):
    """How much of a run folder a reader takes in; a file past its cap is refused, not read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_run_json_bytes: PositiveInt = 16 << 20
    max_jsonl_bytes: PositiveInt = 2 << 30
    """``results.jsonl``, ``failures.jsonl`` and a rescore's dataset file each."""

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


def shown(value: object) -> str:
    """``value`` as text on one line: what is not printable (newlines, U+2028, ANSI escapes) escaped, so a folder
    name or a stored string cannot split an error line or write to the terminal."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def open_lock(path: Path, *, create: bool) -> int:
    """A descriptor on the lock file ``path``, opened without blocking or following a link (a FIFO or a device
    planted as ``run.lock`` never hangs the reader).

    Raises:
        OSError: ``path`` cannot be opened, or is not a regular file (``EINVAL``).
    """
    flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_WRONLY | os.O_APPEND | os.O_CREAT if create else os.O_RDONLY
    fd = os.open(path, flags, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def writer_active(run_dir: str | Path) -> bool:
    """Whether a process holds ``run_dir``'s store open right now (a run still being written)."""
    try:
        fd = open_lock(Path(run_dir) / LOCK_FILE, create=False)
    except OSError:
        return False  # no lock file, or not one a writer made
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


# ---- bytes ------------------------------------------------------------------------------------


def read_file(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` (None when it does not exist): a regular file of at most ``max_bytes``, links followed.

    Checked before opening and again on the open file, so a FIFO never blocks and a device is never read.

    Raises:
        RunReadError: not a regular file, over ``max_bytes``, or unreadable.
    """
    try:
        _check_regular(path, os.stat(path), max_bytes)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RunReadError(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            _check_regular(path, os.fstat(fd), max_bytes)
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise RunReadError(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise _too_large(path, len(data), max_bytes)
    return data


def _check_regular(path: Path, info: os.stat_result, max_bytes: int) -> None:
    """Refuse anything but a regular file, and a file over ``max_bytes``."""
    if not stat.S_ISREG(info.st_mode):
        raise RunReadError(
            f"{shown(path)}: not a regular file ({_file_kind(info.st_mode)}); a run folder's files are read only "
            "when they are regular files"
        )
    if info.st_size > max_bytes:
        raise _too_large(path, info.st_size, max_bytes)


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a folder"}  # fmt: skip
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def _too_large(path: Path, size: int, max_bytes: int) -> RunReadError:
    hint = f"; set {MAX_BYTES_ENV} to read a larger one" if path.name != RUN_FILE else ""
    return RunReadError(f"{shown(path)}: {size:,} bytes or more, over the limit of {max_bytes:,} bytes{hint}")


def jsonl_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """A JSONL file's complete lines, split on ``\\n`` only, and what follows the last newline (b"" or a torn
    write). U+2028, U+2029 and U+0085 inside a row are text, not line ends."""
    lines = data.split(b"\n")
    tail = lines.pop()
    return lines, tail


def _json_object(where: str, raw: bytes) -> JsonObject:
    """The JSON object in ``raw`` (orjson: no NaN, nesting bounded)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RunReadError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RunReadError(f"{where}: not a JSON object")
    return value


def field_problem(exc: ValidationError, prefix: str = "") -> str:
    """The first problem pydantic found, in words: ``field 'a.b[0]' is missing`` or ``field 'x' should be ...``."""
    error = exc.errors(include_url=False)[0]
    name = prefix + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    name = name.lstrip(".")
    if error["type"] == "missing":
        return f"field {shown(name)!r} is missing"
    message = error["msg"].removeprefix("Value error, ").removeprefix("Input ")
    return f"field {shown(name)!r}: {message} (got {shown(_PREVIEW.repr(error['input']))})"


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
    run = _json_object(where, data)
    if _depth(run) > MAX_RUN_JSON_DEPTH:
        raise RunReadError(f"{where}: nested deeper than {MAX_RUN_JSON_DEPTH} levels")
    try:
        return run, RunFile.model_validate(run)
    except ValidationError as exc:
        raise RunReadError(f"{where}: {field_problem(exc)}") from None


def _depth(value: object) -> int:
    """How deeply ``value`` nests lists and objects (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: list[Any] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def read_result_lines[L: PromptLine](
    folder: Path, limits: ReadLimits, model: type[L], *, need_row_ids: bool, finished: bool
) -> Iterator[tuple[int, JsonObject, L]]:
    """Each line of ``results.jsonl`` in file order: (line number, the record as read, typed as ``model``). A
    repeated ``prompt_idx`` is refused; a torn last line too when ``finished``, else skipped (a run killed
    mid-write).

    Raises:
        RunReadError: the file is not regular or too large, or a line is not valid JSON, not an object, lacks a
            field or has one of the wrong type, or repeats a ``prompt_idx`` (both lines named).
    """
    path = folder / RESULTS_FILE
    data = read_file(path, limits.max_jsonl_bytes)
    if data is None:
        if finished:
            raise RunReadError(f"{shown(path)}: missing; the run has no finished prompt group")
        return
    lines, tail = jsonl_lines(data)
    if tail and finished:
        raise RunReadError(
            f"{shown(path)}:{len(lines) + 1}: torn last line (the run was killed mid-write); "
            "`gym-bridge eval --resume` repairs it"
        )
    first_line: dict[int, int] = {}
    for number, raw in enumerate(lines, start=1):
        where = f"{shown(path)}:{number}"
        record = _json_object(where, raw)
        try:
            result = model.model_validate(record)
        except ValidationError as exc:
            raise RunReadError(f"{where}: {field_problem(exc)}") from None
        if need_row_ids and record.get(ROW_ID_KEY) is None:
            raise RunReadError(
                f"{where}: field {ROW_ID_KEY!r} is missing (written before rows had identities); run the eval again"
            )
        earlier = first_line.setdefault(result.prompt_idx, number)
        if earlier != number:
            raise RunReadError(
                f"{where}: field 'prompt_idx': {result.prompt_idx} is also on line {earlier}; "
                "a run holds one result per prompt"
            )
        yield number, record, result


def read_failure_lines(folder: Path, limits: ReadLimits) -> list[FailureLine]:
    """The lines of ``failures.jsonl``, typed (none when it is missing; a torn last line is skipped).

    Raises:
        RunReadError: the file is not regular or too large, or a line is malformed (named).
    """
    path = folder / FAILURES_FILE
    data = read_file(path, limits.max_jsonl_bytes)
    failures: list[FailureLine] = []
    for number, raw in enumerate(jsonl_lines(data or b"")[0], start=1):
        where = f"{shown(path)}:{number}"
        try:
            failures.append(FailureLine.model_validate(_json_object(where, raw)))
        except ValidationError as exc:
            raise RunReadError(f"{where}: {field_problem(exc)}") from None
    return failures


# ---- a run ------------------------------------------------------------------------------------


@dataclass
class RunGroup:
    """One finished prompt group of a run."""

    key: str
    """The row's identity in this run: its ``row_id``, with ``#k`` for the k-th repeat of an identical row."""
    line: int
    """The line in ``results.jsonl`` (1-based)."""
    prompt_idx: int
    agent: str
    rewards: list[float]
    record: JsonObject
    """The line as read (every key, for previews and rewrites); it passed :class:`ResultLine`'s checks."""

    @cached_property
    def result(self) -> ResultLine:
        """The line, typed (built again on first use: a run of 200,000 prompts keeps no model per line)."""
        return ResultLine.model_validate(self.record)


@dataclass
class LoadedRun:
    dir: Path
    run: JsonObject
    """``run.json`` as read."""
    meta: RunFile
    """``run.json``, typed."""
    groups: list[RunGroup]
    failures: list[FailureLine] = field(default_factory=list)
    """``failures.jsonl``, when it was asked for."""
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


def load_run(
    run_dir: str | Path,
    *,
    need_row_ids: bool = True,
    finished: bool = True,
    failures: bool = False,
    limits: ReadLimits | None = None,
) -> LoadedRun:
    """Read ``run.json`` and every ``results.jsonl`` line of ``run_dir``, in file order (and ``failures.jsonl``
    when ``failures``).

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
    lines = read_result_lines(folder, limits, ResultLine, need_row_ids=need_row_ids, finished=finished)
    for number, record, result in lines:
        key = result.row_id if result.row_id is not None else f"idx:{result.prompt_idx}"
        repeat = seen[key]
        seen[key] += 1
        rewards = [c.reward for c in result.completions]
        group = RunGroup(f"{key}#{repeat}" if repeat else key, number, result.prompt_idx, result.agent, rewards, record)
        groups.append(group)
    if finished and not groups:
        raise RunReadError(f"{shown(folder / RESULTS_FILE)}: empty; the run has no finished prompt group")
    found = read_failure_lines(folder, limits) if failures else []
    return LoadedRun(dir=folder, run=run, meta=meta, groups=groups, failures=found)
