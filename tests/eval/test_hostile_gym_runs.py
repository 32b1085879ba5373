"""A folder ``gym eval run`` wrote is data from outside too: generated ``rollouts.jsonl`` and
``rollouts_materialized_inputs.jsonl`` (valid records with one field replaced, JSON of any depth, bad tokens, raw
bytes, torn lines) and FIFOs, links and folders at their names, through ``gym-bridge report`` and ``compare`` in
process. Each ends in a report or comparison, or in one :class:`~gym_bridge.boundary.UntrustedInputError` line naming
the folder (``compare`` may also refuse with one ``CompareError`` line); never another exception, never a wait on a
FIFO, never a write outside the folder. Plus the units of Gym's eval-run records
(:mod:`gym_bridge.gym.protocol.eval_run`)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, strategies as st
from test_hostile_reports_properties import (
    KINDS,
    NUMBERS,
    PROPERTY,
    TEXT,
    good_result,
    good_run_json,
    jsonl,
    plant,
    refusal_or_success,
    snapshot,
)

from gym_bridge.eval.gym_runs import is_gym_run, load_gym_run
from gym_bridge.eval.records import row_id
from gym_bridge.eval.runs import ReadLimits
from gym_bridge.gym.protocol.eval_run import (
    aggregate_metrics_name,
    by_server,
    gym_rollout,
    materialized_input,
    materialized_inputs_name,
    metric_labels,
    metrics_row,
)


def gym_record(task: int, rollout: int, reward: Any, agent: str) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"q{task}"}]},
        "response": {"output": [], "usage": {"output_tokens": 3, "total_tokens": 9}},
        "reward": reward,
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "agent_ref": {"name": agent},
        "_ng_environment_server": f"{agent}_environment_server",
    }


def gym_input(task: int, rollout: int, agent: str) -> dict[str, Any]:
    row = {"responses_create_params": {"input": [{"role": "user", "content": f"q{task}"}]}}
    return {**row, "agent_ref": {"name": agent}, "_ng_task_index": task, "_ng_rollout_index": rollout}


@st.composite
def gym_folder(draw: st.DrawFn) -> dict[str, tuple[str, bytes]]:
    """file name -> (kind, bytes) of a hostile folder ``gym eval run`` wrote (``clean``, half the time: well formed,
    hostile text and numbers at every limit)."""
    clean = draw(st.booleans())
    kinds = st.just("regular") if clean else st.sampled_from(KINDS)
    rewards = st.floats(allow_nan=False, allow_infinity=False) if clean else NUMBERS
    agents = draw(st.lists(TEXT, min_size=2, max_size=2))
    keys = [(t, r) for t in range(draw(st.integers(1, 3))) for r in range(2)]
    rollouts = [gym_record(t, r, draw(rewards), agents[t % 2]) for t, r in keys]
    inputs = [gym_input(t, r, agents[t % 2]) for t, r in keys]
    files = {
        "rollouts.jsonl": (draw(kinds), draw(jsonl(rollouts, clean))),
        materialized_inputs_name("rollouts.jsonl"): (draw(kinds), draw(jsonl(inputs, clean))),
    }
    for name in draw(st.lists(st.sampled_from(["metrics.json", "report.md", "report.html"]), max_size=2)):
        files[name] = (draw(st.sampled_from(["fifo", "link_out", "link_dev_zero", "folder"])), b"")
    return files


@PROPERTY
@given(files=gym_folder())
def test_report_of_any_gym_eval_folder_is_a_report_or_one_line(tmp_path_factory, files) -> None:
    from gym_bridge.eval.report import build_report

    root = tmp_path_factory.mktemp("gym-report")
    outside, folder = root / "outside", root / "run"
    outside.mkdir()
    plant(folder, files, outside)
    before = snapshot(root, folder)
    metrics = refusal_or_success(build_report, folder, folder=folder)
    if metrics is not None:
        assert metrics["prompts_done"] == len({json.dumps(g.key) for g in load_gym_run(folder, ReadLimits()).groups})
    assert snapshot(root, folder) == before, "something outside the run folder changed"


@PROPERTY
@given(files=gym_folder())
def test_compare_with_any_gym_eval_folder_is_a_comparison_or_one_line(tmp_path_factory, files) -> None:
    from gym_bridge.eval.compare import CompareError, compare_runs

    root = tmp_path_factory.mktemp("gym-compare")
    outside, folder, good = root / "outside", root / "run", root / "good"
    outside.mkdir()
    plant(folder, files, outside)
    good.mkdir()
    (good / "run.json").write_text(json.dumps(good_run_json()))
    (good / "results.jsonl").write_text("".join(json.dumps(good_result(i, [1.0, 0.0])) + "\n" for i in range(3)))
    before = snapshot(root, root / "out")
    refusal_or_success(compare_runs, [folder, good], root / "out", folder=folder, allowed=(CompareError,))
    assert snapshot(root, root / "out") == before, "something outside the output folder changed"


def test_a_gym_folder_pairs_with_a_gym_bridge_run_by_the_dataset_row(tmp_path) -> None:
    """A task's key is the row id of its materialized input: the key the same dataset row has in a gym-bridge run."""
    folder = tmp_path / "gym"
    folder.mkdir()
    records = [gym_record(t, r, float(r), "a") for t in range(2) for r in range(2)]
    (folder / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(records)))
    inputs = [gym_input(t, r, "a") for t in range(2) for r in range(2)]
    (folder / materialized_inputs_name("rollouts.jsonl")).write_text("".join(json.dumps(r) + "\n" for r in inputs))
    assert is_gym_run(folder)
    run = load_gym_run(folder, ReadLimits())
    rows = [{"responses_create_params": {"input": [{"role": "user", "content": f"q{t}"}]}, "agent_ref": {"name": "a"}}
            for t in range(2)]  # fmt: skip
    assert [g.key for g in run.groups] == [row_id(row) for row in rows]
    assert [g.rewards for g in run.groups] == [[0.0, 1.0], [0.0, 1.0]], "each task's rollouts in rollout order"
    assert run.meta.fingerprint.num_generations_per_prompt == 2
    (folder / materialized_inputs_name("rollouts.jsonl")).unlink()
    assert [g.key for g in load_gym_run(folder, ReadLimits()).groups] == ["task:0", "task:1"]


