"""The one surface of a Gym server set, whether this process launched it or attached to a running one.

:class:`GymSet` is what every caller of a set uses: ``start`` (the head server's address once every server answers),
the servers' addresses, types and implementations, Gym's routes and its served config, ``poll`` (a dead server raised
as :class:`~gym_bridge.failures.GymServerDied`) and ``stop``. Two classes implement it:
:class:`~gym_bridge.gym.servers.owned.OwnedGym` launches the set and stops it, and
:class:`~gym_bridge.gym.servers.attached.AttachedGym` reads a running Gym from its head server and stops nothing;
:func:`~gym_bridge.gym.servers.server_set.GymServers` chooses one from the config, once.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from gym_bridge.gym.servers.reaper import next_instance_index
from gym_bridge.gym.servers.server_config import GymServersConfig, HeadServerAddress
from gym_bridge.json_types import JsonObject


@dataclass(frozen=True)
class CaptureStore:
    """Where a set's Gym writes its token-id captures (``token_id_capture.dir``; None: its config names none) and
    the ``token_id_capture`` block it runs with."""

    folder: Path | None
    block: JsonObject


class GymSet(ABC):
    """One set of NeMo-Gym servers (head server, models, agents, resources and environment servers).

    ``start()`` returns the head server's address once every server answers; ``stop()`` is idempotent and never
    raises. Usable as a context manager. The server table (``_status["servers"]``: name -> host, port, type, impl,
    pid) and the served config are filled in by ``start``.
    """

    def __init__(self, config: GymServersConfig) -> None:
        self.config = config
        self._index = next_instance_index()
        self.log_dir: Path = config.log_dir or Path.cwd() / "gym-logs" / (
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._index}"
        )
        self.head: HeadServerAddress | None = None
        self._status: JsonObject = {}
        self._served_config: JsonObject = {}

    # ---- what every set does --------------------------------------------------------------------

    @abstractmethod
    def start(self) -> HeadServerAddress:
        """Start (or attach to) the set and return the head server's address once every server answers.

        Raises:
            GymStartupError: a server did not answer by ``startup_timeout_s`` (named).
        """

    @abstractmethod
    def poll(self) -> None:
        """Raise :class:`~gym_bridge.failures.GymServerDied` naming a server that is no longer running."""

    @abstractmethod
    def stop(self) -> None:
        """Stop what this object started; idempotent, never raises."""

    @abstractmethod
    def pids(self) -> set[int]:
        """Every process of this set that this object started and that is still running."""

    @property
    @abstractmethod
    def server_pids(self) -> dict[str, int]:
        """Server name -> the process id this object watches."""

    @property
    @abstractmethod
    def attached(self) -> bool:
        """Whether this set is a running Gym this object attached to (and neither started nor stops)."""

    @property
    @abstractmethod
    def token_capture(self) -> CaptureStore | None:
        """Where the set's Gym writes its token-id captures (None: capture is off), known once ``start`` returned."""

    # ---- what every set knows once started ----------------------------------------------------------

    @property
    def server_urls(self) -> dict[str, str]:
        return {name: f"http://{s['host']}:{s['port']}" for name, s in self._servers().items()}

    @property
    def global_config(self) -> JsonObject:
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
        return {name: s.get("impl") for name, s in self._servers().items()}

    @property
    def server_types(self) -> dict[str, str | None]:
        """Each server's Gym type: ``responses_api_agents``, ``resources_servers`` or ``responses_api_models``."""
        return {name: s.get("server_type") for name, s in self._servers().items()}

    @property
    def routes(self) -> JsonObject:
        """Where the set's config sends rows, as Gym's own code resolved it
        (:mod:`gym_bridge.gym.servers._gym_routes`)."""
        routes = self._status.get("routes")
        return routes if isinstance(routes, dict) else {}

    def _servers(self) -> dict[str, JsonObject]:
        """The server table: name -> ``host``, ``port``, ``server_type``, ``impl``, ``pid``."""
        servers = self._status.get("servers")
        return servers if isinstance(servers, dict) else {}

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
