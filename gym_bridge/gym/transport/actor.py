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
(:func:`~gym_bridge.gym.protocol.rows.episode_request_body`) to ``/run`` of the environment server its taskset names in
the config's ``environment_server_routes``, and the reply is made Gym's record
(:func:`~gym_bridge.gym.protocol.convert.episode_record`): a ``result`` converted like any ``/run`` result, a handled
``failure`` raised typed (:func:`~gym_bridge.gym.protocol.convert.episode_failure`). With ``cfg.gym_head`` the server
set is a Gym that is already running: used, never started or stopped here (:class:`GymServers`).

aiohttp, not httpx, because httpx's connection pool cost 4-8 ms of CPU per request at 256-1,024 requests in flight
against aiohttp's 0.6 ms (benchmarks/RESULTS.md), and this actor sends every row of every group in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.text import shown
from gym_bridge.failures import (
    GymResultError,
    GymServerDied,
    GymServersError,
    GymTransportError,
    InvalidGymRow,
    NemoGymRestarted,
    NemoGymUnavailable,
    RolloutTimeout,
    deadline,
    gym_run_failure,
    shorten,
)
from gym_bridge.failures.classify import gym_failure_class_failure
from gym_bridge.failures.gym_chain import agent_run_error
from gym_bridge.gym.protocol.convert import (
    ENVIRONMENT_SERVER_FAILED,
    FAILURE_CLASS_KEY,
    convert_gym_result,
    episode_failure,
    episode_record,
    is_episode_response,
)
from gym_bridge.gym.protocol.result import GymRowBatch, GymRowResult, NemoRLRowResult
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.protocol.rows import (
    ENVIRONMENT_SERVER_KEY,
    ROW_INDEX_KEY,
    EpisodeRoutes,
    dispatch_target,
    episode_request_body,
    episode_target,
    is_materialized,
    row_label,
)
from gym_bridge.gym.protocol.token_capture import (
    CAPTURE_KEY,
    CaptureBuild,
    TokenCapture,
    capture_block,
    stamp_identity,
    with_capture_dir,
)
from gym_bridge.gym.servers.server_set import GymServers
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym.transport.admission import EndpointLoad
from gym_bridge.gym.transport.endpoint_load import read_endpoint_load
from gym_bridge.gym.transport.health import EndpointWatch, SharedWatch
from gym_bridge.gym.transport.stream_window import BATCH_WINDOW_S, failed, gather_window
from gym_bridge.gym_versions import installed_gym
from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)

_AGENT_SERVER_TYPE = "responses_api_agents"
_ERROR_BODY_LIMIT = 65536  # Gym nests each server's error escaped inside the next: keep it whole to unwrap it
_PROGRESS_EVERY = 10
_LOAD_TIMEOUT_S = 3.0
"""The bound on reading the model endpoints' ``/metrics`` for their load."""
_JSON_HEADERS = {"Content-Type": "application/json"}
_FAILURE_CLASS_KEY = FAILURE_CLASS_KEY
_RESULT_TYPE_KEY = "_ng_result_type"
"""Gym's stamp of the implementation of the environment server that produced a record."""
_ENVIRONMENT_TYPE = "environment_servers"


