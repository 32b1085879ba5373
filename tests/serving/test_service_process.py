"""ServiceProcess: the helper server the fault gate and the benchmarks' endpoint run on, with real processes."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import psutil
import pytest

from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.testing.process import ServiceProcess


def http_server(tmp_path: Path, name: str = "server") -> tuple[ServiceProcess, list[str]]:
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    return ServiceProcess(name, port, tmp_path / f"{name}.log", ready_path="/"), command


def test_spawn_returns_once_it_answers_and_stop_ends_the_whole_group(tmp_path: Path):
    server, command = http_server(tmp_path)
    server.spawn(command, timeout_s=30)
    pid = server.pid
    assert httpx.get(server.root_url + "/", timeout=5).status_code == 200
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    server.stop()
    assert server.proc is None and not psutil.pid_exists(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.root_url + "/", timeout=5)
    server.stop()  # a second stop is a no-op


def test_kill_cuts_it_at_once_and_it_starts_again_on_the_same_port(tmp_path: Path):
    server, command = http_server(tmp_path)
    server.spawn(command, timeout_s=30)
    first = server.pid
    server.kill()
    assert not psutil.pid_exists(first)
    server.spawn(command, timeout_s=30)
    try:
        assert server.pid != first and httpx.get(server.root_url + "/", timeout=5).status_code == 200
    finally:
        server.stop()


def test_a_command_that_exits_during_start_up_is_reported_with_its_log(tmp_path: Path):
    server, _ = http_server(tmp_path, "crasher")
    with pytest.raises(RuntimeError, match=r"the crasher exited with 3 during start-up:\n.*no config here"):
        server.spawn([sys.executable, "-c", "import sys; print('no config here'); sys.exit(3)"], timeout_s=30)


def test_a_command_that_never_answers_is_killed_at_the_deadline(tmp_path: Path):
    server, _ = http_server(tmp_path, "sleeper")
    with pytest.raises(TimeoutError, match=r"the sleeper answers /: not true within 1\.0s:\n.*waiting"):
        server.spawn([sys.executable, "-u", "-c", "import time; print('waiting'); time.sleep(60)"], timeout_s=1.0)
    assert server.proc is None
    assert not [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(60)" in " ".join(p.info["cmdline"] or [])]
