"""Which Gym server commands the launcher forks instead of running in a shell, and what a forked
server sees: the same as under ``cd DIR && K=V python app.py`` (a real fork server, no Gym set;
real Gym servers are forked in every Gym test and checked in test_gym_servers)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gym_bridge.gym.servers._forkserver import ServerCommand, parse_server_command

_CONFIG_YAML = "policy_model:\n  responses_api_models:\n    vllm_model: {entrypoint: app.py}\n"


def _gym_command(setup: str) -> str:
    """The command NeMo-Gym 0.4's RunHelper.start builds for one server (cli/env.py)."""
    return f"""{setup} \\
    && NEMO_GYM_CONFIG_DICT={shlex.quote(_CONFIG_YAML)} \\
    NEMO_GYM_CONFIG_PATH={shlex.quote("policy_model")} \\
    python app.py"""


def test_the_plain_gym_command_is_forked_with_its_folder_venv_and_variables(tmp_path):
    venv = tmp_path / "v" / "responses_api_models" / "vllm_model" / ".venv"
    venv.parent.mkdir(parents=True)
    venv.symlink_to(sys.prefix)  # what the launcher links
    parsed = parse_server_command(
        _gym_command(f"cd /site/responses_api_models/vllm_model && source {venv}/bin/activate"),
        Path(sys.prefix),
    )
    assert parsed == ServerCommand(
        cwd=Path("/site/responses_api_models/vllm_model"),
        venv=venv,
        variables={"NEMO_GYM_CONFIG_DICT": _CONFIG_YAML, "NEMO_GYM_CONFIG_PATH": "policy_model"},
        entrypoint="app.py",
    )


def test_anything_else_runs_in_a_shell(tmp_path):
    (tmp_path / "other-venv").mkdir()  # a real venv of its own: its python, not ours, must run the server
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
        assert parse_server_command(command, Path(sys.prefix)) is None, command
    ours = _gym_command(f"cd /s/x && source {tmp_path / 'other-venv'}/bin/activate")
    assert parse_server_command(ours, Path(sys.prefix)) is None


_PROBE_APP = """
import json, multiprocessing, os, sys, threading
real = lambda paths: [os.path.realpath(p) for p in paths]  # 0.7 runs VENV/bin/python: a link to the same folders
path_before = real(sys.path)
import nemo_gym
open("unclosed.txt", "w").write("kept")  # never closed: Python flushes it at exit
child = multiprocessing.Process(target=len, args=([],))
child.start()
child.join()
threading.Thread(target=lambda: open("thread.txt", "w").write("joined") if not __import__("time").sleep(0.5) else 0).start()
print(json.dumps({
    "start_method": multiprocessing.get_start_method(),
    "parent_process": multiprocessing.parent_process() is not None,
    "process_name": multiprocessing.current_process().name,
    "child_exit": child.exitcode,
    "cwd": os.getcwd(), "path_before_gym": path_before, "path_after_gym": real(sys.path), "file": __file__,
    "argv": sys.argv, "variable": os.environ["NEMO_GYM_CONFIG_PATH"], "pwd": os.environ["PWD"],
    "virtual_env": os.environ["VIRTUAL_ENV"], "nemo_gym_working_dir": str(nemo_gym.WORKING_DIR),
    # uvicorn's workers reopen sys.stdin.fileno(): it must be fd 0 on /dev/null, as the launcher's shell gives it
    "stdin_fd": sys.stdin.fileno(), "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)),
}), flush=True)
sys.exit(3)
"""

_FORK_ONE = """
import os, sys
from pathlib import Path
from gym_bridge.gym.servers._forkserver import fork_context, parse_server_command, start_server
command, log = sys.argv[1], Path(sys.argv[2])
server = parse_server_command(command, Path(sys.prefix))
assert server is not None, command
process = start_server(fork_context(), "probe", server, dict(os.environ), log)
print(process.wait(120))
"""


def _probe_facts(log: Path) -> dict:
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


@pytest.mark.parametrize("shape", ["variables in the command (Gym 0.4-0.6)", "venv python, variables in env (0.7)"])
def test_a_forked_server_sees_what_python_app_py_would(tmp_path, shape):
    """The same probe run by the shell (as Gym would) and forked: everything it sees is the same, but argv[0]."""
    venv = tmp_path / "venvs" / "probe" / ".venv"
    venv.parent.mkdir(parents=True)
    venv.symlink_to(sys.prefix)
    facts = {}
    for how in ("shell", "fork"):
        folder = tmp_path / how / "resources_servers" / "probe"
        folder.mkdir(parents=True)
        (folder / "app.py").write_text(_PROBE_APP)
        setup = f"cd {folder} && source {venv}/bin/activate"
        env = {**os.environ, "PYTHONPATH": str(folder)}  # what the launcher's run_command sets
        if shape.startswith("variables"):
            command = f"{setup} \\\n    && NEMO_GYM_CONFIG_PATH=probe \\\n    python app.py"
        else:
            command = f"{setup} \\\n    && {venv}/bin/python app.py"
            env["NEMO_GYM_CONFIG_PATH"] = "probe"  # run_command's extra_env
        log = tmp_path / f"{how}.log"
        if how == "shell":
            with open(log, "wb") as out:
                done = subprocess.run(["bash", "-c", command], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, timeout=180)
            assert done.returncode == 3, log.read_text()[-3000:]
        else:
            done = subprocess.run(
                [sys.executable, "-P", "-c", _FORK_ONE, command, str(log)],
                capture_output=True,
                text=True,
                timeout=180,
                cwd=tmp_path,
                env=env,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            assert done.stdout.split() == ["3"], (done.stdout, log.read_text()[-3000:])  # the script's exit code
        assert (folder / "unclosed.txt").read_text() == "kept"
        assert (folder / "thread.txt").read_text() == "joined"  # non-daemon threads finish before exit
        found = _probe_facts(log)
        found["argv"] = [Path(a).name for a in found["argv"]]  # the one difference: runpy puts the full path in argv[0]
        facts[how] = json.loads(json.dumps(found).replace(str(tmp_path / how), "<server root>"))
    assert facts["fork"] == facts["shell"]
    assert facts["fork"]["start_method"] == "fork"  # the platform default, not the fork server's
    assert (facts["fork"]["stdin_fd"], facts["fork"]["stdin_is_devnull"]) == (0, True)
    assert facts["fork"]["nemo_gym_working_dir"] == "<server root>/resources_servers/probe"
