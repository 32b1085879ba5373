"""Start and stop real NeMo-Gym servers, with a deadline, logs per server and no leftovers.

It raises ``GymStartupError`` and ``GymServerDied`` (both ``GymServersError``; the tree is
drawn in :mod:`gym_bridge.failures`).

Each :class:`GymServers` runs Gym's own ``RunHelper`` in a launcher process of
its own session (see :mod:`gym_bridge.gym.servers._launcher`); every Gym server is a
child of it, so the whole set is one process group that :meth:`GymServers.stop`
signals, SIGTERM then SIGKILL. The servers run on this interpreter's
environment: Gym's per-server venvs are prepared as links to ``sys.prefix`` and
nothing is installed. The config lives in :mod:`gym_bridge.gym.servers.server_config`, the
cleanup registry and process checks in :mod:`gym_bridge.gym.servers.reaper`.

With ``GymServersConfig.head_url`` the set is a Gym that is already running (``gym env start``, ``ng_run``, another
tool's): :meth:`GymServers.start` attaches to it, as ``gym eval run --no-serve`` does, reading its servers
(``GET /server_instances``) and config (``GET /global_config_dict_yaml``) from its head server and the routes from that
config with Gym's own resolver (:mod:`gym_bridge.gym.servers._gym_routes`, in a process of its own);
:meth:`GymServers.poll` checks that its servers still accept connections, and :meth:`GymServers.stop` stops nothing.

Every file it touches goes through the trust boundary (:mod:`gym_bridge.boundary.files`): the log folder is made as
the user named it, a log is appended to only through a descriptor that refuses a link or a second hard link, and
the launch spec, the status file and the routes are written whole and read under a size cap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import make_dir, open_append, read_bytes, write_atomic
from gym_bridge.boundary.json_io import dumps, loads_object
from gym_bridge.failures import GymPortInUse, GymServerDied, GymServersError, GymStartupError
from gym_bridge.gym.servers._launcher import log_path_of
from gym_bridge.gym.servers.reaper import (
    PORT_WINDOW,
    answers,
    is_alive,
    next_instance_index,
    register_live,
    release,
    reserve_port_window,
    tail,
    wait_gone,
)
from gym_bridge.gym.servers.running import read_global_config, read_head
from gym_bridge.gym.servers.server_config import GymServersConfig, HeadServerAddress, deep_merge, head_address
from gym_bridge.gym_versions import installed_gym
from gym_bridge.json_types import JsonObject

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.25
_PORT_ATTEMPTS = 3
"""How many times a set starts when a server finds its port taken (each time on another port window)."""
_BIND_FAILURE = re.compile(
    r"error while attempting to bind on address (?P<address>\([^)]*\)|\S+)[^\n]*(address already in use|Errno 98)",
    re.IGNORECASE,
)
_KILL_WAIT_S = 5.0
_PROBE_TIMEOUT_S = 0.5
"""The bound on one TCP connect to a server of a running Gym (:meth:`GymServers.poll`)."""
_PROBE_EVERY_S = 2.0
"""How often :meth:`GymServers.poll` probes a running Gym's servers at most (a good probe is trusted this long)."""
_ROUTES_MIN_S = 60.0
"""The least time the routes of a running Gym's config get (Gym's resolver imports NeMo-Gym: seconds)."""

_ROUTES_SCRIPT = """
import sys
from omegaconf import OmegaConf
from gym_bridge.boundary.files import write_atomic
from gym_bridge.boundary.json_io import dumps
from gym_bridge.gym.servers._gym_routes import gym_routes
write_atomic(sys.argv[1], dumps(gym_routes(OmegaConf.create(sys.stdin.read()))))
"""
"""Gym's own resolver over a running Gym's config, in a process of its own: the caller never imports NeMo-Gym."""
_STATUS_MAX_BYTES = 64 << 20
"""The largest status or routes file read back from the launcher (its servers and routes: kilobytes)."""


def _running_ray_address() -> str | None:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    address: str | None = ray.get_runtime_context().gcs_address
    return address


_NO_RAY_SITECUSTOMIZE = """\
import os
if os.environ.get("GYM_BRIDGE_NO_RAY") == "1":
    import ray
    ray.is_initialized = lambda: True  # Gym's initialize_ray() then neither starts nor joins a cluster
"""


