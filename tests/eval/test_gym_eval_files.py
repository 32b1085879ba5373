"""A gym-bridge eval is also a Gym eval run, and a Gym eval run is read by gym-bridge: the round trip with Gym's own
tools, on the session's Gym set (the scripted policy, so both collections see the same generations).

Gym's side is Gym's own CLI as a user runs it: ``gym eval run --no-serve`` collects the same rows against the same
running servers, then ``gym eval compare``, ``aggregate`` and ``health-check`` read the gym-bridge folder, and
``gym-bridge compare`` / ``report`` read Gym's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import ray

from gym_bridge.gym_versions import installed_gym
from gym_bridge.testing import SERVED_MODEL_NAME
from gym_bridge.testing.cli import run_cli
from gym_bridge.testing.gym_rows import EQUIVALENCE_AGENT, TOOL_AGENT, equivalence_row, tool_call_rows

pytestmark = [
    pytest.mark.gym,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        "gym eval compare" not in installed_gym().eval_run_files.tools,
        reason=f"{installed_gym().label} has no `gym eval compare` or `health-check` (0.7's)",
    ),
]
REPEATS = 2


def gym_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Gym's own ``gym`` command, in a process of its own as a Gym user runs it."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("gym")), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, f"gym {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def head_args(head: str) -> list[str]:
    parts = urlsplit(head)
    return [f"+head_server.host={parts.hostname}", f"+head_server.port={parts.port}"]


@pytest.fixture(scope="module")
def runs(gym_actor, scripted_policy, tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, str]:
    """The same rows through gym-bridge's eval and through Gym's own ``gym eval run --no-serve``, on the session's
    running Gym set: (gym-bridge's run folder, Gym's, the head URL)."""
    from gym_bridge.eval.config import build_config
    from gym_bridge.eval.runner import run_eval

    work = tmp_path_factory.mktemp("gym-eval-files")
    rows = [*tool_call_rows()[:3], equivalence_row("Reply with exactly: 7", "7"), equivalence_row("Say hi", "42")]
    dataset = work / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    head = ray.get(gym_actor.server_info.remote())["head"]
    ours = work / "gym-bridge"
    config = build_config(
        {
            "dataset": str(dataset),
            "output_dir": str(ours),
            "base_urls": [scripted_policy.base_url],
            "model_name": SERVED_MODEL_NAME,
            "tokenizer": str(tiny_model_dir),
            "num_generations_per_prompt": REPEATS,
            "max_new_tokens": 64,
            "max_seq_len": 4096,
            "startup_timeout_s": 120,
        },
        [f"gym_head={head}"],
    )
    outcome = run_eval(config, progress=False)
    assert (outcome.done_now, outcome.failed_now) == (len(rows), 0)
    gyms = work / "gym"
    gym_cli("eval", "run", "--no-serve", "--input", str(dataset), "--output", str(gyms / "rollouts.jsonl"),
            "--num-repeats", str(REPEATS), *head_args(head), cwd=work)  # fmt: skip
    return ours, gyms, head


def test_a_gym_bridge_eval_folder_holds_gyms_files(runs):
    ours, gyms, _ = runs
    rollouts = [json.loads(line) for line in (ours / "rollouts.jsonl").read_text().splitlines()]
    gym_rollouts = [json.loads(line) for line in (gyms / "rollouts.jsonl").read_text().splitlines()]
    key = lambda r: (r["_ng_task_index"], r["_ng_rollout_index"])  # noqa: E731
    assert sorted(map(key, rollouts)) == sorted(map(key, gym_rollouts)), "Gym's numbering of every rollout"
    by_key = {key(r): r for r in gym_rollouts}
    for rollout in rollouts:
        gym = by_key[key(rollout)]
        assert rollout["reward"] == gym["reward"]
        for stamp in ("agent_ref", "_ng_environment_server", "_ng_result_type"):
            assert rollout[stamp] == gym[stamp], stamp
    inputs = [json.loads(line) for line in (ours / "rollouts_materialized_inputs.jsonl").read_text().splitlines()]
    assert sorted(map(key, inputs)) == sorted(map(key, rollouts))
    entries = json.loads((ours / "rollouts_aggregate_metrics.json").read_text())
    gym_entries = json.loads((gyms / "rollouts_aggregate_metrics.json").read_text())
    assert sorted(e["agent_ref"]["name"] for e in entries) == sorted([TOOL_AGENT, EQUIVALENCE_AGENT])
    mine = {e["agent_ref"]["name"]: e for e in entries}
    for gym in gym_entries:
        entry = mine[gym["agent_ref"]["name"]]
        assert entry["_ng_environment_server"] == gym["_ng_environment_server"]
        assert entry["key_metrics"] == gym["key_metrics"], "the server's own /aggregate_metrics, on the same rollouts"
        assert len(entry["group_level_metrics"]) == len(gym["group_level_metrics"])


def test_gyms_compare_aggregate_and_health_check_read_a_gym_bridge_eval(runs, tmp_path):
    ours, gyms, head = runs
    done = gym_cli("eval", "compare", "--baseline", str(gyms / "rollouts.jsonl"),
                   "--candidates", str(ours / "rollouts.jsonl"), "--output-dir", str(tmp_path / "cmp"),
                   "--report-format", "json", cwd=tmp_path)  # fmt: skip
    assert "Agents compared" in done.stdout
    report = json.loads((tmp_path / "cmp" / "compare_report.json").read_text())
    text = json.dumps(report)
    assert TOOL_AGENT in text and EQUIVALENCE_AGENT in text

    gym_cli("eval", "aggregate", "--input-glob", str(ours / "rollouts.jsonl"), "--output",
            str(tmp_path / "agg" / "rollouts.jsonl"), "--no-health-check", *head_args(head), cwd=tmp_path)  # fmt: skip
    again = {
        e["agent_ref"]["name"]: e
        for e in json.loads((tmp_path / "agg" / "rollouts_aggregate_metrics.json").read_text())
    }
    written = {e["agent_ref"]["name"]: e for e in json.loads((ours / "rollouts_aggregate_metrics.json").read_text())}
    assert {name: e["key_metrics"] for name, e in again.items()} == {
        name: e["key_metrics"] for name, e in written.items()
    }, "gym eval aggregate over our rollouts gives the metrics we wrote"

    health = gym_cli("eval", "health-check", str(ours), cwd=tmp_path)
    assert f"{(len(tool_call_rows()[:3]) + 2) * REPEATS} checked" in health.stdout


def test_gym_bridge_compare_and_report_read_a_folder_gyms_collection_wrote(runs, tmp_path):
    ours, gyms, _ = runs
    done = run_cli("compare", str(gyms), str(ours), "--out", str(tmp_path / "cmp"), timeout=180)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["shared_prompts"] == 5, "every task paired by its row, across the two collections"
    assert [run["not_shared"] for run in report["runs"]] == [0, 0]
    (comparison,) = report["comparisons"]
    assert comparison["flips"] == [], "the same policy on the same rows: no prompt flips"
    done = run_cli("report", str(gyms), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((gyms / "metrics.json").read_text())
    assert metrics["prompts_done"] == 5
