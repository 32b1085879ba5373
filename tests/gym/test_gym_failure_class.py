"""Failure classes as Gym's collection gives them (``_ng_failure_class``).

Gym's collection classes a ``/run`` that came back without a result by whether a Gym server answered
(``agent_run_error``: the rollout ran and broke) or not (``agent_request_failed``: a gateway's status, or no answer).
An exception raised in Gym's own server code (the agent, its environment server, a resources server) is
deterministic for the row: data, never re-sent as infrastructure. Connection, timeout and cancellation errors, the
model endpoint's statuses and the model server's checks of the endpoint's answer stay infrastructure. The end-to-end
case runs on the session's real Gym servers: a row whose verifier raises.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import pytest

from gym_bridge.failures import (
    FailureClass,
    GymRunError,
    GymTransportError,
    RolloutRetryPolicy,
    classify_rollout_failure,
    gym_run_failure,
)
from gym_bridge.failures.classify import (
    gym_failure_class_failure,
    gym_run_failure_class,
    server_code_exception,
)
from gym_bridge.failures.gym_chain import agent_run_error

CAPTURED = {k: v for k, v in json.loads((Path(__file__).parents[1] / "data" / "gym_errors.json").read_text()).items()
            if not k.startswith("_")}  # fmt: skip
WHERE = "NeMo-Gym /run at http://127.0.0.1:1 for _rowidx=0 (agent 'a')"


def layer(server: str, inner: str) -> str:
    """Gym's middleware answer for an inner server's HTTP error: the inner body as a bytes literal."""
    return json.dumps(f"Hit an exception in {server} calling an inner server: {inner.encode()}")


VERIFY_RAISED = layer(
    "SimpleAgent___lc", json.dumps(repr(TypeError("got multiple values for keyword argument 'reward'")))
)
AGENT_RAISED = json.dumps(repr(ValueError("resources_server is required when invoking the legacy /run route")))
CONNECTION = layer(
    "SimpleAgent___lc", json.dumps("ClientConnectorError(ConnectionKey(host='127.0.0.1'), OSError(111))")
)
MODEL_CHECK = layer("SimpleAgent___lc", layer("SimpleAgent___lc", json.dumps(repr(RuntimeError("no logprobs")))))


def test_gyms_class_of_a_run_without_result_is_by_whether_a_gym_server_answered():
    assert [gym_run_failure_class(s) for s in (500, 400, 429, 502, 503, 504, None)] == [
        "agent_run_error", "agent_run_error", "agent_request_failed", "agent_request_failed",
        "agent_request_failed", "agent_request_failed", "agent_request_failed"]  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (500, VERIFY_RAISED, GymRunError),  # a resources server's verify raised
        (500, AGENT_RAISED, GymRunError),  # the agent's own /run raised
        (500, CONNECTION, GymTransportError),  # the agent could not reach a server
        (500, json.dumps("TimeoutError()"), GymTransportError),
        (500, json.dumps("Request was cancelled"), GymTransportError),
        (500, json.dumps("An unknown error occurred"), GymTransportError),
        (500, MODEL_CHECK, GymTransportError),  # raised inside the agent's model call: the model server's check
        (502, AGENT_RAISED, GymTransportError),  # a gateway's status says nothing about the rollout
        (503, VERIFY_RAISED, GymTransportError),
    ],
)
def test_an_exception_in_gyms_server_code_is_data_and_a_connection_problem_infrastructure(status, body, expected):
    first = gym_run_failure(status, body.encode(), WHERE)
    failure = (
        (agent_run_error(status, body.encode(), WHERE) or first) if isinstance(first, GymTransportError) else first
    )
    assert type(failure) is expected, failure
    assert classify_rollout_failure(failure) is (FailureClass.DATA if expected is GymRunError else FailureClass.INFRA)
    if expected is GymRunError:
        assert "_ng_failure_class agent_run_error" in str(failure) and WHERE in str(failure)
        assert "Hit an exception" not in str(failure)
        assert type(pickle.loads(pickle.dumps(failure))) is GymRunError


@pytest.mark.parametrize("case", sorted(CAPTURED))
def test_the_captured_gym_answers_keep_their_class(case):
    """Real Gym answers (tests/data/gym_errors.json): the endpoint's 4xx and 5xx and the model server's missing-logprobs
    check are no exception of the agent's or a verifier's code; none becomes agent_run_error."""
    assert agent_run_error(CAPTURED[case]["status"], CAPTURED[case]["body"].encode(), WHERE) is None


def test_exception_names_read_from_the_innermost_message():
    assert server_code_exception("TypeError: bad") == "TypeError"
    assert server_code_exception("KeyError('x')") == "KeyError"
    assert server_code_exception("pydantic_core._pydantic_core.ValidationError: 1 error") == (
        "pydantic_core._pydantic_core.ValidationError"
    )
    for infra in ("ServerDisconnectedError('x')", "ClientOSError: reset", "TimeoutError()", "CancelledError()"):
        assert server_code_exception(infra) is None
    assert server_code_exception("the inner server's answer had no body") is None
    assert server_code_exception("Foo(1)") is None, "not an exception's name"


@pytest.mark.parametrize(
    ("failure_class", "expected"),
    [
        ("agent_run_error", GymRunError),
        ("environment_server_failed", GymRunError),
        ("agent_request_failed", GymTransportError),
        ("cancelled", GymTransportError),
        ("kill_shaped", GymTransportError),
    ],
)
def test_a_result_that_carries_gyms_failure_class_is_that_classs_failure(failure_class, expected):
    assert type(gym_failure_class_failure(failure_class, "row 3: boom")) is expected


def test_the_actor_raises_a_failure_row_as_its_class_and_stamps_every_other_result(tiny_tokenizer):
    """The actor's converter: a /run result with ``_ng_failure_class`` is no rollout; any other result gets the row's
    ``_ng_*`` identity, replacing what the agent echoed."""
    from gym_bridge.gym.transport.actor_config import NemoGymConfig
    from gym_bridge.gym.transport.row_convert import Conversion

    cfg = NemoGymConfig.model_validate(
        {"model_name": "m", "base_urls": ["http://127.0.0.1:1/v1"], "config_paths": ["x.yaml"]}
    )
    conversion = Conversion(tiny_tokenizer, cfg, {})
    row = {"_rowidx": 2, "agent_ref": {"name": "a"}, "_ng_task_index": 4, "_ng_rollout_index": 9}
    failure_row = {"_ng_failure_class": "agent_run_error", "_ng_failure_message": "KeyError('x')"}
    with pytest.raises(GymRunError, match=r"_ng_failure_class agent_run_error: _rowidx=2 \(agent 'a'\): KeyError"):
        conversion.row(row, json.dumps(failure_row).encode())
    prompt = tiny_tokenizer.encode("hi")
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok"}],
        "prompt_token_ids": prompt,
        "generation_token_ids": [5, 6],
        "generation_log_probs": [-0.1, -0.2],
    }
    result = {"reward": 1.0, "response": {"output": [item]}, "_ng_task_index": 0, "_ng_rollout_index": 0}
    converted = conversion.row(row, json.dumps(result).encode())
    assert (converted.full_result["_ng_task_index"], converted.full_result["_ng_rollout_index"]) == (4, 9)
    assert "_ng_task_index" not in converted.metrics
    assert converted.agent == "a", "the result carries the agent its row was sent to"


def test_the_routed_agent_travels_with_the_result_and_a_materialized_row_names_none(tiny_tokenizer):
    """``GymRowResult.agent``: the agent the row was sent to, kept across the pickle to the driver; None for a
    materialized row (it goes to an environment server) and for a result converted outside an actor."""
    from gym_bridge.gym.transport.actor_config import NemoGymConfig
    from gym_bridge.gym.transport.row_convert import Conversion

    cfg = NemoGymConfig.model_validate({"model_name": "m", "base_urls": ["http://127.0.0.1:1/v1"], "config_paths": ["x"]})
    conversion = Conversion(tiny_tokenizer, cfg, {"env": "some_environment"})
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok"}],
        "prompt_token_ids": tiny_tokenizer.encode("hi"),
        "generation_token_ids": [5, 6],
        "generation_log_probs": [-0.1, -0.2],
    }
    body = {"reward": 1.0, "response": {"output": [dict(item)]}}
    sent = conversion.row({"_rowidx": 0, "agent_ref": {"name": "math_agent"}}, json.dumps(body).encode())
    assert pickle.loads(pickle.dumps(sent)).agent == "math_agent"
    task_id = {"taskset": "t", "task_id": "1"}
    row = {"_rowidx": 1, "task_id": task_id, "task_input": {}, "_ng_environment_server": "env"}
    reply = {"episode_id": {"rollout_id": "0-0", "attempt": 0}, "task_id": task_id, "result": body}
    episode = conversion.row(row, json.dumps(reply).encode())
    assert episode.agent is None and episode.full_result["_ng_result_type"] == "some_environment"


# ---- end to end: a verifier that raises, on real Gym servers -------------------------------------------------------


@pytest.mark.gym
@pytest.mark.timeout(300)
def test_a_deterministic_agent_500_is_data_and_never_resent(gym_actor, gym_tokenizer):
    """A row carrying a ``reward`` field: Gym's equivalence verifier builds its response with ``reward=`` and the
    row's own fields, and raises TypeError, every time. The agent answers 500 with that exception. gym-bridge raises
    GymRunError (data) at once: no row is re-sent, although the client may re-send rows 3 times; the manager skips
    the prompt after its data budget, without an infrastructure retry."""
    from gym_bridge.data import datum_from_gym_row
    from gym_bridge.gym.protocol.rows import build_rows
    from gym_bridge.gym.transport.client import GymClient
    from gym_bridge.rollout.manager import RolloutManager, RolloutOutcome
    from gym_bridge.rollout.sink import InMemorySink
    from gym_bridge.testing.gym_rows import equivalence_row
    from gym_bridge.types import GenerationSamplingParams

    row = {**equivalence_row("Reply with exactly: 3", "3"), "reward": 0.0}
    rows = build_rows(row, 2, GenerationSamplingParams(temperature=1.0, top_p=1.0), 16, task_index=0)
    client = GymClient([gym_actor], max_gym_row_attempts=3)
    with pytest.raises(GymRunError, match=r"agent_run_error: .*TypeError.*reward") as raised:
        asyncio.run(client.run_group(rows, prompt_idx=0, deadline_s=120))
    assert "lc_equivalence_rule_simple_agent" in str(raised.value)
    assert client.stats.gym_row_redispatches == 0, "a deterministic failure is not re-sent"

    manager = RolloutManager(gym_tokenizer, {"nemo_gym": gym_actor}, 2, 4096, generation_config={
        "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}, use_nemo_gym=True, retry_policy=RolloutRetryPolicy(
        max_infra_attempts=3, max_data_attempts=1, max_gym_row_attempts=3, max_skipped_prompts=1))  # fmt: skip
    outcome = asyncio.run(manager.collect(datum_from_gym_row(row, idx=0), InMemorySink()))
    metrics = manager.stats.as_metrics()
    assert outcome is RolloutOutcome.SKIPPED
    assert metrics["rollout/data_failures_total/GymRunError"] == 1.0, metrics
    assert metrics["rollout/gym_row_redispatch_total"] == 0.0 and metrics["rollout/redispatch_total"] == 0.0, metrics
