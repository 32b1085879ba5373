"""Gym input rows: validation where a row enters, and building N rows per prompt.

A row is what NeMo-Gym's agent ``/run`` endpoint takes: ``responses_create_params``
(OpenAI Responses "create" parameters, ``input`` required), ``agent_ref`` naming the
agent server or ``task_source`` naming the instance that declared its dataset (Gym 0.7's
prepared files; :mod:`gym_bridge.gym.protocol.routing` resolves it), and any verifier fields,
which are passed through untouched.

A materialized row (Gym 0.7's episode protocol: ``task_id`` an object ``{taskset, task_id}`` beside ``task_input``)
is no ``/run`` row: it goes to the environment server its taskset names in Gym's ``environment_server_routes``
(:class:`EpisodeRoutes`), as the episode request :func:`episode_request_body` builds, exactly where Gym's own
collection sends it (``rollout_collection._environment_server_for_config_row`` / ``_episode_request_body``). A row
whose ``task_id`` is a string is an ordinary row to Gym (and to us), whatever else it carries.

A row is validated once, where it enters (the eval dataset, a batch function, the rollout
backend): :func:`validate_row` returns a :class:`ValidGymRow`, which every later step takes
as it is. The NemoGym actor's :func:`dispatch_target` is the cheap check at its public boundary.

Numbering: :func:`number_tasks` numbers a dataset's rows as Gym 0.7's ``preprocess_examples`` does (dense task
indices over distinct rows, one task per source row whatever ``agent_map`` / ``fan_out`` make of it, the rollout
index continuing over a task's repeats and fan-out agents); each of the N rows :func:`build_rows` makes then carries
Gym's rollout identity (``_ng_task_index``, ``_ng_rollout_index``, ``_ng_rollout_id``; ``_ng_attempt_index`` on a
re-send), the keys Gym's own collection stamps and its servers read, as far as the installed Gym reads them.

Seeds: with a run seed, every stamped row carries its own sampling seed in
``responses_create_params.metadata.extra_body`` (a JSON string, as Gym's
``num_repeats_add_seed`` writes it), which Gym's ``vllm_model`` merges into the
chat-completions body and gym-bridge's model server into its completions body: the
endpoint's per-request ``seed``. :func:`rollout_seed` derives it from the run seed, the
rollout index and the task's identity (:func:`prompt_identity`: the row's content, without the keys the bridge
stamps), nothing else: a row keeps its seeds when it is re-sent, when other rows are added before it or repeat,
and in another run; a repeat of it (an identical row, a ``fan_out`` copy) continues its rollout indices and so gets
other seeds; routing it to another agent (``agent_map``) changes its ``agent_ref`` and so its seeds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import numbers
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.json_io import ROW_DEPTH, loads
from gym_bridge.failures import InvalidGymRow, SettingError
from gym_bridge.gym.protocol.routing import GymRoutes, check_agent, check_routable, row_agent
from gym_bridge.gym_versions import ATTEMPT_INDEX_KEY, ROLLOUT_ID_KEY, ROLLOUT_INDEX_KEY, TASK_INDEX_KEY, installed_gym

if TYPE_CHECKING:  # torch stays out of reading rows (an eval's config and dataset checks run before it)
    from gym_bridge.types import GenerationSamplingParams

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
"""What Gym's rollout id pattern (``[A-Za-z0-9][A-Za-z0-9._-]*``) refuses."""
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENVIRONMENT_SERVER_KEY = "_ng_environment_server"
"""Gym's stamp of the environment server a row is dispatched to (``rollout_collection.NG_ENVIRONMENT_SERVER_KEY``)."""

ROW_INDEX_KEY = "_rowidx"
SEED_KEY = "seed"
"""The key of a row's sampling seed in ``responses_create_params.metadata.extra_body``."""
SEED_BITS = 63
"""Derived seeds lie in ``[0, 2**63)``: vLLM's ``seed`` is a signed 64-bit int."""


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


