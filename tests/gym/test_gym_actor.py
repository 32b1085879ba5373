"""The NemoGym Ray actor against real Gym servers and our real server with the scripted policy. No mocks."""

from __future__ import annotations

import math
import pickle
import time

import pytest
import ray
import torch

from gym_bridge.failures import (
    FailureClass,
    InvalidGymRow,
    NemoGymRestarted,
    NemoGymUnavailable,
    RolloutDataFailure,
    classify_rollout_failure,
)
from gym_bridge.generation.scripted import ScriptedGeneration
from gym_bridge.gym.protocol.result import GymRowBatch
from gym_bridge.gym.transport.actor import NemoGym
from gym_bridge.gym.transport.actor_config import NemoGymConfig
from gym_bridge.gym.transport.admission import EndpointLoad
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor
from gym_bridge.testing import wait_until
from gym_bridge.testing.gym_rows import (
    EQUIVALENCE_AGENT,
    TOOL_AGENT,
    equivalence_row,
    gym_actor_config,
    stamp,
    tool_call_rows,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.gym]

PREFIX = "timing/rollout"


def _stream(actor, rows, prefix=PREFIX):
    """``(rowidx, GymRowResult, timing or None)`` per row, flattened from the actor's batches."""
    items = []
    for ref in actor.run_row_batches.options(num_returns="streaming").remote(rows, prefix):
        batch = ray.get(ref, timeout=120)
        assert isinstance(batch, GymRowBatch) and batch.rows, "the actor streamed an empty batch"
        for row in batch.rows:
            assert all(isinstance(m["token_ids"], torch.Tensor) for m in row.message_log), "tensors restored"
        items += [(row.row_index, row, None) for row in batch.rows]
        items[-1] = (*items[-1][:2], batch.timing)
    return items


def _first_error(actor, rows) -> BaseException:
    with pytest.raises(Exception) as info:
        _stream(actor, rows)
    return info.value


def _cause(exc: BaseException) -> BaseException:
    return getattr(exc, "cause", None) or exc


