"""Gym input rows: validation where a row enters, and building N rows per prompt.

A row is what NeMo-Gym's agent ``/run`` endpoint takes: ``responses_create_params``
(OpenAI Responses "create" parameters, ``input`` required), ``agent_ref`` naming the
agent server, and any verifier fields, which are passed through untouched.

A row is validated once, where it enters (the eval dataset, a batch function, the rollout
backend): :func:`validate_row` returns a :class:`ValidGymRow`, which every later step takes
as it is. The NemoGym actor's :func:`dispatch_target` is the cheap check at its public boundary.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gym_bridge.failures import InvalidGymRow
from gym_bridge.gym.versions import installed_gym
from gym_bridge.types import GenerationSamplingParams

ROW_INDEX_KEY = "_rowidx"


class AgentRef(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["responses_api_agents"] = "responses_api_agents"
    name: str


class ResponsesCreateParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            gym = installed_gym()
            unknown = sorted(set(data) - gym.request_fields)
            if unknown:
                raise ValueError(f"unknown key(s) {unknown} ({gym.label} rejects them with 422)")
        return data

    input: str | list[Any]
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class GymRow(BaseModel):
    """The fields of a Gym row that gym-bridge relies on; everything else passes through."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: ResponsesCreateParams
    agent_ref: AgentRef


class ValidGymRow(dict[str, Any]):
    """A Gym row :func:`validate_row` accepted: still a plain dict (NeMo-RL's ``extra_env_info``), so it goes
    wherever a row goes, and the type says it need not be validated again. Edit a copy, not the row."""

    __slots__ = ()

    @property
    def agent_name(self) -> str:
        return str(self["agent_ref"]["name"])


def validate_row(row: Any, *, prompt_idx: int, known_agents: list[str] | None = None) -> ValidGymRow:
    """Check one row where it enters; raise :class:`InvalidGymRow` naming the prompt, field and reason.

    A :class:`ValidGymRow` is returned as it is (its agent still checked against ``known_agents``)."""
    if isinstance(row, ValidGymRow):
        if known_agents is not None:
            check_agent(row.agent_name, known_agents, where=f"prompt_idx={prompt_idx}")
        return row
    if not isinstance(row, dict):
        raise InvalidGymRow(
            f"prompt_idx={prompt_idx}: the Gym row (extra_env_info) must be a dict, got {type(row).__name__}"
        )
    if "agent_ref" not in row and ("task_id" in row or "task_input" in row):
        raise InvalidGymRow(
            f"prompt_idx={prompt_idx}: a materialized Gym row (task_id={row.get('task_id')!r}, task_input, no "
            "agent_ref) is not supported: gym-bridge sends each row to its agent's /run, so the row must name "
            "its agent in agent_ref"
        )
    try:
        parsed = GymRow.model_validate(row)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(row)'}: {err['msg']}" for err in exc.errors())
        raise InvalidGymRow(f"prompt_idx={prompt_idx}: invalid Gym row: {problems}") from None
    if known_agents is not None:
        check_agent(parsed.agent_ref.name, known_agents, where=f"prompt_idx={prompt_idx}")
    return ValidGymRow(row)


def check_agent(name: Any, known_agents: Collection[str], *, where: str) -> None:
    """Raise :class:`InvalidGymRow` unless ``name`` is one of the running agents (listed in the message)."""
    if name not in known_agents:
        raise InvalidGymRow(
            f"{where}: agent_ref.name {name!r} is not a running agent; "
            f"known agents: {', '.join(sorted(known_agents)) or '(none)'}"
        )


def dispatch_target(row: Any, position: int, known_agents: Collection[str]) -> tuple[int, str]:
    """``(row index, agent name)`` of a stamped row about to be sent; :class:`InvalidGymRow` names what is wrong.

    The cheap check the NemoGym actor makes on every row it receives (callers other
    than the rollout backend included); :func:`validate_row` checks the whole row.
    """
    if not isinstance(row, dict):
        raise InvalidGymRow(f"row {position} must be a dict, got {type(row).__name__}")
    rowidx = row.get(ROW_INDEX_KEY)
    if not isinstance(rowidx, int) or isinstance(rowidx, bool):
        raise InvalidGymRow(f"row {position} has no int {ROW_INDEX_KEY} (got {rowidx!r})")
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, dict) else None
    check_agent(name, known_agents, where=f"row {position} ({ROW_INDEX_KEY}={rowidx}, agent_ref={ref!r})")
    assert isinstance(name, str)  # check_agent found it among the known (str) agent names
    return rowidx, name


def build_rows(
    template: dict[str, Any], n: int, sampling: GenerationSamplingParams, max_new_tokens: int | None
) -> list[dict[str, Any]]:
    """N copies of ``template`` stamped by :func:`stamped_row`, ``_rowidx`` 0..N-1."""
    return [stamped_row(template, i, sampling, max_new_tokens) for i in range(n)]


def stamped_row(
    row: dict[str, Any], rowidx: int, sampling: GenerationSamplingParams, max_new_tokens: int | None
) -> dict[str, Any]:
    """A deep copy of ``row`` with the sampling profile, the token cap and ``_rowidx`` (the caller's row is kept).

    ``max_output_tokens`` becomes ``min(row value, max_new_tokens)``; the sequence
    budget (``max_seq_len``) is deliberately not translated into it.
    """
    copied: dict[str, Any] = {key: _copy_json(value) for key, value in row.items()}
    params = copied["responses_create_params"]
    params["temperature"] = sampling.temperature
    params["top_p"] = sampling.top_p
    if max_new_tokens is not None:
        given = params.get("max_output_tokens")
        params["max_output_tokens"] = max_new_tokens if given is None else min(int(given), max_new_tokens)
    copied[ROW_INDEX_KEY] = rowidx
    return copied


_JSON_SCALARS = (str, int, float, bool, type(None))


def _copy_json(value: Any) -> Any:
    """A deep copy, about 10x faster than ``copy.deepcopy`` for the dicts, lists and scalars a row is made of.

    Building a group copies its row N times on the driver's event loop, so 64 groups
    launched at once hold the loop for ~50 ms with ``deepcopy``. Anything else
    (a tuple, a custom object) is still copied by ``copy.deepcopy``.
    """
    kind = type(value)
    if kind is dict:
        return {key: _copy_json(item) for key, item in value.items()}
    if kind is list:
        return [_copy_json(item) for item in value]
    if kind in _JSON_SCALARS:
        return value
    return copy.deepcopy(value)
