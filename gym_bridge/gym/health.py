"""The model endpoints' side of the NemoGym actor's health watch.

Bounded TCP probes, and how long each endpoint has been down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from gym_bridge.failures import EndpointUnavailable

__all__ = ["EndpointWatch", "probe_endpoint"]


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
