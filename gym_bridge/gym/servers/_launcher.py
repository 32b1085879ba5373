"""The process that runs NeMo-Gym's ``RunHelper`` for one :class:`~gym_bridge.gym.servers.owned.OwnedGym`.

Run as ``python -m gym_bridge.gym.servers._launcher <launch.json>`` in a session of its
own. Gym keeps its config, head server and aiohttp client process-wide, so one
launcher per ``GymServers`` keeps two of them apart, and the launcher's process
group holds every server, so killing the group leaves nothing behind.

It changes four things in Gym: each server's output goes to its own log file
(Gym's ``tee`` wrapper would orphan the servers), a server whose start command
would create a venv or install packages is refused, each server is forked
from a process that imported NeMo-Gym's dependencies once (:mod:`gym_bridge.gym.servers._forkserver`)
instead of starting a fresh interpreter, and Gym polls its head and servers every 0.2 s
instead of every 3 s (a set is ready ~2.5 s sooner). Once the set is ready, a server that exits is started again
with its own command, a bounded number of times (:func:`keep_servers_up`). It also binds the head server's socket
itself before Gym reads its config (:func:`claim_head_port`) and hands it to Gym's uvicorn, so no other process can
take the head's port between its choice and its bind. It reports to the parent through a JSON status file:
``phase`` (parsing, spawning, ready, failed), ``servers`` (name -> host, port, pid, log, and after an exit
``exit_code``, ``restarts``, ``gave_up``), ``routes`` (:mod:`gym_bridge.gym.servers._gym_routes`) and ``error``.

Its files go through the trust boundary: each server's log is appended to through a descriptor that refuses a
link or a second hard link (:func:`open_log`), so a log folder someone else filled never leads an append outside
it, and the status file is replaced whole (:func:`~gym_bridge.boundary.files.write_atomic`).
"""

from __future__ import annotations

import functools
import os
import random
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.context import ForkServerContext
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen
from typing import TYPE_CHECKING, BinaryIO

from gym_bridge.boundary.files import make_dir, open_append, read_bytes, write_atomic
from gym_bridge.boundary.json_io import dumps, loads_object
from gym_bridge.failures.errors import GymPortInUse, GymStartupError
from gym_bridge.gym.servers._forkserver import ForkedServer, fork_context, parse_server_command, start_server
from gym_bridge.gym.servers._gym_routes import gym_routes
from gym_bridge.json_types import JsonObject

if TYPE_CHECKING:
    from omegaconf import DictConfig

_INSTALL_MARKERS = ("uv venv", "uv pip install")
_GYM_POLL_S = 0.2
_RESTART_POLL_S = 0.2
"""How often a ready set's servers are checked for one that exited (a restart starts within this of the exit)."""
SPEC_MAX_BYTES = 64 << 20
"""The largest launch spec the launcher reads (the parent writes it: the Gym config and its overrides)."""


class _Status:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: JsonObject = {"phase": "parsing", "servers": {}, "error": None}

    def update(self, **fields: object) -> None:
        self.data.update(fields)
        write_atomic(self.path, dumps(self.data))


def open_log(log_dir: Path, name: str) -> BinaryIO:
    """Server ``name``'s log in ``log_dir``, open for appending: a link or a file with a second hard link planted
    there is refused (:func:`~gym_bridge.boundary.files.open_append`), never appended to.

    Raises:
        UntrustedInputError: the log is a link, has another hard link, is not a regular file, or cannot be opened.
    """
    return open_append(log_path_of(log_dir, name), root=log_dir)


def log_path_of(log_dir: Path, name: str) -> Path:
    """Where server ``name`` logs (its ``/`` made ``_``, so the name stays one file inside ``log_dir``)."""
    return log_dir / f"{name.replace('/', '_')}.log"


# Runs in a child of the launcher, in its process group: when the launcher dies without cleaning
# up (Ray SIGKILLs the direct children of a dead actor, so the launcher's own watch never runs),
# the reaper is re-parented and kills the group, servers included.
_REAPER = """
import os, signal, sys, time
launcher = int(sys.argv[1])
while os.getppid() == launcher:
    time.sleep(0.5)
os.killpg(0, signal.SIGKILL)
"""


