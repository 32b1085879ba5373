"""Which base URL serves a request: sticky per session, least-loaded otherwise.

Policy (``sticky_least_loaded``, as prime-rl and SkyRL route across vLLM replicas):

- **Load** is the number of requests a URL has in flight from this client, counting
  those still waiting for a pooled connection.
- **A new session** (a key not in the table) goes to the least-loaded *healthy*
  URL; ties go to the next URL in round-robin order, so an idle fleet still
  spreads work. The session is then **pinned** there: every later turn of the
  same trajectory reuses that server's prefix cache.
- **A pinned session stays** on its URL while the URL is healthy, whatever its
  load. Pure hashing (``hash(session) % N``) is blind to load and can lock a
  saturated engine into KV-cache thrash; choosing by load only for the first
  request keeps locality without that.
- **Sessionless requests** always go to the least-loaded healthy URL.
- **Health.** A URL that failed with a connection error is unhealthy for a
  cool-down period. A session pinned to an unhealthy URL is re-pinned to the
  least-loaded healthy URL on its next request (a *failover*). When no URL is
  healthy, every URL is a candidate again, so a request is still attempted and
  its errors surface instead of an empty choice.
- **The session table** is an LRU bounded at ``max_sessions`` entries; an evicted
  session is simply treated as new.

The router only does bookkeeping; it never performs I/O. It is thread-safe, since
one generation client may be driven from several event loops.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from gym_bridge.failures.errors import SettingError


@dataclass
class RouterStats:
    """Counters kept by :class:`SessionRouter`."""

    assigned: list[int] = field(default_factory=list)
    """Requests routed to each URL (by index)."""
    failovers: int = 0
    """Sessions moved off an unhealthy URL."""
    marked_unhealthy: int = 0


class SessionRouter:
    """Session-sticky, least-loaded choice among ``n_urls`` endpoints; see the module docstring."""

    def __init__(
        self,
        n_urls: int,
        *,
        max_sessions: int = 100_000,
        cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if n_urls < 1:
            raise SettingError(f"SessionRouter needs at least one URL (n_urls >= 1), got n_urls={n_urls}")
        if max_sessions < 1:
            raise SettingError(f"max_sessions must be >= 1, got {max_sessions}")
        self.n_urls = n_urls
        self.max_sessions = max_sessions
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = [0] * n_urls
        self._unhealthy_until = [0.0] * n_urls
        self._sessions: OrderedDict[Hashable, int] = OrderedDict()
        self._next_rr = 0
        self.stats = RouterStats(assigned=[0] * n_urls)

    # ------------------------------------------------------------------ queries

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._in_flight)

    def is_healthy(self, idx: int) -> bool:
        with self._lock:
            return self._healthy(idx, self._clock())

    def session_url(self, session: Hashable) -> int | None:
        """The URL a session is pinned to, without touching its LRU position."""
        with self._lock:
            return self._sessions.get(session)

    def __len__(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ routing

    def acquire(self, session: Hashable | None = None) -> int:
        """Choose a URL for one request and count it in flight; pair with :meth:`release`."""
        with self._lock:
            now = self._clock()
            idx: int | None = None
            pinned = self._sessions.get(session) if session is not None else None
            if pinned is not None and self._healthy(pinned, now):
                idx = pinned
                self._sessions.move_to_end(session)
            if idx is None:
                idx = self._least_loaded(now)
                if pinned is not None and idx != pinned:
                    self.stats.failovers += 1
                if session is not None:
                    self._sessions[session] = idx
                    self._sessions.move_to_end(session)
                    while len(self._sessions) > self.max_sessions:
                        self._sessions.popitem(last=False)
            self._in_flight[idx] += 1
            self.stats.assigned[idx] += 1
            return idx

    def release(self, idx: int) -> None:
        with self._lock:
            self._in_flight[idx] = max(0, self._in_flight[idx] - 1)

    def mark_unhealthy(self, idx: int) -> None:
        """Take ``idx`` out of rotation for the cool-down period."""
        with self._lock:
            self._unhealthy_until[idx] = self._clock() + self.cooldown_s
            self.stats.marked_unhealthy += 1

    # ------------------------------------------------------------------ internals

    def _healthy(self, idx: int, now: float) -> bool:
        return self._unhealthy_until[idx] <= now

    def _least_loaded(self, now: float) -> int:
        candidates = [i for i in range(self.n_urls) if self._healthy(i, now)] or list(range(self.n_urls))
        low = min(self._in_flight[i] for i in candidates)
        tied = [i for i in candidates if self._in_flight[i] == low]
        # Round-robin among ties: the first tied URL at or after the cursor.
        chosen = min(tied, key=lambda i: (i - self._next_rr) % self.n_urls)
        self._next_rr = (chosen + 1) % self.n_urls
        return chosen
