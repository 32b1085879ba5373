"""Gym's numbering of rollouts, held against Gym itself.

A dataset's rows are numbered as Gym 0.7's ``RolloutCollectionHelper.preprocess_examples`` numbers them: dense task
indices over distinct rows, one task per source row whatever ``agent_map`` / ``fan_out`` make of it, the rollout index
continuing over a task's repeats and fan-out agents. The differential test generates datasets and routing settings
and compares what gym-bridge sends (every row of every prompt group) with Gym's own function, called in-process, on the
same rows. Then every result carries that identity, stamped by the actor, also from an agent that echoes none of it
(Gym's ``example_single_tool_call`` agent, on the session's real Gym servers).
"""

from __future__ import annotations

import asyncio
import json
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gym_bridge.gym.protocol.numbering import rollout_seed
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.protocol.row_file import read_row_file
from gym_bridge.gym.protocol.rows import build_rows, row_seed
from gym_bridge.gym_versions import ROLLOUT_ID_KEY, installed_gym
from gym_bridge.types import GenerationSamplingParams

SAMPLING = GenerationSamplingParams(temperature=1.0, top_p=1.0)
GYM_HAS_PREPROCESS = ROLLOUT_ID_KEY in installed_gym().rollout_identity_keys
"""Gym 0.7's collection (the one that keys captures by ``_ng_rollout_id``) has ``preprocess_examples``; 0.4.0 and
0.5.1 number rows inside ``run_from_config`` only."""
AGENTS = ("a", "b", "c")
SOURCES = ("s1", "s2")


@cache
def _gym_helper() -> Any:
    from nemo_gym.rollout_collection import RolloutCollectionHelper

    return RolloutCollectionHelper()


def gyms_numbering(rows: list[dict[str, Any]], routing: RowRouting, n: int) -> list[tuple[Any, ...]]:
    """(agent, task index, rollout index, rollout id) of every rollout Gym's ``preprocess_examples`` makes."""
    from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body

    with warnings.catch_warnings():  # Gym warns when agent_map overrides an agent_ref the data names
        warnings.simplefilter("ignore")
        expanded = _gym_helper().preprocess_examples(
            [json.loads(json.dumps(row)) for row in rows],
            agent_map={**routing.agent_map, **({"_default": routing.agent_name} if routing.agent_name else {})} or None,
            fan_out=routing.fan_out or None,
            num_repeats=n,
        )
    return [
        (
            (row.get("agent_ref") or {}).get("name"),
            row["_ng_task_index"],
            row["_ng_rollout_index"],
            maybe_rollout_id_from_run_body(row),
        )
        for row in expanded
    ]


def our_rows(rows: list[dict[str, Any]], routing: RowRouting, n: int, seed: int | None = None) -> list[dict[str, Any]]:
    """Every row gym-bridge sends for ``rows`` as a dataset file: read, routed, numbered, N per prompt group."""
    text = "".join(json.dumps(row) + "\n" for row in rows)
    lines, problems = read_row_file(Path("data.jsonl"), text, routing=routing)
    assert problems == []
    sent = []
    for line in lines:
        sent += build_rows(line.row, n, SAMPLING, None, run_seed=seed, task_index=line.prompt_idx)
    return sent


def our_numbering(rows: list[dict[str, Any]], routing: RowRouting, n: int) -> list[tuple[Any, ...]]:
    from gym_bridge.gym_versions import ROLLOUT_INDEX_KEY, TASK_INDEX_KEY

    return [
        ((row.get("agent_ref") or {}).get("name"), row[TASK_INDEX_KEY], row[ROLLOUT_INDEX_KEY], row.get(ROLLOUT_ID_KEY))
        for row in our_rows(rows, routing, n)
    ]


