"""Real NeMo-Gym servers from the installed wheel: start, inspect, fail, stop. No mocks."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from gym_bridge.failures import GymPortInUse, GymServerCrashLoop, GymStartupError
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.servers.owned import OwnedGym
from gym_bridge.gym.servers.server_config import GymServersConfig
from gym_bridge.gym_versions import installed_gym
from gym_bridge.testing import wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.gym]

_CONFIGS = [
    "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
]
_SERVERS = {"policy_model", "example_single_tool_call", "example_single_tool_call_simple_agent"} | (
    {"example_single_tool_call_environment_server"} if installed_gym().relays_per_agent else set()  # Gym's relay
)
# Set B: the tool resources server alone, to keep the module's start-up short on 2 cores.
_TOOL_SERVER = {
    "example_single_tool_call": {
        "resources_servers": {
            "example_single_tool_call": {"entrypoint": "app.py", "domain": "agent", "verified": False}
        }
    }
}
_INSTALL_MARKERS = ("Installed ", "Resolved ", "uv venv", "uv pip", "Creating virtual environment")


def _unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(log_dir: Path, **kwargs) -> GymServersConfig:
    return GymServersConfig(
        config_paths=[str(wheel_config_path(p)) for p in _CONFIGS],
        policy_base_urls=[f"http://127.0.0.1:{_unused_port()}/v1"],
        policy_model_name="test-model",
        log_dir=log_dir,
        startup_timeout_s=150,
        shutdown_timeout_s=15,
        **kwargs,
    )


def _get(host: str, port: int, path: str = "/") -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket ``pid`` or its children listen on."""
    proc = psutil.Process(pid)
    found = set()
    for p in [proc, *proc.children(recursive=True)]:
        found |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return found


@pytest.fixture(scope="module")
def two_sets(ray_session, tmp_path_factory):
    """Two server sets started at once: A (model, agent, tools) joins the session's Ray; B (tools) skips Ray."""
    root = tmp_path_factory.mktemp("gym-servers")
    a = OwnedGym(_config(root / "a"))
    b = OwnedGym(
        GymServersConfig(overrides=_TOOL_SERVER, log_dir=root / "b", startup_timeout_s=150, use_ray=False, max_restarts=0)
    )
    errors: list[BaseException] = []
    timings: dict[str, float] = {}

    def start(name: str, servers: OwnedGym) -> None:
        t0 = time.monotonic()
        try:
            servers.start()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
        timings[name] = time.monotonic() - t0

    threads = [threading.Thread(target=start, args=(n, s)) for n, s in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"start-up (concurrent): {timings}")
    try:
        if errors:
            raise errors[0]
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_head_servers_answer_on_loopback_not_11000(two_sets):
    for servers in two_sets:
        head = servers.head
        assert head is not None and head.host == "127.0.0.1" and head.port != 11000
        status, body = _get(head.host, head.port, "/server_instances")
        assert status == 200
        for name in _names(servers):
            assert name in body
    assert two_sets[0].head.port != two_sets[1].head.port


def _names(servers: OwnedGym) -> set[str]:
    return _SERVERS if "policy_model" in servers.server_urls else {"example_single_tool_call"}


def test_every_server_alive_and_listening_on_loopback(two_sets):
    a, b = two_sets
    for servers in two_sets:
        assert set(servers.server_pids) == _names(servers)
        servers.poll()
        for name, pid in servers.server_pids.items():
            assert _alive(pid), name
            url_port = int(servers.server_urls[name].rsplit(":", 1)[1])
            listening = _listening(pid)
            assert ("127.0.0.1", url_port) in listening, (name, listening)
            assert [ip for ip, port in listening if port == url_port] == ["127.0.0.1"]
            if servers is b:  # a Ray driver's own gRPC port (set A) listens on all interfaces
                assert {ip for ip, _ in listening} == {"127.0.0.1"}, (name, listening)
            assert _get("127.0.0.1", url_port)[0] == 200
            # forked from the launcher's fork server, in the server's own folder, as `cd DIR && python app.py`
            server = psutil.Process(pid)
            assert "multiprocessing.forkserver" in " ".join(server.cmdline()), server.cmdline()
            assert server.parent().ppid() == servers._launcher.pid
            assert Path(server.cwd()).parent.name == servers.server_types[name], server.cwd()
        head_listeners = {(ip, port) for ip, port in _listening(servers._launcher.pid) if port == servers.head.port}
        assert head_listeners == {("127.0.0.1", servers.head.port)}


