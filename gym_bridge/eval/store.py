"""The run folder: ``run.json`` (the config fingerprint), append-only ``results.jsonl`` and
``failures.jsonl``, each line flushed and fsynced as it is written.

A process killed mid-write leaves at most one torn last line; reading tolerates it
(it is not counted) and opening for resume cuts it off, so the next append starts
on a fresh line.

While a store is open it holds an exclusive ``flock`` on ``run.lock``, so readers (``gym-bridge compare``,
``rescore``) can tell a run still being written from a finished or killed one
(:func:`~gym_bridge.eval.run_lock.writer_active`); the kernel releases the lock when the writer exits, even on
SIGKILL.

Reading goes through :mod:`gym_bridge.eval.runs` (regular files only, size caps, typed lines), resume included:
a folder someone sent you is checked the same way whether you compare it or continue it. Writing goes through the
boundary too: on resume ``results.jsonl`` and ``failures.jsonl`` are opened for appending first, through a
descriptor that refuses a link and a file with a second hard link (a ``cp -al`` snapshot), so such a folder is
refused in one line before any torn line is cut off or anything is appended.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import IO

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import make_dir, open_append, open_nofollow, read_bytes, write_atomic
from gym_bridge.boundary.json_io import dumps, jsonl_lines, loads_object
from gym_bridge.boundary.text import shown
from gym_bridge.eval.records import ResumeLine
from gym_bridge.eval.run_lock import LOCK_FILE, open_lock
from gym_bridge.eval.runs import (
    FAILURES_FILE,
    RESULTS_FILE,
    RUN_FILE,
    ReadLimits,
    read_result_lines,
    read_run_json,
)
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject

logger = logging.getLogger(__name__)


class RunDirError(GymBridgeError, RuntimeError):
    """The output folder cannot be used: not empty without resume, or resumed with a changed config."""


def read_jsonl(path: Path, *, repair: bool = False) -> list[JsonObject]:
    """The records of a JSONL file, without a torn last line (cut off when ``repair``, through a descriptor that
    refuses a link, so a planted link never truncates a file outside the folder); split on ``\\n`` only.

    A bad line anywhere but last is corruption, not a crash mid-write: that raises.

    Raises:
        RunDirError: a line before the last is not a JSON object.
        UntrustedInputError: the file is not a regular file, is over the size cap (:class:`ReadLimits`), or is a
            link when ``repair``.
    """
    try:
        data = read_bytes(path, ReadLimits.from_env().max_jsonl_bytes)
    except FileNotFoundError:
        return []
    lines, tail = jsonl_lines(data)
    records: list[JsonObject] = []
    for number, raw in enumerate(lines, start=1):
        try:
            records.append(loads_object(raw, f"{shown(path)}:{number}"))
        except UntrustedInputError as exc:
            raise RunDirError(f"{exc}; the file is corrupt") from None
    if tail:
        logger.warning("%s: ignoring a torn last line (%d bytes)", shown(path), len(tail))
        if repair:
            fd = open_nofollow(path, os.O_RDWR)
            try:
                os.ftruncate(fd, len(data) - len(tail))
                os.fsync(fd)
            finally:
                os.close(fd)
    return records


class RunStore:
    """Appends results and failures to a run folder; one result per prompt index, ever."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.results_path = self.dir / RESULTS_FILE
        self.failures_path = self.dir / FAILURES_FILE
        self.run_path = self.dir / RUN_FILE
        self.done: set[int] = set()
        self.resumed_rewards: list[float] = []
        """The rewards of the completions ``results.jsonl`` held when the run was resumed (the progress bar's mean)."""
        self._files: dict[Path, IO[bytes]] = {}
        self._lock: int | None = None
        """The descriptor holding ``run.lock``'s flock while the store is open."""

    def open(self, fingerprint: JsonObject, *, resume: bool, meta: JsonObject | None = None) -> set[int]:
        """Create or reopen the run folder; return the prompt indices already done.

        ``meta`` (the full config, the dataset size) is stored in ``run.json`` beside the fingerprint.

        Raises:
            RunDirError: the folder is not empty and ``resume`` is false, or ``run.json``
                records a fingerprint that differs (the message names the keys).
            RunReadError: on resume, ``run.json`` or a ``results.jsonl`` line is malformed, a file is not regular
                or too large, or a ``prompt_idx`` is repeated (the file, line and field named).
        """
        if resume and self.run_path.exists():
            self._hold_lock()
            try:
                self._open_appends()
                self._check_resumable(fingerprint)
                self.done = self._resumed_prompts()
                read_jsonl(self.failures_path, repair=True)
            except GymBridgeError:
                self.close()
                raise
        else:
            if not_empty(self.dir):
                raise RunDirError(
                    f"the output folder {shown(self.dir)} is not empty: pass --resume to continue that run, "
                    "or choose another output_dir"
                )
            make_dir(self.dir)
            self._hold_lock()
            _write_atomic(self.run_path, {"fingerprint": fingerprint, "created": time.time(), "sessions": []})
        self.update_run(**(meta or {}))
        return set(self.done)

    def _open_appends(self) -> None:
        """Open the resumed folder's ``results.jsonl`` and ``failures.jsonl`` (those that exist) for appending, before
        anything is read, cut or written: a link, a file that is not regular or one with a second hard link is
        refused here (``UntrustedInputError``), never truncated or appended to through another name."""
        for path in (self.results_path, self.failures_path):
            if os.path.lexists(path):
                os.close(open_nofollow(path, os.O_RDONLY, root=self.dir))  # a FIFO opens for reading, then is named
                self._files[path] = open_append(path, root=self.dir)

    def _check_resumable(self, fingerprint: JsonObject) -> None:
        """Refuse to resume a run whose recorded fingerprint differs from ``fingerprint`` (the keys named)."""
        recorded = self._read_run().get("fingerprint") or {}
        changed = [
            f"{key} ({recorded.get(key)!r} -> {fingerprint.get(key)!r})"
            for key in sorted(set(recorded) | set(fingerprint))
            if recorded.get(key) != fingerprint.get(key)
        ]
        if changed:
            raise RunDirError(
                f"cannot resume {self.dir}: the config changed in a way that matters: {'; '.join(changed)}. "
                "Use a new output_dir, or restore these settings."
            )

    def _read_run(self) -> JsonObject:
        """``run.json``, checked as any reader checks it (:func:`~gym_bridge.eval.runs.read_run_json`)."""
        return read_run_json(self.dir, ReadLimits.from_env())[0]

    def _resumed_prompts(self) -> set[int]:
        """The prompt indices ``results.jsonl`` already holds (their rewards kept in :attr:`resumed_rewards`), its torn
        last line cut off; a line that is not a JSON
        object with an integer ``prompt_idx`` and finite rewards, or repeats a ``prompt_idx``, raises
        :class:`RunReadError` naming it."""
        read_jsonl(self.results_path, repair=True)
        lines = read_result_lines(self.dir, ReadLimits.from_env(), ResumeLine, need_row_ids=False, finished=False)
        done: set[int] = set()
        for _, _, result in lines:
            done.add(result.prompt_idx)
            self.resumed_rewards.extend(c.reward for c in result.completions)
        return done

    def _hold_lock(self) -> None:
        """Take ``run.lock`` for as long as this store is open (see the module docstring)."""
        try:
            lock = open_lock(self.dir / LOCK_FILE, create=True)
        except OSError as exc:
            raise RunDirError(f"{shown(self.dir / LOCK_FILE)}: cannot be used as the run's lock ({exc})") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            raise RunDirError(f"{self.dir} is being written by another process (it holds {LOCK_FILE})") from None
        self._lock = lock

    def update_run(self, **fields: object) -> None:
        """Merge ``fields`` into ``run.json`` (atomically replaced)."""
        run = self._read_run()
        run.update(fields)
        _write_atomic(self.run_path, run)

    def record_session(self, started: float, *, outcome: str, rollouts_started: float | None = None) -> None:
        """Add one session (a start of ``gym-bridge eval``) to ``run.json``; a SIGKILLed one is never recorded."""
        run = self._read_run()
        session = {"started": started, "rollouts_started": rollouts_started, "ended": time.time(), "outcome": outcome}
        run.setdefault("sessions", []).append(session)
        _write_atomic(self.run_path, run)

    def append_result(self, record: JsonObject) -> None:
        idx = int(record["prompt_idx"])
        if idx in self.done:
            raise RunDirError(f"prompt_idx={idx} already has a result in {self.results_path}")
        self._append(self.results_path, record)
        self.done.add(idx)

    def append_failure(self, record: JsonObject) -> None:
        self._append(self.failures_path, record)

    def _append(self, path: Path, record: JsonObject) -> None:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open_append(path, root=self.dir)
        f.write(dumps(record) + b"\n")
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the flock
            self._lock = None


def not_empty(folder: Path) -> bool:
    """Whether ``folder`` exists and holds anything: a file there is "not empty" only once :func:`make_dir` has
    refused it in one line (it is not a folder), so the caller never lists what is not a folder."""
    if not (folder.exists() or folder.is_symlink()):
        return False
    make_dir(folder)
    return any(folder.iterdir())


def _write_atomic(path: Path, data: JsonObject) -> None:
    write_atomic(path, dumps(data, indent=True), root=path.parent)