def weather(i: int, **fields: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": f"what is the weather in city {i}?"}, **fields}


# ---- generated datasets ---------------------------------------------------------------------------------------------

_base_rows = st.lists(
    st.builds(
        lambda text, where, basis, task: {
            "responses_create_params": {"input": text},
            **({"agent_ref": {"name": basis}} if where == "agent" else {"task_source": basis}),
            **({"_ng_task_index": task} if task is not None else {}),
        },
        st.sampled_from(["q1", "q2", "q3", "q4"]),
        st.sampled_from(["agent", "source"]),
        st.sampled_from(AGENTS + SOURCES),
        st.one_of(st.none(), st.none(), st.none(), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda row: json.dumps(row, sort_keys=True),
)
_agent_lists = st.lists(st.sampled_from(AGENTS), min_size=1, max_size=3, unique=True)
_routing = st.builds(
    lambda agent_map, fan_out, agent_name: RowRouting(agent_map=agent_map, fan_out=fan_out, agent_name=agent_name),
    st.dictionaries(st.sampled_from((*AGENTS, *SOURCES, "_default")), st.sampled_from(AGENTS), max_size=3),
    st.dictionaries(st.sampled_from(AGENTS + SOURCES), _agent_lists, max_size=2),
    st.none(),
)


@st.composite
def _datasets(draw: st.DrawFn) -> tuple[list[dict[str, Any]], RowRouting, int]:
    pool = draw(_base_rows)
    rows = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=8))  # repeats: the same row more than once
    routing = draw(_routing)
    if draw(st.booleans()) and "_default" not in routing.agent_map:
        routing = RowRouting(
            agent_map=routing.agent_map, fan_out=routing.fan_out, agent_name=draw(st.sampled_from(AGENTS))
        )
    return rows, routing, draw(st.integers(1, 4))


@pytest.mark.skipif(not GYM_HAS_PREPROCESS, reason=f"{installed_gym().label} has no preprocess_examples")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_datasets())
def test_every_rollouts_identity_equals_gyms_own_preprocess_examples(dataset):
    """Repeats, several agents, agent_map (with _default or agent_name), fan_out, rows that carry their own task
    index, N: the agent, ``_ng_task_index``, ``_ng_rollout_index`` and rollout id of every row gym-bridge sends, in
    order, are those of Gym's ``preprocess_examples`` with ``num_repeats=N``."""
    rows, routing, n = dataset
    assert our_numbering(rows, routing, n) == gyms_numbering(rows, routing, n)


@pytest.mark.skipif(not GYM_HAS_PREPROCESS, reason=f"{installed_gym().label} has no preprocess_examples")
def test_the_issues_examples_equal_gyms():
    """A repeated first row leaves the next row task 1 (not 2); a fan_out row is one task whose rollout index goes on
    across the agents (agent a: 0, 1; agent b: 2, 3)."""
    dataset = [weather(0, agent_ref={"name": "a"})] * 2 + [weather(i, agent_ref={"name": "a"}) for i in range(1, 10)]
    ours = our_numbering(dataset, RowRouting(), 1)
    assert ours == gyms_numbering(dataset, RowRouting(), 1)
    assert [task for _, task, _, _ in ours[:3]] == [0, 0, 1] and ours[1][2] == 1
    fan = RowRouting(fan_out={"src": ["a", "b"]})
    ours = our_numbering([weather(0, task_source="src")], fan, 2)
    assert ours == gyms_numbering([weather(0, task_source="src")], fan, 2)
    assert ours == [("a", 0, 0, "0-0"), ("a", 0, 1, "0-1"), ("b", 0, 2, "0-2"), ("b", 0, 3, "0-3")]


