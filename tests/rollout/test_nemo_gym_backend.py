"""AsyncNemoGymRolloutImpl's stream handling, against a scripted streaming Ray actor.

The scripted actor stands in for the NemoGym actor only to drive the edge cases of
the stream (lost rows, stale and duplicate indices, hangs); the real actor and real
Gym servers are exercised by the integration tests.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
import torch

from gym_bridge.failures import (
    GymRowIndexError,
    GymTransportError,
    RolloutDataFailure,
    RolloutRetryPolicy,
    RolloutTimeout,
    RolloutTimeouts,
)
from gym_bridge.gym.protocol.result import GymRowBatch, GymRowResult
from gym_bridge.gym.protocol.result_fields import gym_row_result
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl
from gym_bridge.types import token_tensor

pytestmark = pytest.mark.usefixtures("ray_session")

GEN_CFG = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
    "agent_ref": {"type": "responses_api_agents", "name": "agent_a"},
}


def fake_result(rowidx: int, reward: float = 1.0, **flags) -> GymRowResult:
    """A converted row as the actor ships it (numpy arrays, the agent it was sent to), built by the same schema
    reader."""
    user = {"role": "user", "content": "", "token_ids": token_tensor([1, 2, 3])}
    asst = {
        "role": "assistant",
        "content": "",
        "token_ids": token_tensor([4, 5 + rowidx]),
        "generation_logprobs": torch.tensor([-0.5, -0.25]),
    }
    full_result = {"reward": reward, "solved": reward > 0, "response": {}, "label": "text", **flags}
    return dataclasses.replace(gym_row_result(rowidx, [user, asst], full_result), agent="agent_a")


_MASK_PLANS = {
    "mask_infra": {"failure_kind": "session_lost", "failure_reason": "the sandbox session reset timed out"},
    "mask_data": {"failure_kind": "judge_failed", "failure_reason": "the judge answered nothing"},
}


@ray.remote
class ScriptedStreamActor:
    """Streams rows back per a script: each call pops one plan (drop / duplicate / stale / fail / hang)."""

    def __init__(self):
        self.reset([])

    def reset(self, plans: list[str], hang_agents: bool = False):
        self.plans = list(plans)
        self.calls: list[list[int]] = []
        self.hang_agents = hang_agents

    async def routes(self):
        if self.hang_agents:  # an actor that never answers (e.g. stuck starting its servers)
            await asyncio.sleep(60)
        return GymRoutes(agents=("agent_a",))

    def dispatched(self):
        return self.calls

    async def run_row_batches(self, rows, timer_prefix):
        plan = self.plans.pop(0) if self.plans else "ok"
        indices = [r["_rowidx"] for r in rows]
        self.calls.append(indices)
        if plan == "hang":
            await asyncio.sleep(60)
        if plan == "legacy_tuple":
            yield [(indices[0], {})], None
            return
        for k, i in enumerate(indices):
            if plan == "drop_last_then_fail" and k == len(indices) - 1:
                raise GymTransportError("NeMo-Gym /run failed with HTTP 502: bad gateway")
            if plan == "data_failure":
                raise RolloutDataFailure("NeMo-Gym /run failed with HTTP 422: bad row")
            timing = {f"{timer_prefix}/await_results": 0.1} if k == len(indices) - 1 else None
            if plan in _MASK_PLANS and i % 2 == 1:  # Gym 0.7's flagged samples, on the odd rows
                yield GymRowBatch([fake_result(i, reward=0.0, mask_sample=True, **_MASK_PLANS[plan])], timing)
                continue
            yield GymRowBatch([fake_result(i, reward=float(i))], timing)
            if plan == "duplicate":
                yield GymRowBatch([fake_result(i)])
        if plan == "stale":
            yield GymRowBatch([fake_result(99)])
        if plan == "short":
            return


@pytest.fixture(scope="module")
def stream_actor(ray_session):
    actor = ScriptedStreamActor.remote()
    yield actor
    ray.kill(actor)


@pytest.fixture
def make(stream_actor):
    """Build the backend over the shared scripted actor, reset to ``plans``."""

    def build(plans, hang_agents=False, max_gym_row_attempts=1, **kwargs):
        ray.get(stream_actor.reset.remote(plans, hang_agents))
        impl = AsyncNemoGymRolloutImpl(
            tokenizer=None, task_to_env={}, num_generations_per_prompt=4, max_seq_len=100, generation_config=GEN_CFG,
            nemo_gym_actor=stream_actor,
            retry_policy=RolloutRetryPolicy.single_attempt(max_gym_row_attempts=max_gym_row_attempts), **kwargs,
        )
        return impl, stream_actor

    return build


def datum(row=ROW, idx=3):
    return {"message_log": [], "length": 0, "extra_env_info": row, "loss_multiplier": 1.0, "idx": idx}


async def test_group_in_generation_order_with_metrics(make):
    impl, _ = make(["ok"])
    record = await impl.run_rollout(datum())
    assert record.prompt_idx == 3 and record.metadata == {"task_name": "nemo_gym"}
    assert [c.reward for c in record.completions] == [0.0, 1.0, 2.0, 3.0]
    assert [c.message_log[1]["token_ids"][-1].item() for c in record.completions] == [5, 6, 7, 8]
    m = record.rollout_metrics
    assert m["total_reward/mean"] == 1.5 and m["turns_per_sample/mean"] == 1
    assert m["agent_a/reward/mean"] == 1.5 and m["agent_a/solved/mean"] == 0.75
    assert "agent_a/label/mean" not in m
    assert m["timing/rollout/await_results"] == 0.1
    assert m["truncation_rate"] == 0.0 and m["token_drift_rate"] == 0.0
    assert 0 < m["timing/rollout/compute_metrics"] < m["timing/rollout/total"]
    assert 0 < m["timing/rollout/run_rollouts"] <= m["timing/rollout/total"]


async def test_only_missing_rows_are_redispatched(make):
    impl, actor = make(["drop_last_then_fail", "ok"], max_gym_row_attempts=3)
    record = await impl.run_rollout(datum())
    assert await actor.dispatched.remote() == [[0, 1, 2, 3], [3]]
    assert [c.reward for c in record.completions] == [0.0, 1.0, 2.0, 3.0]
    assert impl.stats.gym_row_redispatches == 1


async def test_row_budget_exhaustion_reraises_the_transport_error(make):
    impl, actor = make(["drop_last_then_fail"] * 3, max_gym_row_attempts=2)
    with pytest.raises(GymTransportError, match="HTTP 502"):
        await impl.run_rollout(datum())
    assert len(await actor.dispatched.remote()) == 2


async def test_data_failure_is_not_redispatched(make):
    impl, actor = make(["data_failure", "ok"])
    with pytest.raises(RolloutDataFailure, match="HTTP 422"):
        await impl.run_rollout(datum())
    assert len(await actor.dispatched.remote()) == 1


@pytest.mark.parametrize(
    ("plan", "needle"),
    [("duplicate", "duplicate row index 0"), ("stale", "99 came back, which was not dispatched")],
)
async def test_bad_row_indices_are_rejected(make, plan, needle):
    impl, _ = make([plan] * 3, max_gym_row_attempts=1)
    with pytest.raises(GymRowIndexError, match=needle):
        await impl.run_rollout(datum())


async def test_hung_stream_hits_the_group_deadline(make):
    impl, _ = make(["hang"], timeouts=RolloutTimeouts(rollout_s=1.0))
    with pytest.raises(RolloutTimeout, match="NeMo-Gym prompt group exceeded 1.0s"):
        await impl.run_rollout(datum())


async def test_agent_discovery_is_under_the_group_deadline(make):
    """A hung agent_names() fails the group at its deadline instead of waiting without bound; nothing is sent."""
    impl, actor = make(["ok"], hang_agents=True, timeouts=RolloutTimeouts(rollout_s=1.0))
    with pytest.raises(RolloutTimeout, match="NeMo-Gym prompt group exceeded 1.0s"):
        await asyncio.wait_for(impl.run_rollout(datum()), timeout=30)
    assert await actor.dispatched.remote() == []


async def test_stream_elements_must_be_typed_batches(make, stream_actor):
    """The client accepts only GymRowBatch elements: a stray tuple (NeMo-RL's per-row shape) is a transport
    failure."""
    impl, _ = make(["legacy_tuple"], max_gym_row_attempts=1)
    with pytest.raises(GymTransportError, match="not a GymRowBatch"):
        await impl.run_rollout(datum())
    assert impl.in_flight_rows == [0]


async def test_invalid_row_fails_before_dispatch(make):
    impl, actor = make(["ok"])
    with pytest.raises(RolloutDataFailure, match="prompt_idx=3: agent_ref.name 'nope' is not a running agent"):
        await impl.run_rollout(datum({**ROW, "agent_ref": {"name": "nope"}}))
    assert await actor.dispatched.remote() == []


def test_construction_rejects_what_gym_cannot_honour():
    actor = object()
    base = dict(tokenizer=None, task_to_env={}, num_generations_per_prompt=2, max_seq_len=10, nemo_gym_actor=actor)
    with pytest.raises(ValueError, match="stop_strings"):
        AsyncNemoGymRolloutImpl(generation_config={**GEN_CFG, "stop_strings": ["x"]}, **base)
    with pytest.raises(ValueError, match="top_k"):
        AsyncNemoGymRolloutImpl(generation_config={**GEN_CFG, "top_k": 5}, **base)
    with pytest.raises(ValueError, match="max_rollout_turns=1 or None"):
        AsyncNemoGymRolloutImpl(generation_config=GEN_CFG, max_rollout_turns=3, **base)
    with pytest.raises(ValueError, match="greedy"):
        AsyncNemoGymRolloutImpl(generation_config=GEN_CFG, greedy=True, **base)
    with pytest.raises(ValueError, match="generation_config"):
        AsyncNemoGymRolloutImpl(**base)


async def test_manager_routes_use_nemo_gym_and_task_to_env_actor(make):
    _, actor = make(["ok"])
    manager = RolloutManager(None, {"nemo_gym": actor}, 4, 100, use_nemo_gym=True, generation_config=GEN_CFG)
    record = await manager.run_rollout(datum())
    assert len(record.completions) == 4


async def _until_dead(actor) -> None:
    """Until Ray answers calls to ``actor`` with ActorDiedError (a kill takes effect asynchronously)."""
    from gym_bridge.testing import async_wait_until

    async def died() -> bool:
        try:
            await actor.dispatched.remote()
        except ray.exceptions.ActorDiedError:
            return True
        except ray.exceptions.RayActorError:
            return False
        return False

    await async_wait_until(died, 30, "the killed actor to be reported dead")


async def test_a_dead_actor_gets_no_more_groups(ray_session):
    """An actor Ray reports dead for good mid-run: its group is re-dispatched to the other actor, and later
    groups go straight there."""
    from gym_bridge.gym.transport.client import GymClient

    dead, live = ScriptedStreamActor.remote(), ScriptedStreamActor.remote()
    try:
        ray.get([dead.reset.remote([]), live.reset.remote([])])
        client = GymClient([dead, live], max_gym_row_attempts=2)
        assert await client.agent_names() == ["agent_a"]  # asked of the first actor while it lived
        ray.kill(dead, no_restart=True)
        await _until_dead(dead)
        rows = [{**ROW, "_rowidx": i} for i in range(4)]
        first = await client.run_group(rows, prompt_idx=0, deadline_s=60)
        assert sorted(r.row_index for r in first.rows) == [0, 1, 2, 3]
        assert client.dead_actors == [0] and client.stats.gym_row_redispatches == 4
        second = await client.run_group(rows, prompt_idx=1, deadline_s=60)
        assert len(second.rows) == 4 and client.stats.gym_row_redispatches == 4  # straight to the live actor
        assert ray.get(live.dispatched.remote()) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    finally:
        ray.kill(live)


async def test_agent_discovery_skips_a_dead_first_actor(ray_session):
    from gym_bridge.gym.transport.client import GymClient

    dead, live = ScriptedStreamActor.remote(), ScriptedStreamActor.remote()
    try:
        ray.get([dead.reset.remote([]), live.reset.remote([])])
        ray.kill(dead, no_restart=True)
        await _until_dead(dead)
        client = GymClient([dead, live])
        assert await client.agent_names() == ["agent_a"] and client.dead_actors == [0]
    finally:
        ray.kill(live)


async def test_flagged_samples_are_masked_and_counted_never_zero_rewards(make):
    """Gym 0.7's mask_sample with a verifier's failure_kind: the samples stay (masked), are counted per agent,
    and the group is complete; nothing is re-sent for a DATA kind."""
    impl, actor = make(["mask_data"])
    record = await impl.run_rollout(datum())
    assert [c.masked for c in record.completions] == [False, True, False, True]
    assert [c.failure_kind for c in record.completions] == [None, "judge_failed", None, "judge_failed"]
    assert record.rollout_metrics["masked_rate"] == 0.5 and record.rollout_metrics["agent_a/masked_rate"] == 0.5
    assert record.rollout_metrics["agent_a/failure_kind/judge_failed"] == 2.0
    assert ray.get(actor.dispatched.remote()) == [[0, 1, 2, 3]]


async def test_infra_flagged_rows_are_resent_then_kept_masked(make):
    """A row masked for an infrastructure failure_kind (session_lost) is re-sent while the row budget lasts;
    a row still flagged on the last attempt is kept, masked, not turned into a reward."""
    impl, actor = make(["mask_infra", "ok"], max_gym_row_attempts=3)
    record = await impl.run_rollout(datum())
    assert [c.masked for c in record.completions] == [False] * 4 and [c.reward for c in record.completions] == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]
    assert ray.get(actor.dispatched.remote()) == [[0, 1, 2, 3], [1, 3]]
    assert impl.stats.as_metrics()["rollout/env_failure_redispatch_total/session_lost"] == 2.0

    impl, actor = make(["mask_infra"] * 3, max_gym_row_attempts=3)
    record = await impl.run_rollout(datum())
    assert [c.masked for c in record.completions] == [False, True, False, True]
    assert ray.get(actor.dispatched.remote()) == [[0, 1, 2, 3], [1, 3], [1, 3]]


async def test_masking_off_keeps_flagged_samples_and_gyms_result_as_it_came(make):
    """mask_env_flagged_samples=False (NeMo-RL's opt-out): the sample trains; Gym's result is not edited."""
    impl, _ = make(["mask_data"], mask_env_flagged_samples=False)
    record = await impl.run_rollout(datum())
    assert not any(c.masked for c in record.completions)
    assert [bool((c.env_extras or {}).get("mask_sample")) for c in record.completions] == [False, True, False, True]


async def test_masking_off_keeps_infra_flagged_rows_instead_of_resending_them(make):
    """Without masking, a row Gym flagged for an infrastructure failure_kind is kept as it came (NeMo-RL)."""
    impl, actor = make(["mask_infra"], mask_env_flagged_samples=False, max_gym_row_attempts=3)
    record = await impl.run_rollout(datum())
    assert ray.get(actor.dispatched.remote()) == [[0, 1, 2, 3]]
    assert not any(c.masked for c in record.completions)


async def test_every_group_carries_nemo_rls_full_result_table(make):
    """NeMo-RL's AsyncNemoGymRolloutImpl always adds ``{agent}/full_result``: one compact JSON per completion."""
    import json

    impl, _ = make(["ok"])
    record = await impl.run_rollout(datum())
    table = record.rollout_metrics["agent_a/full_result"]
    data = table["data"] if isinstance(table, dict) else table.data
    assert [json.loads(row[0])["reward"] for row in data] == [c.reward for c in record.completions]
