"""Gym input rows: validation where a row enters, and building N rows per prompt.

A row is what NeMo-Gym's agent ``/run`` endpoint takes: ``responses_create_params``
(OpenAI Responses "create" parameters, ``input`` required), ``agent_ref`` naming the
agent server or ``task_source`` naming the instance that declared its dataset (Gym 0.7's
prepared files; :mod:`gym_bridge.gym.protocol.routing` resolves it), and any verifier fields,
which are passed through untouched.

A materialized row (Gym 0.7's episode protocol: ``task_id`` an object ``{taskset, task_id}`` beside ``task_input``)
is no ``/run`` row: it goes to an environment server by Gym's episode protocol (:mod:`gym_bridge.gym.protocol.episode`).
A row whose ``task_id`` is a string is an ordinary row to Gym (and to us), whatever else it carries.

A row is validated once, where it enters (the eval dataset, a batch function, the rollout
backend): :func:`validate_row` returns a :class:`ValidGymRow`, which every later step takes
as it is. The NemoGym actor's :func:`dispatch_target` is the cheap check at its public boundary.

Numbering (:mod:`gym_bridge.gym.protocol.numbering`): ``number_tasks`` numbers a dataset's rows as Gym 0.7's
``preprocess_examples`` does (dense task indices over distinct rows, one task per source row whatever ``agent_map`` /
``fan_out`` make of it, the rollout index continuing over a task's repeats and fan-out agents); each of the N rows
:func:`build_rows` makes then carries Gym's rollout identity (``_ng_task_index``, ``_ng_rollout_index``,
``_ng_rollout_id``; ``_ng_attempt_index`` on a re-send), the keys Gym's own collection stamps and its servers read, as
far as the installed Gym reads them.

Seeds: with a run seed, every stamped row carries its own sampling seed in
``responses_create_params.metadata.extra_body`` (a JSON string, as Gym's
``num_repeats_add_seed`` writes it), which Gym's ``vllm_model`` merges into the
chat-completions body and gym-bridge's model server into its completions body: the
endpoint's per-request ``seed``. ``rollout_seed`` derives it from the run seed, the
rollout index and the task's identity (``prompt_identity``: the row's content, without the keys the bridge
stamps), nothing else: a row keeps its seeds when it is re-sent, when other rows are added before it or repeat,
and in another run; a repeat of it (an identical row, a ``fan_out`` copy) continues its rollout indices and so gets
other seeds; routing it to another agent (``agent_map``) changes its ``agent_ref`` and so its seeds.
"""

from __future__ import annotations

import copy
import json
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.json_io import ROW_DEPTH, loads
from gym_bridge.failures import InvalidGymRow, SettingError
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY, derived_seed, prompt_identity, rollout_identity
from gym_bridge.gym.protocol.routing import GymRoutes, check_agent, check_routable, row_agent
from gym_bridge.gym_versions import ROLLOUT_INDEX_KEY, TASK_INDEX_KEY, installed_gym
from gym_bridge.json_types import JsonMapping, JsonObject

if TYPE_CHECKING:  # torch stays out of reading rows (an eval's config and dataset checks run before it)
    from gym_bridge.types import GenerationSamplingParams

ENVIRONMENT_SERVER_KEY = "_ng_environment_server"
"""Gym's stamp of the environment server a row is dispatched to (``rollout_collection.NG_ENVIRONMENT_SERVER_KEY``)."""