class GymServers:
    """One set of NeMo-Gym servers (head server, models, agents, resources servers).

    ``start()`` returns the head server's address once every server answers ``GET /``
    and the head server says it is ready (``GET /readyz`` from Gym 0.7 on); ``stop()`` is
    idempotent and leaves no process behind. Usable as a context manager.
    """

    def __init__(self, config: GymServersConfig) -> None:
        self.config = config
        self._index = next_instance_index()
        self._launcher: subprocess.Popen[bytes] | None = None
        self._launcher_proc: psutil.Process | None = None
        self._private_dir: Path | None = None
        self._window: int | None = None
        self._status: JsonObject = {}
        self._procs: dict[str, psutil.Process] = {}
        self._busy_port: int | None = None
        self._port_range = (0, -1)
        self.log_dir: Path = config.log_dir or Path.cwd() / "gym-logs" / (
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._index}"
        )
        self.head: HeadServerAddress | None = None
        self._attached = False
        self._served_config: dict[str, Any] = {}
        self._config_yaml = ""
        self._probed_at = -_PROBE_EVERY_S

    # ---- public surface -------------------------------------------------------------------

    @property
    def log_files(self) -> dict[str, Path]:
        """Server name -> its log file (the head server's is ``launcher_log``)."""
        return {name: log_path_of(self.log_dir, name) for name in self._status.get("servers", {})}

    @property
    def launcher_log(self) -> Path:
        return self.log_dir / "_launcher.log"

    @property
    def venv_dir(self) -> Path | None:
        """Gym's ``uv_venv_dir``: only ``.venv`` links to ``sys.prefix``."""
        return self._private_dir / "venvs" if self._private_dir else None

    @property
    def server_pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    @property
    def server_urls(self) -> dict[str, str]:
        return {name: f"http://{s['host']}:{s['port']}" for name, s in self._status.get("servers", {}).items()}

    @property
    def attached(self) -> bool:
        """Whether this set is a Gym that was already running (``head_url``), which this object neither started nor
        stops."""
        return self._attached

    @property
    def global_config(self) -> dict[str, Any]:
        """The set's Gym global config as its head server serves it (``/global_config_dict_yaml``), read at start;
        interpolations (``${policy_base_url}``) are left as Gym wrote them."""
        return self._served_config

    @property
    def environment_server_routes(self) -> dict[str, str]:
        """Gym's ``environment_server_routes`` of the set's config: taskset -> the environment server that runs its
        materialized rows (Gym 0.7's episode protocol; empty when the config sets none)."""
        routes = self._served_config.get("environment_server_routes")
        if not isinstance(routes, dict):
            return {}
        return {str(taskset): server for taskset, server in routes.items() if isinstance(server, str)}

    @property
    def server_impls(self) -> dict[str, str | None]:
        """Each server's implementation folder (``<type>/<impl>``'s ``impl``: ``simple_agent``, ``legacy_agent``, ...),
        what Gym stamps as ``_ng_result_type`` on a record an environment server produced."""
        return {name: s.get("impl") for name, s in self._status.get("servers", {}).items()}

    @property
    def server_types(self) -> dict[str, str | None]:
        """Each server's Gym type: ``responses_api_agents``, ``resources_servers`` or ``responses_api_models``."""
        return {name: s.get("server_type") for name, s in self._status.get("servers", {}).items()}

    @property
    def routes(self) -> JsonObject:
        """Where the launched config sends rows, as Gym's own code resolved it
        (:mod:`gym_bridge.gym.servers._gym_routes`)."""
        routes = self._status.get("routes")
        return routes if isinstance(routes, dict) else {}

    def pids(self) -> set[int]:
        """Every process of this set still running: the launcher, the servers and their children."""
        return {p.pid for p in self._processes() if is_alive(p)}

    def start(self) -> HeadServerAddress:
        """Start the set and return the head server's address once every server answers.

        A server whose port another process took between Gym choosing it and the server binding it exits at once;
        the set is then started again on another port window, up to :data:`_PORT_ATTEMPTS` times, each retry
        logged with the port. Other start-up failures end the start at once.

        Raises:
            GymStartupError: a server exited during start-up or did not answer by the deadline (named, with the
                last lines of its log); ``GymPortInUse`` when its port stayed taken.
        """
        if self._launcher is not None or self._attached:
            raise GymServersError("GymServers.start() was already called")
        if self.config.head_url is not None:
            return self._attach(self.config.head_url)
        started = time.monotonic()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            register_live(self)
            try:
                self._spawn_launcher()
                self._wait_until_ready(started + self.config.startup_timeout_s)
                break
            except GymPortInUse as exc:
                retry = attempt < _PORT_ATTEMPTS and self._chose_busy_port()
                self.stop()
                if not retry:
                    raise
                logger.warning(
                    "NeMo-Gym start-up attempt %d: %s; starting again on other ports", attempt, str(exc).splitlines()[0]
                )
            except BaseException:
                self.stop()
                raise
        assert self.head is not None
        try:
            self._served_config = self._read_global_config(self.head)
        except GymStartupError as exc:  # only the episode protocol's taskset routes need it (Gym 0.7)
            logger.warning("NeMo-Gym's global config could not be read back: %s", exc)
        logger.info(
            "NeMo-Gym servers ready at %s after %.1fs: %s",
            self.head.url,
            time.monotonic() - started,
            ", ".join(f"{n}={u}" for n, u in self.server_urls.items()),
        )
        return self.head

    def poll(self) -> None:
        """Raise :class:`GymServerDied` naming a server (or the head server) that is no longer running.

        For a running Gym this set attached to: a server (or its head server) that no longer accepts connections,
        probed at most every :data:`_PROBE_EVERY_S` while all answer."""
        if self._attached:
            self._probe_attached()
            return
        if self._launcher is None:
            raise GymServersError("GymServers is not started")
        for name, proc in self._procs.items():
            if not is_alive(proc):
                raise GymServerDied(self._describe_failure(name, "is no longer running"))
        if not (self._launcher_proc and is_alive(self._launcher_proc)):
            raise GymServerDied(self._describe_failure("head_server", "is no longer running (launcher exited)"))

    def stop(self) -> None:
        """Stop every process of this set: SIGTERM to the group, SIGKILL after ``shutdown_timeout_s``. A running Gym
        this set attached to is left running: nothing of it was started here."""
        if self._attached:
            self._attached = False
            logger.info("left the running NeMo-Gym at %s running", self.head.url if self.head else self.config.head_url)
            return
        if self._launcher is None and self._private_dir is None:
            return
        started = time.monotonic()
        launcher = self._launcher
        if launcher is not None:
            procs = self._processes()
            self._signal(procs, signal.SIGTERM)
            alive = wait_gone(procs, self.config.shutdown_timeout_s)
            if alive:
                logger.warning("NeMo-Gym processes %s ignored SIGTERM; killing them", sorted(p.pid for p in alive))
                self._signal(procs, signal.SIGKILL)
                alive = wait_gone(alive, _KILL_WAIT_S)
            if alive:
                logger.error("NeMo-Gym processes %s survived SIGKILL", sorted(p.pid for p in alive))
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=_KILL_WAIT_S)
            logger.info("NeMo-Gym servers stopped in %.1fs (logs: %s)", time.monotonic() - started, self.log_dir)
        self._launcher = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        release(self, self._window)
        self._window = None

    def __enter__(self) -> GymServers:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- a running Gym ------------------------------------------------------------------------

    def _attach(self, url: str) -> HeadServerAddress:
        """Use the Gym whose head server is at ``url``, as ``gym eval run --no-serve`` does: wait (bounded) until the
        head server says it is ready, read its config and servers, resolve the routes, and check every server answers.

        Raises:
            GymStartupError: the head server or a server did not answer by ``startup_timeout_s``, or its config
                could not be read or resolved (named).
        """
        head = head_address(url)
        started = time.monotonic()
        deadline = started + self.config.startup_timeout_s
        readiness = installed_gym().head_readiness_path
        self._wait_for(
            lambda: answers(head.host, head.port, readiness),
            deadline,
            f"the running NeMo-Gym's head server at {head.url} did not answer GET {readiness} with 200",
        )
        self._served_config = self._read_global_config(head)
        instances = read_head(head, "/server_instances")
        if not isinstance(instances, list):
            raise GymStartupError(f"the head server at {head.url} answered /server_instances with no list of servers")
        servers: dict[str, JsonObject] = {}
        for instance in instances:
            if not isinstance(instance, dict) or not isinstance(instance.get("process_name"), str):
                continue
            name = instance["process_name"]
            host, port = self._instance_address(name, instance, head)
            servers[name] = {
                "server_type": instance.get("server_type"),
                "impl": instance.get("name"),
                "host": host,
                "port": port,
                "pid": instance.get("pid"),
            }
        self._status = {"phase": "ready", "servers": servers}
        self._status["routes"] = self._resolve_routes(head, deadline)
        for name, server in servers.items():
            self._wait_for(
                lambda server=server: answers(server["host"], server["port"]),
                deadline,
                f"NeMo-Gym server {name!r} of the running Gym at {head.url} did not answer at "
                f"{server['host']}:{server['port']}",
            )
        self.head, self._attached = head, True
        self._probed_at = time.monotonic()
        logger.info(
            "attached to the running NeMo-Gym at %s after %.1fs (started and stopped by its owner): %s",
            head.url,
            time.monotonic() - started,
            ", ".join(f"{n}={u}" for n, u in self.server_urls.items()),
        )
        return head

    def _wait_for(self, check: Any, deadline: float, what: str) -> None:
        while not check():
            if time.monotonic() >= deadline:
                raise GymStartupError(f"{what} within the {self.config.startup_timeout_s}s start-up deadline")
            time.sleep(_POLL_INTERVAL_S)

    def _instance_address(self, name: str, instance: dict[str, Any], head: HeadServerAddress) -> tuple[str, int]:
        """Where a running Gym's server listens: ``/server_instances``' host and port, else its block of the config;
        a wildcard host (``0.0.0.0``) is reached at the head server's host."""
        host, port = instance.get("host"), instance.get("port")
        if not host or not port:
            block = self._served_config.get(name)
            inner: Any = block
            for _ in range(2):
                inner = next(iter(inner.values()), None) if isinstance(inner, dict) and inner else None
            if isinstance(inner, dict):
                host, port = host or inner.get("host"), port or inner.get("port")
        if not port:
            raise GymStartupError(f"the running NeMo-Gym at {head.url} names no port for its server {name!r}")
        if not host or host in ("0.0.0.0", "::"):
            host = head.host
        return str(host), int(port)

    def _read_global_config(self, head: HeadServerAddress) -> dict[str, Any]:
        """The head server's global config as plain data (:func:`~gym_bridge.gym.servers.running.read_global_config`);
        its YAML is kept for Gym's resolver."""
        served = read_global_config(head)
        self._config_yaml = served.yaml
        return served.config

    def _resolve_routes(self, head: HeadServerAddress, deadline: float) -> JsonObject:
        """The routes of the running Gym's config, computed by Gym's own resolver in a process of its own."""
        env = dict(os.environ)
        for key in ("NEMO_GYM_CONFIG_DICT", "NEMO_GYM_CONFIG_PATH"):
            env.pop(key, None)
        timeout = max(deadline - time.monotonic(), _ROUTES_MIN_S)
        with tempfile.TemporaryDirectory(prefix="gym-bridge-routes-") as folder:
            out = Path(folder) / "routes.json"
            try:
                done = subprocess.run(
                    [sys.executable, "-P", "-c", _ROUTES_SCRIPT, str(out)],
                    input=self._config_yaml,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    env=env,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise GymStartupError(
                    f"resolving the routes of the running NeMo-Gym at {head.url} took over {timeout:.0f}s"
                ) from None
            if done.returncode != 0 or not out.exists():
                raise GymStartupError(
                    f"could not resolve the routes of the running NeMo-Gym at {head.url}:\n{done.stderr[-3000:]}"
                )
            try:
                return loads_object(read_bytes(out, _STATUS_MAX_BYTES), "the running NeMo-Gym's routes")
            except UntrustedInputError as exc:
                raise GymStartupError(
                    f"could not read the routes of the running NeMo-Gym at {head.url}: {exc}"
                ) from None

    def _probe_attached(self) -> None:
        now = time.monotonic()
        if now - self._probed_at < _PROBE_EVERY_S:
            return
        assert self.head is not None
        addresses = {"head_server": (self.head.host, self.head.port)}
        addresses.update(
            {name: (str(s["host"]), int(s["port"])) for name, s in self._status.get("servers", {}).items()}
        )
        for name, (host, port) in addresses.items():
            try:
                socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
            except OSError as exc:
                raise GymServerDied(
                    f"NeMo-Gym server {name!r} of the running Gym at {self.head.url} no longer accepts connections at "
                    f"{host}:{port} ({exc})"
                ) from None
        self._probed_at = now

    # ---- start-up ---------------------------------------------------------------------------

    def _global_config(self) -> JsonObject:
        cfg = self.config
        assert self._private_dir is not None and self._window is not None
        config_paths = [str(Path(p).absolute()) if Path(p).exists() else p for p in cfg.config_paths]
        base: JsonObject = {
            "config_paths": config_paths,
            "policy_api_key": cfg.policy_api_key.get_secret_value(),
            "default_host": cfg.host,
            "head_server": {"host": cfg.host},  # the launcher binds its port (_launcher.claim_head_port)
            "port_range_low": self._window,
            "port_range_high": self._window + PORT_WINDOW - 1,
            "skip_venv_if_present": True,
            "uv_venv_dir": str(self._private_dir / "venvs"),
            "uv_cache_dir": str(self._private_dir / "uv-cache"),
            **installed_gym().global_config,
        }
        if cfg.policy_base_urls:
            base["policy_base_url"] = list(cfg.policy_base_urls)
        if cfg.policy_model_name:
            base["policy_model_name"] = cfg.policy_model_name
        ray_address = (cfg.ray_address or _running_ray_address()) if cfg.use_ray else None
        if ray_address:
            base["ray_head_node_address"] = ray_address
        merged = deep_merge(base, cfg.overrides)
        merged.pop("nemo_gym_log_dir", None)  # Gym's tee wrapper orphans servers; logs are ours
        return merged

    def _spawn_launcher(self) -> None:
        self._status, self._procs, self.head, self._busy_port = {}, {}, None, None  # a new attempt's
        make_dir(self.log_dir)
        self._private_dir = Path(tempfile.mkdtemp(prefix="gym-bridge-servers-"))
        self._window = reserve_port_window()
        global_config = self._global_config()
        self._port_range = (int(global_config["port_range_low"]), int(global_config["port_range_high"]))
        uses_ray = "ray_head_node_address" in global_config
        spec = {
            "global_config": global_config,
            "status_file": str(self._private_dir / "status.json"),
            "venv_dir": str(self._private_dir / "venvs"),
            "log_dir": str(self.log_dir.absolute()),
            "parent_pid": os.getpid(),
            "skip_load_from_dotenv": not self.config.load_env_yaml,
            "fork_servers": self.config.fork_servers,
        }
        spec_path = self._private_dir / "launch.json"  # holds the API key: mkdtemp's folder is the owner's alone
        write_atomic(spec_path, dumps(spec), root=self._private_dir, mode=0o600)

        env = dict(os.environ)
        for key in ("NEMO_GYM_CONFIG_DICT", "NEMO_GYM_CONFIG_PATH"):
            env.pop(key, None)
        env.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env["PYTHONUNBUFFERED"] = "1"
        if not uses_ray:
            shim = make_dir(self._private_dir / "no_ray", root=self._private_dir)
            write_atomic(shim / "sitecustomize.py", _NO_RAY_SITECUSTOMIZE, root=self._private_dir)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
            env["GYM_BRIDGE_NO_RAY"] = "1"

        logger.info("NeMo-Gym server logs: %s", self.log_dir)
        cwd = self._working_dir() if self.config.server_dirs else None
        with open_append(self.launcher_log, root=self.log_dir) as log:
            self._launcher = subprocess.Popen(
                # -P: the launcher's folder stays off sys.path, so a server forked from it gets the
                # sys.path that `python app.py` would (gym/servers/_forkserver.py)
                [sys.executable, "-P", "-m", "gym_bridge.gym.servers._launcher", str(spec_path)],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._launcher_proc = psutil.Process(self._launcher.pid)

    def _working_dir(self) -> Path:
        """A folder where Gym's cwd-first lookup finds ``server_dirs`` and the caller's own server folders."""
        assert self._private_dir is not None
        root = self._private_dir / "cwd"
        here = Path.cwd()
        links = {
            f"{kind}/{d.name}": d
            for kind in installed_gym().server_types
            if (here / kind).is_dir()
            for d in (here / kind).iterdir()
            if d.is_dir()
        }
        links.update({key: Path(folder).resolve() for key, folder in self.config.server_dirs.items()})
        for key, folder in links.items():
            link = root / key
            make_dir(link.parent, root=self._private_dir)
            link.symlink_to(folder, target_is_directory=True)
        if (here / "env.yaml").exists():
            (root / "env.yaml").symlink_to(here / "env.yaml")
        return root

    def _read_status(self) -> None:
        assert self._private_dir is not None
        try:
            status = read_bytes(self._private_dir / "status.json", _STATUS_MAX_BYTES)
            self._status = loads_object(status, "the launcher's status file")
        except (OSError, UntrustedInputError):
            return
        head = self._status.get("head")
        if head and self.head is None:
            self.head = HeadServerAddress(head["host"], int(head["port"]))
        for name, server in self._status.get("servers", {}).items():
            if server.get("pid") and name not in self._procs:
                try:
                    self._procs[name] = psutil.Process(server["pid"])
                except psutil.NoSuchProcess:
                    raise self._exited(name) from None

    def _wait_until_ready(self, deadline: float) -> None:
        launcher_proc = self._launcher_proc
        assert launcher_proc is not None, "the launcher is started first"
        ready: set[str] = set()
        while True:
            self._read_status()
            for name, proc in self._procs.items():
                if not is_alive(proc):
                    raise self._exited(name)
            if self._status.get("phase") == "failed" or not is_alive(launcher_proc):
                raise self._launcher_failure()
            servers = self._status.get("servers", {})
            if self._status.get("phase") in ("spawning", "ready") and all(s.get("pid") for s in servers.values()):
                for name, s in servers.items():
                    if name not in ready and answers(s["host"], s["port"]):
                        ready.add(name)
                head, readiness = self.head, installed_gym().head_readiness_path
                if len(ready) == len(servers) and head and answers(head.host, head.port, readiness):
                    return
            if time.monotonic() >= deadline:
                waiting = [n for n in servers if n not in ready] or ["head_server"]
                raise GymStartupError(
                    "\n".join(
                        self._describe_failure(
                            name, f"was not answering after the {self.config.startup_timeout_s}s start-up deadline"
                        )
                        for name in waiting
                    )
                )
            time.sleep(_POLL_INTERVAL_S)

    # ---- diagnostics and teardown -----------------------------------------------------------

    def _describe_failure(self, name: str, what: str) -> str:
        log = self.log_files.get(name, self.launcher_log)
        return f"NeMo-Gym server {name!r} {what}; last lines of {log}:\n{tail(log)}"

    def _exited(self, name: str) -> GymStartupError:
        """The error for a server that exited during start-up: :class:`GymPortInUse` naming the address when its
        log ends in a failed bind (uvicorn: ``[Errno 98] error while attempting to bind on address``)."""
        log = self.log_files.get(name, self.launcher_log)
        bind = _BIND_FAILURE.search(tail(log))
        if bind is None:
            return GymStartupError(self._describe_failure(name, "exited during start-up"))
        port = re.search(r"(\d+)\D*$", bind.group("address"))
        self._busy_port = int(port.group(1)) if port else None
        return GymPortInUse(self._describe_failure(name, f"could not bind its port {bind.group('address')} (in use)"))

    def _chose_busy_port(self) -> bool:
        """Whether the port a server could not bind was Gym's choice in the set's port range (another choice may
        work), rather than a port the config sets outside it (which stays busy)."""
        low, high = self._port_range
        return self._busy_port is None or low <= self._busy_port <= high

    def _launcher_failure(self) -> GymStartupError:
        error = self._status.get("error") or ""
        match = re.search(r"Process `([^`]+)` finished unexpectedly", error)
        if match and match.group(1) in self.log_files:
            return self._exited(match.group(1))
        summary = self._status.get("summary") or "the launcher exited"
        failure = GymPortInUse if str(summary).startswith(GymPortInUse.__name__) else GymStartupError
        return failure(
            f"NeMo-Gym failed before the servers were up: {summary}; "
            f"last lines of {self.launcher_log}:\n{tail(self.launcher_log)}"
        )

    def _processes(self) -> list[psutil.Process]:
        """The launcher, its descendants, the known servers and anything left in its process group."""
        found: dict[int, psutil.Process] = {}
        roots = [p for p in [self._launcher_proc, *self._procs.values()] if p is not None]
        for root in roots:
            if is_alive(root):
                found[root.pid] = root
                with contextlib.suppress(psutil.Error):
                    found.update((c.pid, c) for c in root.children(recursive=True))
        if self._launcher is not None:
            for proc in psutil.process_iter():
                try:
                    if proc.pid not in found and os.getpgid(proc.pid) == self._launcher.pid:
                        found[proc.pid] = proc
                except (OSError, psutil.Error):
                    continue
        return list(found.values())

    def _signal(self, procs: list[psutil.Process], signum: int) -> None:
        if self._launcher is not None:
            with contextlib.suppress(OSError):
                os.killpg(self._launcher.pid, signum)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signum)
