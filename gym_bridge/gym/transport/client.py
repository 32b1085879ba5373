"""GymClient: the driver's side of the NemoGym actors, one prompt group at a time.

It discovers the running agents, checks the group's agent, picks the actor (the one
with the fewest rows in flight from this client, avoiding actors that already failed
this group), streams the rows through ``NemoGym.run_row_batches``, checks every row index
that comes back, and re-dispatches only the rows that never arrived after an infrastructure
failure (and, with ``resend_env_infra_failures``, the rows the environment masked for an
infrastructure ``failure_kind``). One deadline spans all of it, agent discovery included; it counts the
group's time running, not its waits for admission. Every attempt is admitted by the client's
:class:`~gym_bridge.gym.transport.admission.AdmissionControl`: a timeout into a saturated engine halves the rows in
flight and pauses admission, so re-sends back off instead of storming. The result is typed:
:class:`GymGroupResult`.

A deterministic failure (data: Gym's ``agent_run_error``, a bad result) fails the group at once: only
infrastructure failures re-send rows. With ``token_id_capture`` on, every finalised capture is counted against
``max_mask_fraction`` as Gym's collection counts it
(:class:`~gym_bridge.gym.protocol.token_capture.MaskFractionWatch`); when Gym would abort,
:class:`~gym_bridge.failures.TokenCaptureMasked` is raised, and again by every later group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from gym_bridge.failures import (
    FailureClass,
    GymRowIndexError,
    GymServerCrashLoop,
    GymTransportError,
    RolloutFailure,
    RolloutStats,
    RolloutTimeout,
    SettingError,
    classify_rollout_failure,
    gym_failure_kind_class,
)
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY, with_attempt
from gym_bridge.gym.protocol.result import GymRowBatch, GymRowResult
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.protocol.token_capture import MaskFractionWatch
from gym_bridge.gym.transport.admission import (
    AdmissionControl,
    AdmissionSettings,
    AdmissionTicket,
    EndpointLoad,
    InFlightDeadline,
    endpoint_drained,
    saturation_reason,
)
from gym_bridge.json_types import JsonObject
from gym_bridge.types import ActorHandle

logger = logging.getLogger(__name__)

_LOAD_PROBE_S = 5.0
"""The bound on asking an actor for its endpoints' load after a timeout."""
_DRAIN_POLL_S = 1.0
"""How often a drain after a back-off asks for the endpoints' load."""


@dataclass(frozen=True, slots=True)
class GymGroupResult:
    """Every row of one group, in row-index order with tensors, and the actor's timing of the last stream."""

    rows: list[GymRowResult]
    timing: dict[str, float]

    @property
    def agent(self) -> str | None:
        """The agent Gym ran the group's rows on, as each result carries it (None: a materialized row's episode)."""
        return next((row.agent for row in self.rows if row.agent), None)