SEED_KEY = "seed"
"""The key of a row's sampling seed in ``responses_create_params.metadata.extra_body``."""


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
                raise SettingError(f"unknown key(s) {unknown} ({gym.label} rejects them with 422)")
        return data

    input: str | list[Any]
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class GymRow(BaseModel):
    """The fields of a Gym row that gym-bridge relies on; everything else passes through.

    A row names its agent (``agent_ref``) or, as Gym 0.7's ``gym dataset collate`` writes it, the config
    instance that declared its dataset (``task_source``), which :mod:`gym_bridge.gym.protocol.routing` resolves."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: ResponsesCreateParams
    agent_ref: AgentRef | None = None
    task_source: str | None = None


class TaskId(BaseModel):
    """A materialized row's ``task_id``, as Gym's ``episode_types.TaskId`` takes it (no other key)."""

    model_config = ConfigDict(extra="forbid")

    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


def is_materialized(row: JsonMapping) -> bool:
    """Gym 0.7's test (``episode_types.is_materialized_task_row``): ``task_id`` is an object and ``task_input`` is
    there. Such a row routes by its taskset, whatever else it carries (``agent_ref``, ``task_source``); a malformed
    ``task_input`` is still a materialized row, which the environment server refuses."""
    return isinstance(row.get("task_id"), Mapping) and "task_input" in row


def row_label(row: JsonMapping) -> str | None:
    """What a row's results are grouped under: its agent, else (a materialized row, which names none by design)
    the environment server it was routed to (Gym's ``_ng_environment_server`` stamp), else its ``task_source``."""
    if is_materialized(row):
        server = row.get(ENVIRONMENT_SERVER_KEY)
        return server if isinstance(server, str) else None
    source = row.get("task_source")
    return row_agent(row) or (source if isinstance(source, str) else None)


class ValidGymRow(dict[str, Any]):
    """A Gym row :func:`validate_row` accepted: still a plain dict (NeMo-RL's ``extra_env_info``), so it goes
    wherever a row goes, and the type says it need not be validated again. Edit a copy, not the row."""

    __slots__ = ()

    @property
    def agent_name(self) -> str | None:
        """The agent the row names (``agent_ref.name``); None for a row routed by its ``task_source``."""
        return row_agent(self)


def validate_row(row: Any, *, prompt_idx: int, known_agents: list[str] | None = None) -> ValidGymRow:
    """Check one row where it enters; raise :class:`InvalidGymRow` naming the prompt, field and reason.

    A :class:`ValidGymRow` is returned as it is (its agent still checked against ``known_agents``)."""
    where = f"prompt_idx={prompt_idx}"
    if isinstance(row, ValidGymRow):
        if known_agents is not None and not is_materialized(row):
            check_agent(row.agent_name, known_agents, where=where)
        return row
    if not isinstance(row, dict):
        raise InvalidGymRow(f"{where}: the Gym row (extra_env_info) must be a dict, got {type(row).__name__}")
    if is_materialized(row):
        check_materialized(row, where)
        return ValidGymRow(row)
    if "task_input" in row and "responses_create_params" not in row:
        raise InvalidGymRow(
            f"{where}: a materialized Gym row (task_id={row.get('task_id')!r}, task_input) needs task_id as an object "
            "{taskset, task_id} (Gym routes it by task_id.taskset); as written Gym treats it as an ordinary row, "
            "which needs responses_create_params and agent_ref or task_source"
        )
    try:
        parsed = GymRow.model_validate(row)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(row)'}: {err['msg']}" for err in exc.errors())
        raise InvalidGymRow(f"{where}: invalid Gym row: {problems}") from None
    check_routable(row, where=where)
    try:
        repeat_of(row)
        _check_task_index(row)
    except InvalidGymRow as exc:
        raise InvalidGymRow(f"{where}: invalid Gym row: {exc}") from None
    if known_agents is not None and parsed.agent_ref is not None:
        check_agent(parsed.agent_ref.name, known_agents, where=where)
    return ValidGymRow(row)


def check_materialized(row: JsonMapping, where: str) -> None:
    """A materialized row: where the installed Gym speaks the episode protocol, with a ``task_id`` Gym's ``TaskId``
    takes and sound rollout indices. ``task_input`` is the environment server's to check (its own request model)."""
    gym = installed_gym()
    task_id = row["task_id"]
    if not gym.episode_protocol:
        raise InvalidGymRow(
            f"{where}: a materialized Gym row (task_id.taskset={task_id.get('taskset')!r}, task_input) needs Gym's "
            f"episode protocol, nemo-gym >= 0.7 ({gym.label} is installed): give the row responses_create_params and "
            "agent_ref or task_source"
        )
    try:
        TaskId.model_validate(task_id)
    except ValidationError as exc:
        problems = "; ".join(f"task_id.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise InvalidGymRow(f"{where}: invalid materialized Gym row: {problems}") from None
    try:
        repeat_of(row)
        _check_task_index(row)
    except InvalidGymRow as exc:
        raise InvalidGymRow(f"{where}: invalid materialized Gym row: {exc}") from None


def dispatch_target(row: Any, position: int, routes: GymRoutes) -> tuple[int, str]:
    """``(row index, agent name)`` of a stamped row about to be sent; :class:`InvalidGymRow` names what is wrong.

    The cheap check the NemoGym actor makes on every row it receives (callers other than the rollout backend
    included, NeMo-RL's own code among them); the agent comes from ``agent_ref`` or, for a ``task_source`` row,
    from ``routes`` (:meth:`GymRoutes.agent_of`). :func:`validate_row` checks the whole row.
    """
    rowidx = stamped_index(row, position)
    where = f"row {position} ({ROW_INDEX_KEY}={rowidx}, agent_ref={row.get('agent_ref')!r})"
    return rowidx, routes.agent_of(row, where=where)


def stamped_index(row: Any, position: int) -> int:
    """The ``_rowidx`` of a row about to be sent; :class:`InvalidGymRow` when it is no dict or has no int index."""
    if not isinstance(row, dict):
        raise InvalidGymRow(f"row {position} must be a dict, got {type(row).__name__}")
    rowidx = row.get(ROW_INDEX_KEY)
    if not isinstance(rowidx, int) or isinstance(rowidx, bool):
        raise InvalidGymRow(f"row {position} has no int {ROW_INDEX_KEY} (got {rowidx!r})")
    return rowidx


def build_rows(
    template: JsonObject,
    n: int,
    sampling: GenerationSamplingParams,
    max_new_tokens: int | None,
    *,
    run_seed: int | None = None,
    task_index: int | None = None,
    scope: str | None = None,
) -> list[JsonObject]:
    """N copies of ``template`` stamped by :func:`stamped_row`, ``_rowidx`` 0..N-1, each with Gym's rollout identity.

    Copy ``i`` is rollout ``repeat * n + i`` of its task (:func:`rollout_identity`), where ``repeat`` is the
    template's own ``_ng_rollout_index``: the k-th unit of its task (:func:`number_tasks`: a repeat of an identical
    dataset row, or the k-th ``fan_out`` agent), else 0. So a task's units take rollouts 0..N-1, N..2N-1, ... in
    dataset order, as Gym's ``preprocess_examples`` numbers them with ``num_repeats=N``.
    With ``run_seed`` it carries :func:`rollout_seed` of that rollout index; without it the rows keep whatever
    seed the template carries (none, usually). ``task_index``: the task's ``_ng_task_index`` when the template
    carries none (the backend passes the prompt index); with neither, no identity is stamped. The seed derives
    from the template's own identity (:func:`prompt_identity`), not from ``task_index``. ``scope``: a name for the
    rows' dispatch, put before their ``_ng_rollout_id`` (see :func:`rollout_identity`)."""
    identity = prompt_identity(template)
    base = repeat_of(template) * n
    task = template.get(TASK_INDEX_KEY, task_index)
    rows = []
    for i in range(n):
        seed = None if run_seed is None else derived_seed(run_seed, identity, base + i)
        row = stamped_row(template, i, sampling, max_new_tokens, seed=seed)
        if task is not None:
            row.update(rollout_identity(task, base + i, scope=scope))
        rows.append(row)
    return rows


def repeat_of(row: JsonMapping) -> int:
    """Which repeat of its task a dataset row is: its ``_ng_rollout_index`` (0 when it has none)."""
    repeat = row.get(ROLLOUT_INDEX_KEY, 0)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
        raise InvalidGymRow(f"{ROLLOUT_INDEX_KEY} must be a non-negative int, got {repeat!r}")
    return repeat


def _check_task_index(row: JsonMapping) -> None:
    if TASK_INDEX_KEY not in row:
        return
    task = row[TASK_INDEX_KEY]
    if isinstance(task, bool) or not isinstance(task, numbers.Integral) or task < 0:
        raise InvalidGymRow(f"{TASK_INDEX_KEY} must be a non-negative int, got {task!r}")


def stamped_row(
    row: JsonObject,
    rowidx: int,
    sampling: GenerationSamplingParams,
    max_new_tokens: int | None,
    *,
    seed: int | None = None,
) -> JsonObject:
    """A deep copy of ``row`` with the sampling profile, the token cap and ``_rowidx`` (the caller's row is kept).

    ``max_output_tokens`` becomes ``min(row value, max_new_tokens)``; the sequence
    budget (``max_seq_len``) is deliberately not translated into it. A ``seed`` is
    written into ``metadata.extra_body`` (replacing one the row carries).
    """
    copied: JsonObject = {key: _copy_json(value) for key, value in row.items()}
    if is_materialized(row):
        # Gym's planner leaves a materialized row's task_input alone (it refuses responses_create_params overrides
        # and num_repeats_add_seed for such rows): the environment server owns its sampling.
        copied[ROW_INDEX_KEY] = rowidx
        return copied
    params = copied["responses_create_params"]
    params["temperature"] = sampling.temperature
    params["top_p"] = sampling.top_p
    if max_new_tokens is not None:
        given = params.get("max_output_tokens")
        params["max_output_tokens"] = max_new_tokens if given is None else min(int(given), max_new_tokens)
    if seed is not None:
        metadata = params.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise InvalidGymRow(f"responses_create_params.metadata must be an object, got {type(metadata).__name__}")
        extra_body = _extra_body(metadata)
        extra_body[SEED_KEY] = seed
        params["metadata"] = {**metadata, "extra_body": json.dumps(extra_body, sort_keys=True)}
    copied[ROW_INDEX_KEY] = rowidx
    return copied


def row_seed(row: JsonMapping) -> int | None:
    """The seed a stamped row (or a Gym result, which echoes ``responses_create_params``) carries, or None."""
    params = row.get("responses_create_params")
    metadata = params.get("metadata") if isinstance(params, Mapping) else None
    if not isinstance(metadata, Mapping) or not metadata.get("extra_body"):
        return None
    try:
        seed = _extra_body(metadata).get(SEED_KEY)
    except InvalidGymRow:
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _extra_body(metadata: JsonMapping) -> JsonObject:
    """``metadata.extra_body`` parsed: Gym's metadata values are strings, this one a JSON object (decoded by the
    boundary, so no deeper than a row may nest)."""
    raw = metadata.get("extra_body") or "{}"
    try:
        parsed = loads(raw, "metadata.extra_body", max_depth=ROW_DEPTH) if isinstance(raw, str) else None
    except UntrustedInputError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidGymRow(
            f"responses_create_params.metadata.extra_body must be a JSON object in a string (Gym's metadata "
            f"values are strings), got {raw!r:.80}"
        )
    return parsed


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
