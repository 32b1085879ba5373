"""``run_cli``: the ``gym-bridge`` command run as a real subprocess of this interpreter, for tests of its exit codes
and its output."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_cli(
    *args: str,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess[str]:
    """``python -m gym_bridge.cli ARGS`` in ``cwd`` with ``env`` (None: this process's), stdout and stderr
    captured as text; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "gym_bridge.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        check=False,
    )