class GymClient:
    """Sends prompt groups to one or more NemoGym actors (each with its own Gym servers, same configs)."""

    def __init__(
        self,
        actors: Sequence[ActorHandle],
        *,
        max_gym_row_attempts: int = 3,
        stats: RolloutStats | None = None,
        timer_prefix: str = "timing/rollout",
        resend_env_infra_failures: bool = True,
        admission: AdmissionSettings | AdmissionControl | None = None,
    ) -> None:
        """``admission``: how rows in flight adapt to a saturated engine (default: adaptive);
        ``AdmissionSettings(adaptive=False)`` sends every row at once and re-sends without pause. Another client's
        :class:`AdmissionControl` is shared: clients on one engine (training and validation) adapt together."""
        if not actors or any(actor is None for actor in actors):
            raise SettingError("GymClient needs at least one NemoGym actor")
        if max_gym_row_attempts < 1:
            raise SettingError(f"max_gym_row_attempts must be >= 1, got {max_gym_row_attempts}")
        self.actors = list(actors)
        self.max_gym_row_attempts = max_gym_row_attempts
        self.stats = stats if stats is not None else RolloutStats()
        self.timer_prefix = timer_prefix
        self.resend_env_infra_failures = resend_env_infra_failures
        self.admission = (
            admission if isinstance(admission, AdmissionControl) else AdmissionControl(admission or AdmissionSettings())
        )
        self.mask_watch = MaskFractionWatch()
        """Finalised token captures and masked ones, against ``token_id_capture.max_mask_fraction``."""
        self._in_flight = [0] * len(self.actors)
        self._dead: set[int] = set()
        self._routes: GymRoutes | None = None
        self._locks: tuple[asyncio.AbstractEventLoop, asyncio.Lock, asyncio.Lock] | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def in_flight_rows(self) -> list[int]:
        """Rows in flight per actor (for metrics and tests)."""
        return list(self._in_flight)

    @property
    def run_stop(self) -> BaseException | None:
        """The terminal error that ended this client's run (:class:`~gym_bridge.failures.TokenCaptureMasked`: Gym's
        ``max_mask_fraction`` abort), or None. Every later group raises it before sending anything; the manager
        ends the run on it (a ``RunConfigurationError``), whatever its retry policy."""
        return self.mask_watch.stopped

    async def routes(self) -> GymRoutes | None:
        """Where the Gym servers send rows (asked once, of the first live actor); None for an actor that cannot say.

        Groups launched together share the one question (a lock, not a call per group).
        """
        if self._routes is not None:
            return self._routes
        async with self._loop_locks()[0]:
            for i, actor in enumerate(self.actors):
                if self._routes is not None or not hasattr(actor, "routes"):
                    break
                if i in self._dead:
                    continue
                try:
                    self._routes = await actor.routes.remote()
                except ray.exceptions.ActorDiedError as exc:
                    self._mark_dead(i, exc)
        return self._routes

    async def agent_names(self) -> list[str] | None:
        """The running agents; None for an actor that cannot say."""
        routes = await self.routes()
        return list(routes.agents) if routes is not None else None

    async def routed(self, row: JsonObject, *, prompt_idx: int) -> JsonObject:
        """``row`` with ``agent_ref`` naming the running agent it goes to (:meth:`GymRoutes.routed`)."""
        routes = await self.routes()
        return row if routes is None else routes.routed(row, where=f"prompt_idx={prompt_idx}")

    async def run_group(self, rows: list[JsonObject], *, prompt_idx: int, deadline_s: float | None) -> GymGroupResult:
        """Roll out one group's stamped rows (``_rowidx`` = position) within ``deadline_s`` seconds.

        The deadline covers every attempt, agent discovery included, but not the waits for admission
        (:class:`InFlightDeadline`): no row is in flight longer than ``deadline_s``. A row that names only its
        ``task_source`` is sent with ``agent_ref`` stamped (a copy), an unknown agent or source is
        :class:`InvalidGymRow`.

        Raises the typed failure of the last attempt (``RolloutTimeout`` at the deadline,
        :class:`GymRowIndexError` for a bad streamed index, data failures at once), or
        :class:`~gym_bridge.failures.TokenCaptureMasked` (terminal) once the run's masked captures exceed Gym's limit.
        """
        if self.run_stop is not None:
            raise self.run_stop
        clock = InFlightDeadline(deadline_s, "NeMo-Gym prompt group")
        async with clock.running():
            routes = await self.routes()
        if routes is not None:
            where = f"prompt_idx={prompt_idx}"
            rows = [routes.routed(row, where=where) for row in rows]
        return await self._collect(rows, prompt_idx, clock)

    @property
    def dead_actors(self) -> list[int]:
        """Indices of the actors Ray reported dead for good (``ActorDiedError``); no group goes to them."""
        return sorted(self._dead)

    @contextlib.asynccontextmanager
    async def loop_turn(self) -> AsyncIterator[None]:
        """Run the block alone in one event-loop iteration: groups launched together take turns.

        1,024 groups launched at once each build, pickle and submit their rows (~0.1-0.5 ms apiece);
        in one iteration that is up to 0.7 s in which the loop serves nothing else (benchmarks/RESULTS.md, scale).
        """
        async with self._loop_locks()[1]:
            yield
            await asyncio.sleep(0)

    def _loop_locks(self) -> tuple[asyncio.Lock, asyncio.Lock]:
        """(agent question, stream submission) locks of the running loop (a client may outlive a loop)."""
        loop = asyncio.get_running_loop()
        if self._locks is None or self._locks[0] is not loop:
            self._locks = (loop, asyncio.Lock(), asyncio.Lock())
        return self._locks[1], self._locks[2]

    def _pick_actor(self, avoid: set[int]) -> int:
        """The live actor with the fewest rows in flight, preferring those not in ``avoid``."""
        everyone = range(len(self.actors))
        live = [i for i in everyone if i not in self._dead] or list(everyone)
        candidates = [i for i in live if i not in avoid] or live
        return min(candidates, key=lambda i: (self._in_flight[i], i))

    async def _collect(self, rows: list[JsonObject], prompt_idx: int, clock: InFlightDeadline) -> GymGroupResult:
        """Stream the rows; after an infrastructure failure re-dispatch only the missing ones, elsewhere if possible.

        Each attempt waits for admission first; a timeout that the engine's load explains backs admission off."""
        n = len(rows)
        results: list[GymRowResult | None] = [None] * n
        timing: dict[str, float] = {}
        last_error: BaseException | None = None
        failed_actors: set[int] = set()
        attempts = 0
        for attempts in range(1, self.max_gym_row_attempts + 1):
            pending = [row for row in rows if results[row[ROW_INDEX_KEY]] is None]
            if not pending:
                break
            if attempts > 1:
                self.stats.record_gym_row_redispatch(len(pending))
                logger.warning(
                    "prompt_idx=%d: re-dispatching %d of %d rows (attempt %d) after %s: %s",
                    prompt_idx,
                    len(pending),
                    n,
                    attempts,
                    type(last_error).__name__ if last_error else "masked rows",
                    last_error or "the environment flagged an infrastructure failure_kind",
                )
                pending = [with_attempt(row, attempts - 1) for row in pending]
            last_attempt = attempts == self.max_gym_row_attempts
            ticket = await self.admission.acquire(len(pending))
            actor = self._pick_actor(failed_actors)
            try:
                async with clock.running():
                    streamed = await self._stream(actor, pending, results, ticket, keep_env_failures=last_attempt)
                timing = streamed or timing
            except Exception as exc:
                last_error = exc
                failed_actors.add(actor)
                if isinstance(exc, ray.exceptions.ActorDiedError):
                    self._mark_dead(actor, exc)
                if isinstance(exc, RolloutTimeout):
                    await self._judge_timeout(actor, ticket, prompt_idx)
                if classify_rollout_failure(exc) is not FailureClass.INFRA or last_attempt or clock.expired:
                    raise
            finally:
                self.admission.release(ticket)
        done = [result for result in results if result is not None]
        if len(done) < n:
            missing = [i for i, result in enumerate(results) if result is None]
            raise GymTransportError(
                f"prompt_idx={prompt_idx}: stream ended before all rows arrived; missing rows {missing} "
                f"of {n} after {attempts} attempt(s)"
            ) from last_error
        return GymGroupResult(rows=done, timing=timing)

    async def _judge_timeout(self, actor: int, ticket: AdmissionTicket, prompt_idx: int) -> None:
        """A timeout of ``ticket``'s attempt: when the endpoint's queue or the latency says the engine is
        saturated, count it and back admission off (halve the limit, pause), once per saturation."""
        control = self.admission
        if not control.adaptive:
            return
        elapsed = control.clock() - ticket.admitted_at
        in_flight = control.in_flight
        load = await self._endpoint_load(actor)
        reason = saturation_reason(load, control.fastest_row_s, elapsed, in_flight, control.settings.latency_rise)
        if reason is None:
            return
        pause = control.back_off(ticket)
        self.stats.record_saturation_timeout(reason.value, pause)
        if pause is not None:
            self.stats.record_admission_limit(control.limit)
            if control.settings.drain_timeout_s > 0 and not control.draining:
                held_since = control.hold_until_drained()
                self._drain = asyncio.create_task(self._wait_for_drain(actor, held_since, prompt_idx))
            logger.warning(
                "prompt_idx=%d: timed out with %d rows in flight into a saturated engine (%s%s); "
                "rows in flight limited to %s, admission paused %.1fs",
                prompt_idx,
                in_flight,
                reason.value,
                f", {load.waiting:g} requests waiting" if load is not None and load.waiting else "",
                control.limit,
                pause,
            )

    async def _wait_for_drain(self, actor: int, held_since: float, prompt_idx: int) -> None:
        """Admission is held (since ``held_since``) until the endpoint has drained the work of the rows given up on
        (:func:`endpoint_drained`), at most ``drain_timeout_s``; the back-off pause still applies after it."""
        control = self.admission
        ends = held_since + control.settings.drain_timeout_s
        drained = False
        try:
            while not drained and control.clock() < ends:
                load = await self._endpoint_load(actor)
                drained = endpoint_drained(load, control.in_flight)
                if not drained:
                    await asyncio.sleep(min(_DRAIN_POLL_S, max(0.0, ends - control.clock())))
        finally:
            control.drained(held_since)
        waited = control.clock() - held_since
        self.stats.record_admission_drain(waited, drained=drained)
        logger.warning(
            "prompt_idx=%d: admission waited %.1fs for the endpoint to drain%s",
            prompt_idx,
            waited,
            "" if drained else f" (not drained within {control.settings.drain_timeout_s:g}s)",
        )

    async def _endpoint_load(self, actor: int) -> EndpointLoad | None:
        """The actor's endpoints' load (``NemoGym.endpoint_load``); None when the actor cannot say in time."""
        handle = self.actors[actor]
        if not hasattr(handle, "endpoint_load"):
            return None
        try:
            load = await asyncio.wait_for(_unwrapped(handle.endpoint_load.remote()), _LOAD_PROBE_S)
        except Exception as exc:  # a dead or busy actor: the latency decides
            logger.debug("could not read the endpoints' load: %s", exc)
            return None
        return load if isinstance(load, EndpointLoad) else None

    def _mark_dead(self, actor: int, exc: BaseException) -> None:
        """No more groups go to ``actor``: Ray says it is gone for good (a restarting one is ActorUnavailableError)."""
        if actor not in self._dead and len(self._dead) + 1 < len(self.actors):
            logger.warning("NemoGym actor %d died (%s); no more groups go to it", actor, exc)
        self._dead.add(actor)

    async def _stream(
        self,
        actor: int,
        pending: list[JsonObject],
        results: list[GymRowResult | None],
        ticket: AdmissionTicket,
        *,
        keep_env_failures: bool,
    ) -> dict[str, float] | None:
        dispatched = {row[ROW_INDEX_KEY] for row in pending}
        seen: set[int] = set()
        timing = None
        self._in_flight[actor] += len(pending)
        stream = None
        try:
            async with self.loop_turn():
                stream = (
                    self.actors[actor]
                    .run_row_batches.options(num_returns="streaming")
                    .remote(pending, self.timer_prefix)
                )
            async for ref in stream:
                batch = await _unwrapped(ref)
                if not isinstance(batch, GymRowBatch):
                    raise GymTransportError(f"the NemoGym stream sent a {type(batch).__name__}, not a GymRowBatch")
                for row in batch.rows:
                    self._accept(actor, row, results, dispatched, seen, ticket, keep_env_failures)
                if batch.timing:
                    timing = batch.timing
        finally:
            self._in_flight[actor] -= len(pending) - len(seen)
            if stream is not None and len(seen) < len(dispatched):
                _cancel_quietly(stream)
        return timing

    def _accept(
        self,
        actor: int,
        row: GymRowResult,
        results: list[GymRowResult | None],
        dispatched: set[int],
        seen: set[int],
        ticket: AdmissionTicket,
        keep_env_failures: bool,
    ) -> None:
        """Check one streamed row index, count its token capture (:class:`MaskFractionWatch`) and keep the row.

        With ``resend_env_infra_failures``, a row the environment masked for an infrastructure
        ``failure_kind`` (a lost session, an unreachable provider) is left out, so the next attempt
        re-sends it, unless this is the last attempt: then it is kept, masked."""
        rowidx = row.row_index
        if rowidx not in dispatched:
            raise GymRowIndexError(f"row index {rowidx!r} came back, which was not dispatched in this attempt")
        if rowidx in seen:
            raise GymRowIndexError(f"duplicate row index {rowidx}")
        seen.add(rowidx)
        self._in_flight[actor] -= 1
        resend = self.resend_env_infra_failures and not keep_env_failures and _infra_flagged(row)
        limit = self.admission.limit
        self.admission.row_done(ticket, success=not resend)
        if self.admission.limit != limit:
            self.stats.record_admission_limit(self.admission.limit)
        self.mask_watch.record(row.capture)  # every finalised rollout counts, as in Gym's collection
        if resend:
            self.stats.record_env_failure_redispatch(str(row.failure_kind))
            logger.warning(
                "row %d came back masked (%s: %s); re-sending it", rowidx, row.failure_kind, row.failure_reason
            )
            return
        results[rowidx] = row


def _infra_flagged(row: GymRowResult) -> bool:
    """The environment masked the row for an infrastructure ``failure_kind``."""
    return row.mask_sample and gym_failure_kind_class(row.failure_kind) is FailureClass.INFRA


async def _unwrapped(ref: Any) -> Any:
    """Await one streamed element; a typed failure raised in the actor comes back as itself.

    Ray wraps it in a ``RayTaskError(<type>)`` subclass; our failures are picklable and
    name their row, so the caller gets the original type (and counts it by its name).
    """
    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, RolloutFailure | GymServerCrashLoop):  # a crash loop stops the run, in one line
            raise exc.cause from None
        raise


def _cancel_quietly(stream: Any) -> None:
    if not ray.is_initialized():  # nothing to cancel, and ray.cancel would start a local Ray
        return
    try:
        ray.cancel(stream)
    except Exception as exc:  # the stream may already be finished or its actor gone
        logger.debug("could not cancel a NeMo-Gym stream: %s", exc)
