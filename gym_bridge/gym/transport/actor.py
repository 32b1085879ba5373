"""The NeMo-Gym Ray actor: owns one set of Gym servers and streams converted rollouts.

Lifecycle: ``NemoGym(cfg, tokenizer)`` is cheap; the tokenizer travels once, with
the constructor arguments (shipping it per call would stall the actor's event loop
on deserialization), so Ray keeps it for restarts. ``spinup()`` starts the servers;
``shutdown()`` is idempotent and never raises.

Two streams, each an async generator consumed with ``num_returns="streaming"``:
``run_rollouts(rows, prefix)`` yields NeMo-RL's ``(rowidx, result, timing)`` per row, the
contract NeMo-RL's own rollout functions and manager consume; ``run_row_batches(rows, prefix)``
yields :class:`GymRowBatch` es (the rows that finished together, typed), which our
:class:`~gym_bridge.gym.transport.client.GymClient` consumes: one Ray message per batch instead of per row.

When Ray restarts the actor (``actor_options={"max_restarts": ...}``), the Gym servers
died with the old process. ``cfg.on_restart="fail"`` makes every call raise
:class:`NemoGymRestarted` (infrastructure) until ``spinup()`` is called again;
``"respin"`` starts fresh servers on the first call after the restart.

Errors raised inside the actor are typed and picklable (see
:mod:`gym_bridge.failures`): an HTTP error from ``/run`` is unwrapped
(:func:`~gym_bridge.failures.gym_run_failure`) and becomes ``EndpointConfigError``
(the model endpoint answered 4xx), ``GymRunError`` (Gym's ``agent_run_error``: an exception raised in Gym's
server code, deterministic for the row: :func:`~gym_bridge.failures.gym_chain.agent_run_error`),
``GymTransportError`` (infra status) or ``RolloutDataFailure``; a result that carries Gym's
``_ng_failure_class`` is that class's failure; a connection
error ``GymTransportError``; an expired ``request_timeout_s`` ``RolloutTimeout``;
bad rows and bad results ``RolloutDataFailure`` subclasses.

Every result is stamped with the ``_ng_*`` rollout identity of its row before it is converted
(:func:`~gym_bridge.gym.protocol.token_capture.stamp_identity`), as Gym's collection stamps every result it records,
whatever the agent echoes.

Rows are posted where Gym's ``RolloutCollectionHelper.run_examples`` posts them (JSON body,
``Content-Type: application/json``, no cookie jar): ``POST {server}/run`` of the environment server
in front of the row's agent, or of the agent itself when that server is the pass-through
``legacy_agent`` relay (one hop fewer) or there is none (Gym < 0.6); plus a bounded wait and no retry
loop. ``task_source`` rows are resolved by the routes Gym's own resolver computed at start
(:mod:`gym_bridge.gym.protocol.routing`). A materialized row (Gym 0.7's episode protocol: ``task_id`` = ``{taskset,
task_id}`` plus ``task_input``) is posted as Gym's episode request
(:func:`~gym_bridge.gym.protocol.episode.episode_request_body`) to ``/run`` of the environment server its taskset names
in the config's ``environment_server_routes``, and the reply is made Gym's record
(:func:`~gym_bridge.gym.protocol.episode.episode_record`): a ``result`` converted like any ``/run`` result, a handled
``failure`` raised typed (:func:`~gym_bridge.gym.protocol.episode.episode_failure`). With ``cfg.gym_head`` the server
set is a Gym that is already running: used, never started or stopped here
(:class:`~gym_bridge.gym.servers.attached.AttachedGym`, behind the same surface as a set it launches).

aiohttp, not httpx, because httpx's connection pool cost 4-8 ms of CPU per request at 256-1,024 requests in flight
against aiohttp's 0.6 ms (benchmarks/RESULTS.md), and this actor sends every row of every group in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import aiohttp

from gym_bridge.failures import (
    GymServerCrashLoop,
    GymServerDied,
    GymServerRestarting,
    GymServersError,
    InvalidGymRow,
    NemoGymRestarted,
    NemoGymServerRestarting,
    NemoGymUnavailable,
)
from gym_bridge.gym.protocol.episode import episode_request_body, episode_target
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY
from gym_bridge.gym.protocol.result import GymRowBatch, NemoRLRowResult
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.protocol.rows import ENVIRONMENT_SERVER_KEY, dispatch_target, is_materialized
from gym_bridge.gym.protocol.token_capture import TokenCapture
from gym_bridge.gym.servers.gym_set import GymSet
from gym_bridge.gym.servers.server_set import GymServers
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym.transport.admission import EndpointLoad
from gym_bridge.gym.transport.aggregate_metrics import aggregate_metrics
from gym_bridge.gym.transport.endpoint_load import read_endpoint_load
from gym_bridge.gym.transport.health import EndpointWatch, SharedWatch
from gym_bridge.gym.transport.row_convert import Conversion, counted_as
from gym_bridge.gym.transport.row_post import RowPost, http_client
from gym_bridge.gym.transport.set_routes import set_routes
from gym_bridge.gym.transport.stream_window import BATCH_WINDOW_S, failed, gather_window
from gym_bridge.json_types import JsonObject
from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)

_AGENT_SERVER_TYPE = "responses_api_agents"
_PROGRESS_EVERY = 10
_LOAD_TIMEOUT_S = 3.0
"""The bound on reading the model endpoints' ``/metrics`` for their load."""
_RESTART_WAIT_POLL_S = 0.25
"""How often rows waiting to be sent check whether a restarting Gym server answers again."""


