"""One row posted to Gym as Gym's collection posts it, and its reply read back whole (or its failure typed).

``POST {server}/run`` with the row as a JSON body (a materialized row as Gym's episode request), no cookie jar and a
bounded wait, no retry loop: an HTTP error is unwrapped (:func:`~gym_bridge.failures.gym_run_failure`,
:func:`~gym_bridge.failures.gym_chain.agent_run_error`), a transport failure first blamed on a dead Gym server when
one died. With token capture on and the row's agent taking part, the reply is finalised with its captured token ids
(:mod:`gym_bridge.gym.protocol.token_capture`), as Gym's collection finalises it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.failures import GymResultError, GymTransportError, RolloutTimeout, deadline, gym_run_failure
from gym_bridge.failures.gym_chain import agent_run_error
from gym_bridge.gym.protocol.episode import FAILURE_CLASS_KEY, episode_request_body
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY
from gym_bridge.gym.protocol.rows import is_materialized
from gym_bridge.gym.protocol.token_capture import CaptureBuild, TokenCapture
from gym_bridge.gym.transport.row_convert import counted_as, describe_row, loads_result
from gym_bridge.json_types import JsonObject

ERROR_BODY_LIMIT = 65536
"""How much of an error body is kept: Gym nests each server's error escaped inside the next, kept whole to unwrap."""
_JSON_HEADERS = {"Content-Type": "application/json"}

Posted = tuple[JsonObject, bytes, CaptureBuild | None]
"""``(row, result body, capture build)`` of one posted row."""


@dataclass(frozen=True)
class RowPost:
    """What posting a row takes: the session, the deadline of one ``/run``, the capture store (None: capture off),
    and the check that names a dead Gym server after a failed ``/run`` (it raises when one died)."""

    client: aiohttp.ClientSession
    request_timeout_s: float | None
    capture: TokenCapture | None
    blame_dead_server: Callable[[str], None]

    async def post(self, url: str, row: JsonObject) -> Posted:
        """POST one row; ``(row, result body, capture build)``, the body finalised with its captured token ids when
        Gym's collection would finalise it (``token_id_capture`` on, the row's agent taking part)."""
        episode = is_materialized(row)
        agent = counted_as(row)
        where = f"NeMo-Gym /run at {url} for {ROW_INDEX_KEY}={row[ROW_INDEX_KEY]} ({describe_row(row)})"
        # bytes, as aiohttp sends them: no str in between; a materialized row as Gym's episode request
        request = orjson.dumps(episode_request_body(row) if episode else row)
        capture = (
            self.capture if self.capture is not None and not episode and self.capture.participates(agent) else None
        )
        if capture is not None:
            capture.clear(row)
        try:
            async with (
                deadline(self.request_timeout_s, where),
                self.client.post(f"{url}/run", data=request, headers=_JSON_HEADERS) as response,
            ):
                status, body = response.status, await response.read()
        except RolloutTimeout:
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.blame_dead_server(where)
            raise GymTransportError(f"{where} failed in transport: {type(exc).__name__}: {exc}") from None
        if status >= 400:
            error_body = body[:ERROR_BODY_LIMIT]
            failure = gym_run_failure(status, error_body, where)
            if isinstance(failure, GymTransportError):
                failure = agent_run_error(status, error_body, where) or failure
            if isinstance(failure, GymTransportError):
                self.blame_dead_server(where)
            raise failure
        if capture is None:
            return row, body, None
        return (row, *await _finalized(capture, row, body, where))


async def _finalized(
    capture: TokenCapture, row: JsonObject, body: bytes, where: str
) -> tuple[bytes, CaptureBuild | None]:
    """The result with its captured token ids (:mod:`gym_bridge.gym.protocol.token_capture`), as JSON bytes
    again, and the build. A failure row (``_ng_failure_class``) is no rollout: Gym finalises none, nor do we."""
    try:
        result = loads_result(body, f"{where}: /run answer")
    except UntrustedInputError as exc:
        raise GymResultError(str(exc)) from None
    if not isinstance(result, dict) or result.get(FAILURE_CLASS_KEY):
        return body, None  # the converter names what is wrong with it
    build = await capture.finalize(row, result)
    return orjson.dumps(result), build


def http_client(max_connections: int, connect_timeout_s: float) -> aiohttp.ClientSession:
    """The session towards Gym's servers, made on the actor's loop at first use.

    Its cookie jar stores nothing, as Gym's does: a stored session cookie would send later rows into an earlier
    row's resources-server session and pin its policy URL. Deadlines are ours (``deadline``), so the session has none
    of its own but the TCP connect (``sock_connect``). Not aiohttp's ``connect``, which also counts the wait for a
    free connection in the pool: with more rows in flight than ``max_connections`` a row queues there for as long as
    the rows ahead of it take, bounded by ``request_timeout_s``.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        trust_env=False,
    )
