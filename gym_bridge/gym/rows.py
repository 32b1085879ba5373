"""Gym input rows: validation where a row enters, and building N rows per prompt.

A row is what NeMo-Gym's agent ``/run`` endpoint takes: ``responses_create_params``
(OpenAI Responses "create" parameters, ``input`` required), ``agent_ref`` naming the
agent server, and any verifier fields, which are passed through untouched.

A row is validated once, where it enters (the eval dataset, a batch function, the rollout
backend): :func:`validate_row` returns a :class:`ValidGymRow`, which every later step takes
as it is. The NemoGym actor's :func:`dispatch_target` is the cheap check at its public boundary.

Seeds: with a run seed, every stamped row carries its own sampling seed in
``responses_create_params.metadata.extra_body`` (a JSON string, as Gym's
``num_repeats_add_seed`` writes it), which Gym's ``vllm_model`` merges into the
chat-completions body and gym-bridge's model server into its completions body: the
endpoint's per-request ``seed``. :func:`rollout_seed` derives it from the run seed, the
prompt's stable identity (:func:`prompt_identity`) and the sample index, so a row keeps
its seed when it is re-sent and the same prompt gets the same seeds in another run.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gym_bridge.failures import InvalidGymRow, SettingError
from gym_bridge.gym.versions import installed_gym
from gym_bridge.types import NEMO_GYM_TASK_INDEX_KEY, GenerationSamplingParams

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
    template: dict[str, Any],
    n: int,
    sampling: GenerationSamplingParams,
    max_new_tokens: int | None,
    *,
    run_seed: int | None = None,
) -> list[dict[str, Any]]:
    """N copies of ``template`` stamped by :func:`stamped_row`, ``_rowidx`` 0..N-1.

    With ``run_seed``, row ``i`` carries :func:`rollout_seed` ``(run_seed, template, i)``; without it the
    rows keep whatever seed the template carries (none, usually)."""
    if run_seed is None:
        return [stamped_row(template, i, sampling, max_new_tokens) for i in range(n)]
    identity = prompt_identity(template)
    return [
        stamped_row(template, i, sampling, max_new_tokens, seed=_derived_seed(run_seed, identity, i)) for i in range(n)
    ]


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
    """A dataset row's stable identity: Gym's ``_ng_task_index`` when the row has one, else its canonical JSON
    (sorted keys, no spaces, as the eval's ``row_id``). Identical rows share an identity."""
    task_index = row.get(NEMO_GYM_TASK_INDEX_KEY)
    if task_index is not None:
        return f"{NEMO_GYM_TASK_INDEX_KEY}={task_index}"
    fields = {key: value for key, value in row.items() if key != ROW_INDEX_KEY}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def rollout_seed(run_seed: int, row: Mapping[str, Any], sample_index: int) -> int:
    """The sampling seed of sample ``sample_index`` of the prompt ``row`` in a run seeded ``run_seed``.

    The first 63 bits of ``sha256("<run_seed>:<sample_index>:<prompt identity>")``: independent of the
    order, timing and machine a row is sent in, different for each sample of a group."""
    return _derived_seed(run_seed, prompt_identity(row), sample_index)


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
    """``metadata.extra_body`` parsed: Gym's metadata values are strings, this one a JSON object."""
    raw = metadata.get("extra_body") or "{}"
    try:
        parsed = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
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
