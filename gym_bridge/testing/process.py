"""A helper server run as its own process on a fixed 127.0.0.1 port, so a test can kill it and start it again there.

Used by the fault gate and the benchmarks' endpoint: the command runs in a session of its own (so
stopping it stops its children too), writes to a log file, and counts as started once ``ready_path``
answers 200.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from gym_bridge.boundary.files import open_append, open_regular
from gym_bridge.failures import GymBridgeError
from gym_bridge.testing import wait_until

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 1 << 20
"""How much of the end of a service's log :meth:`ServiceProcess.log_tail` reads."""


class ServiceProcessError(GymBridgeError, RuntimeError):
    """A :class:`ServiceProcess` that is not started, or exited during start-up (named, with its log's tail)."""


class ServiceProcess:
    """One command serving HTTP on ``port``; :meth:`spawn` waits until it answers, :meth:`stop` ends its group."""

    def __init__(self, name: str, port: int, log_path: Path, ready_path: str) -> None:
        self.name = name
        self.port = port
        self.log_path = log_path
        self.ready_path = ready_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (``.../v1``)."""
        return f"{self.root_url}/v1"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ServiceProcessError(f"the {self.name} is not started")
        return self.proc.pid

    def spawn(self, command: list[str], timeout_s: float) -> None:
        """Start ``command`` and return once ``ready_path`` answers 200; on failure stop it and say why with the log."""
        with open_append(self.log_path) as out:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = self.proc

        def answering() -> bool:
            if proc.poll() is not None:
                raise ServiceProcessError(
                    f"the {self.name} exited with {proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                return httpx.get(self.root_url + self.ready_path, timeout=2.0, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(answering, timeout_s, f"the {self.name} answers {self.ready_path}", poll_s=0.1)
        except TimeoutError as exc:
            self.kill()
            raise TimeoutError(f"{exc}:\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout_s``."""
        self._end(((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)))

    def kill(self) -> None:
        """SIGKILL the process group at once: connections in flight are cut, new ones refused."""
        self._end(((signal.SIGKILL, 5.0),))

    def _end(self, signals: tuple[tuple[signal.Signals, float], ...]) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for signum, wait_s in signals:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
        log.error("the %s (pid %d) survived SIGKILL", self.name, proc.pid)

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return "(no log)"
        with open_regular(self.log_path, sys.maxsize) as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            text = log.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])