def _expected_generation(tokenizer, prompt_str: str) -> list[int]:
    reply = ScriptedGeneration(tokenizer).reply_text(prompt_str)
    return list(tokenizer.encode(reply, add_special_tokens=False)) + [tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def mixed_results(gym_actor):
    rows = stamp(
        tool_call_rows()
        + [equivalence_row("What is 2+2? Reply with exactly: 4", "4"), equivalence_row("Reply with exactly: 4", "5")]
    )
    t0 = time.monotonic()
    items = _stream(gym_actor, rows)
    print(f"{len(rows)} rollouts streamed in {time.monotonic() - t0:.2f}s")
    return rows, items


def test_agents_and_health(gym_actor):
    assert ray.get(gym_actor.agent_names.remote()) == sorted([EQUIVALENCE_AGENT, TOOL_AGENT])
    ray.get(gym_actor.health_check.remote(), timeout=10)


def test_endpoint_load_reads_the_endpoints_metrics(gym_actor):
    """Our server answers /metrics; its numbers are what it reports (vLLM's request gauges only if it has them)."""
    load = ray.get(gym_actor.endpoint_load.remote(), timeout=30)
    assert isinstance(load, EndpointLoad) and load.reachable
    assert load.waiting is None or load.waiting >= 0


def test_every_row_streams_back_once_with_timing_last(mixed_results):
    rows, items = mixed_results
    assert sorted(idx for idx, _, _ in items) == list(range(len(rows)))
    timings = [t for _, _, t in items]
    assert all(t is None for t in timings[:-1])
    last = timings[-1]
    suffixes = {"await_results", "postprocess_results", "postprocess_results_pct"}
    assert set(last) == {f"{PREFIX}/{s}" for s in suffixes}
    assert last[f"{PREFIX}/await_results"] > 0 and last[f"{PREFIX}/postprocess_results"] > 0
    assert 0 < last[f"{PREFIX}/postprocess_results_pct"] < 100


def test_message_logs_dtypes_and_scripted_tokens(mixed_results, tiny_tokenizer):
    _, items = mixed_results
    for _, result, _ in items:
        log = result.message_log
        assert result.input_message_log == log[:1]
        assert result.token_drift is None
        assert [m["role"] for m in log] == ["user", "assistant"] * (len(log) // 2)
        model_calls = [i for i in result.full_result["response"]["output"] if "generation_str" in i]
        assert len(model_calls) == len(log) // 2
        for message, call in zip(log[1::2], model_calls, strict=True):
            assert message["token_ids"].dtype == torch.int64
            assert message["generation_logprobs"].dtype == torch.float32
            logprobs = message["generation_logprobs"]
            assert torch.allclose(logprobs, torch.full_like(logprobs, math.log(0.5)))
            assert message["token_ids"].tolist() == _expected_generation(tiny_tokenizer, call["prompt_str"])
            assert "generation_token_ids" not in call and "prompt_token_ids" not in call
            assert message["is_invalid_tool_call"] is False and message["has_malformed_thinking"] is False
        for message in log[::2]:
            assert message["token_ids"].dtype == torch.int64
        # the monotonic history decodes to the last call's prompt + generation
        whole = tiny_tokenizer.decode(torch.cat([m["token_ids"] for m in log]).tolist())
        assert whole == model_calls[-1]["prompt_str"] + model_calls[-1]["generation_str"]


def test_run_rollouts_streams_nemo_rls_per_row_tuples(gym_actor, tiny_tokenizer):
    """NeMo-RL's own rollout code does ``rowidx, result, timing = await ref`` per element of ``run_rollouts``
    and turns the result's token fields into tensors with ``torch.tensor``: the actor streams exactly that."""
    rows = stamp(tool_call_rows()[:3])
    stream = gym_actor.run_rollouts.options(num_returns="streaming").remote(rows, PREFIX)
    items = [ray.get(ref, timeout=120) for ref in stream]
    assert sorted(rowidx for rowidx, _, _ in items) == [0, 1, 2]
    assert [timing is not None for _, _, timing in items] == [False, False, True]
    assert f"{PREFIX}/await_results" in items[-1][2]
    for _, result, _ in items:
        assert set(result) == {"message_log", "input_message_log", "full_result"}
        assert result["input_message_log"] == result["message_log"][:1]
        ids = torch.tensor(result["message_log"][1]["token_ids"])
        logprobs = torch.tensor(result["message_log"][1]["generation_logprobs"])
        assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32 and len(ids) == len(logprobs) > 0
        assert "reward" in result["full_result"]


def test_set_tokenizer_replaces_the_tokenizer(ray_session, tmp_path):
    """NeMo-RL's distillation re-installs the tokenizer on a running actor; the second call replaces the first."""
    actor = ray.remote(NemoGym).options(num_cpus=0).remote(gym_actor_config(["http://127.0.0.1:9/v1"], tmp_path))
    try:
        assert ray.get(actor.set_tokenizer.remote("first"), timeout=30) is None
        assert ray.get(actor.set_tokenizer.remote("second"), timeout=30) is None
    finally:
        ray.kill(actor)


def test_tool_call_episodes_have_two_contiguous_calls(mixed_results):
    rows, items = mixed_results
    tool_items = [(idx, r) for idx, r, _ in items if rows[idx]["agent_ref"]["name"] == TOOL_AGENT]
    assert len(tool_items) == len(tool_call_rows())
    for _, result in tool_items:
        output = result.full_result["response"]["output"]
        assert [i["type"] for i in output] == ["function_call", "function_call_output", "message"]
        assert output[0]["name"] == "get_weather"
        assert len(result.message_log) == 4
        assert result.full_result["reward"] == 1.0


def test_reward_is_the_verifiers(mixed_results):
    rows, items = mixed_results
    by_idx = {idx: r for idx, r, _ in items}
    eq = [i for i, row in enumerate(rows) if row["agent_ref"]["name"] == EQUIVALENCE_AGENT]
    right, wrong = (by_idx[i].full_result for i in eq)
    assert right["reward"] == right["equivalence_score"] == 1.0
    assert wrong["reward"] == wrong["equivalence_score"] == 0.0
    assert right["response"]["output"][-1]["content"][0]["text"] == "4"
    assert len(by_idx[eq[0]].message_log) == 2


def test_unknown_agent_is_a_data_failure_naming_the_agents(gym_actor):
    rows = stamp([equivalence_row("Reply with exactly: 4", "4"), equivalence_row("x", "y")])
    rows[1]["agent_ref"]["name"] = "nope"
    err = _first_error(gym_actor, rows)
    assert isinstance(err, RolloutDataFailure)
    assert "'nope'" in str(err) and TOOL_AGENT in str(err) and "_rowidx=1" in str(err)


def test_rows_need_an_int_rowidx(gym_actor):
    row = equivalence_row("Reply with exactly: 4", "4")
    assert isinstance(_first_error(gym_actor, [row]), RolloutDataFailure)


def test_empty_rows(gym_actor):
    assert isinstance(_cause(_first_error(gym_actor, [])), InvalidGymRow)


def test_http_422_from_run_is_a_picklable_data_failure(gym_actor):
    rows = stamp([equivalence_row("Reply with exactly: 4", "4")])
    rows[0]["responses_create_params"]["bogus"] = 1  # Gym's params model forbids extra keys
    err = _first_error(gym_actor, rows)
    cause = _cause(err)
    assert type(cause) is RolloutDataFailure
    assert "HTTP 422" in str(cause) and "bogus" in str(cause) and "_rowidx=0" in str(cause)
    assert str(pickle.loads(pickle.dumps(cause))) == str(cause)


def test_verify_422_inside_a_run_500_is_a_picklable_data_failure(gym_actor):
    rows = stamp([equivalence_row("Reply with exactly: 4", "4")])
    del rows[0]["expected_answer"]  # the model call happens, then /verify answers 422: /run answers 500
    cause = _cause(_first_error(gym_actor, rows))
    # Unwrapped, the innermost error is the resources server's 422 on this row: data, not infrastructure.
    assert type(cause) is RolloutDataFailure, repr(cause)
    assert "422" in str(cause) and "expected_answer" in str(cause), str(cause)
    assert str(pickle.loads(pickle.dumps(cause))) == str(cause)
    ray.get(gym_actor.health_check.remote(), timeout=10)  # the actor survives failed calls


def test_unspun_actor_reports_clearly_and_shuts_down_quietly(ray_session, tiny_tokenizer, tmp_path):
    config = gym_actor_config(["http://127.0.0.1:9/v1"], tmp_path)
    actor = ray.remote(NemoGym).options(num_cpus=0).remote(config)
    try:
        with pytest.raises(NemoGymUnavailable, match=r"spinup\(\) was never called"):
            ray.get(actor.health_check.remote(), timeout=30)
        err = _cause(_first_error(actor, stamp([equivalence_row("x", "y")])))
        assert type(err) is NemoGymUnavailable and "spinup() was never called" in str(err)
        ray.get(actor.shutdown.remote(), timeout=30)
        ray.get(actor.shutdown.remote(), timeout=30)
    finally:
        ray.kill(actor)


def test_actor_restarted_by_ray_reports_it_typed(ray_session, tmp_path):
    """Fault: the NemoGym actor process is killed and Ray restarts it (on_restart="fail").
    Expected: every call raises NemoGymRestarted (infrastructure) saying what to do; never a cryptic error."""
    config = gym_actor_config(["http://127.0.0.1:9/v1"], tmp_path)
    actor = ray.remote(NemoGym).options(num_cpus=0, max_restarts=1).remote(config)
    try:
        assert ray.get(actor.set_tokenizer.remote("t"), timeout=30) is None  # the process is up
        ray.kill(actor, no_restart=False)

        def restarted() -> NemoGymRestarted | None:
            try:
                ray.get(actor.health_check.remote(), timeout=30)
            except NemoGymRestarted as exc:
                return exc
            except (ray.exceptions.RayActorError, NemoGymUnavailable) as exc:
                # ray.kill is asynchronous: the old process may still answer ("never called") for a moment
                assert isinstance(exc, ray.exceptions.RayActorError) or "never called" in str(exc), exc
            return None

        exc = wait_until(restarted, 60, "Ray restarts the actor", poll_s=0.5)
        assert "on_restart='respin'" in str(exc)
        assert classify_rollout_failure(exc) is FailureClass.INFRA
    finally:
        ray.kill(actor)


def test_config_sets_gym_connector_limits():
    config = NemoGymConfig(model_name="m", base_urls=["http://h:1/v1"], overrides={"global_aiohttp_connector_limit": 5})
    overrides = config.servers_config().overrides
    assert overrides["global_aiohttp_connector_limit"] == 5
    assert overrides["global_aiohttp_connector_limit_per_host"] == 16384


def test_spinup_failure_kills_the_actor_and_raises_typed(ray_session, tiny_tokenizer, tmp_path):
    from gym_bridge.failures import GymStartupError

    config = NemoGymConfig(
        model_name="m",
        base_urls=["http://127.0.0.1:9/v1"],
        overrides={"broken": {"resources_servers": {"no_such_server_module": {"entrypoint": "app.py", "domain": "x"}}}},
        log_dir=tmp_path,
        startup_timeout_s=60,
        actor_options={"num_cpus": 0},
    )
    with pytest.raises(GymStartupError, match="(?s)NeMo-Gym failed before the servers were up.*'broken'"):
        start_nemo_gym_actor(config, tiny_tokenizer)