def test_two_sets_use_disjoint_ports(two_sets):
    a, b = two_sets
    ports = [{int(u.rsplit(":", 1)[1]) for u in s.server_urls.values()} | {s.head.port} for s in (a, b)]
    assert len(ports[0]) == len(_SERVERS) + 1 and len(ports[1]) == 2
    assert not ports[0] & ports[1]


def test_logs_per_server_and_no_installs(two_sets):
    site_packages = wheel_config_path("nemo_gym").parent
    for servers in two_sets:
        assert set(servers.log_files) == _names(servers)
        for name, log in servers.log_files.items():
            assert log.parent == servers.log_dir
            text = log.read_text()
            assert "Uvicorn running on http://127.0.0.1" in text, (name, text)
            assert not [m for m in _INSTALL_MARKERS if m in text], (name, text)
        links = list(servers.venv_dir.glob("*/*/.venv"))
        assert len(links) == len(_names(servers))
        for link in links:
            assert link.is_symlink() and link.resolve() == Path(sys.prefix).resolve()
    for rel in ("responses_api_models/vllm_model", "responses_api_agents/simple_agent"):
        assert not (site_packages / rel / ".venv").exists()
        assert not (Path.cwd() / rel / ".venv").exists()


def test_ray_joined_not_started(two_sets):
    import ray

    gcs = ray.get_runtime_context().gcs_address
    a, b = two_sets
    assert f"Connecting to Ray cluster at specified address: {gcs}" in a.launcher_log.read_text()
    for log in a.log_files.values():
        assert "NeMo Gym is starting a new Ray cluster" not in log.read_text()
    assert "Ray already initialized" in b.launcher_log.read_text()
    for log in b.log_files.values():  # Gym 0.7's servers touch Ray only if they use it; none may start or join one
        text = log.read_text()
        assert "starting a new Ray cluster" not in text and "Connecting to Ray cluster" not in text


def test_poll_names_a_dead_server_then_stop_leaves_nothing(two_sets):
    a, b = two_sets
    victim = b.server_pids["example_single_tool_call"]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: not _alive(victim), 10, "the killed server is gone", poll_s=0.1)
    with pytest.raises(GymServerCrashLoop, match=r"'example_single_tool_call' exited .*restart \(0 of 0\); its log: "):
        b.poll()  # B allows no restart
    a.poll()

    pids = a.pids() | b.pids()
    ports = [(s.head.port, [int(u.rsplit(":", 1)[1]) for u in s.server_urls.values()]) for s in (a, b)]
    assert len(pids) >= len(_SERVERS) + 2
    t0 = time.monotonic()
    a.stop()
    b.stop()
    print(f"stop both: {time.monotonic() - t0:.1f}s")
    assert not [pid for pid in pids if _alive(pid)]
    for head_port, server_ports in ports:
        for port in [head_port, *server_ports]:
            with pytest.raises(OSError):
                _get("127.0.0.1", port)
    a.stop()  # idempotent


def _assert_nothing_left(servers: OwnedGym, launcher_pid: int | None) -> None:
    assert servers.pids() == set()
    if launcher_pid is not None:
        assert not _alive(launcher_pid)
    for pid in servers.server_pids.values():
        assert not _alive(pid)


@pytest.mark.parametrize("fork_servers", [True, False], ids=["forked", "shell"])
def test_server_that_dies_at_startup(tmp_path, fork_servers):
    broken = {"entrypoint": "app.py", "domain": "agent"}
    config = GymServersConfig(
        overrides={"broken_server": {"resources_servers": {"no_such_server_module": broken}}},
        log_dir=tmp_path / "logs",
        startup_timeout_s=60,
        use_ray=False,
        fork_servers=fork_servers,
    )
    servers = OwnedGym(config)
    t0 = time.monotonic()
    with pytest.raises(GymStartupError, match="'broken_server' exited during start-up") as info:
        servers.start()
    print(f"dead server reported after {time.monotonic() - t0:.1f}s")
    assert time.monotonic() - t0 < 60
    # the log tail: "cd: .../no_such_server_module: No such file or directory" (from bash, or the fork)
    assert "no_such_server_module: No such file or directory" in str(info.value)
    _assert_nothing_left(servers, servers._launcher_proc.pid)


