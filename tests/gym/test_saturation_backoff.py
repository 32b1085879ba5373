"""A run that saturates a slow engine, with real components: our OpenAI server over an engine of fixed
throughput (``WORK_S`` of it per request, shared among the requests in progress), real Gym servers (model server
+ equivalence agent) on the real NemoGym actor, and ``RolloutManager.collect`` with a retry policy and an
in-memory sink.

Five prompts of two samples each are sent at once, so every row of the first wave misses the ``DEADLINE_S``
group deadline that one group alone meets easily (as in issue 43's workplace_assistant run). With adaptive
admission (the default) the timeouts halve the rows in flight and pause admission, and every group commits;
with adaptation off (the old behaviour) every retry goes back at the same concurrency, into an engine still
busy, and groups are dropped. The tests run in file order: the adaptive run first, each on an idle engine. The
last one gives up on a group whose requests would each run a minute, and the engine's work for them stops at
once: the disconnect travels through Gym's servers to our server, which cancels the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from gym_bridge.batched import BatchedDataDict
from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeout, RolloutTimeouts
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.gym.protocol.rows import build_rows, validate_row
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.transport.admission import AdmissionControl, AdmissionSettings
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.gym_versions import installed_gym
from gym_bridge.rollout.manager import RolloutManager, RolloutOutcome
from gym_bridge.rollout.sink import InMemorySink
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing import SERVED_MODEL_NAME, async_wait_until
from gym_bridge.testing.gym_rows import EQUIVALENCE_GYM_CONFIGS, equivalence_row, gym_actor_config
from gym_bridge.types import (
    ActorHandle,
    GenerationDatumSpec,
    GenerationOutputSpec,
    GenerationSamplingParams,
    Tokenizer,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.gym, pytest.mark.slow]

WORK_S = 0.6
"""Seconds of the engine one request needs: a group of two alone takes 1.2 s, ten rows in flight 6 s."""
TICK_S = 0.02
DEADLINE_S = 4.0
"""The group deadline: one group alone meets it easily, the first wave (ten rows at once) cannot."""
PROMPTS, SAMPLES = 5, 2
ATTEMPTS = 6
RUN_BOUND_S = 150.0


class SharedScriptedGeneration(ScriptedGeneration):
    """The scripted policy on an engine of fixed throughput: each request needs ``work_s`` seconds of it, shared
    equally among the requests in progress (as a batching engine shares its steps), so ten rows take ten times
    as long as one, and all of them finish late together."""

    def __init__(self, tokenizer: Tokenizer, work_s: float) -> None:
        super().__init__(tokenizer)
        self.work_s = work_s
        self.active = 0
        self.peak = 0
        self.served = 0

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        loop = asyncio.get_running_loop()
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            left, last = self.work_s, loop.time()
            while left > 0:
                await asyncio.sleep(TICK_S)
                now = loop.time()
                left -= (now - last) / self.active
                last = now
            async for item in super().generate_async(data, greedy):
                yield item
            self.served += 1
        finally:
            self.active -= 1


@pytest.fixture(scope="module")
def slow_engine(tiny_tokenizer: Tokenizer) -> SharedScriptedGeneration:
    return SharedScriptedGeneration(tiny_tokenizer, WORK_S)


@pytest.fixture(scope="module")
def slow_server(slow_engine: SharedScriptedGeneration, tiny_tokenizer: Tokenizer) -> Iterator[OpenAIServer]:
    server = OpenAIServer(slow_engine, tiny_tokenizer, served_model_name=SERVED_MODEL_NAME)
    server.start_in_thread()
    yield server
    server.stop_thread()


@pytest.fixture(scope="module")
def slow_gym(ray_session, slow_server, tiny_tokenizer, tmp_path_factory) -> Iterator[ActorHandle]:
    """A NemoGym actor of its own (the model server and the equivalence agent) on the slow engine."""
    assert slow_server.base_url is not None
    config = gym_actor_config([slow_server.base_url], tmp_path_factory.mktemp("saturation-gym-logs")).model_copy(
        update={"config_paths": [str(wheel_config_path(p)) for p in EQUIVALENCE_GYM_CONFIGS]}
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    stop_nemo_gym_actors([actor])


def saturating_manager(actor: ActorHandle, tokenizer: Tokenizer, admission: AdmissionSettings) -> RolloutManager:
    """Two samples per prompt, the short group deadline, ``ATTEMPTS`` infrastructure attempts per prompt."""
    manager = RolloutManager(
        tokenizer,
        {"nemo_gym": actor},
        SAMPLES,
        4096,
        generation_config={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16},
        use_nemo_gym=True,
        timeouts=RolloutTimeouts(rollout_s=DEADLINE_S),
        retry_policy=RolloutRetryPolicy(
            max_infra_attempts=ATTEMPTS,
            max_data_attempts=1,
            max_gym_row_attempts=1,
            backoff_base_s=0.2,
            max_backoff_s=1.0,
            max_skipped_prompts=100,
            max_consecutive_dropped_prompts=100,
        ),
    )
    manager.backend.client.admission = AdmissionControl(admission)  # type: ignore[attr-defined]
    return manager


async def run_wave(
    manager: RolloutManager, engine: SharedScriptedGeneration
) -> tuple[list[RolloutOutcome], InMemorySink]:
    """Every prompt collected at once on an idle engine; the sink keeps no partial group."""
    await async_wait_until(lambda: engine.active == 0, 60, "the engine idle before the run")
    prompts = [datum_from_gym_row(equivalence_row(f"Reply with exactly: {k}", str(k)), idx=k) for k in range(PROMPTS)]
    sink = InMemorySink()
    outcomes = await asyncio.wait_for(asyncio.gather(*(manager.collect(p, sink) for p in prompts)), RUN_BOUND_S)
    assert not sink.reserved, f"slots left reserved: {sink.reserved}"
    committed = sorted(p["idx"] for p, o in zip(prompts, outcomes, strict=True) if o is RolloutOutcome.COMMITTED)
    assert sorted(r.prompt_idx for r in sink.records) == committed
    for record in sink.records:
        assert len(record.completions) == SAMPLES
        assert all(c.reward == 1.0 for c in record.completions), "the scripted policy answers every prompt right"
    return outcomes, sink


async def test_a_saturated_engine_makes_admission_back_off_and_every_group_commits(
    slow_gym, slow_engine, tiny_tokenizer
):
    manager = saturating_manager(slow_gym, tiny_tokenizer, AdmissionSettings(backoff_base_s=1.0, max_backoff_s=4.0))
    outcomes, sink = await run_wave(manager, slow_engine)
    metrics = manager.stats.as_metrics()
    assert outcomes == [RolloutOutcome.COMMITTED] * PROMPTS, metrics
    assert len(sink.records) == PROMPTS
    assert metrics["rollout/saturation_timeout_total"] >= 1, metrics
    assert metrics["rollout/admission_backoff_total"] >= 1, metrics
    assert metrics["rollout/admission_lowest_limit"] < PROMPTS * SAMPLES, metrics
    # The first wave did time out, and a timeout stays a timeout: the only re-dispatch reason.
    assert metrics["rollout/redispatch_total"] >= 1, metrics
    assert set(manager.stats.redispatches_by_reason) == {"RolloutTimeout"}, metrics
    assert set(manager.stats.saturation_timeouts_by_reason) <= {"latency", "endpoint_queue"}


async def test_without_adaptation_retries_storm_the_same_queue_and_groups_are_dropped(
    slow_gym, slow_engine, tiny_tokenizer
):
    manager = saturating_manager(slow_gym, tiny_tokenizer, AdmissionSettings(adaptive=False))
    outcomes, _ = await run_wave(manager, slow_engine)
    metrics = manager.stats.as_metrics()
    assert RolloutOutcome.SKIPPED in outcomes, metrics
    assert metrics["rollout/infra_drops_total/RolloutTimeout"] >= 1, metrics
    assert metrics["rollout/admission_backoff_total"] == 0 and "rollout/admission_lowest_limit" not in metrics


async def test_a_row_given_up_on_stops_generating_in_the_engine(slow_gym, slow_engine):
    """A group's deadline cancels its stream; the actor's ``/run`` connections close, and Gym 0.7's servers cancel
    a request whose client went away (``ClientDisconnectCancellationMiddleware``) down to the model server, whose
    call to our server is then cancelled there too (``serving/disconnect.py``): the engine stops the rows at once
    instead of generating them to the end for nobody."""
    if not installed_gym().cancels_on_disconnect:
        pytest.skip(f"{installed_gym().label} runs a row its client gave up on to its end (no cancel on disconnect)")
    await async_wait_until(lambda: slow_engine.active == 0, 60, "the engine idle before the run")
    slow_engine.work_s = 60.0  # each request would run a minute
    try:
        served, slow_engine.peak = slow_engine.served, 0
        client = GymClient([slow_gym], admission=AdmissionSettings(adaptive=False))
        template = validate_row(equivalence_row("Reply with exactly: 7", "7"), prompt_idx=0)
        rows = build_rows(template, SAMPLES, GenerationSamplingParams(temperature=1.0, top_p=1.0), 16)
        with pytest.raises(RolloutTimeout):
            await client.run_group(rows, prompt_idx=0, deadline_s=3.0)
        assert slow_engine.peak == SAMPLES, "both rows were generating in the engine"
        gave_up = asyncio.get_running_loop().time()
        await async_wait_until(lambda: slow_engine.active == 0, 15, "the engine's requests for the rows cancelled")
        print(f"engine requests cancelled {asyncio.get_running_loop().time() - gave_up:.2f} s after the deadline")
        assert slow_engine.served == served, "no request was generated to its end"
    finally:
        slow_engine.work_s = WORK_S
