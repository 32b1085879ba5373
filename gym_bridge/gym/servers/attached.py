"""A NeMo-Gym that is already running (``gym env start``, ``ng_run``, another tool's), used and never stopped.

:class:`AttachedGym` starts as ``gym eval run --no-serve`` does: it waits (bounded) until the head server says it is
ready, reads its servers (``GET /server_instances``) and config (``GET /global_config_dict_yaml``) with the readers of
:mod:`gym_bridge.gym.servers.running`, resolves the routes of that config with Gym's own resolver
(:mod:`gym_bridge.gym.servers._gym_routes`, in a process of its own: this process never imports NeMo-Gym), and
checks that every server answers. :meth:`AttachedGym.poll` checks that its servers still accept connections;
:meth:`AttachedGym.stop` stops nothing: the Gym's owner started it and stops it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import read_bytes
from gym_bridge.boundary.json_io import loads_object
from gym_bridge.failures import GymServerDied, GymServersError, GymStartupError
from gym_bridge.gym.protocol.token_capture import capture_block
from gym_bridge.gym.servers.gym_set import CaptureStore, GymSet
from gym_bridge.gym.servers.reaper import answers
from gym_bridge.gym.servers.running import read_global_config, read_head
from gym_bridge.gym.servers.server_config import GymServersConfig, HeadServerAddress, head_address
from gym_bridge.gym_versions import installed_gym
from gym_bridge.json_types import JsonMapping, JsonObject

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.25
_PROBE_TIMEOUT_S = 0.5
"""The bound on one TCP connect to a server of a running Gym (:meth:`AttachedGym.poll`)."""
_PROBE_EVERY_S = 2.0
"""How often :meth:`AttachedGym.poll` probes a running Gym's servers at most (a good probe is trusted this long)."""
_ROUTES_MIN_S = 60.0
"""The least time the routes of a running Gym's config get (Gym's resolver imports NeMo-Gym: seconds)."""
_ROUTES_MAX_BYTES = 64 << 20
"""The largest routes file read back from Gym's resolver (kilobytes, usually)."""

_ROUTES_SCRIPT = """
import sys
from omegaconf import OmegaConf
from gym_bridge.boundary.files import write_atomic
from gym_bridge.boundary.json_io import dumps
from gym_bridge.gym.servers._gym_routes import gym_routes
write_atomic(sys.argv[1], dumps(gym_routes(OmegaConf.create(sys.stdin.read()))))
"""
"""Gym's own resolver over a running Gym's config, in a process of its own: the caller never imports NeMo-Gym."""


