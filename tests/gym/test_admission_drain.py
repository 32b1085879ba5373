"""After a back-off, admission waits for the endpoint to drain (bounded), and the admission and prefix-caching
settings reach the client and the engine from a training config and an eval config.

The drain rule (:func:`endpoint_drained`), the hold in :class:`AdmissionControl`, and :class:`GymClient` holding
admission after a saturation timeout until a fake actor's endpoint reports the abandoned work gone, or the bound
passes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gym_bridge.config.grpo import engine_prefix_caching
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.run_settings import grpo_run_settings
from gym_bridge.config.training import nemo_gym_rollout_settings
from gym_bridge.eval.config import EvalConfig
from gym_bridge.failures import RolloutTimeout
from gym_bridge.gym.protocol.numbering import ROW_INDEX_KEY
from gym_bridge.gym.transport import client as client_module
from gym_bridge.gym.transport.admission import AdmissionControl, AdmissionSettings, EndpointLoad, endpoint_drained
from gym_bridge.gym.transport.client import GymClient

DEMO = Path(__file__).resolve().parents[2] / "examples" / "grpo_nemo_gym.yaml"
BUSY = EndpointLoad(reachable=True, waiting=2.0, running=8.0)
IDLE = EndpointLoad(reachable=True, waiting=0.0, running=0.0)


@pytest.mark.parametrize(
    ("load", "in_flight", "drained"),
    [
        (None, 0, True),
        (EndpointLoad(reachable=False), 0, True),
        (EndpointLoad(reachable=True), 0, True),
        (IDLE, 0, True),
        (EndpointLoad(reachable=True, waiting=1.0, running=0.0), 4, False),
        (EndpointLoad(reachable=True, waiting=0.0, running=3.0), 2, False),
        (EndpointLoad(reachable=True, waiting=0.0, running=2.0), 2, True),
        (EndpointLoad(reachable=True, waiting=None, running=1.0), 1, True),
    ],
    ids=["unknown", "down", "no-gauges", "idle", "queue", "abandoned-running", "only-ours", "running-only"],
)
def test_an_endpoint_has_drained_when_it_holds_no_work_but_ours(load, in_flight, drained):
    assert endpoint_drained(load, in_flight) is drained


def test_a_hold_stops_admission_until_drained_and_the_pause_still_applies():
    async def scenario() -> None:
        now = [100.0]
        admission = AdmissionControl(AdmissionSettings(backoff_base_s=5.0), clock=lambda: now[0])
        ticket = await admission.acquire(4)
        assert admission.back_off(ticket) == 5.0
        admission.release(ticket)
        held = admission.hold_until_drained()
        now[0] += 10.0  # past the pause, still draining
        waiter = asyncio.ensure_future(admission.acquire(1))
        await asyncio.sleep(0.01)
        assert not waiter.done() and admission.waiting_rows == 1
        admission.drained(held)
        await asyncio.sleep(0)
        assert waiter.done() and admission.in_flight == 1
        assert admission.drains == 1 and admission.drain_s == 10.0

    asyncio.run(scenario())


class _Method:
    def __init__(self, call: Any) -> None:
        self._call = call

    def remote(self, *args: Any) -> Any:
        return self._call(*args)

    def options(self, **_: Any) -> _Method:
        return self


class SlowActor:
    """An actor whose rows never come back and whose endpoint reports ``loads`` in turn (the last one repeats)."""

    def __init__(self, loads: list[EndpointLoad]) -> None:
        self.loads = loads
        self.asked = 0
        self.run_row_batches = _Method(self._stream)
        self.endpoint_load = _Method(self._load)

    async def _stream(self, rows: list[dict[str, Any]], prefix: str) -> AsyncIterator[Any]:
        await asyncio.sleep(3600)
        yield None

    async def _load(self) -> EndpointLoad:
        load = self.loads[min(self.asked, len(self.loads) - 1)]
        self.asked += 1
        return load


def _rows() -> list[dict[str, Any]]:
    return [{ROW_INDEX_KEY: i, "agent_ref": {"name": "agent"}} for i in range(2)]


async def _timed_out_group(client: GymClient) -> None:
    with pytest.raises(RolloutTimeout, match=r"NeMo-Gym prompt group exceeded 0\.2s"):
        await client.run_group(_rows(), prompt_idx=0, deadline_s=0.2)


def test_after_a_saturation_timeout_admission_waits_for_the_endpoint_to_drain(monkeypatch):
    monkeypatch.setattr(client_module, "_DRAIN_POLL_S", 0.05)

    async def scenario() -> tuple[GymClient, SlowActor, float]:
        actor = SlowActor([BUSY, BUSY, BUSY, BUSY, IDLE])  # the timeout's judgement, three busy polls, then idle
        client = GymClient([actor], admission=AdmissionSettings(backoff_base_s=0.0, drain_timeout_s=30.0))
        await _timed_out_group(client)
        assert client.admission.draining and client.admission.limit == 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        ticket = await asyncio.wait_for(client.admission.acquire(1), 10)
        client.admission.release(ticket)
        return client, actor, loop.time() - started

    client, actor, waited = asyncio.run(scenario())
    assert actor.asked == 5, "judged once, then polled until the endpoint was idle"
    assert waited >= 0.1
    metrics = client.stats.as_metrics()
    assert metrics["rollout/saturation_timeout_total/endpoint_queue"] == 1.0
    assert metrics["rollout/admission_drain_total"] == 1.0
    assert metrics["rollout/admission_drain_timeout_total"] == 0.0


def test_a_drain_that_never_comes_ends_at_its_bound(monkeypatch):
    monkeypatch.setattr(client_module, "_DRAIN_POLL_S", 0.05)

    async def scenario() -> GymClient:
        client = GymClient([SlowActor([BUSY])], admission=AdmissionSettings(backoff_base_s=0.0, drain_timeout_s=0.3))
        await _timed_out_group(client)
        ticket = await asyncio.wait_for(client.admission.acquire(1), 5)
        client.admission.release(ticket)
        return client

    metrics = asyncio.run(scenario()).stats.as_metrics()
    assert metrics["rollout/admission_drain_timeout_total"] == 1.0
    assert 0.3 <= metrics["rollout/admission_drain_s"] < 2.0


def test_no_drain_without_a_bound_or_without_adaptation():
    async def scenario(settings: AdmissionSettings) -> AdmissionControl:
        client = GymClient([SlowActor([BUSY])], admission=settings)
        await _timed_out_group(client)
        return client.admission

    assert not asyncio.run(scenario(AdmissionSettings(backoff_base_s=0.0, drain_timeout_s=0.0))).draining
    assert asyncio.run(scenario(AdmissionSettings(adaptive=False))).drains == 0


def _gym_config(**nemo_gym: object) -> dict[str, Any]:
    return {
        "grpo": {"num_generations_per_prompt": 2},
        "policy": {"model_name": "tiny", "max_total_sequence_length": 256, "generation": {"max_new_tokens": 8}},
        "env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": ["a.yaml"], **nemo_gym}},
    }


def test_env_nemo_gym_admission_reaches_the_client_and_never_gyms_config():
    settings = nemo_gym_rollout_settings(
        _gym_config(admission={"initial_limit": 4, "drain_timeout_s": 10}), base_urls=["http://127.0.0.1:1/v1"]
    )
    assert settings.launch.manager_options.admission == AdmissionSettings(initial_limit=4, drain_timeout_s=10.0)
    assert "admission" not in settings.launch.gym.overrides
    default = nemo_gym_rollout_settings(_gym_config(), base_urls=["http://127.0.0.1:1/v1"])
    assert default.launch.manager_options.admission == AdmissionSettings()
    for bad, named in (({"initial_limt": 4}, "initial_limt"), ({"drain_timeout_s": -1}, "drain_timeout_s")):
        with pytest.raises(TrainingConfigError, match=rf"env\.nemo_gym\.admission.*{named}"):
            nemo_gym_rollout_settings(_gym_config(admission=bad), base_urls=["http://127.0.0.1:1/v1"])


def test_enable_prefix_caching_reaches_the_training_engine():
    assert grpo_run_settings(load_with_overrides(DEMO, [])).engine.enable_prefix_caching is True
    off = load_with_overrides(DEMO, ["++policy.generation.vllm_kwargs.enable_prefix_caching=false"])
    assert grpo_run_settings(off).engine.enable_prefix_caching is False
    nemo_rl = load_with_overrides(DEMO, ["++policy.generation.vllm_cfg.enable_prefix_caching=false"])
    assert grpo_run_settings(nemo_rl).engine.enable_prefix_caching is False
    both = _gym_config()
    both["policy"]["generation"]["vllm_kwargs"] = {"enable_prefix_caching": True}
    both["policy"]["generation"]["vllm_cfg"] = {"enable_prefix_caching": False}
    with pytest.raises(TrainingConfigError, match="disagree"):
        engine_prefix_caching(both)
    both["policy"]["generation"]["vllm_kwargs"] = {"enable_prefix_caching": "no"}
    with pytest.raises(TrainingConfigError, match=r"vllm_kwargs\.enable_prefix_caching must be true or false"):
        engine_prefix_caching(both)


def test_the_eval_config_takes_admission_and_prefix_caching(tmp_path):
    keys = {"dataset": tmp_path / "rows.jsonl", "config_paths": ["a.yaml"], "output_dir": tmp_path / "out"}
    config = EvalConfig.model_validate({**keys, "admission": {"initial_limit": 2}, "enable_prefix_caching": False})
    assert config.admission == AdmissionSettings(initial_limit=2)
    assert config.enable_prefix_caching is False
    assert EvalConfig.model_validate(keys).admission == AdmissionSettings()
    with pytest.raises(ValueError, match="initial_limt"):
        EvalConfig.model_validate({**keys, "admission": {"initial_limt": 2}})