def test_gyms_records_and_metrics_rows() -> None:
    row = {"responses_create_params": {"input": "q"}, "agent_ref": {"type": "responses_api_agents", "name": "a"}}
    result = {"reward": 1.0, "response": {"output": ["long"], "usage": {"total_tokens": 3}}, "_ng_task_index": 0}
    record = gym_rollout(result, row, agent="a", server="a_env", result_type="legacy_agent")
    assert record["agent_ref"] == row["agent_ref"], "Gym copies the row's own agent_ref"
    assert (record["_ng_environment_server"], record["_ng_result_type"]) == ("a_env", "legacy_agent")
    assert gym_rollout(result, row, agent="b", server=None, result_type=None)["agent_ref"] == {"name": "b"}
    assert metrics_row(record) == {**{k: v for k, v in record.items() if k != "response"},
                                   "response": {"usage": {"total_tokens": 3}}}  # fmt: skip
    assert materialized_input(row, record)["agent_ref"] == row["agent_ref"]
    assert "_ng_result_type" not in materialized_input(row, record)
    assert by_server([metrics_row(record), {"agent_ref": {"name": "b"}}, {"reward": 0}], {"b": "b_env"}) == {
        "a_env": [metrics_row(record)],
        "b_env": [{"agent_ref": {"name": "b"}}],
    }
    assert aggregate_metrics_name("results/rollouts.jsonl") == "results/rollouts_aggregate_metrics.json"


def test_metric_labels_are_agents_unless_an_agent_has_several_servers() -> None:
    assert metric_labels({"a_env": "a", "b_env": "b"}) == {"a_env": "a", "b_env": "b"}
    assert metric_labels({"s1": "a", "s2": "a", "b_env": "b"}) == {"s1": "s1", "s2": "s2", "b_env": "b"}
    assert metric_labels({"x": "y", "y": None}) == {"x": "x", "y": "y"}, "a label that clashes falls back"
    assert metric_labels({"x": None}) == {"x": "x"}
