"""The NemoGym actor's health watch: bounded TCP probes of the model endpoints (and how long each has been
down), and :class:`SharedWatch`, which runs one watch for all the streams in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any
from urllib.parse import urlsplit

from gym_bridge.failures import EndpointUnavailable


class EndpointWatch:
    """Fails with :class:`EndpointUnavailable` once a model endpoint has refused every connection for ``window_s``.

    A probe is one TCP connect (bounded by ``window_s``); a success clears the
    endpoint's record. The records outlive one stream, so a retry fails at its first probe.
    """

    def __init__(self, base_urls: Sequence[str], window_s: float) -> None:
        self.base_urls = list(base_urls)
        self.window_s = window_s
        self._down_since: dict[str, float] = {}

    async def check(self) -> None:
        """Probe every endpoint once; raise for one that has been down ``window_s`` or longer."""
        window = self.window_s
        errors = await asyncio.gather(*(probe_endpoint(url, window) for url in self.base_urls))
        now = time.monotonic()
        for url, error in zip(self.base_urls, errors, strict=True):
            if error is None:
                self._down_since.pop(url, None)
                continue
            since = self._down_since.setdefault(url, now)
            if now - since >= window:
                raise EndpointUnavailable(
                    f"model endpoint {url} has refused connections for {now - since:.1f}s "
                    f"(connect_timeout_s={window}) while rows were in flight: {error}; "
                    "Gym's model server would retry it forever"
                )


async def probe_endpoint(base_url: str, timeout_s: float) -> str | None:
    """None when ``base_url``'s host accepts a TCP connection within ``timeout_s``, else why not."""
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(parts.hostname, port)
    except (OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


class SharedWatch[Target]:
    """One watch task for every stream in flight on the same target: the first stream to :meth:`join` starts it,
    the last to :meth:`leave` cancels it, and a watch that finished (it failed a stream) or watches another
    target (servers re-spun) is replaced for the next stream.

    One watch, not one per stream: with 1,024 groups in flight a watch per stream made 1,024 process polls
    and endpoint TCP probes a second.
    """

    def __init__(self, watch: Callable[[Target], Coroutine[Any, Any, None]], name: str) -> None:
        self._watch = watch
        self._name = name
        self._current: asyncio.Task[None] | None = None
        self._target: Target | None = None
        self._members: dict[asyncio.Task[None], int] = {}

    @property
    def current(self) -> asyncio.Task[None] | None:
        """The watch the next stream on the same target joins, if it is still running."""
        return self._current

    @property
    def members(self) -> dict[asyncio.Task[None], int]:
        """Streams in flight per watch task."""
        return dict(self._members)

    def join(self, target: Target) -> asyncio.Task[None]:
        """The watch of ``target`` for one more stream (started here when there is none to share)."""
        if self._current is None or self._current.done() or self._target is not target:
            self._current = asyncio.create_task(self._watch(target), name=self._name)
            self._target = target
        self._members[self._current] = self._members.get(self._current, 0) + 1
        return self._current

    def leave(self, watch: asyncio.Task[None], callback: Callable[[asyncio.Task[None]], object]) -> None:
        """One stream stops listening to ``watch`` (``callback`` was its done-callback); the last one cancels it."""
        watch.remove_done_callback(callback)
        self._members[watch] -= 1
        if not self._members[watch]:
            del self._members[watch]
            watch.cancel()
            if watch is self._current:
                self._current = self._target = None
