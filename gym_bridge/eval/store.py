"""The run folder: ``run.json`` (the config fingerprint), append-only ``results.jsonl`` and
``failures.jsonl``, each line flushed and fsynced as it is written.

A process killed mid-write leaves at most one torn last line; reading tolerates it
(it is not counted) and opening for resume cuts it off, so the next append starts
on a fresh line.

While a store is open it holds an exclusive ``flock`` on ``run.lock``, so readers (``gym-bridge compare``,
``rescore``) can tell a run still being written from a finished or killed one (:func:`writer_active`);
the kernel releases the lock when the writer exits, even on SIGKILL.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, TextIO

from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
RESULTS_FILE = "results.jsonl"
FAILURES_FILE = "failures.jsonl"
LOCK_FILE = "run.lock"


class RunDirError(GymBridgeError, RuntimeError):
    """The output folder cannot be used: not empty without resume, or resumed with a changed config."""


def read_jsonl(path: Path, *, repair: bool = False) -> list[JsonObject]:
    """The records of a JSONL file, without a torn last line (cut off when ``repair``).

    A bad line anywhere but last is corruption, not a crash mid-write: that raises.
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    records: list[JsonObject] = []
    good_end = 0
    lines = data.split(b"\n")
    for i, raw in enumerate(lines):
        last = i == len(lines) - 1
        if last and not raw:
            break  # the file ends with a newline
        record = _json_object(raw, last=last)
        if isinstance(record, str):
            if last:
                logger.warning("%s: ignoring a torn last line (%d bytes)", path, len(raw))
                if repair:
                    with path.open("r+b") as f:
                        f.truncate(good_end)
                        os.fsync(f.fileno())
                break
            raise RunDirError(f"{path}:{i + 1} is not a JSON object ({record}); the file is corrupt")
        records.append(record)
        good_end += len(raw) + 1
    return records


def _json_object(raw: bytes, *, last: bool) -> JsonObject | str:
    """The JSON object on one line, or what is wrong with it (a last line without its newline is torn)."""
    if last:
        return "no newline: torn write"
    try:
        record = json.loads(raw)
    except ValueError as exc:
        return str(exc)
    return record if isinstance(record, dict) else "not an object"


class RunStore:
    """Appends results and failures to a run folder; one result per prompt index, ever."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.results_path = self.dir / RESULTS_FILE
        self.failures_path = self.dir / FAILURES_FILE
        self.run_path = self.dir / RUN_FILE
        self.done: set[int] = set()
        self._files: dict[Path, IO[bytes]] = {}
        self._lock: TextIO | None = None

    def open(self, fingerprint: JsonObject, *, resume: bool, meta: JsonObject | None = None) -> set[int]:
        """Create or reopen the run folder; return the prompt indices already done.

        ``meta`` (the full config, the dataset size) is stored in ``run.json`` beside the fingerprint.

        Raises:
            RunDirError: the folder is not empty and ``resume`` is false, or ``run.json``
                records a fingerprint that differs (the message names the keys).
        """
        if resume and self.run_path.exists():
            self._hold_lock()
            recorded = json.loads(self.run_path.read_text()).get("fingerprint", {})
            changed = [
                f"{key} ({recorded.get(key)!r} -> {fingerprint.get(key)!r})"
                for key in sorted(set(recorded) | set(fingerprint))
                if recorded.get(key) != fingerprint.get(key)
            ]
            if changed:
                self.close()
                raise RunDirError(
                    f"cannot resume {self.dir}: the config changed in a way that matters: {'; '.join(changed)}. "
                    "Use a new output_dir, or restore these settings."
                )
            self.done = {int(r["prompt_idx"]) for r in read_jsonl(self.results_path, repair=True)}
            read_jsonl(self.failures_path, repair=True)
        else:
            if self.dir.exists() and any(self.dir.iterdir()):
                raise RunDirError(
                    f"the output folder {self.dir} is not empty: pass --resume to continue that run, "
                    "or choose another output_dir"
                )
            self.dir.mkdir(parents=True, exist_ok=True)
            self._hold_lock()
            _write_atomic(self.run_path, {"fingerprint": fingerprint, "created": time.time(), "sessions": []})
        self.update_run(**(meta or {}))
        return set(self.done)

    def _hold_lock(self) -> None:
        """Take ``run.lock`` for as long as this store is open (see the module docstring)."""
        lock = (self.dir / LOCK_FILE).open("a")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RunDirError(f"{self.dir} is being written by another process (it holds {LOCK_FILE})") from None
        self._lock = lock

    def update_run(self, **fields: object) -> None:
        """Merge ``fields`` into ``run.json`` (atomically replaced)."""
        run = json.loads(self.run_path.read_text())
        run.update(fields)
        _write_atomic(self.run_path, run)

    def record_session(self, started: float, *, outcome: str, rollouts_started: float | None = None) -> None:
        """Add one session (a start of ``gym-bridge eval``) to ``run.json``; a SIGKILLed one is never recorded."""
        run = json.loads(self.run_path.read_text())
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
            f = self._files[path] = path.open("ab")
        f.write(json.dumps(record, default=str).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None


def writer_active(run_dir: str | Path) -> bool:
    """Whether a process holds ``run_dir``'s store open right now (a run still being written)."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return False
    with path.open("a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return False


def _write_atomic(path: Path, data: JsonObject) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
