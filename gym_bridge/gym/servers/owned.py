"""A set of NeMo-Gym servers this process launches and stops, with a deadline, logs per server and no leftovers.

It raises ``GymStartupError`` and ``GymServerDied`` (both ``GymServersError``; the tree is drawn in
:mod:`gym_bridge.failures`).

Each :class:`OwnedGym` runs Gym's own ``RunHelper`` in a launcher process of its own session (see
:mod:`gym_bridge.gym.servers._launcher`); every Gym server is a child of it, so the whole set is one process group
that :meth:`OwnedGym.stop` signals, SIGTERM then SIGKILL. The servers run on this interpreter's environment: Gym's
per-server venvs are prepared as links to ``sys.prefix`` and nothing is installed. The config lives in
:mod:`gym_bridge.gym.servers.server_config`, the cleanup registry and process checks in
:mod:`gym_bridge.gym.servers.reaper`.

Every file it touches goes through the trust boundary (:mod:`gym_bridge.boundary.files`): the log folder is made as
the user named it, a log is appended to only through a descriptor that refuses a link or a second hard link, and
the launch spec and the status file are written whole and read under a size cap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import make_dir, open_append, read_bytes, write_atomic
from gym_bridge.boundary.json_io import dumps, loads_object
from gym_bridge.failures import (
    GymPortInUse,
    GymServerDied,
    GymServersError,
    GymStartupError,
)
from gym_bridge.gym.protocol.token_capture import CAPTURE_KEY, with_capture_dir
from gym_bridge.gym.servers._launcher import log_path_of
from gym_bridge.gym.servers.gym_set import CaptureStore, GymSet
from gym_bridge.gym.servers.reaper import (
    PORT_WINDOW,
    answers,
    is_alive,
    register_live,
    release,
    reserve_port_window,
    tail,
    wait_gone,
)
from gym_bridge.gym.servers.restarts import restart_seen
from gym_bridge.gym.servers.running import read_global_config
from gym_bridge.gym.servers.server_config import GymServersConfig, HeadServerAddress, deep_merge
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
_STATUS_MAX_BYTES = 64 << 20
"""The largest status file read back from the launcher (its servers and routes: kilobytes)."""


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


class OwnedGym(GymSet):
    """A set of NeMo-Gym servers launched here: ``start()`` returns the head server's address once every server
    answers ``GET /`` and the head server says it is ready (``GET /readyz`` from Gym 0.7 on); ``stop()`` is
    idempotent and leaves no process behind.

    With ``token_id_capture`` switched on in its overrides, the capture store's folder is set here (the block's
    ``dir``, else ``<log_dir>/token-captures``, else a fresh temporary folder) before anything starts."""

    def __init__(self, config: GymServersConfig) -> None:
        default_dir = config.log_dir / "token-captures" if config.log_dir else None
        overrides, capture_dir = with_capture_dir(config.overrides, default_dir)
        if capture_dir is not None:
            config = config.model_copy(update={"overrides": overrides})
        super().__init__(config)
        self._capture = CaptureStore(capture_dir, overrides[CAPTURE_KEY]) if capture_dir is not None else None
        self._launcher: subprocess.Popen[bytes] | None = None
        self._launcher_proc: psutil.Process | None = None
        self._private_dir: Path | None = None
        self._window: int | None = None
        self._procs: dict[str, psutil.Process] = {}
        self.restarts: dict[str, int] = {}
        """Restarts per server that answered again (counted in ``rollout/gym_server_restarts``)."""
        self._busy_port: int | None = None
        self._port_range = (0, -1)

    @property
    def attached(self) -> bool:
        return False

    @property
    def token_capture(self) -> CaptureStore | None:
        return self._capture

    @property
    def log_files(self) -> dict[str, Path]:
        """Server name -> its log file (the head server's is ``launcher_log``)."""
        return {name: log_path_of(self.log_dir, name) for name in self._servers()}

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
        if self._launcher is not None:
            raise GymServersError("GymServers.start() was already called")
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
            self._served_config = read_global_config(self.head).config
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
        """Check every server: one that exited and is being started again (or is not answering since) raises
        :class:`GymServerRestarting`; one past its last restart :class:`GymServerCrashLoop`; the head server gone
        (the launcher exited) :class:`GymServerDied`. Each names the server and its log in one line."""
        if self._launcher is None:
            raise GymServersError("GymServers is not started")
        if not (self._launcher_proc and is_alive(self._launcher_proc)):
            raise GymServerDied(self._describe_failure("head_server", "is no longer running (launcher exited)"))
        for name, proc in list(self._procs.items()):
            if not is_alive(proc):
                self._read_status(restarted=True)
                proc = self._procs[name]
            entry = self._status.get("servers", {}).get(name, {})
            log = self.log_files.get(name, self.launcher_log)
            seen = restart_seen(name, entry, is_alive(proc), self.restarts.get(name, 0), self.config.max_restarts, log)
            if seen != self.restarts.get(name, 0):
                self.restarts[name] = seen
                logger.warning("NeMo-Gym server %r answers again after restart %d (log: %s)", name, seen, log)

    def stop(self) -> None:
        """Stop every process of this set: SIGTERM to the group, SIGKILL after ``shutdown_timeout_s``."""
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
        self.restarts = {}
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
            "max_restarts": self.config.max_restarts,
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

    def _read_status(self, *, restarted: bool = False) -> None:
        """The launcher's status file read again: the head's address and each server's process (``restarted``: a
        server's new process after a restart replaces its old one; during start-up an exited one is an error)."""
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
            known = self._procs.get(name)
            if server.get("pid") and (known is None or (restarted and known.pid != server["pid"])):
                try:
                    self._procs[name] = psutil.Process(server["pid"])
                except psutil.NoSuchProcess:
                    if not restarted:
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
