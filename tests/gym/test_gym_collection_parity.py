"""gym-bridge's rollouts equal NeMo-Gym's own collection on the same rows and the same servers.

Gym's side is its own ``RolloutCollectionHelper.run_examples`` (what ``ng_collect_rollouts`` runs; on 0.7 it
posts to each agent's ``legacy_agent`` relay, we post to the agent's ``/run``), in a process of its own as a
Gym user runs it. The policy is the scripted one, so both sides see the same generations: rewards, every
turn's token ids and logprobs must match, tool-call turns included.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import ray
import torch

from gym_bridge.failures import InvalidGymRow
from gym_bridge.gym.protocol.rows import build_rows, validate_row
from gym_bridge.gym_versions import installed_gym
from gym_bridge.testing.cli import run_cli
from gym_bridge.testing.gym_rows import (
    EQUIVALENCE_AGENT,
    TOOL_AGENT,
    gym_dataset_collate,
    gym_token_turns,
    gyms_own_collection,
    tool_call_rows,
)
from gym_bridge.types import GenerationSamplingParams

pytestmark = [pytest.mark.gym, pytest.mark.timeout(300)]

def test_rewards_tokens_and_logprobs_equalgyms_own_collection(gym_actor, gym_tokenizer):
    rows = []
    for row in tool_call_rows()[:4]:
        rows += build_rows(row, 1, GenerationSamplingParams(temperature=1.0, top_p=1.0), max_new_tokens=64)
    for i, row in enumerate(rows):
        row["_rowidx"] = i

    gym_results = gyms_own_collection(gym_actor, rows)

    from gym_bridge.gym.transport.client import GymClient

    ours = asyncio.run(GymClient([gym_actor]).run_group(rows, prompt_idx=0, deadline_s=120)).rows
    assert [row.row_index for row in ours] == list(range(len(rows)))
    for row, gym in zip(ours, gym_results, strict=True):
        assert row.reward == gym["reward"]
        turns = gym_token_turns(gym)
        assert turns, "the scripted policy's turns carry token ids"
        assistant = [m for m in row.message_log if m["role"] == "assistant"]
        assert [m["token_ids"].tolist() for m in assistant] == [t["generation_token_ids"] for t in turns]
        for message, turn in zip(assistant, turns, strict=True):
            assert torch.equal(message["generation_logprobs"], torch.tensor(turn["generation_log_probs"]))
        history = torch.cat([m["token_ids"] for m in row.message_log]).tolist()
        final = turns[-1]
        assert history == final["prompt_token_ids"] + final["generation_token_ids"]  # the whole episode, exactly
    assert any(len(gym_token_turns(gym)) > 1 for gym in gym_results), "a tool call makes a second model turn"


_COLLATED_CONFIGS = [
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "resources_servers/equivalence_rule/configs/lc.yaml",
]
_TASK_SOURCE = installed_gym().task_source_routing


@pytest.fixture(scope="module")
def collated(tmp_path_factory) -> Path:
    if not _TASK_SOURCE:
        pytest.skip(f"{installed_gym().label} has no `gym dataset collate` (test_task_source_rows_are_refused_...)")
    return gym_dataset_collate(tmp_path_factory.mktemp("collate"), _COLLATED_CONFIGS)


def test_rows_gym_07_collates_run_as_gyms_own_collection_runs_them(gym_actor, collated):
    """``gym dataset collate`` writes rows with ``task_source`` and no ``agent_ref``; both sides resolve them (Gym
    with its own resolver in ``run_examples``, we with the routes Gym's resolver computed at start) and roll
    them out alike. The equivalence rows' prompts exceed the scripted policy's context on both sides, so the
    tool-call rows are compared."""
    collated_rows = [json.loads(line) for line in collated.read_text().split("\n") if line.strip()]
    assert len(collated_rows) == 10 and all("task_source" in r and "agent_ref" not in r for r in collated_rows)
    sources = [r for r in collated_rows if r["task_source"] == TOOL_AGENT]
    assert len(sources) == 5
    rows = []
    for i, row in enumerate(sources):
        built = build_rows(row, 1, GenerationSamplingParams(temperature=1.0, top_p=1.0), 64, task_index=i)[0]
        built["_rowidx"] = i
        rows.append(built)
    assert all("agent_ref" not in row for row in rows)
    gym_results = gyms_own_collection(gym_actor, rows)

    from gym_bridge.gym.transport.client import GymClient

    ours = asyncio.run(GymClient([gym_actor]).run_group(rows, prompt_idx=0, deadline_s=120)).rows
    assert [row.reward for row in ours] == [gym["reward"] for gym in gym_results]
    for row, gym in zip(ours, gym_results, strict=True):
        assistant = [m for m in row.message_log if m["role"] == "assistant"]
        assert [m["token_ids"].tolist() for m in assistant] == [t["generation_token_ids"] for t in gym_token_turns(gym)]
        for message, turn in zip(assistant, gym_token_turns(gym), strict=True):
            assert torch.equal(message["generation_logprobs"], torch.tensor(turn["generation_log_probs"]))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_collated_dataset_runs_through_gym_bridge_eval(collated, tmp_path, ray_session):
    """The collated file, unchanged, through ``gym-bridge eval``: every row is sent to the agent Gym resolves for
    it. ``max_seq_len`` is the scripted policy's context too, so the equivalence rows (Gym's long-context
    examples, 3,900-7,100 tokens) finish beside the tool-call rows. The command joins the session Ray
    (``RAY_ADDRESS``) instead of starting its own; it starts its own Gym set."""
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = run_cli("eval", "examples/eval_equivalence_tools.yaml", f"dataset={collated}", f"output_dir={out}",
                   "max_seq_len=8192", "num_generations_per_prompt=2", env=env, timeout=420)  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().split("\n") if line.strip()]
    assert done.returncode == 0 and not (out / "failures.jsonl").exists(), done.stderr[-3000:]
    assert sorted(r["prompt_idx"] for r in results) == list(range(10))
    tool = [r for r in results if r["agent"] == TOOL_AGENT]
    assert sorted(r["prompt_idx"] for r in tool) == list(range(5))
    assert all(len(r["completions"]) == 2 and r["completions"][0]["reward"] == 1.0 for r in tool)
    assert {r["agent"] for r in results} - {TOOL_AGENT} == {EQUIVALENCE_AGENT}


def test_task_source_rows_are_refused_in_one_line_where_gym_cannot_resolve_them():
    """On 0.4 and 0.5 a ``task_source`` row without ``agent_ref`` is refused where it enters, naming the field and
    the installed version; on 0.6+ it is a valid row."""
    row = {"responses_create_params": {"input": "hi"}, "task_source": TOOL_AGENT}
    if _TASK_SOURCE:
        assert validate_row(row, prompt_idx=3).agent_name is None
        return
    with pytest.raises(InvalidGymRow, match=rf"^prompt_idx=3: task_source .* needs nemo-gym >= 0.6 .*{installed_gym().version}"):
        validate_row(row, prompt_idx=3)
