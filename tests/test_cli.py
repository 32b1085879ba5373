"""The `gym-bridge` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def test_backends_lists_the_registry():
    out = subprocess.run(
        [sys.executable, "-m", "gym_bridge.cli", "backends"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "native" in out and "gym_bridge.rollout.native:AsyncRolloutImpl" in out
    assert "nemo_gym" in out and "(gym-bridge " in out