def is_materialized(row: Mapping[str, Any]) -> bool:
    """Gym 0.7's test (``episode_types.is_materialized_task_row``): ``task_id`` is an object and ``task_input`` is
    there. Such a row routes by its taskset, whatever else it carries (``agent_ref``, ``task_source``); a malformed
    ``task_input`` is still a materialized row, which the environment server refuses."""
    return isinstance(row.get("task_id"), Mapping) and "task_input" in row


def row_label(row: Mapping[str, Any]) -> str | None:
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
        _check_materialized(row, where)
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


def _check_materialized(row: Mapping[str, Any], where: str) -> None:
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


@dataclass(frozen=True)
class EpisodeRoutes(GymRoutes):
    """:class:`GymRoutes` plus the taskset routes of Gym's episode protocol: a materialized row goes to the environment
    server ``environment_server_routes`` names for its ``task_id.taskset`` (Gym's
    ``_environment_server_for_config_row``); every other row routes as before. Read from the launched config."""

    tasksets: Mapping[str, str] = field(default_factory=dict)
    """taskset -> the running environment server its rows go to."""
    taskset_errors: Mapping[str, str] = field(default_factory=dict)
    """taskset -> why its route names no running environment server."""

    def environment_server_of(self, row: Mapping[str, Any], *, where: str) -> str:
        """The environment server a materialized row goes to; :class:`InvalidGymRow` naming the taskset and the routes
        there are (Gym's ``No environment server route is configured for taskset ...``)."""
        taskset = row["task_id"].get("taskset")
        if taskset in self.tasksets:
            return self.tasksets[taskset]
        if taskset in self.taskset_errors:
            raise InvalidGymRow(f"{where}: taskset {taskset!r} routes nowhere: {self.taskset_errors[taskset]}")
        known = ", ".join(f"{name} -> {server}" for name, server in sorted(self.tasksets.items())) or "(none)"
        raise InvalidGymRow(
            f"{where}: no environment server route is configured for taskset {taskset!r} (Gym's "
            f"environment_server_routes of the launched config: {known})"
        )

    def agent_of(self, row: Mapping[str, Any], *, where: str) -> str:
        if is_materialized(row):
            raise InvalidGymRow(
                f"{where}: a materialized row goes to an environment server (taskset "
                f"{row['task_id'].get('taskset')!r}), not to an agent"
            )
        return super().agent_of(row, where=where)

    def routed(self, row: dict[str, Any], *, where: str) -> dict[str, Any]:
        """A materialized row with Gym's ``_ng_environment_server`` stamp (a copy when it changes; no ``agent_ref``:
        Gym's materialized tasks carry none by design); any other row as :meth:`GymRoutes.routed` routes it."""
        if not is_materialized(row):
            return super().routed(row, where=where)
        server = self.environment_server_of(row, where=where)
        return row if row.get(ENVIRONMENT_SERVER_KEY) == server else {**row, ENVIRONMENT_SERVER_KEY: server}


def episode_target(row: Any, position: int, routes: GymRoutes) -> tuple[int, str]:
    """``(row index, environment server)`` of a stamped materialized row about to be sent (:func:`dispatch_target`'s
    counterpart); :class:`InvalidGymRow` where the routes have no taskset routes or none for its taskset."""
    rowidx = _stamped_index(row, position)
    where = f"row {position} ({ROW_INDEX_KEY}={rowidx}, task_id={row.get('task_id')!r})"
    if not installed_gym().episode_protocol:
        _check_materialized(row, where)  # names the version
    if not isinstance(routes, EpisodeRoutes):
        raise InvalidGymRow(f"{where}: a materialized row, but this Gym server set has no taskset routes")
    return rowidx, routes.environment_server_of(row, where=where)


def episode_request_body(row: Mapping[str, Any]) -> dict[str, Any]:
    """The episode request a materialized row is sent as, Gym 0.7's ``_episode_request_body``:
    ``{"episode_id": {"rollout_id", "attempt"}, "task": {"task_id", "task_input"}}``.

    ``rollout_id``: the row's ``_ng_rollout_id`` (Gym's ``maybe_rollout_id_from_run_body`` of the row at attempt 0),
    else ``"<task index>-<rollout index>"``; ``attempt``: its ``_ng_attempt_index`` (0 on a first send). Nothing
    else of the row is sent: sampling, seeds and verifier fields live in ``task_input``, which Gym sends unchanged.
    :class:`InvalidGymRow` where Gym raises ``ValueError`` (a bad attempt or rollout id) or ``KeyError`` (no indices).
    """
    attempt = row.get(ATTEMPT_INDEX_KEY, 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise InvalidGymRow(f"invalid episode attempt: {attempt!r}")
    rollout_id = row.get(ROLLOUT_ID_KEY)
    if rollout_id is not None:
        if not isinstance(rollout_id, str) or not _ROLLOUT_ID.fullmatch(rollout_id):
            raise InvalidGymRow(
                f"{ROLLOUT_ID_KEY} must be a string of letters, digits, dots, dashes or underscores starting with a "
                f"letter or digit; got {rollout_id!r}"
            )
    elif TASK_INDEX_KEY in row and ROLLOUT_INDEX_KEY in row:
        rollout_id = f"{row[TASK_INDEX_KEY]}-{row[ROLLOUT_INDEX_KEY]}"
    else:
        raise InvalidGymRow(
            f"a materialized row needs its rollout identity ({TASK_INDEX_KEY} and {ROLLOUT_INDEX_KEY}, or "
            f"{ROLLOUT_ID_KEY}) to name its episode"
        )
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "task": {"task_id": row["task_id"], "task_input": row["task_input"]},
    }


def dispatch_target(row: Any, position: int, routes: GymRoutes) -> tuple[int, str]:
    """``(row index, agent name)`` of a stamped row about to be sent; :class:`InvalidGymRow` names what is wrong.

    The cheap check the NemoGym actor makes on every row it receives (callers other than the rollout backend
    included, NeMo-RL's own code among them); the agent comes from ``agent_ref`` or, for a ``task_source`` row,
    from ``routes`` (:meth:`GymRoutes.agent_of`). :func:`validate_row` checks the whole row.
    """
    rowidx = _stamped_index(row, position)
    where = f"row {position} ({ROW_INDEX_KEY}={rowidx}, agent_ref={row.get('agent_ref')!r})"
    return rowidx, routes.agent_of(row, where=where)


def _stamped_index(row: Any, position: int) -> int:
    """The ``_rowidx`` of a row about to be sent; :class:`InvalidGymRow` when it is no dict or has no int index."""
    if not isinstance(row, dict):
        raise InvalidGymRow(f"row {position} must be a dict, got {type(row).__name__}")
    rowidx = row.get(ROW_INDEX_KEY)
    if not isinstance(rowidx, int) or isinstance(rowidx, bool):
        raise InvalidGymRow(f"row {position} has no int {ROW_INDEX_KEY} (got {rowidx!r})")
    return rowidx


def build_rows(
    template: dict[str, Any],
    n: int,
    sampling: GenerationSamplingParams,
    max_new_tokens: int | None,
    *,
    run_seed: int | None = None,
    task_index: int | None = None,
    scope: str | None = None,
) -> list[dict[str, Any]]:
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
        seed = None if run_seed is None else _derived_seed(run_seed, identity, base + i)
        row = stamped_row(template, i, sampling, max_new_tokens, seed=seed)
        if task is not None:
            row.update(rollout_identity(task, base + i, scope=scope))
        rows.append(row)
    return rows


def repeat_of(row: Mapping[str, Any]) -> int:
    """Which repeat of its task a dataset row is: its ``_ng_rollout_index`` (0 when it has none)."""
    repeat = row.get(ROLLOUT_INDEX_KEY, 0)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
        raise InvalidGymRow(f"{ROLLOUT_INDEX_KEY} must be a non-negative int, got {repeat!r}")
    return repeat


