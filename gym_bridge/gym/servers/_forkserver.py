"""Start Gym servers by forking a process that has already imported NeMo-Gym's dependencies.

Importing ``nemo_gym`` (wandb, pandas, ray, fastapi, openai and anthropic types) costs each
server process about 3.5 CPU-seconds; a set of six servers spent 20 s of CPU before any of
them listened. The launcher instead starts one multiprocessing fork server that imports
those third-party packages once (:mod:`gym_bridge.gym.servers._server_preload`). Each server is a
fork of it that runs its ``app.py`` as ``__main__`` with the environment, folder and
``sys.path`` that Gym's shell command would have given it (only ``argv[0]`` differs: it is
the full path). Each server imports NeMo-Gym itself (0.3 s), so NeMo-Gym's import-time
state (``WORKING_DIR`` from the folder, the Hugging Face cache variables, its ``atexit``
hooks) is the server's own.

Only the plain command shapes Gym builds when a server's venv exists (``cd DIR && source
VENV/bin/activate && K=V ... python ENTRYPOINT``, or 0.7's ``... && VENV/bin/python ENTRYPOINT``)
whose venv is this interpreter's environment (Gym's venvs are links to ``sys.prefix`` here) are
forked; anything else returns None and runs in a shell as before.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import multiprocessing.process
import os
import runpy
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

import psutil

from gym_bridge.boundary.files import open_nofollow, stdin_from_devnull


@dataclass(frozen=True)
class ServerCommand:
    """What Gym's shell command for one server does: its folder, venv, variables and entrypoint."""

    cwd: Path
    venv: Path
    variables: dict[str, str]
    entrypoint: str


def parse_server_command(command: str, python_prefix: Path) -> ServerCommand | None:
    """The parts of Gym's server command, or None unless it is a plain shape we can fork and its
    venv is ``python_prefix`` (the forked server runs this interpreter's packages).

    The two shapes: ``cd D && source V/bin/activate && K=V ... python ENTRYPOINT`` (Gym 0.4 to 0.6, the
    config in ``K=V`` words) and ``cd D && source V/bin/activate && V/bin/python ENTRYPOINT`` (0.7, the
    config in ``run_command``'s ``extra_env``, which the caller puts in the server's environment).
    """
    try:
        tokens = shlex.split(command.replace("\\\n", " "))
    except ValueError:
        return None
    match tokens:
        case ["cd", cwd, "&&", "source", activate, "&&", *assignments, python, entrypoint] if (
            activate.endswith("/bin/activate")
            and all("=" in a and not a.startswith("=") for a in assignments)
            and python in ("python", str(Path(activate).parent / "python"))
        ):
            venv = Path(activate).parent.parent
            if venv.resolve() != python_prefix.resolve():
                return None
            return ServerCommand(Path(cwd), venv, dict(a.split("=", 1) for a in assignments), entrypoint)
        case _:
            return None


def fork_context() -> ForkServerContext:
    """The fork server context, started now so its imports overlap the launcher's own."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["gym_bridge.gym.servers._server_preload"])
    forkserver.ensure_running()
    return context


def start_server(
    context: ForkServerContext,
    name: str,
    server: ServerCommand,
    env: dict[str, str],
    log_path: Path,
    *,
    log_dir: Path | None = None,
) -> ForkedServer:
    """Fork one Gym server from ``context``'s fork server; its output goes to ``log_path`` (opened as
    :func:`redirect_output` opens it, under ``log_dir`` when given)."""
    venv = server.venv.resolve()  # what `source VENV/bin/activate` sets: the path the venv was made at
    env = {**env, **server.variables, "VIRTUAL_ENV": str(venv), "PWD": str(server.cwd)}
    env["PATH"] = os.pathsep.join(filter(None, [str(venv / "bin"), env.get("PATH")]))
    root = str(log_dir) if log_dir is not None else None
    process = context.Process(target=_run_server, args=(server, env, str(log_path), root), name=name, daemon=False)
    process.start()
    return ForkedServer(process)


def redirect_output(log_path: str | Path, log_dir: str | Path | None = None) -> None:
    """Send this process's stdout and stderr to the end of ``log_path``, opened through the boundary: a link or a
    second hard link planted there is refused (``UntrustedInputError``), never appended to."""
    log = open_nofollow(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, root=log_dir)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _run_server(server: ServerCommand, env: dict[str, str], log_path: str, log_dir: str | None = None) -> None:
    """In the forked child: become ``cd DIR && K=V python ENTRYPOINT`` and run it."""
    redirect_output(log_path, log_dir)
    stdin_from_devnull()  # multiprocessing closed fd 0; a server that starts workers hands it to each
    if not server.cwd.is_dir():
        raise SystemExit(f"cd: {server.cwd}: No such file or directory")  # what the shell said
    os.environ.clear()
    os.environ.update(env)
    os.chdir(server.cwd)
    _become_a_main_process(server.cwd)
    entries = [str(server.cwd), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = entries + [entry for entry in sys.path if entry not in entries]
    sys.argv = [server.entrypoint]  # run_path puts the full path in argv[0] while it runs
    try:
        runpy.run_path(str(server.cwd / server.entrypoint), run_name="__main__")  # __file__ absolute, as Python sets it
    finally:
        _finish_like_the_interpreter()


def _become_a_main_process(cwd: Path) -> None:
    """Undo what multiprocessing set up for its child, so the server's own multiprocessing (a pool,
    a Manager) works as under ``python app.py``: the platform's start method, no parent process."""
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.current_process().name = "MainProcess"
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]  # what parent_process() reads
    multiprocessing.process.ORIGINAL_DIR = str(cwd)  # type: ignore[attr-defined]  # relative paths of children


def _finish_like_the_interpreter() -> None:
    """What Python does when a script ends, which multiprocessing's ``os._exit`` would skip: wait for
    non-daemon threads, run the ``atexit`` hooks, then collect what the script left (files get flushed)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()


class ForkedServer:
    """The part of :class:`subprocess.Popen` that Gym's ``RunHelper`` uses, for a forked server.

    Liveness comes from the process itself: multiprocessing reports every child as exited (255)
    once the fork server that forked it is gone, though the child is still running.
    """

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        self.args = process.name
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code = self._process.exitcode
        if code is not None and self._running():
            return None  # the fork server died, not the server
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is not None and self._running():  # the fork server died: watch the pid
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.wait_procs([psutil.Process(self.pid)], timeout=timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[None, None]:
        """Output went to the server's log file, so there is none to return."""
        self.wait(timeout)
        return None, None

    def send_signal(self, signum: int) -> None:
        if self.poll() is not None:
            return  # reaped: the pid may belong to another process by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _running(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