def test_seeds_derive_from_the_run_seed_the_rows_content_and_the_rollout_index_only():
    """A row's seeds are ``rollout_seed(run seed, its content, rollout index)``: the same wherever the row sits in its
    file, whatever rows come before it, and for its first copy when it repeats (later copies continue its rollout
    indices); routing it to another agent changes its ``agent_ref``, a part of its content, and so its seeds."""
    row = weather(1, agent_ref={"name": "a"})
    alone = our_rows([row], RowRouting(), 2, seed=7)
    repeated = our_rows([row, row], RowRouting(), 2, seed=7)
    after_another = our_rows([weather(2, agent_ref={"name": "a"}), row], RowRouting(), 2, seed=7)
    assert [row_seed(r) for r in repeated[:2]] == [row_seed(r) for r in alone] == [row_seed(r) for r in after_another[2:]]
    assert [row_seed(r) for r in repeated] == [rollout_seed(7, row, r) for r in range(4)]
    assert len({row_seed(r) for r in repeated}) == 4, "every rollout of a task draws its own samples"
    rerouted = our_rows([row], RowRouting(agent_map={"_default": "b"}), 2, seed=7)
    assert {r["agent_ref"]["name"] for r in rerouted} == {"b"}
    assert [row_seed(r) for r in rerouted] == [rollout_seed(7, {**row, "agent_ref": {"name": "b"}}, r) for r in (0, 1)]
    other_content = our_rows([weather(2, agent_ref={"name": "a"})], RowRouting(), 2, seed=7)
    assert not {row_seed(r) for r in other_content} & {row_seed(r) for r in alone}, "another task: other seeds"


# ---- every result carries the identity, on real Gym servers ----------------------------------------------------------


@pytest.mark.gym
@pytest.mark.timeout(300)
def test_every_result_carries_its_rows_identity_from_an_agent_that_echoes_none(gym_actor):
    """Gym's example_single_tool_call agent returns its resources server's verify response, which drops the row's
    extra keys: Gym's own run_examples gives results without any ``_ng_*`` key. Through gym-bridge every result
    carries the identity of the row it answers, stamped by the actor."""
    from gym_bridge.gym.transport.client import GymClient
    from gym_bridge.gym_versions import ROLLOUT_IDENTITY_KEYS
    from gym_bridge.testing.gym_rows import TOOL_AGENT, gyms_own_collection, tool_call_rows

    dataset = [tool_call_rows()[0], tool_call_rows()[0], tool_call_rows()[1]]
    rows = our_rows(dataset, RowRouting(), 2)
    for i, row in enumerate(rows):
        row["_rowidx"] = i
    assert {row["agent_ref"]["name"] for row in rows} == {TOOL_AGENT}
    identity = [{k: row[k] for k in ROLLOUT_IDENTITY_KEYS if k in row} for row in rows]
    assert [(i["_ng_task_index"], i["_ng_rollout_index"]) for i in identity] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                                                 (1, 0), (1, 1)]  # fmt: skip

    gyms = gyms_own_collection(gym_actor, rows[:1])
    assert not [key for key in gyms[0] if key.startswith("_ng_")], "the agent echoes no identity"

    group = asyncio.run(GymClient([gym_actor]).run_group(rows, prompt_idx=0, deadline_s=180))
    for result, expected in zip(group.rows, identity, strict=True):
        assert {k: result.full_result.get(k) for k in expected} == expected
        assert not [k for k in result.metrics if k.startswith("_ng_")], "identity is no verifier field"


def test_identity_the_callers_row_carried_is_summarised_as_nemo_rl_summarises_it():
    """NeMo-RL summarises every numeric field of a result; its rows hold only what its caller stamped (the async
    collector's ``_ng_task_index``). The identity gym-bridge stamps itself stays out of the per-agent metrics."""
    from gym_bridge.gym.protocol.result_fields import caller_fields, scalar_fields

    result = {"reward": 1.0, "_ng_task_index": 3, "_ng_rollout_index": 1, "_ng_rollout_id": "3-1", "judge": True}
    metrics = scalar_fields(result)
    assert metrics == {"reward": 1.0, "judge": 1.0}
    assert caller_fields(metrics, result, {"responses_create_params": {}}) == metrics
    assert caller_fields(metrics, result, {"_ng_task_index": 3}) == {**metrics, "_ng_task_index": 3.0}
    assert caller_fields(metrics, {"reward": 1.0}, {"_ng_task_index": 3}) == metrics, "a result that echoes none"
