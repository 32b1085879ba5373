"""The listening socket our servers serve on, bound on its own so a command can claim its port before it loads a
model (``gym-bridge serve``: a busy port is one line at once, not after the engine is built)."""

from __future__ import annotations

import socket

from gym_bridge.failures import GymBridgeError


class ServerBindError(GymBridgeError, OSError):
    """The server cannot listen on its host and port (in use, not an address of this machine, no permission)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening, non-blocking TCP socket whose accepted connections get ``TCP_NODELAY``.

    Why the explicit ``IPPROTO_TCP``: asyncio's transport sets ``TCP_NODELAY`` on an
    accepted socket only when its ``proto`` is ``IPPROTO_TCP``, and an accepted socket
    copies the listener's ``proto``; ``socket.socket(family, SOCK_STREAM)`` leaves it
    0, so Nagle stayed on and every keep-alive response (written as headers, then
    body) waited ~40 ms for the client's delayed ACK. ``TCP_NODELAY`` on the listener
    as well is inherited by accepted sockets on Linux and the BSDs, whatever the loop.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ServerBindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock
