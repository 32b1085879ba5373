"""A multi-node Ray cluster on one machine, started with the ``ray`` CLI: a head and worker nodes, each its
own raylet, each with a custom resource that pins actors to it; one node can be killed mid-run.

Every node gets its own short ``--temp-dir`` (Ray's sockets live under it and a Unix socket path is limited
to ~107 bytes) and explicit, free ports for everything it opens, so two raylets on one host never race for
a default port, and the raylet does not wait on its agents' port files (a fixed 15 s that a loaded machine
misses). A node's processes are the ones whose command line names its temp dir, plus the raylet's
children (the Ray workers): :meth:`LocalRayCluster.kill_node` SIGKILLs exactly those, and ``stop`` ends
each node's processes and their descendants, never another Ray on the machine (``ray stop`` would).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from gym_bridge.failures import GymBridgeError, SettingError
from gym_bridge.gym.servers.reaper import free_ports

logger = logging.getLogger(__name__)

_SOCKET_DIR_BUDGET = 44
"""Longest node temp dir: Ray appends ~62 bytes (session name, ``sockets/plasma_store``) to it, and a Unix
socket path holds 107."""
_START_ATTEMPTS = 3
_RETRIED_START_FAULTS = ("timed out during startup", "same port is used by multiple components")
"""``ray start`` output that a fresh attempt (new temp dir, new ports) can clear: a slow start on a loaded
machine, or a chosen port another process took before Ray bound it."""
_RAY_ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",  # under `uv run`, Ray would ship the working directory to workers
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # a token file in ~/.ray would otherwise switch a joining node to token auth
    # A second node needs Ray's multi-machine switch, which init_ray turns off for its loopback Ray
    # (gym_bridge.ray_utils.LOOPBACK_FLAG); on, Ray gives every node the routable address and wildcard binds.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
}


class LocalClusterError(GymBridgeError, RuntimeError):
    """A node of a :class:`LocalRayCluster` did not start, register, connect or stop in time (names the node)."""


@dataclass(frozen=True)
class NodeSpec:
    """One node: its custom resource (``{name: 1}``, which pins actors to it), CPUs and object store."""

    name: str
    num_cpus: int = 1
    object_store_memory: int = 100 * 1024**2

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise SettingError(f"NodeSpec.name must be an identifier (it is a Ray resource name), got {self.name!r}")
        if self.num_cpus < 0:
            raise SettingError(f"NodeSpec.num_cpus must be >= 0, got {self.num_cpus}")


@dataclass
class ClusterNode:
    """A started node: its spec, temp dir, raylet process and Ray node id."""

    spec: NodeSpec
    temp_dir: Path
    head: bool
    raylet_pid: int = 0
    node_id: str = ""
    killed: bool = False

    def processes(self) -> list[psutil.Process]:
        """This node's live processes: those naming its temp dir, and the raylet's children (Ray's workers)."""
        marker = str(self.temp_dir)
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["cmdline"]):
            if marker in " ".join(proc.info["cmdline"] or ()):
                found[proc.pid] = proc
        raylet = _process(self.raylet_pid) if self.raylet_pid else None
        if raylet is not None:
            found.update({child.pid: child for child in _children(raylet, recursive=False)})
        return list(found.values())


