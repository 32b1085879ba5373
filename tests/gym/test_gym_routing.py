"""Rows as Gym 0.7 writes and routes them, without Gym servers: routing keys, task_source resolution, rollout
identity, repeats and the one row-file reader. The real servers are in test_gym_collection_parity.py,
test_gym_environment_servers.py and test_seeded_rollouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gym_bridge.config.grpo import load_gym_rows, row_routing
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.training import nemo_gym_config_from
from gym_bridge.eval.config import EvalConfig
from gym_bridge.failures import InvalidGymRow
from gym_bridge.gym.protocol.numbering import mark_repeats, rollout_seed, with_attempt
from gym_bridge.gym.protocol.routing import GymRoutes, RowRouting
from gym_bridge.gym.protocol.row_file import read_row_file
from gym_bridge.gym.protocol.rows import build_rows, row_seed, validate_row
from gym_bridge.gym_versions import installed_gym
from gym_bridge.types import GenerationSamplingParams

PARAMS = {"input": "hi"}
SAMPLING = GenerationSamplingParams(temperature=1.0, top_p=1.0)
ROUTES = GymRoutes(
    agents=("a", "b", "c"),
    dispatch={"a": "a_env", "b": "b", "c": "c"},
    task_sources={"src_a": "a", "b": "b"},
    task_source_errors={"ambiguous": "its datasets pin conflicting agents (['a', 'b'])"},
)


def row(**fields):
    return {"responses_create_params": PARAMS, **fields}


def test_agent_map_precedence_is_gyms():
    routing = RowRouting(agent_map={"src": "mapped_src", "old": "mapped_old", "_default": "fallback"})
    assert RowRouting().apply(row(task_source="src")) == [row(task_source="src")]
    assert routing.apply(row(task_source="src"))[0]["agent_ref"] == {"name": "mapped_src"}
    both = row(agent_ref={"name": "old"}, task_source="src")
    assert routing.apply(both)[0]["agent_ref"] == {"name": "mapped_old"}, "the agent name's entry wins"
    assert routing.apply(row(agent_ref={"name": "x"}))[0]["agent_ref"] == {"name": "fallback"}, "_default > agent_ref"
    assert RowRouting(agent_name="only").apply(row(task_source="src"))[0]["agent_ref"] == {"name": "only"}
    original = row(task_source="src")
    routing.apply(original)
    assert "agent_ref" not in original, "the caller's row is kept"


def test_fan_out_makes_one_task_per_agent():
    routing = RowRouting(fan_out={"src": ["a", "b"]}, agent_map={"_default": "c"})
    copies = routing.apply(row(task_source="src"))
    assert [c["agent_ref"]["name"] for c in copies] == ["a", "b"]
    assert routing.apply(row(task_source="other"))[0]["agent_ref"] == {"name": "c"}


def test_routing_keys_that_contradict_each_other_are_refused():
    with pytest.raises(ValidationError, match="agent_name .* and agent_map._default .* both route every row"):
        RowRouting(agent_name="a", agent_map={"_default": "b"})
    with pytest.raises(ValidationError, match=r"fan_out lists no agent for \['src'\]"):
        RowRouting(fan_out={"src": []})
    with pytest.raises(ValidationError, match=r"fan_out lists an agent more than once: \{'src': \['a'\]\}"):
        RowRouting(fan_out={"src": ["a", "b", "a"]})
    same = RowRouting(agent_name="a", agent_map={"_default": "a"})  # Gym folds agent_name into _default: no conflict
    assert same.apply(row(task_source="src"))[0]["agent_ref"] == {"name": "a"}
    with pytest.raises(Exception, match="both route every row"):
        EvalConfig.model_validate(
            {
                "dataset": "d.jsonl",
                "config_paths": ["c.yaml"],
                "output_dir": "o",
                "agent_name": "a",
                "agent_map": {"_default": "b"},
            }  # fmt: skip
        )


def test_routes_resolve_a_task_source_and_name_what_routes_nowhere():
    assert ROUTES.agent_of(row(task_source="src_a"), where="prompt_idx=0") == "a"
    assert ROUTES.routed(row(task_source="src_a"), where="w")["agent_ref"] == {"name": "a"}
    named = row(agent_ref={"name": "b"}, task_source="src_a")
    assert ROUTES.routed(named, where="w") is named, "agent_ref > task_source"
    with pytest.raises(
        InvalidGymRow, match=r"^prompt_idx=4: task_source 'nope' routes nowhere: .*known agents: a, b, c$"
    ):
        ROUTES.agent_of(row(task_source="nope"), where="prompt_idx=4")
    with pytest.raises(InvalidGymRow, match=r"task_source 'ambiguous' routes nowhere: its datasets pin conflicting"):
        ROUTES.agent_of(row(task_source="ambiguous"), where="w")
    with pytest.raises(InvalidGymRow, match=r"agent_ref.name 'zz' is not a running agent; known agents: a, b, c"):
        ROUTES.agent_of(row(agent_ref={"name": "zz"}), where="w")
    with pytest.raises(InvalidGymRow, match="neither agent_ref nor task_source; set agent_name or agent_map._default"):
        ROUTES.agent_of(row(), where="w")
    old = GymRoutes(agents=("a",), task_sources=None)
    with pytest.raises(InvalidGymRow, match=rf"needs nemo-gym >= 0.6 to resolve it \({installed_gym().label}"):
        old.agent_of(row(task_source="src_a"), where="w")


def test_a_whole_dataset_is_routed_at_once_and_every_row_that_routes_nowhere_named():
    rows = [row(task_source="src_a"), row(task_source="nope"), row(agent_ref={"name": "zz"})]
    routed, problems = ROUTES.route_all(rows, ["line 1", "line 2", "line 3"])
    assert routed == [{**rows[0], "agent_ref": {"name": "a"}}]
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3"]


def test_each_copy_carries_gyms_rollout_identity_and_repeats_get_their_own():
    keys = installed_gym().rollout_identity_keys
    first, second = mark_repeats([row(q=1), row(q=1)], [5, 6])
    assert (first["_ng_task_index"], first["_ng_rollout_index"]) == (5, 0)
    assert (second["_ng_task_index"], second["_ng_rollout_index"]) == (5, 1)
    assert mark_repeats([row(q=1), row(q=2)], [0, 1]) == [row(q=1), row(q=2)], "unique rows are left as they are"
    a = build_rows(first, 3, SAMPLING, 8, run_seed=11, task_index=99)
    b = build_rows(second, 3, SAMPLING, 8, run_seed=11, task_index=99)
    assert [r["_ng_rollout_index"] for r in a + b] == [0, 1, 2, 3, 4, 5]
    assert {r["_ng_task_index"] for r in a + b} == {5}, "the row's own task index wins over the prompt index"
    if "_ng_rollout_id" in keys:
        assert [r["_ng_rollout_id"] for r in b] == ["5-3", "5-4", "5-5"]
    seeds = [row_seed(r) for r in a + b]
    assert len(set(seeds)) == 6
    assert seeds == [rollout_seed(11, row(q=1), i) for i in range(6)], "run seed, the row's content, rollout: only"
    plain = build_rows(row(q=3), 2, SAMPLING, 8, task_index=7)
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in plain] == [(7, 0), (7, 1)]
    resent = with_attempt(a[1], 2)
    assert row_seed(resent) == row_seed(a[1]) and resent["_ng_rollout_index"] == 1
    assert resent.get("_ng_attempt_index") == (2 if "_ng_attempt_index" in keys else None)
    assert "_ng_attempt_index" not in a[1], "the caller's row is kept"


def test_a_scope_keeps_the_rollout_ids_of_restarted_numbering_apart():
    """Two validation sets (or a set beside training rows) both number their tasks from 0: with a scope each,
    their rows keep distinct token-capture keys and the same task index, rollout index and seed."""
    plain = build_rows(row(q=1), 2, SAMPLING, 8, run_seed=3, task_index=0)
    first = build_rows(row(q=1), 2, SAMPLING, 8, run_seed=3, task_index=0, scope="val6-0")
    second = build_rows(row(q=2), 2, SAMPLING, 8, run_seed=3, task_index=0, scope="val 6/1")
    assert [r["_ng_task_index"] for r in first + second] == [0, 0, 0, 0]
    assert [row_seed(r) for r in first] == [row_seed(r) for r in plain]
    if "_ng_rollout_id" in installed_gym().rollout_identity_keys:
        assert [r["_ng_rollout_id"] for r in first + second] == [
            "val6-0-0-0",
            "val6-0-0-1",
            "val_6_1-0-0",
            "val_6_1-0-1",
        ]
        from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body

        assert [maybe_rollout_id_from_run_body(r) for r in second] == ["val_6_1-0-0", "val_6_1-0-1"]


def test_a_rollout_index_that_is_not_a_count_is_refused_where_the_row_enters():
    with pytest.raises(
        InvalidGymRow, match=r"^prompt_idx=2: invalid Gym row: _ng_rollout_index must be a non-negative int, got '1'$"
    ):
        validate_row(row(agent_ref={"name": "a"}, _ng_rollout_index="1"), prompt_idx=2)
    with pytest.raises(
        InvalidGymRow, match=r"^prompt_idx=2: invalid Gym row: _ng_task_index must be a non-negative int, got -1$"
    ):
        validate_row(row(agent_ref={"name": "a"}, _ng_task_index=-1), prompt_idx=2)


def test_a_rows_own_task_index_is_kept_and_its_rollouts_continue_gyms_count(tmp_path: Path):
    """As Gym honours a task index the data carries (a slicer's global index), and counts that task's rollouts on
    from the rows numbered before it; a ``_ng_rollout_index`` in the data is replaced by the count."""
    lines = [json.dumps(row(agent_ref={"name": "a"}, q=1)), json.dumps(row(agent_ref={"name": "a"}, _ng_task_index=0,
             _ng_rollout_index=7)), json.dumps(row(agent_ref={"name": "a"}, q=2))]  # fmt: skip
    rows, problems = read_row_file(tmp_path / "d.jsonl", "\n".join(lines))
    assert problems == []
    assert [(r.row["_ng_task_index"], r.row["_ng_rollout_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0)]


def test_a_row_file_splits_on_newlines_only_routes_and_numbers_rows_as_gym(tmp_path: Path):
    """Every row gets Gym's task index (dense over distinct rows: the bad line takes none) and its unit's ordinal:
    the fan_out row is task 0 for both agents (ordinals 0, 1), the repeated row task 1 (ordinals 0, 1)."""
    separators = "a\u2028b\u2029c\u0085d"
    lines = [
        json.dumps(row(task_source="src", text=separators), ensure_ascii=False),
        "{bad",
        json.dumps(row(agent_ref={"name": "a"})),
        json.dumps(row(agent_ref={"name": "a"})),
    ]
    path = tmp_path / "rows.jsonl"
    text = "\n".join(lines) + "\n"
    rows, problems = read_row_file(path, text, routing=RowRouting(fan_out={"src": ["a", "b"]}))
    assert len(problems) == 1 and problems[0].startswith(f"{path}:2: not valid JSON"), problems
    assert [(r.prompt_idx, r.line) for r in rows] == [(0, 1), (1, 1), (3, 3), (4, 4)]
    assert rows[0].row["text"] == separators and rows[0].row["agent_ref"] == {"name": "a"}
    assert rows[1].row["agent_ref"] == {"name": "b"}
    assert [(r.row["_ng_task_index"], r.row["_ng_rollout_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all("_ng_task_index" not in json.loads(line) for line in lines if line != "{bad"), "the data is kept"


def test_a_training_config_reads_gyms_routing_keys_and_keeps_them_from_gyms_global_config(tmp_path: Path):
    config = {"env": {"nemo_gym": {"config_paths": ["x.yaml"], "base_urls": ["http://127.0.0.1:1/v1"],
                                   "model_name": "m", "agent_map": {"_default": "a"}, "fan_out": {"s": ["a", "b"]}}}}  # fmt: skip
    routing = row_routing(config)
    assert routing.agent_map == {"_default": "a"} and routing.fan_out == {"s": ["a", "b"]}
    assert not {"agent_map", "fan_out"} & set(nemo_gym_config_from(config).overrides)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(row(task_source="s")) + "\n" + json.dumps(row(task_source="t")) + "\n")
    rows = load_gym_rows(data, routing)
    assert [r["agent_ref"]["name"] for r in rows] == ["a", "b", "a"]
    with pytest.raises(
        TrainingConfigError, match=r"^env.nemo_gym: agent_name \('a'\) and agent_map._default \('b'\) both"
    ):
        row_routing({"env": {"nemo_gym": {"agent_name": "a", "agent_map": {"_default": "b"}}}})