def _watch_parent(parent_pid: int) -> None:
    """Kill this process group once the parent is gone (it cannot clean up any more)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def _start_reaper() -> None:
    Popen([sys.executable, "-c", _REAPER, str(os.getpid())], stdin=DEVNULL, stdout=DEVNULL, stderr=DEVNULL)


def _server_instances(global_config_dict: DictConfig) -> dict[str, JsonObject]:
    """The ``<name>: {<type>: {<impl>: {entrypoint: ...}}}`` entries, walked as RunHelper walks them."""
    from nemo_gym.global_config import NEMO_GYM_RESERVED_TOP_LEVEL_KEYS
    from omegaconf import DictConfig

    servers: dict[str, JsonObject] = {}
    for name, value in global_config_dict.items():
        if name in NEMO_GYM_RESERVED_TOP_LEVEL_KEYS or not isinstance(value, DictConfig) or not value:
            continue
        server_type = next(iter(value))
        if not isinstance(value[server_type], DictConfig) or not value[server_type]:
            continue
        impl = next(iter(value[server_type]))
        inner = value[server_type][impl]
        if not isinstance(inner, DictConfig) or "entrypoint" not in inner:
            continue
        servers[str(name)] = {
            "server_type": str(server_type),
            "impl": str(impl),
            "host": inner.get("host"),
            "port": inner.get("port"),
            "pid": None,
        }
    return servers


def _link_venvs(servers: dict[str, JsonObject], venv_dir: Path) -> None:
    """``<venv_dir>/<type>/<impl>/.venv`` -> this interpreter's environment, so Gym skips its venv setup."""
    for server in servers.values():
        link = venv_dir / server["server_type"] / server["impl"] / ".venv"
        make_dir(link.parent, root=venv_dir)
        if not link.is_symlink():
            link.symlink_to(sys.prefix, target_is_directory=True)


type _Process = Popen[bytes] | ForkedServer
type _Started = dict[str, tuple[_Process, Callable[[], _Process]]]
"""Each server's process and what starts it again (the same command, environment and so port)."""