class NemoGym:
    """The actor class; create it with :func:`start_nemo_gym_actor` (or NeMo-RL's ``spinup_nemo_gym_actor``)."""

    def __init__(self, cfg: NemoGymConfig | dict[str, Any], tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, NemoGymConfig) else NemoGymConfig.model_validate(cfg)
        self._servers: GymServers | None = None
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
        self._health: SharedWatch[GymServers] = SharedWatch(self._watch_servers, "nemo-gym-health-watch")
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
        config = self.cfg.servers_config()
        if config.head_url is None:
            default_dir = config.log_dir / "token-captures" if config.log_dir else None
            overrides, capture_dir = with_capture_dir(config.overrides, default_dir)
            if capture_dir is not None:
                config = config.model_copy(update={"overrides": overrides})
                self._capture = await asyncio.to_thread(TokenCapture, capture_dir, overrides[CAPTURE_KEY])
        servers = GymServers(config)
        self._servers = servers
        try:
            await asyncio.to_thread(servers.start)
            if servers.attached:
                await self._use_running_gym(servers)
        except BaseException:
            self._servers = None
            await asyncio.to_thread(servers.stop)
            raise
        self._restarted = False
        types, urls = servers.server_types, servers.server_urls
        agents = sorted(name for name in urls if types.get(name) == _AGENT_SERVER_TYPE)
        self._routes = self._routes_of(servers, agents)
        self._agent_urls = {agent: urls[self._routes.dispatch.get(agent, agent)] for agent in agents}
        self._result_types = servers.server_impls
        if self._capture is not None:  # the agents whose results Gym finalises
            self._capture.read_participants(servers.global_config, agents)
        if not self._agent_urls and not self._episode_urls:
            logger.warning("NeMo-Gym started without any agent server: %s", sorted(urls))

    async def _use_running_gym(self, servers: GymServers) -> None:
        """A running Gym's own token capture (its config's ``token_id_capture``, read from its file store ``dir``),
        and a warning when its model server calls other endpoints than ``base_urls`` or another model name."""
        config = servers.global_config
        block = capture_block(config)
        if block is not None:
            if not block.get("dir"):
                raise NemoGymUnavailable(
                    f"the running NeMo-Gym at {self.cfg.gym_head} captures token ids (token_id_capture) without a "
                    "dir: gym-bridge reads the captures from Gym's file store, so set token_id_capture.dir in the "
                    "config that Gym is started with"
                )
            self._capture = await asyncio.to_thread(TokenCapture, Path(str(block["dir"])), block)
        theirs = config.get("policy_base_url")
        theirs_list = [theirs] if isinstance(theirs, str) else list(theirs) if isinstance(theirs, list) else []
        if sorted(u.rstrip("/") for u in map(str, theirs_list)) != sorted(u.rstrip("/") for u in self.cfg.base_urls):
            logger.warning(
                "the running NeMo-Gym at %s calls the endpoints %s (its policy_base_url), not base_urls %s: those "
                "were preflighted and are watched, Gym's model server calls its own",
                self.cfg.gym_head,
                theirs_list,
                self.cfg.base_urls,
            )
        model = config.get("policy_model_name")
        if isinstance(model, str) and model != self.cfg.model_name:
            logger.warning(
                "the running NeMo-Gym at %s asks its endpoints for model %r, not model_name %r",
                self.cfg.gym_head,
                model,
                self.cfg.model_name,
            )

    def _routes_of(self, servers: GymServers, agents: list[str]) -> GymRoutes:
        """The routes of the server set: Gym's resolver's table, plus (Gym 0.7) the taskset routes of its episode
        protocol, each checked to name a running environment server as Gym's collection checks it."""
        routes = GymRoutes.from_json(servers.routes, agents)
        self._episode_urls = {}
        if not installed_gym().episode_protocol:
            return routes
        types, urls = servers.server_types, servers.server_urls
        tasksets: dict[str, str] = {}
        errors: dict[str, str] = {}
        for taskset, server in servers.environment_server_routes.items():
            if types.get(server) == _ENVIRONMENT_TYPE and server in urls:
                tasksets[taskset] = server
                self._episode_urls[server] = urls[server]
            else:
                running = sorted(name for name, kind in types.items() if kind == _ENVIRONMENT_TYPE)
                errors[taskset] = (
                    f"environment_server_routes names {server!r}, which is not a running environment server of the "
                    f"launched Gym config (environment servers: {', '.join(running) or '(none)'})"
                )
        return EpisodeRoutes(
            agents=routes.agents,
            dispatch=routes.dispatch,
            dispatch_errors=routes.dispatch_errors,
            task_sources=routes.task_sources,
            task_source_errors=routes.task_source_errors,
            tasksets=tasksets,
            taskset_errors=errors,
        )

    async def _ready(self) -> GymServers:
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

    async def server_info(self) -> dict[str, Any]:
        """Gym's server URLs, process ids and log folder, for diagnostics and tests."""
        servers = self._servers
        if servers is None:
            return {
                "urls": {},
                "pids": [],
                "server_pids": {},
                "server_types": {},
                "log_dir": None,
                "head": None,
                "attached": False,
            }
        return {
            "urls": servers.server_urls,
            "pids": sorted(servers.pids()),
            "server_pids": servers.server_pids,
            "server_types": servers.server_types,
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
        nemo_gym_examples: Sequence[dict[str, Any]],
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
        self, rows: Sequence[dict[str, Any]], timer_prefix: str = "timing/rollout"
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
        client = self._http_client()
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        consumer_s = await_s = postprocess_s = 0.0
        pending = Counter(_label(row) for row in rows)
        self._check_servers(servers, "before dispatch")
        finished: asyncio.Queue[asyncio.Task[Any]] = asyncio.Queue()
        tasks: list[asyncio.Task[Any]] = [
            asyncio.create_task(self._post(client, url, row)) for url, row in zip(urls, rows, strict=True)
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
                batch = await loop.run_in_executor(self._convert_executor(), partial(self._convert_batch, posted))
                t2 = time.perf_counter()
                await_s += t1 - t0
                postprocess_s += t2 - t1
                remaining -= len(batch)
                for row, _, _ in posted:
                    pending[_label(row)] -= 1
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
    def _check_servers(servers: GymServers, when: str) -> None:
        try:
            servers.poll()
        except GymServerDied as exc:
            raise NemoGymUnavailable(f"{when}: {exc}") from None

    async def _watch_servers(self, servers: GymServers) -> None:
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
        """The session towards the agents, made on the actor's loop at first use.

        Its cookie jar stores nothing, as Gym's does: a stored session cookie would send
        later rows into an earlier row's resources-server session and pin its policy URL.
        Deadlines are ours (``deadline``), so the session has none of its own but the TCP
        connect (``sock_connect``). Not aiohttp's ``connect``, which also counts the wait for a
        free connection in the pool: with more rows in flight than ``max_connections`` a row
        queues there for as long as the rows ahead of it take, bounded by ``request_timeout_s``.
        """
        if self._client is None:
            cfg = self.cfg
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0),
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s),
                trust_env=False,
            )
        return self._client

    def _convert_executor(self) -> ThreadPoolExecutor:
        # One thread: conversion stays off the event loop, and the tokenizer is used by one thread at a time.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemo-gym-convert")
        return self._executor

    async def _post(
        self, client: aiohttp.ClientSession, url: str, row: dict[str, Any]
    ) -> tuple[dict[str, Any], bytes, CaptureBuild | None]:
        """POST one row; ``(row, result body, capture build)``, the body finalised with its captured token ids when
        Gym's collection would finalise it (``token_id_capture`` on, the row's agent taking part)."""
        episode = is_materialized(row)
        agent = _label(row)
        where = f"NeMo-Gym /run at {url} for {ROW_INDEX_KEY}={row[ROW_INDEX_KEY]} ({_describe(row)})"
        # bytes, as aiohttp sends them: no str in between; a materialized row as Gym's episode request
        request = orjson.dumps(episode_request_body(row) if episode else row)
        capture = (
            self._capture if self._capture is not None and not episode and self._capture.participates(agent) else None
        )
        if capture is not None:
            capture.clear(row)
        try:
            async with (
                deadline(self.cfg.request_timeout_s, where),
                client.post(f"{url}/run", data=request, headers=_JSON_HEADERS) as response,
            ):
                status, body = response.status, await response.read()
        except RolloutTimeout:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._raise_if_a_server_died(where)
            raise GymTransportError(f"{where} failed in transport: {type(exc).__name__}: {exc}") from None
        if status >= 400:
            error_body = body[:_ERROR_BODY_LIMIT]
            failure = gym_run_failure(status, error_body, where)
            if isinstance(failure, GymTransportError):
                failure = agent_run_error(status, error_body, where) or failure
            if isinstance(failure, GymTransportError):
                self._raise_if_a_server_died(where)
            raise failure
        if capture is None:
            return row, body, None
        return (row, *await self._finalized(capture, row, body, where))

    @staticmethod
    async def _finalized(
        capture: TokenCapture, row: dict[str, Any], body: bytes, where: str
    ) -> tuple[bytes, CaptureBuild | None]:
        """The result with its captured token ids (:mod:`gym_bridge.gym.protocol.token_capture`), as JSON bytes
        again, and the build. A failure row (``_ng_failure_class``) is no rollout: Gym finalises none, nor do we."""
        try:
            result = _loads(body, f"{where}: /run answer")
        except UntrustedInputError as exc:
            raise GymResultError(str(exc)) from None
        if not isinstance(result, dict) or result.get(_FAILURE_CLASS_KEY):
            return body, None  # the converter names what is wrong with it
        build = await capture.finalize(row, result)
        return orjson.dumps(result), build

    def _raise_if_a_server_died(self, where: str) -> None:
        """After a failed /run, name a dead Gym server (the likely cause) instead of a nested 500."""
        if self._servers is None:
            raise NemoGymUnavailable(f"{where}: the NemoGym actor was shut down")
        self._check_servers(self._servers, f"{where} failed because a Gym server died")

    def _convert_batch(self, posted: list[tuple[dict[str, Any], bytes, CaptureBuild | None]]) -> list[GymRowResult]:
        return [self._convert(row, body, capture) for row, body, capture in posted]

    def _convert(self, row: dict[str, Any], body: bytes, capture: CaptureBuild | None = None) -> GymRowResult:
        """One result as its :class:`GymRowResult`: Gym's failure row raised as its class, the row's ``_ng_*``
        identity stamped, the message log built, the capture build kept."""
        rowidx = row[ROW_INDEX_KEY]
        try:
            result = _loads(body, f"{ROW_INDEX_KEY}={rowidx}: /run answer")
        except UntrustedInputError as exc:
            raise GymResultError(str(exc)) from None
        where = f"{ROW_INDEX_KEY}={rowidx} ({_describe(row)})"
        episode = is_materialized(row)
        if episode and is_episode_response(result):  # the reply to Gym's episode request: Gym's record of it
            try:
                result = episode_record(result)
            except GymResultError as exc:
                raise GymResultError(f"{where}: {exc}") from None
        if isinstance(result, dict):
            failure_class = result.get(_FAILURE_CLASS_KEY)
            if failure_class == ENVIRONMENT_SERVER_FAILED:
                raise episode_failure(result, where)
            if isinstance(failure_class, str) and failure_class:
                detail = result.get("_ng_failure_message") or result.get("error") or "(no message)"
                raise gym_failure_class_failure(failure_class, f"{where}: {shorten(str(detail))}")
            stamp_identity(row, result)
            if episode:  # every record names the environment server that ran it and its type, as Gym's does
                server = row.get(ENVIRONMENT_SERVER_KEY)
                result[ENVIRONMENT_SERVER_KEY] = server
                result[_RESULT_TYPE_KEY] = self._result_types.get(server) if isinstance(server, str) else None
        assert self._tokenizer is not None  # run_rollouts refuses to start without one
        try:
            converted = convert_gym_result(
                result,
                self._tokenizer,
                row_index=rowidx,
                on_drift=self.cfg.on_drift,
                invalid_tool_call_patterns=self.cfg.invalid_tool_call_patterns,
                thinking_tags=self.cfg.thinking_tags,
            )
        except GymResultError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        converted.capture = capture
        return converted


