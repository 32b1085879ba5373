"""RolloutManager.collect: the retry policy, the sink contract, and the stats.

The backend here is a scripted stand-in that fails on cue, so the policy's edge
cases (budgets, backoff, skips, drops) can be driven exactly; real faults against
real components are the fault-injection suite's job.
"""

from __future__ import annotations

import asyncio

import pytest

from gym_bridge.failures import (
    GymTransportError,
    RolloutDataFailure,
    RolloutRedispatchExhausted,
    RolloutRetryPolicy,
)
from gym_bridge.rollout.manager import RolloutManager, RolloutOutcome
from gym_bridge.rollout.sink import InMemorySink, RolloutSink
from gym_bridge.testing import async_wait_until
from gym_bridge.types import Completion, PromptGroupRecord


class ScriptedBackend:
    """Each run_rollout pops the next outcome: "ok", "infra", "data" or "hang"."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    async def run_rollout(self, datum):
        self.calls += 1
        step = self.script.pop(0) if self.script else "ok"
        if step == "infra":
            raise GymTransportError("NeMo-Gym /run failed with HTTP 503")
        if step == "data":
            raise RolloutDataFailure("verifier rejected the row")
        if step == "hang":
            await asyncio.sleep(60)
        completions = [Completion([], None, False, 1.0) for _ in range(2)]
        return PromptGroupRecord(datum["idx"], [], None, {}, completions, {})


def manager(script, **policy):
    policy = RolloutRetryPolicy(**{"max_infra_attempts": 3, "max_data_attempts": 2, "max_gym_row_attempts": 1,
                                   "backoff_base_s": 0.0, **policy})
    m = RolloutManager(None, {}, 2, 128, backend="native", policy_generation=object(), retry_policy=policy)
    m.backend = ScriptedBackend(script)
    return m


def datum(idx=0):
    return {"message_log": [], "length": 0, "extra_env_info": None, "loss_multiplier": 1.0, "idx": idx}


def test_policy_validation_and_backoff():
    with pytest.raises(ValueError, match="max_infra_attempts must be >= 1"):
        RolloutRetryPolicy(max_infra_attempts=0, max_data_attempts=1, max_gym_row_attempts=1)
    policy = RolloutRetryPolicy(1, 1, 1, backoff_base_s=1.0, max_backoff_s=4.0)
    assert [policy.backoff_for(k) for k in range(1, 7)] == [1, 2, 4, 4, 4, 4]
    assert RolloutRetryPolicy.single_attempt(max_skipped_prompts=2).max_skipped_prompts == 2
    assert isinstance(InMemorySink(), RolloutSink)


async def test_transient_infra_failure_is_retried_and_committed():
    m, sink = manager(["infra", "infra", "ok"]), InMemorySink()
    assert await m.collect(datum(), sink) is RolloutOutcome.COMMITTED
    assert len(sink.records) == 1 and len(sink.discarded) == 2 and not sink.reserved
    metrics = m.stats.as_metrics()
    assert metrics["rollout/committed_total"] == 1.0 and metrics["rollout/redispatch_total"] == 2.0
    assert metrics["rollout/redispatch_total/GymTransportError"] == 2.0


async def test_exhausted_infra_budget_stops_the_run_by_default():
    m, sink = manager(["infra"] * 3), InMemorySink()
    with pytest.raises(RolloutRedispatchExhausted, match="max_consecutive_dropped_prompts=0"):
        await m.collect(datum(), sink)
    assert sink.records == [] and not sink.reserved and m.backend.calls == 3


async def test_infra_drops_are_tolerated_up_to_the_cap_and_reset_by_a_commit():
    m = manager(["infra"] * 2 + ["ok"] + ["infra"] * 4, max_infra_attempts=2, max_consecutive_dropped_prompts=1)
    sink = InMemorySink()
    assert await m.collect(datum(0), sink) is RolloutOutcome.SKIPPED
    assert await m.collect(datum(1), sink) is RolloutOutcome.COMMITTED
    assert await m.collect(datum(2), sink) is RolloutOutcome.SKIPPED
    with pytest.raises(RolloutRedispatchExhausted, match="2 prompt\\(s\\) dropped in a row"):
        await m.collect(datum(3), sink)
    assert m.stats.max_consecutive_infra_drops == 1 and m.stats.skipped == 2


async def test_one_data_retry_separates_transient_from_deterministic():
    m, sink = manager(["data", "ok"]), InMemorySink()
    assert await m.collect(datum(), sink) is RolloutOutcome.COMMITTED
    assert m.stats.as_metrics()["rollout/data_retry_total"] == 1.0
    assert m.stats.as_metrics()["rollout/redispatch_total"] == 0.0


async def test_a_bad_prompt_fails_the_run_by_default_with_its_own_error():
    m, sink = manager(["data", "data"]), InMemorySink()
    with pytest.raises(RolloutDataFailure, match="verifier rejected the row"):
        await m.collect(datum(), sink)
    assert sink.records == [] and len(sink.discarded) == 2


async def test_skip_budget_is_run_wide():
    m, sink = manager(["data"] * 6, max_skipped_prompts=2), InMemorySink()
    assert await m.collect(datum(0), sink) is RolloutOutcome.SKIPPED
    assert await m.collect(datum(1), sink) is RolloutOutcome.SKIPPED
    assert type(sink.last_error[1]) is RolloutDataFailure, "the sink learns why each attempt failed"
    with pytest.raises(RolloutDataFailure, match="exceeding max_skipped_prompts=2"):
        await m.collect(datum(2), sink)
    assert m.stats.as_metrics()["rollout/data_failures_total/RolloutDataFailure"] == 3.0


async def test_cancellation_is_not_retried_and_releases_the_slot():
    m, sink = manager(["hang"]), InMemorySink()
    task = asyncio.ensure_future(m.collect(datum(), sink))
    await async_wait_until(lambda: m.backend.calls == 1, 10, "the backend running the group")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert m.backend.calls == 1 and not sink.reserved and len(sink.discarded) == 1


async def test_a_failing_discard_does_not_mask_the_error():
    class BrokenDiscard(InMemorySink):
        def discard(self, slot, error=None):
            raise OSError("disk gone")

    m = manager(["data", "data"])
    with pytest.raises(RolloutDataFailure, match="verifier"):
        await m.collect(datum(), BrokenDiscard())


class GatedBackend:
    """A backend whose rollouts finish only when the test opens their gate."""

    def __init__(self):
        self.gates: dict[int, asyncio.Event] = {}
        self.started: dict[int, asyncio.Event] = {}

    async def run_rollout(self, datum):
        idx = datum["idx"]
        self.started.setdefault(idx, asyncio.Event()).set()
        await self.gates.setdefault(idx, asyncio.Event()).wait()
        return PromptGroupRecord(idx, [], None, {}, [Completion([], None, False, 1.0) for _ in range(2)], {})


async def test_commits_carry_start_and_end_weight_versions_across_a_refit_in_flight():
    m, sink = manager([]), InMemorySink()
    backend = m.backend = GatedBackend()
    assert m.weight_version == 0
    m.set_weight_version(5)
    before = asyncio.ensure_future(m.collect(datum(0), sink))
    backend.started.setdefault(0, asyncio.Event())
    await asyncio.wait_for(backend.started[0].wait(), 5)
    m.set_weight_version(6)  # a refit lands while prompt 0 is in flight
    after = asyncio.ensure_future(m.collect(datum(1), sink))
    backend.started.setdefault(1, asyncio.Event())
    await asyncio.wait_for(backend.started[1].wait(), 5)
    for idx in (1, 0):
        backend.gates.setdefault(idx, asyncio.Event()).set()
    assert await before is RolloutOutcome.COMMITTED and await after is RolloutOutcome.COMMITTED
    versions = {g.record.prompt_idx: (g.start_weight_version, g.end_weight_version) for g in sink.groups}
    assert versions == {0: (5, 6), 1: (6, 6)}
    assert [r.prompt_idx for r in sink.records] == [1, 0]


async def test_a_retried_attempt_takes_the_version_current_when_it_starts():
    m = manager(["infra", "ok"])

    class BumpOnDiscard(InMemorySink):
        def discard(self, slot, error=None):
            super().discard(slot, error)
            m.set_weight_version(m.weight_version + 1)

    sink = BumpOnDiscard()
    assert await m.collect(datum(), sink) is RolloutOutcome.COMMITTED
    [group] = sink.groups
    assert (group.start_weight_version, group.end_weight_version) == (1, 1)


def test_next_action_is_the_retry_policy_as_a_pure_function():
    """Each failure class against each budget: back off then drop (infra), retry then skip or raise (data)."""
    from gym_bridge.failures import EndpointConfigError, GymTransportError, RolloutDataFailure
    from gym_bridge.rollout.manager import Attempts, RetryAction, next_action

    policy = RolloutRetryPolicy(max_infra_attempts=2, max_data_attempts=2, max_gym_row_attempts=1, max_skipped_prompts=1)
    infra, data = GymTransportError("502"), RolloutDataFailure("bad row")
    config = EndpointConfigError("HTTP 404: no such model")
    assert next_action(infra, Attempts(), policy, 0) == (RetryAction.BACK_OFF, Attempts(infra=1))
    assert next_action(infra, Attempts(infra=1), policy, 0) == (RetryAction.DROP, Attempts(infra=2))
    assert next_action(data, Attempts(infra=1), policy, 0) == (RetryAction.RETRY, Attempts(infra=1, data=1))
    assert next_action(data, Attempts(data=1), policy, 0) == (RetryAction.SKIP, Attempts(data=2))
    assert next_action(data, Attempts(data=1), policy, 1) == (RetryAction.RAISE, Attempts(data=2))
    assert next_action(config, Attempts(), policy, 0) == (RetryAction.SKIP, Attempts(data=1))  # never retried
    assert next_action(ValueError("a bug"), Attempts(), policy, 1)[0] is RetryAction.RETRY  # unrecognised: DATA