def test_server_that_hangs_hits_the_deadline(tmp_path, monkeypatch):
    server_dir = tmp_path / "resources_servers" / "hanging_server"
    server_dir.mkdir(parents=True)
    (server_dir / "requirements.txt").write_text("")
    (server_dir / "app.py").write_text("import time\nprint('hanging on purpose', flush=True)\ntime.sleep(3600)\n")
    monkeypatch.chdir(tmp_path)  # Gym looks for servers in the cwd first
    config = GymServersConfig(
        overrides={"stuck": {"resources_servers": {"hanging_server": {"entrypoint": "app.py", "domain": "agent"}}}},
        log_dir=tmp_path / "logs",
        # The deadline counts from the launcher's start: its NeMo-Gym import and the fork server's
        # preload come first (5.5 s on a quiet machine, over 15 s seen with the other lane busy, over 25 s at a
        # load average of 14).
        startup_timeout_s=40,
        use_ray=False,
    )
    servers = OwnedGym(config)
    t0 = time.monotonic()
    with pytest.raises(GymStartupError, match="'stuck' was not answering after the 40") as info:
        servers.start()
    elapsed = time.monotonic() - t0
    assert 40 <= elapsed < 40 + 60  # the stop after the deadline is bounded; the margin is for a loaded machine
    assert "hanging on purpose" in str(info.value)
    _assert_nothing_left(servers, servers._launcher_proc.pid)


def _tool_server_config(tmp_path: Path, **tool_settings) -> GymServersConfig:
    settings = {**_TOOL_SERVER["example_single_tool_call"]["resources_servers"]["example_single_tool_call"]}
    settings.update(tool_settings)
    overrides = {"example_single_tool_call": {"resources_servers": {"example_single_tool_call": settings}}}
    # A generous deadline: these tests show a start that ends when a server exits, long before any deadline.
    return GymServersConfig(overrides=overrides, log_dir=tmp_path / "logs", startup_timeout_s=200, use_ray=False)


def _listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def test_a_port_taken_before_its_server_binds_is_noticed_and_the_set_starts_on_other_ports(tmp_path, caplog):
    """The race for real: another process binds the port Gym chose for a server between the choice (the launcher's
    status file lists it) and the server's own bind. The server exits, the set starts again on another window."""
    servers = OwnedGym(_tool_server_config(tmp_path))
    taken: list[socket.socket] = []

    def take_the_first_chosen_port() -> None:
        deadline = time.monotonic() + 60
        while not taken and time.monotonic() < deadline:
            status = servers._private_dir / "status.json" if servers._private_dir else None
            try:
                chosen = json.loads(status.read_text())["servers"]["example_single_tool_call"]["port"]
                taken.append(_listen(int(chosen)))
            except (AttributeError, OSError, ValueError, KeyError, TypeError):
                time.sleep(0.005)

    thief = threading.Thread(target=take_the_first_chosen_port)
    thief.start()
    t0 = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="gym_bridge.gym.servers.owned"):
            head = servers.start()
        thief.join()
        assert taken, "the test took the server's port before the server bound it"
        port = taken[0].getsockname()[1]
        retries = [r.getMessage() for r in caplog.records if "starting again on other ports" in r.getMessage()]
        assert len(retries) == 1 and str(port) in retries[0] and "in use" in retries[0], retries
        assert _get(head.host, head.port)[0] == 200
        assert not servers.server_urls["example_single_tool_call"].endswith(f":{port}")
        print(f"recovered from the taken port in {time.monotonic() - t0:.1f}s")
    finally:
        servers.stop()
        for sock in taken:
            sock.close()


def test_a_configured_port_that_is_busy_ends_the_start_in_seconds_naming_it(tmp_path):
    with _listen(0) as held:
        port = held.getsockname()[1]
        servers = OwnedGym(_tool_server_config(tmp_path, port=port))
        with pytest.raises(GymPortInUse, match=rf"'example_single_tool_call' could not bind its port .*{port}") as info:
            servers.start()
    # Noticed when the server exited and named with its cause, not the start-up deadline's "was not answering".
    assert "address already in use" in str(info.value).lower() and "was not answering" not in str(info.value)
    _assert_nothing_left(servers, None)


def test_port_windows_are_held_across_processes():
    """A window this process holds is refused to another process (its lock file), until released."""
    from gym_bridge.gym.servers import reaper

    window = reaper.reserve_port_window()
    probe = (
        "import fcntl, os, sys, tempfile; "
        f"fd = os.open(os.path.join(tempfile.gettempdir(), 'gym-bridge-port-windows-{os.getuid()}', '{window}.lock'), "
        "os.O_RDWR); "
        "sys.exit(0 if fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB) is None else 1)"
    )
    import subprocess

    held = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert held.returncode == 1 and "BlockingIOError" in held.stderr, held.stderr
    reaper.release(object(), window)  # type: ignore[arg-type]
    free = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert free.returncode == 0, free.stderr
