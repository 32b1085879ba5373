"""No Gym process outlives its owner: the live-set registry with atexit/signal cleanup, port windows,
and the process checks (alive, answering, log tail) an OwnedGym uses to start, watch and stop its set."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import http.client
import logging
import os
import random
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Protocol

import psutil

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import make_dir, open_nofollow
from gym_bridge.failures import GymServersError


class Stoppable(Protocol):
    """What the reaper needs of a server set (``OwnedGym``): a ``stop()`` that never raises."""

    def stop(self) -> None: ...


logger = logging.getLogger(__name__)

# Gym's default range (10001-20000) overlaps Ray's worker ports; stay below Linux's ephemeral range.
_PORT_SPACE = (20_000, 32_000)
PORT_WINDOW = 200
"""Ports per launched Gym set."""
_LOG_TAIL_BYTES = 3000

_instances_lock = threading.Lock()
_live: set[Stoppable] = set()
_used_windows: dict[int, int] = {}
"""Window start -> the descriptor holding its lock file."""
_instance_count = 0
_handlers_installed = False


def _stop_all_live() -> None:
    for servers in list(_live):
        try:
            servers.stop()
        except Exception:
            logger.exception("stopping NeMo-Gym servers failed")


def _install_cleanup_handlers() -> None:
    """atexit, plus SIGTERM/SIGHUP handlers that stop every live launched set, then chain."""
    global _handlers_installed
    with _instances_lock:
        if _handlers_installed:
            return
        _handlers_installed = True
    atexit.register(_stop_all_live)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or previous is None:
            continue

        def handler(num: int, frame: FrameType | None, previous: object = previous) -> None:
            _stop_all_live()
            if callable(previous):
                previous(num, frame)
            else:
                signal.signal(num, signal.SIG_DFL)
                os.kill(os.getpid(), num)

        signal.signal(signum, handler)


def free_port(host: str) -> int:
    """A port the OS says is free on ``host`` now."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now: each socket stays bound until all are chosen, so the
    kernel cannot hand one port out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def reserve_port_window() -> int:
    """The start of a block of ports no other launched set uses, in this process or any other on the machine (Gym
    picks its servers' ports, and the launcher its head port, there).

    A window is held by an exclusive ``flock`` on its lock file for as long as the set lives; the kernel drops the
    lock when its holder dies, so a killed run never keeps a window. Two runs started at the same moment therefore
    never choose ports in one window.

    Raises:
        GymServersError: every window of the port space is held.
    """
    low, high = _PORT_SPACE
    with _instances_lock:
        candidates = [w for w in range(low, high - PORT_WINDOW + 1, PORT_WINDOW) if w not in _used_windows]
        random.shuffle(candidates)
        for window in candidates:
            fd = _lock_window(window)
            if fd is not None:
                _used_windows[window] = fd
                return window
    raise GymServersError(f"every NeMo-Gym port window in {low}..{high} is held by another run on this machine")


def _lock_window(window: int) -> int | None:
    """A descriptor holding ``window``'s lock, or None when another process holds it (or its file is not ours)."""
    folder = Path(tempfile.gettempdir()) / f"gym-bridge-port-windows-{os.getuid()}"
    try:
        make_dir(folder, mode=0o700)
        fd = open_nofollow(folder / f"{window}.lock", os.O_RDWR | os.O_CREAT, 0o600, root=folder)
    except (OSError, UntrustedInputError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def next_instance_index() -> int:
    """A process-wide counter naming each Gym set's default log folder."""
    global _instance_count
    with _instances_lock:
        _instance_count += 1
        return _instance_count


def register_live(servers: Stoppable) -> None:
    """Stop ``servers`` at exit or on SIGTERM/SIGHUP unless :func:`release` d first."""
    _install_cleanup_handlers()
    with _instances_lock:
        _live.add(servers)


def release(servers: Stoppable, window: int | None) -> None:
    """Forget a stopped set and free its port window."""
    with _instances_lock:
        _live.discard(servers)
        fd = _used_windows.pop(window, None) if window is not None else None
    if fd is not None:
        os.close(fd)


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def answers(host: str, port: int, path: str = "/") -> bool:
    """Whether ``GET path`` on the server answers 200 within a second."""
    conn = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def tail(path: Path, limit: int = _LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a log, for error messages (a log that is a link, a FIFO or has another hard link
    is not read: only the log gym-bridge wrote)."""
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except UntrustedInputError as exc:
        return f"<no log: {exc}>"
    try:
        return os.pread(fd, limit, max(0, os.fstat(fd).st_size - limit)).decode("utf-8", errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    finally:
        os.close(fd)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``procs`` to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if is_alive(p)]
    return alive