class LocalRayCluster:
    """Start ``nodes`` (the first is the head) with ``ray start``; connect, kill a node, stop everything.

    Use it as a context manager: ``with LocalRayCluster([NodeSpec("node_a"), NodeSpec("node_b")]) as c:
    c.connect(); ...``. Every wait is bounded; a failure raises :class:`LocalClusterError` naming the node
    and its log folder.
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        *,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 30.0,
        term_grace_s: float = 3.0,
        health_check_period_ms: int = 1000,
        health_check_failure_threshold: int = 5,
    ) -> None:
        if not nodes:
            raise SettingError("LocalRayCluster needs at least one node")
        names = [spec.name for spec in nodes]
        if len(set(names)) != len(names):
            raise SettingError(f"node names must be distinct, got {names}")
        self.specs = list(nodes)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.term_grace_s = term_grace_s
        # The GCS declares a dead raylet's node dead after threshold x period (Ray's default: 5 x 3 s).
        self.system_config = {
            "health_check_period_ms": health_check_period_ms,
            "health_check_failure_threshold": health_check_failure_threshold,
        }
        self.nodes: dict[str, ClusterNode] = {}
        self.port = 0
        self._root: Path | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address workers and drivers join (``127.0.0.1:<port>``)."""
        if not self.port:
            raise LocalClusterError("the cluster is not started")
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> LocalRayCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the head, then each worker node; each ``ray start`` returns once its node registered."""
        root = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
        self._root = Path(tempfile.mkdtemp(prefix="gbray-", dir=root))
        try:
            for i, spec in enumerate(self.specs):
                self._start_node(spec, head=i == 0)
        except BaseException:
            self.stop()
            raise

    def connect(self, timeout_s: float = 60.0) -> None:
        """``ray.init`` this process onto the cluster and wait until every node is alive in ``ray.nodes()``."""
        import ray

        from gym_bridge.ray_utils import apply_ray_env

        apply_ray_env()
        if ray.is_initialized():
            raise LocalClusterError("this process is already connected to a Ray; ray.shutdown() it first")
        ray.init(address=self.address, logging_level=logging.WARNING)
        deadline = time.monotonic() + timeout_s
        while missing := set(self.alive_node_ids()) ^ {n.node_id for n in self.nodes.values() if not n.killed}:
            if time.monotonic() >= deadline:
                raise LocalClusterError(f"nodes not alive in ray.nodes() within {timeout_s}s: {sorted(missing)}")
            time.sleep(0.1)

    def alive_node_ids(self) -> list[str]:
        """The node ids the GCS reports alive (needs :meth:`connect`)."""
        import ray

        return [n["NodeID"] for n in ray.nodes() if n["Alive"]]

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL a worker node's Ray processes (raylet, agents, workers) as a crashed machine would lose them.

        Processes the workers started themselves (NeMo-Gym's servers) are left to their own reaping.
        Returns the killed pids.
        """
        node = self._node(name)
        if node.head:
            raise LocalClusterError(f"node {name!r} is the head; killing it ends the cluster, use stop()")
        procs = node.processes()
        for proc in procs:
            _signal(proc, signal.SIGKILL)
        _, alive = psutil.wait_procs(procs, timeout=self.stop_timeout_s)
        if alive:
            raise LocalClusterError(f"node {name!r}: processes survived SIGKILL: {[p.pid for p in alive]}")
        node.killed = True
        logger.info("killed node %s (%s): pids %s", name, node.node_id, sorted(p.pid for p in procs))
        return [p.pid for p in procs]

    def stop(self) -> None:
        """Disconnect this process if it joined, stop the worker nodes then the head, remove the temp dirs."""
        try:
            self._disconnect()
        finally:
            leftovers = []
            for node in sorted(self.nodes.values(), key=lambda n: n.head):
                leftovers += self._stop_node(node)
            self.nodes = {}
            self.port = 0
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                self._root = None
            if leftovers:
                raise LocalClusterError(f"processes survived the cluster's stop: {leftovers}")

    def processes(self) -> list[psutil.Process]:
        """Every live process of every node, with their descendants."""
        return [p for node in self.nodes.values() for p in _with_descendants(node.processes())]

    # ---- internals -----------------------------------------------------------------------------

    def _node(self, name: str) -> ClusterNode:
        if name not in self.nodes:
            raise LocalClusterError(f"no node {name!r}; nodes: {sorted(self.nodes)}")
        return self.nodes[name]

    def _start_node(self, spec: NodeSpec, *, head: bool) -> None:
        assert self._root is not None
        for attempt in range(1, _START_ATTEMPTS + 1):
            node = ClusterNode(spec, Path(tempfile.mkdtemp(prefix=f"{spec.name[:4]}", dir=self._root)), head)
            if len(str(node.temp_dir)) > _SOCKET_DIR_BUDGET:
                raise LocalClusterError(f"node {spec.name!r}: temp dir {node.temp_dir} is too long for Ray's sockets")
            self.nodes[spec.name] = node
            result = self._run_ray_start(node)
            if result.returncode == 0:
                self._find_raylet(node)
                logger.info("started %s node %s (%s)", "head" if head else "worker", spec.name, node.node_id)
                return
            self._stop_node(node)
            del self.nodes[spec.name]
            output = (result.stdout or "")[-3000:]
            if attempt == _START_ATTEMPTS or not any(fault in output for fault in _RETRIED_START_FAULTS):
                raise LocalClusterError(
                    f"`ray start` of node {spec.name!r} failed (exit {result.returncode}); logs under "
                    f"{node.temp_dir}/session_latest/logs:\n{output}"
                )
            logger.warning(
                "node %s did not start; attempt %d of %d:\n%s", spec.name, attempt + 1, _START_ATTEMPTS, output
            )

    def _run_ray_start(self, node: ClusterNode) -> subprocess.CompletedProcess[str]:
        spec = node.spec
        # Explicit ports, all distinct: no race for Ray's defaults with a second raylet, no wait on port files.
        ports = iter(free_ports("127.0.0.1", 9 if node.head else 6))
        if node.head:
            self.port = next(ports)
        args = [
            sys.executable, "-m", "ray.scripts.scripts", "start",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={spec.num_cpus}",
            f"--resources={json.dumps({spec.name: 1})}",
            f"--object-store-memory={spec.object_store_memory}",
            f"--temp-dir={node.temp_dir}",
            "--disable-usage-stats",
            f"--node-manager-port={next(ports)}",
            f"--object-manager-port={next(ports)}",
            f"--dashboard-agent-listen-port={next(ports)}",
            f"--dashboard-agent-grpc-port={next(ports)}",
            f"--metrics-export-port={next(ports)}",
            f"--runtime-env-agent-port={next(ports)}",
        ]  # fmt: skip
        if node.head:
            args += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--dashboard-port={next(ports)}",
                f"--ray-client-server-port={next(ports)}",
                f"--system-config={json.dumps(self.system_config)}",
            ]
        else:
            args.append(f"--address={self.address}")
        env = {**os.environ, **_RAY_ENV}
        env.pop("RAY_ADDRESS", None)
        try:
            return subprocess.run(
                args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                timeout=self.start_timeout_s, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            self._stop_node(node)
            raise LocalClusterError(
                f"`ray start` of node {spec.name!r} did not return within {self.start_timeout_s}s; logs under "
                f"{node.temp_dir}/session_latest/logs"
            ) from exc

    def _find_raylet(self, node: ClusterNode) -> None:
        marker = f"--temp_dir={node.temp_dir}"
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if cmdline and cmdline[0].endswith("/raylet") and marker in cmdline:
                node.raylet_pid = proc.pid
                node.node_id = next(a.split("=", 1)[1] for a in cmdline if a.startswith("--node_id="))
                return
        raise LocalClusterError(f"node {node.spec.name!r}: `ray start` succeeded but no raylet names {node.temp_dir}")

    def _stop_node(self, node: ClusterNode) -> list[int]:
        """SIGTERM the node's processes and their descendants, SIGKILL what is left after ``term_grace_s``."""
        procs = _with_descendants(node.processes())
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=self.term_grace_s)
        for proc in alive:  # the GCS and Ray's monitor can take tens of seconds to honour SIGTERM
            logger.debug("node %s: pid %d still up after SIGTERM; killing it", node.spec.name, proc.pid)
            _signal(proc, signal.SIGKILL)
        _, alive = psutil.wait_procs(alive, timeout=self.stop_timeout_s)
        return [p.pid for p in alive]

    def _disconnect(self) -> None:
        """``ray.shutdown`` when this process is connected to this cluster (before its GCS goes away)."""
        import ray

        if not (self.port and ray.is_initialized()):
            return
        gcs = ray.get_runtime_context().gcs_address
        if gcs.rsplit(":", 1)[-1] == str(self.port):
            ray.shutdown()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _children(proc: psutil.Process, *, recursive: bool) -> list[psutil.Process]:
    try:
        return proc.children(recursive=recursive)
    except psutil.NoSuchProcess:
        return []


def _with_descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    found = {p.pid: p for p in procs}
    for proc in procs:
        found.update({child.pid: child for child in _children(proc, recursive=True)})
    return list(found.values())


def _signal(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        proc.send_signal(sig)