def rollout_identity(task_index: Any, rollout_index: int, *, scope: str | None = None) -> dict[str, Any]:
    """Gym's identity keys of one rollout, as its collection stamps them, limited to those the installed Gym reads:
    ``_ng_task_index``, ``_ng_rollout_index`` and (0.7) ``_ng_rollout_id`` = ``"<task>-<rollout>"``.

    ``scope`` makes the rollout id ``"<scope>-<task>-<rollout>"``: rows whose task indices restart (a validation
    set in flight beside training rows or beside another set) keep distinct token-capture keys, as Gym asks of
    dispatches that restart their numbering. Characters Gym's id pattern refuses become ``_``."""
    keys = installed_gym().rollout_identity_keys
    rollout_id = f"{task_index}-{rollout_index}"
    if scope is not None:
        rollout_id = f"{_ID_UNSAFE.sub('_', scope)}-{rollout_id}"
    identity = {
        TASK_INDEX_KEY: task_index,
        ROLLOUT_INDEX_KEY: rollout_index,
        ROLLOUT_ID_KEY: rollout_id,
    }
    return {key: value for key, value in identity.items() if key in keys}


def with_attempt(row: dict[str, Any], attempt: int) -> dict[str, Any]:
    """``row`` as re-send number ``attempt`` (0 = the first send): Gym's ``_ng_attempt_index`` where the installed
    Gym reads it, every other key (the seed included) as it was. A shallow copy; the caller's row is kept."""
    if ATTEMPT_INDEX_KEY not in installed_gym().rollout_identity_keys:
        return row
    return {**row, ATTEMPT_INDEX_KEY: attempt}


def number_tasks(units: Sequence[tuple[Any, Any]]) -> list[Any]:
    """A dataset's rows numbered as Gym 0.7's ``RolloutCollectionHelper.preprocess_examples`` numbers them.

    ``units``: ``(source, row)`` in dataset order, ``source`` the row as read and ``row`` what routing made of it
    (one unit per ``fan_out`` agent, all with the same source). Each row comes back as a copy with
    ``_ng_task_index``: the source's own when it carries one, else dense over distinct sources in order of first
    appearance (``row_to_task_idx.setdefault(<source JSON, sorted keys>, len(row_to_task_idx))``: identical rows are
    one task, and ``[r0, r0, r1]`` gives r1 task 1); and ``_ng_rollout_index`` = k, the k-th unit of that task
    (a ``_ng_rollout_index`` in the data is replaced, as Gym replaces it). :func:`build_rows` makes unit k's N rows
    rollouts ``k*N .. k*N+N-1``: Gym's rollout index continuing over a task's repeats and ``fan_out`` agents.
    A unit that is not a dict pair is returned as it is (the row validator names it)."""
    task_of: dict[str, Any] = {}
    units_of: Counter[Any] = Counter()
    numbered: list[Any] = []
    for source, row in units:
        if not isinstance(source, dict) or not isinstance(row, dict):
            numbered.append(row)
            continue
        if TASK_INDEX_KEY in source:
            task = source[TASK_INDEX_KEY]
            if not _hashable(task):
                numbered.append(row)  # validate_row names the bad index
                continue
        else:
            task = task_of.setdefault(_canonical_all(source), len(task_of))
        repeat = units_of[task]
        units_of[task] += 1
        numbered.append({**row, TASK_INDEX_KEY: task, ROLLOUT_INDEX_KEY: repeat})
    return numbered


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _check_task_index(row: Mapping[str, Any]) -> None:
    if TASK_INDEX_KEY not in row:
        return
    task = row[TASK_INDEX_KEY]
    if isinstance(task, bool) or not isinstance(task, numbers.Integral) or task < 0:
        raise InvalidGymRow(f"{TASK_INDEX_KEY} must be a non-negative int, got {task!r}")