class NemoGym:
    """The actor class; create it with :func:`start_nemo_gym_actor` (or NeMo-RL's ``spinup_nemo_gym_actor``)."""

    def __init__(self, cfg: NemoGymConfig | dict[str, Any], tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, NemoGymConfig) else NemoGymConfig.model_validate(cfg)
        self._servers: GymSet | None = None
        self._agent_urls: dict[str, str] = {}
        self._episode_urls: dict[str, str] = {}
        """environment server -> URL, for the materialized rows its tasksets route to it."""
        self._result_types: dict[str, str | None] = {}
        self._routes = GymRoutes(agents=())
        self._capture: TokenCapture | None = None
        self._tokenizer: Tokenizer | None = tokenizer
        self._client: aiohttp.ClientSession | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._spinup_lock = asyncio.Lock()
        self._health: SharedWatch[GymSet] = SharedWatch(self._watch_servers, "nemo-gym-health-watch")
        self._restarted = _was_restarted()
        self._endpoints = EndpointWatch(self.cfg.base_urls, self.cfg.connect_timeout_s)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def spinup(self) -> dict[str, str]:
        """Start the Gym servers; return agent name -> URL."""
        async with self._spinup_lock:
            if self._servers is not None:
                raise GymServersError("spinup() was already called")
            await self._start_servers()
        return dict(self._agent_urls)

    async def _spinup(self) -> dict[str, str]:
        """NeMo-RL's name for :meth:`spinup`."""
        return await self.spinup()

    async def _start_servers(self) -> None:
        servers = GymServers(self.cfg.servers_config())
        self._servers = servers
        try:
            await asyncio.to_thread(servers.start)
            self._capture = await self._token_capture(servers)
        except BaseException:
            self._servers = None
            await asyncio.to_thread(servers.stop)
            raise
        self._restarted = False
        types, urls = servers.server_types, servers.server_urls
        agents = sorted(name for name in urls if types.get(name) == _AGENT_SERVER_TYPE)
        self._routes, self._episode_urls = set_routes(servers, agents)
        self._agent_urls = {agent: urls[self._routes.dispatch.get(agent, agent)] for agent in agents}
        self._result_types = servers.server_impls
        if self._capture is not None:  # the agents whose results Gym finalises
            self._capture.read_participants(servers.global_config, agents)
        if not self._agent_urls and not self._episode_urls:
            logger.warning("NeMo-Gym started without any agent server: %s", sorted(urls))

    async def _token_capture(self, servers: GymSet) -> TokenCapture | None:
        """The set's token capture store (:attr:`GymSet.token_capture`), opened; None when capture is off."""
        store = servers.token_capture
        if store is None:
            return None
        if store.folder is None:
            raise NemoGymUnavailable(
                f"the running NeMo-Gym at {self.cfg.gym_head} captures token ids (token_id_capture) without a "
                "dir: gym-bridge reads the captures from Gym's file store, so set token_id_capture.dir in the "
                "config that Gym is started with"
            )
        return await asyncio.to_thread(TokenCapture, store.folder, store.block)

    async def _ready(self) -> GymSet:
        """The running servers; after a Ray restart, re-spin or raise as ``cfg.on_restart`` says."""
        if self._servers is None and self._restarted:
            if self.cfg.on_restart == "fail":
                raise NemoGymRestarted(
                    "Ray restarted this NemoGym actor and its Gym servers died with the old process; "
                    "call spinup() again, or set NemoGymConfig.on_restart='respin'"
                )
            async with self._spinup_lock:
                if self._servers is None:
                    logger.warning("NemoGym actor was restarted by Ray: starting fresh Gym servers")
                    await self._start_servers()
        if self._servers is None:
            raise NemoGymUnavailable("spinup() was never called on this NemoGym actor, or it was shut down")
        return self._servers

    async def set_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Install the tokenizer rows are decoded with, replacing any earlier one (NeMo-RL's distillation
        re-installs it this way)."""
        self._tokenizer = tokenizer

    async def health_check(self) -> None:
        """Raise :class:`NemoGymUnavailable` if unspun or a Gym server died (named); callers bound this."""
        self._check_servers(await self._ready(), "health check")

    async def agent_names(self) -> list[str]:
        await self._ready()
        return sorted(self._agent_urls)

    async def routes(self) -> GymRoutes:
        """Where this server set sends rows: agents, their entry servers, ``task_source`` resolution."""
        await self._ready()
        return self._routes

    async def endpoint_load(self) -> EndpointLoad:
        """The model endpoints' waiting and running requests from their ``/metrics`` (vLLM's gauges), bounded."""
        return await read_endpoint_load(self.cfg.base_urls, _LOAD_TIMEOUT_S)

    async def aggregate_metrics(self, groups: dict[str, list[JsonObject]], timeout_s: float) -> dict[str, JsonObject]:
        """Each scoring server's ``/aggregate_metrics`` answer for the metrics rows of the rollouts it ran (server ->
        answer; :mod:`gym_bridge.gym.transport.aggregate_metrics`)."""
        servers = await self._ready()
        return await aggregate_metrics(self._http_client(), servers.server_urls, groups, timeout_s)

    async def server_info(self) -> dict[str, Any]:
        """Gym's server URLs, process ids and log folder, for diagnostics and tests."""
        servers = self._servers
        if servers is None:
            return {
                "urls": {},
                "pids": [],
                "server_pids": {},
                "server_types": {},
                "server_impls": {},
                "log_dir": None,
                "head": None,
                "attached": False,
            }
        return {
            "urls": servers.server_urls,
            "pids": sorted(servers.pids()),
            "server_pids": servers.server_pids,
            "server_types": servers.server_types,
            "server_impls": servers.server_impls,
            "log_dir": str(servers.log_dir),
            "head": servers.head.url if servers.head else None,
            "attached": servers.attached,
        }

    async def shutdown(self) -> None:
        """Stop the servers and the client; idempotent, never raises."""
        servers, self._servers = self._servers, None
        client, self._client = self._client, None
        executor, self._executor = self._executor, None
        self._agent_urls = {}
        self._episode_urls = {}
        self._routes = GymRoutes(agents=())
        self._capture = None
        try:
            if client is not None:
                await client.close()
        except Exception:
            logger.exception("closing the NeMo-Gym client failed")
        try:
            if servers is not None:
                await asyncio.to_thread(servers.stop)
        except Exception:
            logger.exception("stopping the NeMo-Gym servers failed")
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    # ---- rollouts -----------------------------------------------------------------------------

    async def run_rollouts(
        self,
        nemo_gym_examples: Sequence[JsonObject],
        timer_prefix: str = "timing/rollout",
        deduplicate_multimodal_data: bool = False,
    ) -> AsyncIterator[tuple[int, NemoRLRowResult, dict[str, float] | None]]:
        """NeMo-RL's stream: ``(rowidx, result, timing)`` per row in completion order, ``timing`` on the last.

        ``result`` is NeMo-RL's dict (:meth:`GymRowResult.as_nemo_rl_result`). NeMo-RL's third argument,
        ``deduplicate_multimodal_data``, changes nothing here: the converted rows carry no media to leave out.
        """
        async for batch in self.run_row_batches(nemo_gym_examples, timer_prefix):
            last = len(batch.rows) - 1
            for i, row in enumerate(batch.rows):
                yield row.row_index, row.as_nemo_rl_result(), batch.timing if i == last else None

    async def run_row_batches(
        self, rows: Sequence[JsonObject], timer_prefix: str = "timing/rollout"
    ) -> AsyncIterator[GymRowBatch]:
        """Yield :class:`GymRowBatch` es in completion order, each row's ``row_index`` its ``_rowidx``.

        Every row is posted to its agent's ``/run`` at once. Rows that finish within
        ``BATCH_WINDOW_S`` of the first unsent one, or while a batch is being converted,
        travel together in one element (one Ray message instead of one per row). The
        element that completes the call carries ``timing``: ``{prefix}/await_results``,
        ``{prefix}/postprocess_results`` and ``{prefix}/postprocess_results_pct``
        (seconds; pct of this generator's own time, consumer time excluded).
        The first failure ends the stream and cancels the rows still in flight.
        """
        servers = await self._ready()
        if not rows:
            raise InvalidGymRow("run_rollouts() needs at least one row")
        if self._tokenizer is None:
            raise NemoGymUnavailable("set_tokenizer must be called before run_rollouts")
        urls = [self._route(i, row) for i, row in enumerate(rows)]
        poster = RowPost(self._http_client(), self.cfg.request_timeout_s, self._capture, self._raise_if_a_server_died)
        conversion = Conversion(self._tokenizer, self.cfg, self._result_types)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        consumer_s = await_s = postprocess_s = 0.0
        pending = Counter(counted_as(row) for row in rows)
        await self._await_restarts(servers)
        finished: asyncio.Queue[asyncio.Task[Any]] = asyncio.Queue()
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(poster.post(url, row)) for url, row in zip(urls, rows, strict=True)
        ]
        for task in tasks:
            task.add_done_callback(finished.put_nowait)
        # The watch only ever finishes by raising (a Gym server died), which fails every stream.
        watch = self._health.join(servers)
        watch.add_done_callback(finished.put_nowait)
        remaining = len(rows)
        try:
            while remaining:
                t0 = time.perf_counter()
                ready = await gather_window(finished, remaining, BATCH_WINDOW_S)
                failure = next((task for task in ready if failed(task)), None)
                if failure is not None and failure is not watch and len(ready) > 1:
                    ready.remove(failure)  # the rows that finished before it travel first
                    finished.put_nowait(failure)
                posted = [task.result() for task in ready]  # raises a failure that came alone
                t1 = time.perf_counter()
                batch = await loop.run_in_executor(self._convert_executor(), partial(conversion.batch, posted))
                t2 = time.perf_counter()
                await_s += t1 - t0
                postprocess_s += t2 - t1
                remaining -= len(batch)
                for row, _, _ in posted:
                    pending[counted_as(row)] -= 1
                timing = None
                if not remaining:
                    total = t2 - started - consumer_s
                    timing = {
                        f"{timer_prefix}/await_results": await_s,
                        f"{timer_prefix}/postprocess_results": postprocess_s,
                        f"{timer_prefix}/postprocess_results_pct": 100.0 * postprocess_s / total if total > 0 else 0.0,
                    }
                elif (done := len(rows) - remaining) // _PROGRESS_EVERY > (done - len(batch)) // _PROGRESS_EVERY:
                    busiest = [(n, c) for n, c in pending.most_common(5) if c > 0]
                    logger.info("NeMo-Gym rollouts: %d/%d done; remaining by agent: %s", done, len(rows), busiest)
                y0 = time.perf_counter()
                yield GymRowBatch(batch, timing)
                consumer_s += time.perf_counter() - y0
        finally:
            self._health.leave(watch, finished.put_nowait)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _check_servers(servers: GymSet, when: str) -> None:
        """A dead server as a failure of the rows in flight (re-sent by the retry policy); a server past its last
        restart (:class:`GymServerCrashLoop`) as it is, which stops the run."""
        try:
            servers.poll()
        except GymServerCrashLoop:
            raise
        except GymServerRestarting as exc:
            raise NemoGymServerRestarting(f"{when}: {exc}") from None
        except GymServerDied as exc:
            raise NemoGymUnavailable(f"{when}: {exc}") from None

    async def _await_restarts(self, servers: GymSet) -> None:
        """Before rows are sent: wait while a server restarts (at most ``startup_timeout_s``), so rows re-sent after
        a crash reach the new server instead of failing at the dead one."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            try:
                self._check_servers(servers, "before dispatch")
                return
            except NemoGymServerRestarting as exc:
                if time.monotonic() >= deadline:
                    raise NemoGymUnavailable(f"{exc}; not answering after {self.cfg.startup_timeout_s:g} s") from None
            await asyncio.sleep(_RESTART_WAIT_POLL_S)

    async def _watch_servers(self, servers: GymSet) -> None:
        """Poll Gym's processes and the model endpoints while rows are in flight; a dead one fails the stream, named.

        Gym's own client retries a refused connection forever, so without this a dead
        resources server or model endpoint would only surface at the group deadline.
        """
        while True:
            await asyncio.sleep(self.cfg.health_poll_s)
            self._check_servers(servers, "while rows were in flight")
            await self._endpoints.check()

    def _route(self, i: int, row: Any) -> str:
        """The URL a row is posted to, checking the row before anything is sent.

        A row that names only its ``task_source`` gains ``agent_ref`` (this actor's copy), as Gym's collection
        stamps it. The URL is the agent's entry server: the environment server in front of it when that server
        does work of its own, else the agent itself (a ``legacy_agent`` relay forwards ``/run`` unchanged).
        A materialized row goes to the environment server its taskset routes to, stamped with it
        (``_ng_environment_server``, as Gym stamps it), its episode request checked here."""
        if isinstance(row, dict) and is_materialized(row):
            _, server = episode_target(row, i, self._routes)
            try:
                episode_request_body(row)
            except InvalidGymRow as exc:
                raise InvalidGymRow(f"row {i} ({ROW_INDEX_KEY}={row[ROW_INDEX_KEY]}): {exc}") from None
            row[ENVIRONMENT_SERVER_KEY] = server
            return self._episode_urls[server]
        _, name = dispatch_target(row, i, self._routes)
        if row.get("agent_ref") is None:
            row["agent_ref"] = {"name": name}
        return self._agent_urls[name]

    def _http_client(self) -> aiohttp.ClientSession:
        """The session towards Gym's servers (:func:`~gym_bridge.gym.transport.row_post.http_client`), made on the
        actor's loop at first use."""
        if self._client is None:
            self._client = http_client(self.cfg.max_connections, self.cfg.connect_timeout_s)
        return self._client

    def _convert_executor(self) -> ThreadPoolExecutor:
        # One thread: conversion stays off the event loop, and the tokenizer is used by one thread at a time.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemo-gym-convert")
        return self._executor

    def _raise_if_a_server_died(self, where: str) -> None:
        """After a failed /run, name a dead Gym server (the likely cause) instead of a nested 500."""
        if self._servers is None:
            raise NemoGymUnavailable(f"{where}: the NemoGym actor was shut down")
        self._check_servers(self._servers, f"{where} failed because a Gym server died")


def _was_restarted() -> bool:
    """Whether this process is a Ray restart of the actor (False outside Ray)."""
    try:
        import ray

        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside an actor
        return False
