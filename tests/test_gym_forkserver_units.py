"""Which Gym server commands the launcher forks instead of running in a shell (unit tests; the forked
servers themselves are exercised by every Gym test, and checked in test_gym_servers)."""

from __future__ import annotations

import shlex
from pathlib import Path

from gym_bridge.gym._forkserver import ServerCommand, parse_server_command

_CONFIG_YAML = "policy_model:\n  responses_api_models:\n    vllm_model: {entrypoint: app.py}\n"


def _gym_command(setup: str) -> str:
    """The command NeMo-Gym 0.4's RunHelper.start builds for one server (cli/env.py)."""
    return f"""{setup} \\
    && NEMO_GYM_CONFIG_DICT={shlex.quote(_CONFIG_YAML)} \\
    NEMO_GYM_CONFIG_PATH={shlex.quote("policy_model")} \\
    python app.py"""


def test_the_plain_gym_command_is_forked_with_its_folder_venv_and_variables():
    parsed = parse_server_command(
        _gym_command(
            "cd /site/responses_api_models/vllm_model && source /v/responses_api_models/vllm_model/.venv/bin/activate"
        )
    )
    assert parsed == ServerCommand(
        cwd=Path("/site/responses_api_models/vllm_model"),
        venv=Path("/v/responses_api_models/vllm_model/.venv"),
        variables={"NEMO_GYM_CONFIG_DICT": _CONFIG_YAML, "NEMO_GYM_CONFIG_PATH": "policy_model"},
        entrypoint="app.py",
    )


def test_anything_else_runs_in_a_shell():
    installs = (
        "cd /s/x && uv venv --seed /v/.venv && source /v/.venv/bin/activate && uv pip install -r requirements.txt"
    )
    for command in [
        _gym_command(installs),  # a venv to create: refused by the launcher, never forked
        f"set -o pipefail; ({_gym_command('cd /s/x && source /v/bin/activate')}) 2>&1 | tee -a /l.log",
        _gym_command("cd /s/x && source /v/bin/activate").replace("python app.py", "python -m app"),
        "cd /s/x && source /v/bin/activate && python app.py 'unterminated",
        "cd /s/x && source /v/bin/activate && =x python app.py",
    ]:
        assert parse_server_command(command) is None, command
