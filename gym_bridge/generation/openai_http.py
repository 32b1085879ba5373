"""A :class:`GenerationInterface` over OpenAI-compatible ``/v1/completions`` endpoints (ours or vLLM).

Token in, token out: each row is one ``POST {base_url}/completions`` whose ``prompt``
is the row's token ids, in vLLM's completions dialect (``return_token_ids``,
``return_tokens_as_token_ids``, ``logprobs``). The output follows the local backend
(:mod:`gym_bridge.generation.hf`) exactly: ``output_ids`` = input + generated,
right-padded with ``pad_token_id``; ``logprobs`` zero on prompt and padding;
``truncated`` = ``finish_reason == "length"``; plus ``gen_leader_worker_idx``, the
index of the base URL that served each row. Requests are routed across base URLs
by :class:`~gym_bridge.generation.routing.SessionRouter` (sticky per session,
least-loaded otherwise); the data dict's optional ``session_ids`` list names each
row's session. Rows may carry their own ``temperature`` / ``top_p`` / ``top_k`` /
``max_new_tokens`` / ``seed`` (lists, ``None`` = the config's value, or no seed), as
:class:`~gym_bridge.generation.hf.HFGeneration` does.

Failures, per row:

- connection errors, timeouts, HTTP 5xx/408/429: retried up to ``max_retries``
  times with capped exponential backoff; a connection error also takes its URL out
  of rotation for ``unhealthy_cooldown_s``, so the retry (and the row's session)
  moves to another URL. Exhausted → :class:`~gym_bridge.failures.GenerationUnavailable`.
- any other 4xx: :class:`~gym_bridge.failures.RolloutDataFailure`, not retried.
- an answer larger than :data:`~gym_bridge.generation.upstream_answer.MAX_ANSWER_BYTES` (raw or decompressed),
  not JSON, or without the fields we need checked (token ids in the vocabulary, logprobs finite and <= 0, a
  known finish reason): ``RolloutDataFailure`` naming the field, ``http_status`` 502.

An error raised for an HTTP status carries it as ``exc.http_status`` (for a proxy
that hands the status on: a 429 stays a 429); others have ``http_status = None``.

Every attempt is bounded by ``request_timeout_s`` (time spent waiting for one of the
``max_connections`` pooled connections per URL is not counted: it is bounded by the
requests ahead of it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.text import shown
from gym_bridge.failures import (
    EngineShutDownError,
    GenerationUnavailable,
    GymBridgeError,
    NoHealthyShards,
    RolloutDataFailure,
    RolloutFailure,
    gather_cancel_siblings,
    http_status_is_infra,
    shorten,
)
from gym_bridge.generation.batch import assemble_output
from gym_bridge.generation.completions_wire import (
    bad_answer,
    check_batch,
    completion_request,
    parse_completion,
    row_value,
)
from gym_bridge.generation.openai_http_config import OpenAIHTTPGenerationConfig
from gym_bridge.generation.routing import SessionRouter
from gym_bridge.generation.upstream_answer import read_response_async
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import GenerationDatumSpec, GenerationOutputSpec

logger = logging.getLogger(__name__)

_BODY_LIMIT = 200
_NO_SERVER = -1  # gen_leader_worker_idx of a row answered without a request (max_new_tokens == 0)


@dataclass
class OpenAIHTTPStats:
    """Counters (reset by :meth:`OpenAIHTTPGeneration.clear_logger_metrics`)."""

    requests_per_url: dict[str, int] = field(default_factory=dict)
    """HTTP attempts sent to each base URL."""
    retries: int = 0
    failovers: int = 0
    """Retries that went to a different URL than the failed attempt, plus sessions re-pinned."""
    rows_completed: int = 0
    infra_errors: int = 0
    data_errors: int = 0


@dataclass
class _RowResult:
    tokens: list[int]
    logprobs: list[float]
    truncated: bool
    url_idx: int


class BlockingCallInEventLoop(GymBridgeError, RuntimeError):
    """:meth:`OpenAIHTTPGeneration.generate` blocks, so it is refused inside a running event loop."""


class _Retryable(GymBridgeError):
    """One attempt failed in a way worth retrying; ``connection`` marks the URL unhealthy."""

    def __init__(self, message: str, *, connection: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.connection = connection
        self.status = status


def _with_status(exc: RolloutFailure, status: int | None) -> RolloutFailure:
    exc.http_status = status
    return exc


class _LoopResources:
    """httpx clients and connection semaphores for one event loop (httpx clients are loop-bound)."""

    def __init__(self, cfg: OpenAIHTTPGenerationConfig, transport: httpx.AsyncBaseTransport | None) -> None:
        headers = {}
        if cfg.api_key is not None and cfg.api_key.get_secret_value():
            headers["Authorization"] = f"Bearer {cfg.api_key.get_secret_value()}"
        # Pool waits are bounded by our semaphore; the attempt itself by request_timeout_s.
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None)
        limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
        self.clients = [
            httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits, transport=transport)
            for url in cfg.base_urls
        ]
        self.slots = [asyncio.Semaphore(cfg.max_connections) for _ in cfg.base_urls]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)


class OpenAIHTTPGeneration(GenerationInterface):
    """Generation over OpenAI-compatible HTTP endpoints; see the module docstring."""

    #: Rows may carry their own temperature / top_p / top_k / max_new_tokens / seed.
    supports_per_request_sampling = True

    def __init__(
        self,
        cfg: OpenAIHTTPGenerationConfig | JsonMapping,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """``transport`` replaces the network for every URL (tests: ``httpx.MockTransport``); ``vocab_size``, when
        given, bounds the token ids an answer may hold (else int64 does)."""
        if not isinstance(cfg, OpenAIHTTPGenerationConfig):
            cfg = OpenAIHTTPGenerationConfig(**dict(cfg))
        self.cfg = cfg
        self.vocab_size = vocab_size
        self._transport = transport
        self.router = SessionRouter(
            len(cfg.base_urls), max_sessions=cfg.max_sessions, cooldown_s=cfg.unhealthy_cooldown_s
        )
        self.stats = OpenAIHTTPStats(requests_per_url={u: 0 for u in cfg.base_urls})
        self._lock = threading.Lock()
        self._resources: dict[asyncio.AbstractEventLoop, _LoopResources] = {}
        self._private_loop: asyncio.AbstractEventLoop | None = None
        self._private_thread: threading.Thread | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    # ------------------------------------------------------------------ public API

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate every row concurrently on a private event loop thread (blocking).

        Raises:
            BlockingCallInEventLoop: called from inside a running event loop (use :meth:`generate_async`).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise BlockingCallInEventLoop(
                "OpenAIHTTPGeneration.generate blocks; inside an event loop use generate_async"
            )
        self._check_open()
        input_ids, lengths = check_batch(data)
        future = asyncio.run_coroutine_threadsafe(self._generate_all(data, greedy), self._ensure_private_loop())
        results = future.result()
        out = assemble_output(input_ids, lengths, results, self.cfg.pad_token_id)
        out["gen_leader_worker_idx"] = [r.url_idx for r in results]
        return out

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row index, single-row output)`` as each row's request finishes.

        The first failing row cancels the others and its typed error propagates;
        cancelling (or closing) the iteration cancels the requests still in flight.
        """
        self._check_open()
        input_ids, lengths = check_batch(data)
        tasks = {asyncio.ensure_future(self._generate_row(data, i, greedy)): i for i in range(input_ids.shape[0])}
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=tasks.__getitem__):
                    i = tasks.pop(task)
                    res = task.result()
                    out = assemble_output(input_ids[i : i + 1], lengths[i : i + 1], [res], self.cfg.pad_token_id)
                    out["gen_leader_worker_idx"] = [res.url_idx]
                    yield i, out
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def shutdown(self) -> bool:
        """Close every httpx client and stop the private loop; idempotent."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            resources = list(self._resources.items())
            self._resources.clear()
            private_loop, private_thread = self._private_loop, self._private_thread
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, res in resources:
            if loop.is_closed():
                continue
            if loop is current:
                self._closing.add(task := loop.create_task(res.aclose()))
                task.add_done_callback(self._closing.discard)
            elif loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(res.aclose(), loop).result(timeout=self.cfg.connect_timeout_s)
                except (TimeoutError, RuntimeError):  # a loop that cannot close them in time drops them
                    logger.warning("could not close HTTP clients on a foreign event loop")
            else:
                loop.run_until_complete(res.aclose())
        if private_loop is not None and private_thread is not None:
            private_loop.call_soon_threadsafe(private_loop.stop)
            private_thread.join(timeout=self.cfg.connect_timeout_s)
            if not private_thread.is_alive():
                private_loop.close()
        return True

    async def aclose(self) -> None:
        """Close the clients of the running loop (awaited), then everything else as :meth:`shutdown`."""
        loop = asyncio.get_running_loop()
        with self._lock:
            res = self._resources.pop(loop, None)
        if res is not None:
            await res.aclose()
        await asyncio.to_thread(self.shutdown)

    def get_logger_metrics(self) -> dict[str, int]:
        metrics = {
            "openai_http/retries": self.stats.retries,
            "openai_http/failovers": self.stats.failovers,
            "openai_http/rows_completed": self.stats.rows_completed,
            "openai_http/infra_errors": self.stats.infra_errors,
            "openai_http/data_errors": self.stats.data_errors,
        }
        for i, url in enumerate(self.cfg.base_urls):
            metrics[f"openai_http/requests/{i}"] = self.stats.requests_per_url[url]
        return metrics

    def clear_logger_metrics(self) -> None:
        self.stats = OpenAIHTTPStats(requests_per_url={u: 0 for u in self.cfg.base_urls})

    # ------------------------------------------------------------------ per-row request

    async def _generate_all(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool) -> list[_RowResult]:
        n = int(torch.as_tensor(data["input_lengths"]).shape[0])
        return await gather_cancel_siblings(*(self._generate_row(data, i, greedy) for i in range(n)))

    async def _generate_row(self, data: BatchedDataDict[GenerationDatumSpec], i: int, greedy: bool) -> _RowResult:
        cfg = self.cfg
        n_in = int(torch.as_tensor(data["input_lengths"])[i])
        prompt = torch.as_tensor(data["input_ids"])[i, :n_in].tolist()
        session = row_value(data.get("session_ids"), i)
        body = completion_request(cfg, prompt, data, i, greedy)
        if body["max_tokens"] == 0:
            return _RowResult([], [], True, _NO_SERVER)
        res = self._loop_resources()
        prev_idx: int | None = None
        last_error = ""
        last_status: int | None = None
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(cfg.backoff_for(attempt))
            failovers_before = self.router.stats.failovers
            idx = self.router.acquire(session)
            self.stats.failovers += self.router.stats.failovers - failovers_before
            if prev_idx is not None and idx != prev_idx and session is None:
                self.stats.failovers += 1
            prev_idx = idx
            url = cfg.base_urls[idx]
            try:
                async with res.slots[idx]:
                    self.stats.requests_per_url[url] += 1
                    payload = await self._post(res.clients[idx], url, body)
            except _Retryable as exc:
                if exc.connection:
                    self.router.mark_unhealthy(idx)
                last_error, last_status = str(exc), exc.status
                logger.warning("attempt %d/%d failed: %s", attempt + 1, cfg.max_retries + 1, last_error)
                continue
            except RolloutDataFailure:
                self.stats.data_errors += 1
                raise
            finally:
                self.router.release(idx)
            try:
                tokens, logprobs, truncated = parse_completion(payload, url, self.vocab_size)
            except RolloutDataFailure:
                self.stats.data_errors += 1
                raise
            self.stats.rows_completed += 1
            return _RowResult(tokens, logprobs, truncated, idx)
        self.stats.infra_errors += 1
        if not any(self.router.is_healthy(j) for j in range(len(cfg.base_urls))):
            raise _with_status(
                NoHealthyShards(
                    f"no generation shard is eligible: all {len(cfg.base_urls)} endpoint(s) refused connections and "
                    f"are cooling down; last of {cfg.max_retries + 1} attempts: {last_error}"
                ),
                last_status,
            )
        raise _with_status(
            GenerationUnavailable(f"generation unavailable after {cfg.max_retries + 1} attempts: {last_error}"),
            last_status,
        )

    async def _post(self, client: httpx.AsyncClient, url: str, body: JsonObject) -> object:
        """One attempt: the decoded JSON body (read under the answer cap, compressed or not), or
        :class:`_Retryable` / ``RolloutDataFailure``."""
        where = f"{url}/completions"
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                async with client.stream("POST", "/completions", json=body) as response:
                    status = response.status_code
                    raw = await read_response_async(response, f"{where} answer")
        except TimeoutError:
            raise _Retryable(f"{where}: no response within {self.cfg.request_timeout_s}s", connection=False) from None
        except httpx.ConnectTimeout:
            raise _Retryable(f"{where}: connect timed out", connection=True) from None
        except httpx.TimeoutException as exc:
            raise _Retryable(f"{where}: {type(exc).__name__}", connection=False) from None
        except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError) as exc:
            raise _Retryable(f"{where}: {type(exc).__name__}: {exc}", connection=True) from None
        except httpx.HTTPError as exc:  # our own mistake (bad URL scheme, invalid request)
            raise RolloutDataFailure(f"{where}: {type(exc).__name__}: {exc}") from None
        except UntrustedInputError as exc:
            raise bad_answer(str(exc)) from None
        if status >= 400:
            detail = f"{where} returned HTTP {status}: {shown(shorten(raw.decode('utf-8', 'replace'), _BODY_LIMIT))}"
            if http_status_is_infra(status):
                raise _Retryable(detail, connection=False, status=status)
            raise _with_status(RolloutDataFailure(detail), status)
        try:
            return json_io.loads(raw, f"{where} answer")
        except UntrustedInputError as exc:
            raise bad_answer(str(exc)) from None

    # ------------------------------------------------------------------ loops and clients

    def _check_open(self) -> None:
        if self._closed:
            raise EngineShutDownError("OpenAIHTTPGeneration was shut down")

    def _loop_resources(self) -> _LoopResources:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise EngineShutDownError("OpenAIHTTPGeneration was shut down")
            res = self._resources.get(loop)
            if res is None:
                res = self._resources[loop] = _LoopResources(self.cfg, self._transport)
            return res

    def _ensure_private_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._private_loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="openai-http-generation", daemon=True)
                thread.start()
                self._private_loop, self._private_thread = loop, thread
            return self._private_loop