def mark_repeats(rows: list[dict[str, Any]], first_index: list[int]) -> list[dict[str, Any]]:
    """Identical rows as one task rolled out more than once, its task index chosen by the caller.

    Rows whose canonical JSON occurs more than once get ``_ng_task_index`` = ``first_index`` of the first of them
    and ``_ng_rollout_index`` = 0, 1, ... in order (copies; unique rows are returned as they are). Row files are
    numbered by :func:`number_tasks` (Gym's dense task indices); this keeps the caller's indices."""
    counts: dict[str, int] = {}
    keys = [_canonical(row) if isinstance(row, dict) else None for row in rows]
    for key in keys:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    first: dict[str, int] = {}
    seen: dict[str, int] = {}
    marked = []
    for row, key, index in zip(rows, keys, first_index, strict=True):
        if key is None or counts[key] == 1 or TASK_INDEX_KEY in row or ROLLOUT_INDEX_KEY in row:
            marked.append(row)
            continue
        task = first.setdefault(key, index)
        repeat = seen.get(key, 0)
        seen[key] = repeat + 1
        marked.append({**row, TASK_INDEX_KEY: task, ROLLOUT_INDEX_KEY: repeat})
    return marked


def stamped_row(
    row: dict[str, Any],
    rowidx: int,
    sampling: GenerationSamplingParams,
    max_new_tokens: int | None,
    *,
    seed: int | None = None,
) -> dict[str, Any]:
    """A deep copy of ``row`` with the sampling profile, the token cap and ``_rowidx`` (the caller's row is kept).

    ``max_output_tokens`` becomes ``min(row value, max_new_tokens)``; the sequence
    budget (``max_seq_len``) is deliberately not translated into it. A ``seed`` is
    written into ``metadata.extra_body`` (replacing one the row carries).
    """
    copied: dict[str, Any] = {key: _copy_json(value) for key, value in row.items()}
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


def prompt_identity(row: Mapping[str, Any]) -> str:
    """A task's identity, what its seeds derive from: the row's canonical JSON (sorted keys, no spaces, as the eval's
    ``row_id``) without the keys the bridge stamps (Gym's ``_ng_*`` numbering, ``_rowidx``). Identical rows share an
    identity, and their repeats differ by rollout index; a row's place in its file, the rows before it and whether
    it repeats do not change it."""
    return _canonical(row)


def _canonical(row: Mapping[str, Any]) -> str:
    fields = {key: value for key, value in row.items() if not key.startswith(_STAMP_PREFIXES)}
    return _canonical_all(fields)


def _canonical_all(row: Mapping[str, Any]) -> str:
    """The whole row's JSON, sorted keys: equal exactly when Gym's ``orjson.dumps(row, OPT_SORT_KEYS)`` is equal."""
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


_STAMP_PREFIXES = ("_ng_", ROW_INDEX_KEY)
"""The keys a row gains as it enters and is sent (its Gym numbering, its index), none of what it asks."""


def rollout_seed(run_seed: int, row: Mapping[str, Any], rollout_index: int) -> int:
    """The sampling seed of rollout ``rollout_index`` of the task ``row`` in a run seeded ``run_seed``.

    The first 63 bits of ``sha256("<run_seed>:<rollout index>:<prompt identity>")`` (:func:`prompt_identity`: the
    row's content without the bridge's stamps). Sample ``i`` of a group of ``n`` is rollout ``repeat * n + i``
    (:func:`build_rows`). Independent of the order, timing, actor and machine a row is sent in, of its place in the
    file and of re-sends; different for each rollout of a task."""
    return _derived_seed(run_seed, prompt_identity(row), rollout_index)


def row_seed(row: Mapping[str, Any]) -> int | None:
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


def _derived_seed(run_seed: int, identity: str, sample_index: int) -> int:
    digest = hashlib.sha256(f"{run_seed}:{sample_index}:{identity}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


def _extra_body(metadata: Mapping[str, Any]) -> dict[str, Any]:
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
