"""The `gym-bridge` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_backends_lists_the_registry():
    out = subprocess.run(
        [sys.executable, "-m", "gym_bridge.cli", "backends"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "native" in out and "gym_bridge.rollout.native:AsyncRolloutImpl" in out
    assert "nemo_gym" in out and "(gym-bridge " in out


def test_overrides_after_an_option_reach_the_command(tmp_path, capsys):
    """``eval CONFIG --resume key=value``: argparse before Python 3.13 leaves a key=value after an option
    unparsed; main() hands it to the command's overrides, and a stray option is still refused."""
    from gym_bridge.cli import main

    missing = tmp_path / "missing.yaml"
    assert main(["eval", str(missing), "--resume", "limit=2"]) == 2
    assert "missing.yaml" in capsys.readouterr().err  # the config was read: the override parsed
    with pytest.raises(SystemExit):
        main(["eval", str(missing), "--resume", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
