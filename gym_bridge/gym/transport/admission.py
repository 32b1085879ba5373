"""Adaptive admission of Gym rows: an AIMD limit on the rows in flight, a pause after each back-off, and the
deadline clock that counts a group's time in flight.

A timeout into a saturated engine is answered by sending less, not by sending the same again: the limit on
rows in flight is halved once per saturation (timeouts of rows admitted before the last halving do not halve
it again), admission pauses for :func:`~gym_bridge.failures.backoff_delay` of the back-offs since the last
success and, at most ``drain_timeout_s``, until the endpoint has drained (:func:`endpoint_drained`: the work of
the rows given up on has left its queue and its running batch), and every row that comes back grows the limit
by one until it reaches the most rows the run ever had in flight, where it is lifted. Whether a timeout is a
saturation is :func:`saturation_reason`'s rule: the endpoint's own queue (vLLM's ``vllm:num_requests_waiting``
on ``/metrics``), else a rising latency.
Groups wait in arrival order; a group larger than the limit is admitted alone.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from pydantic import ConfigDict

from gym_bridge.failures import SettingError, backoff_delay, deadline
from gym_bridge.failures.retry import deadline_expired


@dataclass(frozen=True)
class AdmissionSettings:
    """How :class:`AdmissionControl` adapts; ``adaptive=False`` admits every row at once and never backs off.

    A config section read into it (``env.nemo_gym.admission``, the eval config's ``admission:``) refuses a key it
    does not know."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    adaptive: bool = True
    """False: the old behaviour (every row sent at once, re-sends at the same concurrency, no pause)."""
    initial_limit: int | None = None
    """Rows in flight before any back-off; None sets no limit until the first saturation."""
    min_limit: int = 1
    """The floor a halving stops at."""
    backoff_base_s: float = 1.0
    """The pause after the first back-off, doubled for each further one before a row succeeds."""
    max_backoff_s: float = 30.0
    """The cap on that pause."""
    latency_rise: float = 2.0
    """A timeout after this many times the fastest row's latency counts as a rising latency."""
    drain_timeout_s: float = 60.0
    """After a back-off, admission also waits (at most this long) until the endpoint has drained: nothing waiting
    in its queue and no more requests running than this client still has rows in flight (the requests of the
    rows it gave up on have ended). 0: only the fixed pause. An endpoint without vLLM's gauges ends it at once."""

    def __post_init__(self) -> None:
        if self.initial_limit is not None and (isinstance(self.initial_limit, bool) or self.initial_limit < 1):
            raise SettingError(f"initial_limit must be None or >= 1, got {self.initial_limit!r}")
        if isinstance(self.min_limit, bool) or self.min_limit < 1:
            raise SettingError(f"min_limit must be >= 1, got {self.min_limit!r}")
        for name in ("backoff_base_s", "max_backoff_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise SettingError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if not (self.latency_rise >= 1):
            raise SettingError(f"latency_rise must be >= 1, got {self.latency_rise!r}")


@dataclass(frozen=True)
class EndpointLoad:
    """What the model endpoints' ``/metrics`` said, summed over the endpoints that answered."""

    reachable: bool
    """At least one endpoint answered ``/metrics`` (with any status)."""
    waiting: float | None = None
    """``vllm:num_requests_waiting``; None when no endpoint exposes it."""
    running: float | None = None
    """``vllm:num_requests_running``; None when no endpoint exposes it."""


class SaturationReason(enum.StrEnum):
    """Why a timeout counts as a saturated engine."""

    ENDPOINT_QUEUE = "endpoint_queue"
    """The endpoint reports requests waiting in its queue."""
    LATENCY = "latency"
    """Rows take far longer than the fastest row did, or nothing finished while several rows were in flight."""


def saturation_reason(
    load: EndpointLoad | None, fastest_row_s: float | None, elapsed_s: float, in_flight: int, latency_rise: float
) -> SaturationReason | None:
    """Whether a timeout after ``elapsed_s`` with ``in_flight`` rows in flight is a saturation, and why.

    An endpoint that does not answer is down, not busy (None); requests waiting in its queue are a saturation;
    otherwise the latency decides: ``elapsed_s`` at least ``latency_rise`` times the fastest row so far, or,
    before any row finished, more than one row in flight.
    """
    if load is not None and not load.reachable:
        return None
    if load is not None and load.waiting is not None and load.waiting > 0:
        return SaturationReason.ENDPOINT_QUEUE
    if fastest_row_s is not None:
        return SaturationReason.LATENCY if elapsed_s >= latency_rise * fastest_row_s else None
    return SaturationReason.LATENCY if in_flight > 1 else None


def endpoint_drained(load: EndpointLoad | None, rows_in_flight: int) -> bool:
    """Whether the endpoint holds no work beyond this client's ``rows_in_flight``: nothing waiting, and at most
    that many requests running (each row has at most one model call in flight). An endpoint that does not answer,
    or has no request gauges, cannot say: True, so a drain never waits on it."""
    if load is None or not load.reachable or (load.waiting is None and load.running is None):
        return True
    return (load.waiting or 0) <= 0 and (load.running or 0) <= rows_in_flight


@dataclass
class AdmissionTicket:
    """Rows one attempt holds: released one by one as they come back, the rest when the attempt ends."""

    rows: int
    epoch: int
    admitted_at: float


@dataclass
class _Waiter:
    rows: int
    future: asyncio.Future[AdmissionTicket]


@dataclass
class AdmissionControl:
    """The AIMD limit on rows in flight (see the module docstring); one per :class:`GymClient`."""

    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    clock: Callable[[], float] = time.monotonic
    limit: int | None = None
    in_flight: int = 0
    peak_in_flight: int = 0
    lowest_limit: int | None = None
    backoffs: int = 0
    """Halvings of the limit (one per saturation epoch)."""
    backoff_s: float = 0.0
    """Seconds of admission pause those back-offs asked for."""
    fastest_row_s: float | None = None
    epoch: int = 0
    consecutive_backoffs: int = 0
    paused_until: float = 0.0
    held_until: float = 0.0
    """While a drain is awaited (:meth:`hold_until_drained`, :meth:`drained`): its bound, after which admission
    goes on even if nobody ends the hold."""
    drains: int = 0
    """Drains waited for."""
    drain_s: float = 0.0
    """Seconds admission waited for them."""
    _waiters: deque[_Waiter] = field(default_factory=deque)
    _timer: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None

    def __post_init__(self) -> None:
        self.limit = self.settings.initial_limit
        self.lowest_limit = self.limit

    @property
    def adaptive(self) -> bool:
        """Whether the limit and the pauses apply."""
        return self.settings.adaptive

    @property
    def waiting_rows(self) -> int:
        """Rows of the groups waiting for admission."""
        return sum(w.rows for w in self._waiters if not w.future.done())

    def fits(self, rows: int) -> bool:
        """Whether ``rows`` more rows may go now (a group larger than the limit goes alone)."""
        if not self.adaptive:
            return True
        if self.clock() < max(self.paused_until, self.held_until):
            return False
        return self.limit is None or self.in_flight == 0 or self.in_flight + rows <= self.limit

    async def acquire(self, rows: int) -> AdmissionTicket:
        """Wait until ``rows`` rows may go (in arrival order), then count them in flight."""
        if not self._waiters and self.fits(rows):
            return self._admit(rows)
        waiter = _Waiter(rows, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._wake()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())
            else:
                waiter.future.cancel()
            self._wake()
            raise

    def row_done(self, ticket: AdmissionTicket, *, success: bool) -> None:
        """One row of ``ticket`` came back; a success grows the limit by one and ends the back-off streak."""
        if ticket.rows <= 0:
            return
        if success:
            latency = self.clock() - ticket.admitted_at
            self.fastest_row_s = latency if self.fastest_row_s is None else min(self.fastest_row_s, latency)
            self.consecutive_backoffs = 0
            self._grow()
        ticket.rows -= 1
        self.in_flight -= 1
        self._wake()

    def _grow(self) -> None:
        """One more row allowed: up to ``initial_limit`` when set, else lifted at the run's peak in flight."""
        if self.limit is None:
            return
        cap = self.settings.initial_limit
        if cap is not None:
            self.limit = min(self.limit + 1, cap)
        elif self.limit + 1 >= self.peak_in_flight:
            self.limit = None
        else:
            self.limit += 1

    def release(self, ticket: AdmissionTicket) -> None:
        """The attempt ended: the rows it still holds leave the count."""
        self.in_flight -= ticket.rows
        ticket.rows = 0
        self._wake()

    def back_off(self, ticket: AdmissionTicket) -> float | None:
        """A saturation timeout of ``ticket``'s attempt: halve the limit and pause admission, once per epoch.

        Returns the pause in seconds, or None when an earlier timeout of the same epoch already backed off.
        """
        if not self.adaptive or ticket.epoch != self.epoch:
            return None
        base = self.in_flight if self.limit is None else min(self.limit, self.in_flight)
        self.limit = max(self.settings.min_limit, base // 2)
        self.lowest_limit = self.limit if self.lowest_limit is None else min(self.lowest_limit, self.limit)
        self.epoch += 1
        self.backoffs += 1
        self.consecutive_backoffs += 1
        pause = backoff_delay(self.consecutive_backoffs, self.settings.backoff_base_s, self.settings.max_backoff_s)
        self.backoff_s += pause
        self.paused_until = max(self.paused_until, self.clock() + pause)
        return pause

    @property
    def draining(self) -> bool:
        """Whether admission waits for the endpoint to drain."""
        return self.clock() < self.held_until

    def hold_until_drained(self) -> float:
        """Admit nothing until :meth:`drained`, at most ``drain_timeout_s``; returns when the hold began."""
        now = self.clock()
        self.held_until = now + self.settings.drain_timeout_s
        self.drains += 1
        return now

    def drained(self, held_since: float) -> None:
        """The endpoint drained, or the wait for it ended: admission goes on once the back-off pause is over."""
        self.held_until = 0.0
        self.drain_s += self.clock() - held_since
        self._wake()

    def _admit(self, rows: int) -> AdmissionTicket:
        self.in_flight += rows
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return AdmissionTicket(rows=rows, epoch=self.epoch, admitted_at=self.clock())

    def _wake(self) -> None:
        """Admit the waiting groups at the head of the line that fit; during a pause, wake again at its end."""
        while self._waiters and self._waiters[0].future.done():
            self._waiters.popleft()
        left = max(self.paused_until, self.held_until) - self.clock()
        if self._waiters and left > 0:
            loop = asyncio.get_running_loop()
            due = loop.time() + left
            if self._timer is not None and (self._timer[0] is not loop or self._timer[1].when() > due + 0.01):
                self._timer[1].cancel()  # another loop's, or due after the pause now ends (a hold ended early)
                self._timer = None
            if self._timer is None:
                self._timer = (loop, loop.call_at(due, self._timer_fired))
            return
        while self._waiters:
            waiter = self._waiters[0]
            if not waiter.future.done():
                if not self.fits(waiter.rows):
                    return
                waiter.future.set_result(self._admit(waiter.rows))
            self._waiters.popleft()

    def _timer_fired(self) -> None:
        self._timer = None
        self._wake()


class InFlightDeadline:
    """A group's deadline that counts only the time it runs (its rows in flight, its agent question),
    not its waits for admission: ``seconds`` still bounds how long any of its rows is in flight.

    Each stretch on the clock is :func:`~gym_bridge.failures.deadline` with the time left, its expiry naming
    the whole deadline (``<description> exceeded <seconds>s``)."""

    def __init__(self, seconds: float | None, description: str) -> None:
        self.seconds = seconds
        self.description = description
        self.used_s = 0.0
        self.expired = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the body on the group's clock; expiry raises :class:`RolloutTimeout` naming the whole deadline."""
        if self.seconds is None:
            yield
            return
        left = self.seconds - self.used_s
        if left <= 0:
            self.expired = True
            raise deadline_expired(self.description, self.seconds)
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout: asyncio.Timeout | None = None
        try:
            async with deadline(left, self.description, shown_seconds=self.seconds) as timeout:
                yield
        finally:
            self.used_s += loop.time() - started
            if timeout is not None and timeout.expired():
                self.expired = True
