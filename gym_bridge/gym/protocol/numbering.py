"""How Gym rows are numbered and told apart: the row index, Gym's task and rollout indices and ids, and the seeds.

:func:`number_tasks` numbers a dataset's rows as Gym 0.7's ``preprocess_examples`` does; :func:`rollout_identity` is
the ``_ng_*`` identity of one rollout as Gym's collection stamps it; :func:`prompt_identity` is a task's content
without the bridge's stamps, from which :func:`rollout_seed` derives each rollout's sampling seed. The rows that carry
them are built in :mod:`gym_bridge.gym.protocol.rows`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from gym_bridge.gym_versions import ATTEMPT_INDEX_KEY, ROLLOUT_ID_KEY, ROLLOUT_INDEX_KEY, TASK_INDEX_KEY, installed_gym
from gym_bridge.json_types import JsonMapping, JsonObject

ROW_INDEX_KEY = "_rowidx"
"""A row's index in its group (NeMo-RL's ``_rowidx``), stamped on every row sent."""
SEED_BITS = 63
"""Derived seeds lie in ``[0, 2**63)``: vLLM's ``seed`` is a signed 64-bit int."""
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
"""What Gym's rollout id pattern (``[A-Za-z0-9][A-Za-z0-9._-]*``) refuses."""


def rollout_identity(task_index: Any, rollout_index: int, *, scope: str | None = None) -> JsonObject:
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


def with_attempt(row: JsonObject, attempt: int) -> JsonObject:
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


def mark_repeats(rows: list[JsonObject], first_index: list[int]) -> list[JsonObject]:
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


def prompt_identity(row: JsonMapping) -> str:
    """A task's identity, what its seeds derive from: the row's canonical JSON (sorted keys, no spaces, as the eval's
    ``row_id``) without the keys the bridge stamps (Gym's ``_ng_*`` numbering, ``_rowidx``). Identical rows share an
    identity, and their repeats differ by rollout index; a row's place in its file, the rows before it and whether
    it repeats do not change it."""
    return _canonical(row)


def _canonical(row: JsonMapping) -> str:
    fields = {key: value for key, value in row.items() if not key.startswith(_STAMP_PREFIXES)}
    return _canonical_all(fields)


def _canonical_all(row: JsonMapping) -> str:
    """The whole row's JSON, sorted keys: equal exactly when Gym's ``orjson.dumps(row, OPT_SORT_KEYS)`` is equal."""
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


_STAMP_PREFIXES = ("_ng_", ROW_INDEX_KEY)
"""The keys a row gains as it enters and is sent (its Gym numbering, its index), none of what it asks."""


def rollout_seed(run_seed: int, row: JsonMapping, rollout_index: int) -> int:
    """The sampling seed of rollout ``rollout_index`` of the task ``row`` in a run seeded ``run_seed``.

    The first 63 bits of ``sha256("<run_seed>:<rollout index>:<prompt identity>")`` (:func:`prompt_identity`: the
    row's content without the bridge's stamps). Sample ``i`` of a group of ``n`` is rollout ``repeat * n + i``
    (:func:`build_rows`). Independent of the order, timing, actor and machine a row is sent in, of its place in the
    file and of re-sends; different for each rollout of a task."""
    return derived_seed(run_seed, prompt_identity(row), rollout_index)


def derived_seed(run_seed: int, identity: str, sample_index: int) -> int:
    digest = hashlib.sha256(f"{run_seed}:{sample_index}:{identity}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
