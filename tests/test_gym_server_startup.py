"""Gym server sets that fail to start, from the installed wheel, without Ray: a server that dies during start-up is
named at once, one that hangs hits the deadline, and neither leaves a process behind. No mocks.

Split from tests/test_gym_servers.py, whose sets join the session Ray: these need none, so they run in the
"local" xdist lane (tests/conftest.py), and the hanging server's 40 s deadline is waited out beside the Ray lane's
work instead of inside it.
"""

from __future__ import annotations

import time

import psutil
import pytest

from gym_bridge.gym.servers import GymServers, GymServersConfig, GymStartupError

pytestmark = [pytest.mark.timeout(240), pytest.mark.gym]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_nothing_left(servers: GymServers, launcher_pid: int | None) -> None:
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
    servers = GymServers(config)
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
    servers = GymServers(config)
    t0 = time.monotonic()
    with pytest.raises(GymStartupError, match="'stuck' was not answering after the 40") as info:
        servers.start()
    elapsed = time.monotonic() - t0
    assert 40 <= elapsed < 40 + 60  # the stop after the deadline is bounded; the margin is for a loaded machine
    assert "hanging on purpose" in str(info.value)
    _assert_nothing_left(servers, servers._launcher_proc.pid)