def _label(row: dict[str, Any]) -> str:
    """What a row's progress and messages are counted under: its agent, or a materialized row's environment server."""
    return row_label(row) or "(unrouted)"


def _describe(row: dict[str, Any]) -> str:
    """The row's destination for messages: ``agent 'x'``, or a materialized row's ``environment server 'y' (taskset
    't')``."""
    if is_materialized(row):
        return f"environment server {row.get(ENVIRONMENT_SERVER_KEY)!r}, taskset {row['task_id'].get('taskset')!r}"
    return f"agent {_label(row)!r}"


def _loads(body: bytes, where: str) -> Any:
    """The boundary's decoder (depth-bounded); for a body it refuses that holds ``NaN`` or ``Infinity`` (Python's
    json writes them), the stdlib within the same depth, so a NaN logprob is reported as such by the conversion."""
    try:
        return json_io.loads(body, where)
    except UntrustedInputError:
        if b"NaN" not in body and b"Infinity" not in body:
            raise
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise UntrustedInputError(f"{where}: not valid JSON ({shown(exc)})") from None
    if json_io.depth(value, stop_after=json_io.MAX_DEPTH) > json_io.MAX_DEPTH:
        raise UntrustedInputError(f"{where}: nested deeper than {json_io.MAX_DEPTH} levels")
    return value


def _was_restarted() -> bool:
    """Whether this process is a Ray restart of the actor (False outside Ray)."""
    try:
        import ray

        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside an actor
        return False
