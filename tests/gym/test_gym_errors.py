"""Gym's nested error chains, unwrapped from REAL NeMo-Gym 0.4.0 ``/run`` answers (tests/data/gym_errors.json,
captured from Gym's servers in front of our server made to fail), their classification, and the
stop-at-once rule. The end-to-end cases run in tests/gym/test_fault_injection.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from gym_bridge.failures import (
    ConfigFailureWatch,
    EndpointConfigError,
    FailureClass,
    GymTransportError,
    RolloutDataFailure,
    RunConfigurationError,
    classify_rollout_failure,
    gym_run_failure,
    unwrap_gym_error,
)

CAPTURED = {k: v for k, v in json.loads((Path(__file__).parents[1] / "data" / "gym_errors.json").read_text()).items()
            if not k.startswith("_")}
EQ_AGENT = "lc_equivalence_rule_simple_agent (SimpleAgent)"
TOOL_AGENT = "example_single_tool_call_simple_agent (SimpleAgent)"
MODEL = "policy_model (VLLMModel)"
WHERE = "NeMo-Gym /run at http://127.0.0.1:1/ for _rowidx=3 (agent 'a')"


@pytest.mark.parametrize(
    ("case", "kind", "status", "servers", "message"),
    [
        ("model_not_found_404", "endpoint", 404, (EQ_AGENT, MODEL),
         "The model `no-such-model` does not exist; this server serves 'tiny'"),
        ("tools_rejected_400", "endpoint", 400, (TOOL_AGENT, MODEL),
         '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ("endpoint_500", "empty", None, (EQ_AGENT, MODEL), "the inner server's answer had no body"),
        ("no_logprobs", "exception", None, (EQ_AGENT,),
         "RuntimeError: `policy_model` requested per-token logprobs from vLLM"),
        ("verify_422", "validation", 422, (EQ_AGENT,), "request rejected: body.expected_answer: Field required"),
        ("run_422", "validation", 422, (), "request rejected: body.responses_create_params.bogus: Extra inputs"),
    ],
)
def test_real_gym_chains_unwrap_to_the_innermost_message_and_the_server_path(case, kind, status, servers, message):
    body = CAPTURED[case]["body"]
    chain = unwrap_gym_error(body.encode())
    assert chain.kind == kind and chain.status == status and chain.servers == servers, chain
    assert chain.message.startswith(message), chain.message
    assert "\\" not in chain.describe() and "Hit an exception" not in chain.describe()
    assert unwrap_gym_error(body) == chain  # str and bytes alike


@pytest.mark.parametrize(
    ("case", "cls", "klass"),
    [
        ("model_not_found_404", EndpointConfigError, FailureClass.DATA),
        ("tools_rejected_400", EndpointConfigError, FailureClass.DATA),
        ("endpoint_500", GymTransportError, FailureClass.INFRA),
        ("no_logprobs", GymTransportError, FailureClass.INFRA),
        ("verify_422", RolloutDataFailure, FailureClass.DATA),
        ("run_422", RolloutDataFailure, FailureClass.DATA),
    ],
)
def test_real_gym_errors_are_classified_by_the_innermost_status(case, cls, klass):
    failure = gym_run_failure(CAPTURED[case]["status"], CAPTURED[case]["body"].encode(), WHERE)
    assert type(failure) is cls and classify_rollout_failure(failure) is klass
    assert WHERE in str(failure) and "Hit an exception" not in str(failure)


def test_endpoint_config_error_carries_status_message_and_path_in_one_picklable_string():
    failure = gym_run_failure(404, CAPTURED["model_not_found_404"]["body"], WHERE)
    restored = pickle.loads(pickle.dumps(failure))
    assert type(restored) is EndpointConfigError and str(restored) == str(failure)
    assert restored.status == 404
    assert restored.detail == "The model `no-such-model` does not exist; this server serves 'tiny'"
    assert restored.path == f"{EQ_AGENT} > {MODEL} > model endpoint"
    assert restored.summary == f"HTTP 404: {restored.detail}"
    assert str(restored) == f"model endpoint answered HTTP 404: {restored.detail} | via {restored.path} | {WHERE}"


def test_vllm_top_level_error_shape_and_endpoint_429_stay_infra():
    inner = {"object": "error", "message": "rate limited", "type": "TooManyRequests", "param": None, "code": 429}
    body = json.dumps(f"Hit an exception in VLLMModel___policy_model calling an inner server: {json.dumps(inner).encode()}")
    chain = unwrap_gym_error(body)
    assert (chain.kind, chain.status, chain.message, chain.servers) == ("endpoint", 429, "rate limited", (MODEL,))
    assert type(gym_run_failure(500, body, WHERE)) is GymTransportError


def test_unrecognised_bodies_pass_through_readably():
    assert unwrap_gym_error(b"An unknown error occurred").message == "An unknown error occurred"
    assert unwrap_gym_error(b"").kind == "empty"
    chain = unwrap_gym_error(b'"Hit an exception in X___y calling an inner server: not a bytes literal"')
    assert chain.servers == ("y (X)",) and chain.message == "not a bytes literal"


def config_error(message: str, row: int) -> EndpointConfigError:
    return EndpointConfigError.build(404, message, "a (SimpleAgent) > model endpoint", f"row {row}")


def test_stop_at_once_fires_when_the_first_prompts_share_one_config_error():
    watch = ConfigFailureWatch(stop_after=2)
    watch.config_failure(config_error("model `x` does not exist", 0))
    with pytest.raises(RunConfigurationError, match="first 2 prompt groups .* HTTP 404: model `x` does not exist") as info:
        watch.config_failure(config_error("model `x` does not exist", 1))
    assert isinstance(info.value.__cause__, EndpointConfigError)
    assert "row 1" not in str(info.value), "the stop message names the problem, not a row"


@pytest.mark.parametrize("first", ["committed", "other config error", "disabled"])
def test_stop_at_once_does_not_fire_after_a_success_or_a_different_error(first):
    watch = ConfigFailureWatch(stop_after=0 if first == "disabled" else 2)
    if first == "committed":
        watch.other_outcome()
    elif first == "other config error":
        watch.config_failure(config_error("tools refused", 0))
    for row in range(1, 4):
        watch.config_failure(config_error("model `x` does not exist", row))  # never raises
    # A success or a different error shuts the window for good; with the rule off, nothing is even counted.
    expected = {"committed": (True, 0), "other config error": (True, 1), "disabled": (False, 0)}[first]
    assert (watch.closed, watch.seen) == expected
    fresh = ConfigFailureWatch(stop_after=2)  # the control: the same errors on an open window do fire it
    fresh.config_failure(config_error("model `x` does not exist", 1))
    with pytest.raises(RunConfigurationError):
        fresh.config_failure(config_error("model `x` does not exist", 2))


def test_eval_cli_exits_2_with_one_line_when_the_run_stops_on_a_config_error(monkeypatch, capsys, tmp_path):
    """The CLI's side of the stop-at-once rule (the run itself is exercised in tests/gym/test_fault_injection.py)."""
    import gym_bridge.eval
    from gym_bridge.cli import main

    message = "stopping the run: its first 2 prompt groups all failed with the same configuration error: ..."

    def stopped(config, **_):
        raise RunConfigurationError(message)

    monkeypatch.setattr(gym_bridge.eval, "load_config", lambda path, overrides: SimpleNamespace(policies=None))
    monkeypatch.setattr(gym_bridge.eval, "run_eval", stopped)
    assert main(["eval", str(tmp_path / "eval.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == f"gym-bridge eval: {message}\n", err
