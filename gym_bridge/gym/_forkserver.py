"""Start Gym servers by forking a process that has already imported NeMo-Gym.

Importing ``nemo_gym`` (wandb, pandas, ray, fastapi, openai types) costs each server
process about 3.5 CPU-seconds; a set of six servers spent 20 s of CPU before any of
them listened. The launcher instead starts one multiprocessing fork server that imports
those modules once, and each server is a fork of it that runs its ``app.py`` as
``__main__`` with the environment, folder and ``sys.path`` Gym's shell command would
have given it. The servers already run on this interpreter's environment (Gym's venvs
are links to ``sys.prefix``), so a fork runs the same code as ``python app.py`` did.

Only the command shape Gym 0.4 builds (``cd DIR && source VENV/bin/activate && K=V ...
python ENTRYPOINT``) is forked; anything else returns None and runs in a shell as before.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

__all__ = ["ForkedServer", "ServerCommand", "fork_context", "parse_server_command", "start_server"]

_PRELOAD = [
    "nemo_gym.base_resources_server",
    "nemo_gym.base_responses_api_agent",
    "nemo_gym.base_responses_api_model",
]


@dataclass(frozen=True)
class ServerCommand:
    """What Gym's shell command for one server does: its folder, venv, variables and entrypoint."""

    cwd: Path
    venv: Path
    variables: dict[str, str]
    entrypoint: str


def parse_server_command(command: str) -> ServerCommand | None:
    """The parts of Gym's server command, or None when it is not the plain shape we can fork."""
    try:
        tokens = shlex.split(command.replace("\\\n", " "))
    except ValueError:
        return None
    match tokens:
        case ["cd", cwd, "&&", "source", activate, "&&", *assignments, "python", entrypoint] if activate.endswith(
            "/bin/activate"
        ) and all("=" in a and not a.startswith("=") for a in assignments):
            variables = dict(a.split("=", 1) for a in assignments)
            return ServerCommand(Path(cwd), Path(activate).parent.parent, variables, entrypoint)
        case _:
            return None


def fork_context() -> ForkServerContext:
    """The fork server context, started now so its imports overlap the launcher's own."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return context


def start_server(
    context: ForkServerContext, name: str, server: ServerCommand, env: dict[str, str], log_path: Path
) -> ForkedServer:
    """Fork one Gym server from ``context``'s fork server; its output goes to ``log_path``."""
    env = {**env, **server.variables, "VIRTUAL_ENV": str(server.venv)}
    env["PATH"] = os.pathsep.join(filter(None, [str(server.venv / "bin"), env.get("PATH")]))
    process = context.Process(target=_run_server, args=(server, env, str(log_path)), name=name, daemon=False)
    process.start()
    return ForkedServer(process)


def _run_server(server: ServerCommand, env: dict[str, str], log_path: str) -> None:
    """In the forked child: become ``cd DIR && K=V python ENTRYPOINT`` and run it."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if not server.cwd.is_dir():
        raise SystemExit(f"cd: {server.cwd}: No such file or directory")  # what the shell said
    os.environ.clear()
    os.environ.update(env)
    os.chdir(server.cwd)
    entries = [str(server.cwd), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:0] = [entry for entry in entries if entry not in sys.path]
    sys.argv = [server.entrypoint]
    try:
        runpy.run_path(str(server.cwd / server.entrypoint), run_name="__main__")  # __file__ absolute, as Python sets it
    finally:
        atexit._run_exitfuncs()  # what ``python app.py`` runs at exit (Gym's aiohttp and Ray clean-up)


class ForkedServer:
    """The part of :class:`subprocess.Popen` that Gym's ``RunHelper`` uses, for a forked server."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        self.args = process.name

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[None, None]:
        """Output went to the server's log file, so there is none to return."""
        self.wait(timeout)
        return None, None

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