def _make_run_command(
    status: _Status, log_dir: Path, forks: ForkServerContext | None, started: _Started
) -> Callable[..., _Process]:
    """A stand-in for ``nemo_gym.cli.setup_command.run_command``: one log file per server, no installs,
    and each server forked from ``forks`` (:mod:`gym_bridge.gym.servers._forkserver`) when its command allows.
    Every server it starts is entered in ``started`` with the call that starts it again."""
    from nemo_gym.global_config import UV_CACHE_DIR_KEY_NAME, get_global_config_dict

    def run_command(
        command: str,
        working_dir_path: Path,
        server_name: str = "",
        project_root: Path | None = None,
        *,
        global_config_dict: object = None,
        stdout_target: object = None,
        stderr_target: object = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> Popen[bytes] | ForkedServer:
        """Every Gym version's signature at once (the keywords came in 0.6 and 0.7); output goes to the log."""
        name = server_name or working_dir_path.name
        if any(marker in command for marker in _INSTALL_MARKERS):
            raise GymStartupError(f"refusing to create a venv or install packages for server {name!r}: {command[:300]}")
        env = os.environ.copy()
        env.update(extra_env or {})
        entries = [str(working_dir_path.absolute())]
        if project_root is not None:
            entries.append(str(project_root.absolute()))
        if env.get("PYTHONPATH"):
            entries.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = ":".join(entries)
        env["UV_CACHE_DIR"] = str(get_global_config_dict()[UV_CACHE_DIR_KEY_NAME])
        server = parse_server_command(command, Path(sys.prefix)) if forks is not None else None
        process: Popen[bytes] | ForkedServer
        with open_log(log_dir, name) as log:
            log.write(f"$ {shlex.quote(name)} starting{' (forked)' if server else ''}\n".encode())
            log.flush()
            if forks is not None and server is not None:
                process = start_server(forks, name, server, env, log_path_of(log_dir, name), log_dir=log_dir)
            else:
                process = Popen(
                    command, executable="/bin/bash", shell=True, env=env, stdin=DEVNULL, stdout=log, stderr=STDOUT
                )
        servers = status.data["servers"]
        servers.setdefault(name, {})["pid"] = process.pid
        status.update(servers=servers)
        again = functools.partial(run_command, command, working_dir_path, server_name, project_root,
                                  global_config_dict=global_config_dict, extra_env=extra_env)  # fmt: skip
        started[name] = (process, again)
        return process

    return run_command


def keep_servers_up(status: _Status, log_dir: Path, started: _Started, max_restarts: int) -> None:
    """Once the set is ready, start a server that exits again, with its own command (so on its own port, under the
    routes Gym already has), up to ``max_restarts`` times each. The status file counts each server's ``restarts``;
    a server that exits once more stays down with ``gave_up`` set, and the parent names it and its log."""
    while True:
        time.sleep(_RESTART_POLL_S)
        for name, (process, again) in list(started.items()):
            code = process.poll()
            entry = status.data["servers"].setdefault(name, {})
            if code is None or entry.get("gave_up"):
                continue
            count = int(entry.get("restarts", 0))
            with open_log(log_dir, name) as log:
                what = f"restarting it ({count + 1} of {max_restarts})" if count < max_restarts else "giving up"
                log.write(f"$ {shlex.quote(name)} exited with code {code}; {what}\n".encode())
            entry.update(exit_code=code)
            if count >= max_restarts:
                entry.update(gave_up=True)
                status.update(servers=status.data["servers"])
                continue
            entry.update(restarts=count + 1)
            try:
                again()  # enters the new process in ``started`` and its pid in the status file
            except Exception as exc:  # a start that fails is a restart that failed: the server stays down
                entry.update(gave_up=True, error=f"{type(exc).__name__}: {exc}")
                status.update(servers=status.data["servers"])


def claim_head_port(global_config: JsonObject) -> socket.socket:
    """A listening socket for Gym's head server, bound now: on ``head_server.port`` when the config sets one, else
    on a free port of ``port_range_low..port_range_high`` (the run's port window). The config's ``head_server.port``
    is set to the bound port, so Gym keeps its servers off it.

    Raises:
        GymPortInUse: the configured head port is busy, or no port of the range can be bound.
    """
    head = global_config.setdefault("head_server", {})
    host = str(head.get("host") or global_config.get("default_host") or "127.0.0.1")
    if head.get("port") is not None:
        ports = [int(head["port"])]
    else:
        ports = list(range(int(global_config["port_range_low"]), int(global_config["port_range_high"]) + 1))
        random.shuffle(ports)
    error: OSError | None = None
    for port in ports:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.bind((host, port))
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        head["port"] = port
        return sock
    raise GymPortInUse(f"NeMo-Gym's head server cannot bind {host}:{ports[0] if len(ports) == 1 else ports}: {error}")


def _serve_head_on(sock: socket.socket) -> None:
    """Gym's head server (a ``uvicorn.Server`` run in a thread of this process, every Gym version) serves on
    ``sock``; the servers Gym starts are other processes and bind their own ports."""
    import uvicorn

    port = sock.getsockname()[1]
    run = uvicorn.Server.run

    def run_on_claimed_socket(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None and self.config.port == port:
            sockets = [sock]
        run(self, sockets=sockets)

    uvicorn.Server.run = run_on_claimed_socket  # type: ignore[method-assign]


def _short_sleep(seconds: float) -> None:
    """Gym's ``RunHelper`` sleeps 3 s between polls of its head and its servers; polling every
    :data:`_GYM_POLL_S` marks the head ready within that of the last server answering."""
    time.sleep(min(seconds, _GYM_POLL_S))


def main(argv: list[str]) -> int:
    spec = loads_object(read_bytes(argv[1], SPEC_MAX_BYTES), argv[1])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    status = _Status(Path(spec["status_file"]))
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    _start_reaper()
    try:
        _serve_head_on(claim_head_port(spec["global_config"]))
        forks = fork_context() if spec.get("fork_servers", True) else None
        import nemo_gym.cli.env as gym_env
        from nemo_gym.global_config import GlobalConfigDictParserConfig, get_global_config_dict
        from omegaconf import OmegaConf

        parser_config = GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create(spec["global_config"]),
            skip_load_from_cli=True,
            skip_load_from_dotenv=spec["skip_load_from_dotenv"],
        )
        global_config_dict = get_global_config_dict(global_config_dict_parser_config=parser_config)
        servers = _server_instances(global_config_dict)
        _link_venvs(servers, make_dir(spec["venv_dir"]))
        head = global_config_dict["head_server"]
        status.update(
            phase="spawning",
            servers=servers,
            head={"host": head["host"], "port": head["port"]},
            routes=gym_routes(global_config_dict),
        )
        started: _Started = {}
        gym_env.run_command = _make_run_command(status, Path(spec["log_dir"]), forks, started)
        gym_env.sleep = _short_sleep
        gym_env.RunHelper().start(global_config_dict_parser_config=parser_config)
    except BaseException as exc:
        summary = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        status.update(phase="failed", error=traceback.format_exc(), summary=summary)
        return 1
    status.update(phase="ready")
    keep_servers_up(status, Path(spec["log_dir"]), started, int(spec.get("max_restarts", 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
