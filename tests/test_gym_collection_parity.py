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
import subprocess
import sys

import pytest
import ray
import torch

from gym_bridge.gym.rows import build_rows
from gym_bridge.types import GenerationSamplingParams
from gym_bridge.testing.gym_rows import tool_call_rows

pytestmark = [pytest.mark.gym, pytest.mark.timeout(300)]

_GYM_COLLECT = """
import asyncio, json, os, sys, urllib.request
from urllib.parse import urlsplit
head_url = sys.argv[1]
with urllib.request.urlopen(head_url + "/global_config_dict_yaml", timeout=30) as response:
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.loads(response.read())
from nemo_gym.rollout_collection import RolloutCollectionHelper
from nemo_gym.server_utils import BaseServerConfig
rows = json.loads(sys.stdin.read())
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # Gym's own prints go to stderr

async def main():
    parts = urlsplit(head_url)
    head = BaseServerConfig(host=parts.hostname, port=parts.port)
    results = {}
    for future in RolloutCollectionHelper().run_examples(examples=rows, head_server_config=head):
        row, result = await future
        results[row["_rowidx"]] = result
    answers.write(json.dumps([results[i] for i in range(len(rows))]))

asyncio.run(main())
"""


def _gym_turns(result: dict) -> list[dict]:
    """Each model call's tokens in a Gym result: the output items that carry them."""
    return [
        {key: item[key] for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}
        for item in result["response"]["output"]
        if item.get("generation_token_ids")
    ]


def test_rewards_tokens_and_logprobs_equal_gyms_own_collection(gym_actor, gym_tokenizer):
    rows = []
    for row in tool_call_rows()[:4]:
        rows += build_rows(row, 1, GenerationSamplingParams(temperature=1.0, top_p=1.0), max_new_tokens=64)
    for i, row in enumerate(rows):
        row["_rowidx"] = i

    head = ray.get(gym_actor.server_info.remote())["head"]
    done = subprocess.run(
        [sys.executable, "-c", _GYM_COLLECT, head],
        input=json.dumps(rows),
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    gym_results = json.loads(done.stdout)

    from gym_bridge.gym.client import GymClient

    ours = asyncio.run(GymClient([gym_actor]).run_group(rows, prompt_idx=0, deadline_s=120)).rows
    assert [row.row_index for row in ours] == list(range(len(rows)))
    for row, gym in zip(ours, gym_results, strict=True):
        assert row.reward == gym["reward"]
        turns = _gym_turns(gym)
        assert turns, "the scripted policy's turns carry token ids"
        assistant = [m for m in row.message_log if m["role"] == "assistant"]
        assert [m["token_ids"].tolist() for m in assistant] == [t["generation_token_ids"] for t in turns]
        for message, turn in zip(assistant, turns, strict=True):
            assert torch.equal(message["generation_logprobs"], torch.tensor(turn["generation_log_probs"]))
        history = torch.cat([m["token_ids"] for m in row.message_log]).tolist()
        final = turns[-1]
        assert history == final["prompt_token_ids"] + final["generation_token_ids"]  # the whole episode, exactly
    assert any(len(_gym_turns(gym)) > 1 for gym in gym_results), "a tool call makes a second model turn"
