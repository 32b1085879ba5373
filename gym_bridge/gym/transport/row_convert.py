"""One ``/run`` reply made the typed :class:`~gym_bridge.gym.protocol.result.GymRowResult` of the row it answers.

The actor's conversion step, run off its event loop: the body decoded (depth-bounded; a ``NaN`` logprob kept as
such, for the conversion to name), a materialized row's episode reply made Gym's record, Gym's failure rows raised
as their class, the row's ``_ng_*`` identity stamped on the result as Gym's collection stamps it, the message log
built (:func:`~gym_bridge.gym.protocol.convert.convert_gym_result`), and the routed agent and the capture build kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymResultError, shorten
from gym_bridge.failures.classify import gym_failure_class_failure
from gym_bridge.gym.protocol.convert import convert_gym_result
from gym_bridge.gym.protocol.episode import (
    ENVIRONMENT_SERVER_FAILED,
    FAILURE_CLASS_KEY,
    episode_failure,
    episode_record,
    is_episode_response,
)
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY
from gym_bridge.gym.protocol.result import GymRowResult
from gym_bridge.gym.protocol.routing import row_agent
from gym_bridge.gym.protocol.rows import ENVIRONMENT_SERVER_KEY, is_materialized, row_label
from gym_bridge.gym.protocol.token_capture import CaptureBuild, stamp_identity
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import Tokenizer

RESULT_TYPE_KEY = "_ng_result_type"
"""Gym's stamp of the implementation of the environment server that produced a record."""


@dataclass(frozen=True)
class Conversion:
    """What converting a set's results takes: the tokenizer, the actor's conversion settings, and each server's
    implementation (stamped on an environment server's record as ``_ng_result_type``)."""

    tokenizer: Tokenizer
    cfg: NemoGymConfig
    result_types: Mapping[str, str | None]

    def batch(self, posted: list[tuple[JsonObject, bytes, CaptureBuild | None]]) -> list[GymRowResult]:
        return [self.row(row, body, capture) for row, body, capture in posted]

    def row(self, row: JsonObject, body: bytes, capture: CaptureBuild | None = None) -> GymRowResult:
        """One result as its :class:`GymRowResult`: Gym's failure row raised as its class, the row's ``_ng_*``
        identity stamped, the message log built, the routed agent and the capture build kept."""
        rowidx = row[ROW_INDEX_KEY]
        try:
            result = loads_result(body, f"{ROW_INDEX_KEY}={rowidx}: /run answer")
        except UntrustedInputError as exc:
            raise GymResultError(str(exc)) from None
        where = f"{ROW_INDEX_KEY}={rowidx} ({describe_row(row)})"
        episode = is_materialized(row)
        if episode and is_episode_response(result):  # the reply to Gym's episode request: Gym's record of it
            try:
                result = episode_record(result)
            except GymResultError as exc:
                raise GymResultError(f"{where}: {exc}") from None
        if isinstance(result, dict):
            self._check_and_stamp(row, result, where, episode)
        try:
            converted = convert_gym_result(
                result,
                self.tokenizer,
                row_index=rowidx,
                on_drift=self.cfg.on_drift,
                invalid_tool_call_patterns=self.cfg.invalid_tool_call_patterns,
                thinking_tags=self.cfg.thinking_tags,
            )
        except GymResultError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        converted.capture = capture
        converted.agent = None if episode else row_agent(row)
        return converted

    def _check_and_stamp(self, row: JsonMapping, result: JsonObject, where: str, episode: bool) -> None:
        """Raise Gym's failure row as its class; else stamp the row's identity (and, for an episode, the environment
        server that ran it and its type, as Gym's record names them) on the result."""
        failure_class = result.get(FAILURE_CLASS_KEY)
        if failure_class == ENVIRONMENT_SERVER_FAILED:
            raise episode_failure(result, where)
        if isinstance(failure_class, str) and failure_class:
            detail = result.get("_ng_failure_message") or result.get("error") or "(no message)"
            raise gym_failure_class_failure(failure_class, f"{where}: {shorten(str(detail))}")
        stamp_identity(row, result)
        if episode:
            server = row.get(ENVIRONMENT_SERVER_KEY)
            result[ENVIRONMENT_SERVER_KEY] = server
            result[RESULT_TYPE_KEY] = self.result_types.get(server) if isinstance(server, str) else None


def counted_as(row: JsonMapping) -> str:
    """What a row's progress and messages are counted under: its agent, or a materialized row's environment server."""
    return row_label(row) or "(unrouted)"


def describe_row(row: JsonMapping) -> str:
    """The row's destination for messages: ``agent 'x'``, or a materialized row's ``environment server 'y' (taskset
    't')``."""
    if is_materialized(row):
        return f"environment server {row.get(ENVIRONMENT_SERVER_KEY)!r}, taskset {row['task_id'].get('taskset')!r}"
    return f"agent {counted_as(row)!r}"


def loads_result(body: bytes, where: str) -> Any:
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