class AttachedGym(GymSet):
    """The running Gym whose head server is at ``config.head_url``: read, watched, and left running."""

    def __init__(self, config: GymServersConfig) -> None:
        super().__init__(config)
        self._attached = False
        self._config_yaml = ""
        self._probed_at = -_PROBE_EVERY_S

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def server_pids(self) -> dict[str, int]:
        """None: the running Gym's processes are its owner's."""
        return {}

    def pids(self) -> set[int]:
        return set()

    @property
    def token_capture(self) -> CaptureStore | None:
        """The running Gym's own ``token_id_capture`` block (its config's), read from its file store ``dir``."""
        block = capture_block(self._served_config)
        if block is None:
            return None
        folder = block.get("dir")
        return CaptureStore(Path(str(folder)) if folder else None, block)

    def start(self) -> HeadServerAddress:
        """Use the Gym whose head server is at ``head_url``, as ``gym eval run --no-serve`` does: wait (bounded) until
        the head server says it is ready, read its config and servers, resolve the routes, and check every server
        answers.

        Raises:
            GymStartupError: the head server or a server did not answer by ``startup_timeout_s``, or its config
                could not be read or resolved (named).
        """
        if self._attached:
            raise GymServersError("GymServers.start() was already called")
        assert self.config.head_url is not None, "an AttachedGym is made for a head_url"
        head = head_address(self.config.head_url)
        started = time.monotonic()
        deadline = started + self.config.startup_timeout_s
        readiness = installed_gym().head_readiness_path
        self._wait_for(
            lambda: answers(head.host, head.port, readiness),
            deadline,
            f"the running NeMo-Gym's head server at {head.url} did not answer GET {readiness} with 200",
        )
        served = read_global_config(head)
        self._served_config, self._config_yaml = served.config, served.yaml
        servers = self._read_servers(head)
        self._status = {"phase": "ready", "servers": servers}
        self._status["routes"] = self._resolve_routes(head, deadline)
        for name, server in servers.items():
            self._wait_for(
                partial(answers, str(server["host"]), int(server["port"])),
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
        self._warn_if_other_policy()
        return head

    def poll(self) -> None:
        """Raise :class:`GymServerDied` naming a server (or the head server) that no longer accepts connections,
        probed at most every :data:`_PROBE_EVERY_S` while all answer."""
        if not self._attached:
            raise GymServersError("GymServers is not started")
        now = time.monotonic()
        if now - self._probed_at < _PROBE_EVERY_S:
            return
        assert self.head is not None
        addresses = {"head_server": (self.head.host, self.head.port)}
        addresses.update({name: (str(s["host"]), int(s["port"])) for name, s in self._servers().items()})
        for name, (host, port) in addresses.items():
            try:
                socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
            except OSError as exc:
                raise GymServerDied(
                    f"NeMo-Gym server {name!r} of the running Gym at {self.head.url} no longer accepts connections at "
                    f"{host}:{port} ({exc})"
                ) from None
        self._probed_at = now

    def stop(self) -> None:
        """Leave the running Gym running: nothing of it was started here."""
        if self._attached:
            self._attached = False
            logger.info("left the running NeMo-Gym at %s running", self.head.url if self.head else self.config.head_url)

    def _wait_for(self, check: Callable[[], bool], deadline: float, what: str) -> None:
        while not check():
            if time.monotonic() >= deadline:
                raise GymStartupError(f"{what} within the {self.config.startup_timeout_s}s start-up deadline")
            time.sleep(_POLL_INTERVAL_S)

    def _read_servers(self, head: HeadServerAddress) -> dict[str, JsonObject]:
        """The running Gym's servers from ``/server_instances``: name -> type, impl, host, port, pid."""
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
        return servers

    def _instance_address(self, name: str, instance: JsonMapping, head: HeadServerAddress) -> tuple[str, int]:
        """Where a running Gym's server listens: ``/server_instances``' host and port, else its block of the config;
        a wildcard host (``0.0.0.0``) is reached at the head server's host."""
        host, port = instance.get("host"), instance.get("port")
        if not host or not port:
            inner: object = self._served_config.get(name)
            for _ in range(2):
                inner = next(iter(inner.values()), None) if isinstance(inner, dict) and inner else None
            if isinstance(inner, dict):
                host, port = host or inner.get("host"), port or inner.get("port")
        if not port:
            raise GymStartupError(f"the running NeMo-Gym at {head.url} names no port for its server {name!r}")
        if not host or host in ("0.0.0.0", "::"):
            host = head.host
        return str(host), int(port)

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
                return loads_object(read_bytes(out, _ROUTES_MAX_BYTES), "the running NeMo-Gym's routes")
            except UntrustedInputError as exc:
                raise GymStartupError(
                    f"could not read the routes of the running NeMo-Gym at {head.url}: {exc}"
                ) from None

    def _warn_if_other_policy(self) -> None:
        """A warning when the running Gym's model server calls other endpoints than the ones this set was given
        (``policy_base_urls``: preflighted and watched by the caller) or asks them for another model name."""
        if not self.config.policy_base_urls:
            return
        config = self._served_config
        theirs = config.get("policy_base_url")
        theirs_list = [theirs] if isinstance(theirs, str) else list(theirs) if isinstance(theirs, list) else []
        ours = self.config.policy_base_urls
        if sorted(u.rstrip("/") for u in map(str, theirs_list)) != sorted(u.rstrip("/") for u in ours):
            logger.warning(
                "the running NeMo-Gym at %s calls the endpoints %s (its policy_base_url), not base_urls %s: those "
                "were preflighted and are watched, Gym's model server calls its own",
                self.config.head_url,
                theirs_list,
                ours,
            )
        model = config.get("policy_model_name")
        if isinstance(model, str) and model != self.config.policy_model_name:
            logger.warning(
                "the running NeMo-Gym at %s asks its endpoints for model %r, not model_name %r",
                self.config.head_url,
                model,
                self.config.policy_model_name,
            )
