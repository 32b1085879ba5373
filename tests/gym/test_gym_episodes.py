"""Materialized rows through Gym 0.7's episode protocol (issue 50, item 3).

A materialized row (``task_id`` = ``{taskset, task_id}`` beside ``task_input``) is no ``/run`` row: Gym's collection
sends it as an episode request (``_episode_request_body``) to the environment server its taskset names in
``environment_server_routes`` and stores the reply as ``_episode_record`` makes it; a row whose ``task_id`` is a
string is an ordinary row. The unit tests hold our request, record and routing equal to Gym's own functions; the
Gym tests run materialized rows on real Gym servers through an environment server written to the protocol
(``tests/data/episode_environment``), beside an ordinary row on the same set, and against Gym's own ``run_examples``.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from gym_bridge.failures import (
    GymResultError,
    GymRunError,
    GymTransportError,
    InvalidGymRow,
    classify_rollout_failure,
)
from gym_bridge.failures.classify import FailureClass
from gym_bridge.gym.protocol.episode import (
    EpisodeRoutes,
    episode_failure,
    episode_record,
    episode_request_body,
    episode_target,
    is_episode_response,
)
from gym_bridge.gym.protocol.numbering import with_attempt
from gym_bridge.gym.protocol.routing import GymRoutes
from gym_bridge.gym.protocol.rows import (
    ENVIRONMENT_SERVER_KEY,
    ValidGymRow,
    build_rows,
    is_materialized,
    row_label,
    validate_row,
)
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor, stop_nemo_gym_actors
from gym_bridge.gym_versions import gym_version, installed_gym
from gym_bridge.testing.gym_rows import (
    TOOL_AGENT,
    gym_actor_config,
    gym_token_turns,
    gyms_own_collection,
    tool_call_rows,
)
from gym_bridge.types import GenerationSamplingParams

EPISODES = installed_gym().episode_protocol
needs_episodes = pytest.mark.skipif(not EPISODES, reason=f"{installed_gym().label} has no episode protocol")
ENVIRONMENT_DIR = Path(__file__).parents[1] / "data" / "episode_environment"
ENVIRONMENT_SERVER = "episode_environment"
TASKSET = "weather"
SAMPLING = GenerationSamplingParams(temperature=0.7, top_p=0.9)


def weather_input(i: int = 0) -> dict[str, Any]:
    """An ordinary weather row of Gym's example data, without its agent: the task input of a materialized row."""
    row = tool_call_rows()[i]
    row.pop("agent_ref")
    return row


def materialized(i: int = 0, **task_input: Any) -> dict[str, Any]:
    return {"task_id": {"taskset": TASKSET, "task_id": f"sf-{i}"}, "task_input": {**weather_input(i), **task_input}}


# ---- rows: which are materialized, and how they are validated --------------------------------------------------


@needs_episodes
def test_materialized_means_what_it_means_to_gym():
    from nemo_gym.episode_types import is_materialized_task_row

    rows = [
        materialized(),
        {"task_id": "math-17", "task_input": {"q": 1}},  # a string task_id: an ordinary row to Gym
        {"task_id": {"taskset": "t", "task_id": "1"}},  # no task_input
        {"task_input": {}},
        {"task_id": {}, "task_input": None},  # malformed, still materialized: the server refuses it
        {"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "a"}},
    ]
    assert [is_materialized(row) for row in rows] == [is_materialized_task_row(row) for row in rows]


@needs_episodes
def test_a_materialized_row_is_valid_and_its_task_input_is_the_servers_to_check():
    row = validate_row(materialized(), prompt_idx=3)
    assert isinstance(row, ValidGymRow) and row.agent_name is None
    assert validate_row({**materialized(), "task_input": "anything"}, prompt_idx=3)  # the environment server's call
    # routed by its taskset whatever else it carries, as Gym's collection routes it
    assert validate_row({**materialized(), "agent_ref": {"name": "x"}, "task_source": "y"}, prompt_idx=3)


@needs_episodes
@pytest.mark.parametrize(
    ("task_id", "message"),
    [
        ({"taskset": "", "task_id": "1"}, r"task_id\.taskset: String should have at least 1 character"),
        ({"taskset": "t"}, r"task_id\.task_id: Field required"),
        ({"taskset": "t", "task_id": "1", "extra": 1}, r"task_id\.extra: Extra inputs are not permitted"),
    ],
)
def test_a_materialized_row_with_a_task_id_gym_refuses_is_refused_naming_the_field(task_id, message):
    with pytest.raises(InvalidGymRow, match=rf"^prompt_idx=2: invalid materialized Gym row: {message}"):
        validate_row({"task_id": task_id, "task_input": {}}, prompt_idx=2)


def test_a_row_with_a_string_task_id_is_an_ordinary_row():
    """Gym treats it as ordinary (``is_materialized_task_row`` is false): with responses_create_params and a route it
    is valid; without them the one line names both shapes."""
    row = {
        "task_id": "math-17",
        "task_input": {"question": "2+2"},
        "responses_create_params": {"input": "2+2?"},
        "task_source": "math_resources",
    }
    if installed_gym().task_source_routing:
        assert validate_row(row, prompt_idx=0) == row
    with pytest.raises(
        InvalidGymRow, match=r"^prompt_idx=4: .*task_id as an object \{taskset, task_id\}.*task_source$"
    ):
        validate_row({"task_id": "math-17", "task_input": {"question": "2+2"}}, prompt_idx=4)


def test_a_gym_without_the_protocol_refuses_materialized_rows_naming_the_version(monkeypatch):
    import gym_bridge.gym.protocol.rows as rows

    monkeypatch.setattr(rows, "installed_gym", lambda: gym_version("0.6.0"))
    with pytest.raises(InvalidGymRow, match=r"^prompt_idx=0: .*taskset='weather'.*nemo-gym >= 0\.7 \(nemo-gym 0\.6\.0"):
        validate_row(materialized(), prompt_idx=0)
    assert not gym_version("0.6.0").episode_protocol and gym_version("0.7.0").episode_protocol


# ---- the request, the record, the failure: Gym's own functions ------------------------------------------------


@needs_episodes
def test_build_rows_stamps_identity_and_leaves_task_input_as_gym_does():
    template = validate_row(materialized(), prompt_idx=0)
    rows = build_rows(template, 3, SAMPLING, max_new_tokens=16, run_seed=7, task_index=5)
    for i, row in enumerate(rows):
        assert row["task_input"] == template["task_input"] and row["task_input"] is not template["task_input"]
        assert "responses_create_params" not in row, "no sampling stamps: the environment server owns task_input"
        assert (row["_rowidx"], row["_ng_task_index"], row["_ng_rollout_index"]) == (i, 5, i)


@needs_episodes
def test_the_episode_request_is_gyms():
    from nemo_gym.rollout_collection import _episode_request_body

    template = validate_row(materialized(), prompt_idx=0)
    rows = build_rows(template, 2, SAMPLING, 16, task_index=4)
    rows += build_rows(template, 1, SAMPLING, 16, task_index=4, scope="val")
    rows += [with_attempt(rows[0], 2), {k: v for k, v in rows[1].items() if k != "_ng_rollout_id"}]
    for row in rows:
        assert episode_request_body(row) == _episode_request_body(row)
    assert episode_request_body(rows[2])["episode_id"] == {"rollout_id": "val-4-0", "attempt": 0}
    assert episode_request_body(rows[3])["episode_id"] == {"rollout_id": "4-0", "attempt": 2}
    for bad in ({**rows[0], "_ng_attempt_index": -1}, {**rows[0], "_ng_attempt_index": True}):
        with pytest.raises(ValueError):
            _episode_request_body(bad)
        with pytest.raises(InvalidGymRow, match="invalid episode attempt"):
            episode_request_body(bad)
    with pytest.raises(InvalidGymRow, match="needs its rollout identity"):
        episode_request_body(materialized())


@needs_episodes
def test_the_record_of_a_reply_is_gyms():
    from nemo_gym.rollout_collection import _episode_record, _is_episode_response

    identity = {"episode_id": {"rollout_id": "0-0", "attempt": 0}, "task_id": {"taskset": TASKSET, "task_id": "1"}}
    failure = {"failure_reason": "no sandbox", "terminal": True, "stage": "seed", "partial_response": {"id": "r"}}
    replies = [
        {**identity, "result": {"reward": 1.0, "response": {"output": []}}},
        {**identity, "failure": failure},
        {**identity, "failure": {"failure_reason": "later", "terminal": False}},
        {**identity, "failure": "not an object"},
        {**identity, "result": ["not an object"]},
        {**identity, "result": {"reward": 0.0, "_ng_task_index": 3}},
        {**identity, "result": {"reward": 0.0, "ng_trajectory": {}}},
    ]
    for reply in replies:
        assert is_episode_response(reply) == _is_episode_response(reply)
        try:
            theirs = _episode_record(reply)
        except ValueError as exc:
            with pytest.raises(GymResultError) as ours:
                episode_record(reply)
            assert str(ours.value) == str(exc)
        else:
            assert episode_record(reply) == theirs
    for not_a_reply in ({"reward": 1.0}, {"episode_id": {}, "task_id": "x", "result": {}}, [identity]):
        assert is_episode_response(not_a_reply) == _is_episode_response(not_a_reply) is False


def test_a_handled_failure_is_retried_as_gym_retries_it_unless_terminal():
    def failure(terminal: bool) -> Any:
        record = episode_record(
            {
                "episode_id": {"rollout_id": "0-0", "attempt": 0},
                "task_id": {"taskset": TASKSET, "task_id": "1"},
                "failure": {"failure_reason": "the sandbox went away", "terminal": terminal, "stage": "agent"},
            }
        )
        return episode_failure(record, "_rowidx=0 (environment server 'env')")

    terminal, retryable = failure(True), failure(False)
    assert isinstance(terminal, GymRunError) and classify_rollout_failure(terminal) is FailureClass.DATA
    assert isinstance(retryable, GymTransportError) and classify_rollout_failure(retryable) is FailureClass.INFRA
    assert str(terminal) == (
        "_rowidx=0 (environment server 'env'): Gym's _ng_failure_class environment_server_failed (terminal, stage "
        "agent): the sandbox went away"
    )
    assert "(not terminal: Gym retries it, stage agent)" in str(retryable)


# ---- routes -------------------------------------------------------------------------------------------------------


def test_routes_send_a_materialized_row_to_its_tasksets_server_and_every_other_row_as_before():
    routes = EpisodeRoutes(
        agents=(TOOL_AGENT,),
        tasksets={TASKSET: ENVIRONMENT_SERVER},
        taskset_errors={"broken": "environment_server_routes names 'nothing', which is not a running environment"},
    )
    assert pickle.loads(pickle.dumps(routes)) == routes, "it crosses Ray"
    row = materialized()
    routed = routes.routed(row, where="prompt_idx=0")
    assert routed == {**row, ENVIRONMENT_SERVER_KEY: ENVIRONMENT_SERVER} and ENVIRONMENT_SERVER_KEY not in row
    assert "agent_ref" not in routed, "Gym's materialized tasks carry no agent"
    assert routes.routed(routed, where="prompt_idx=0") is routed
    assert row_label(routed) == ENVIRONMENT_SERVER and row_label(tool_call_rows()[0]) == TOOL_AGENT
    ordinary = tool_call_rows()[0]
    assert routes.routed(ordinary, where="prompt_idx=1") is ordinary
    unrouted = (
        r"^prompt_idx=2: no environment server route is configured for taskset 'other' "
        r"\(Gym's environment_server_routes .*: weather -> episode_environment\)$"
    )
    with pytest.raises(InvalidGymRow, match=unrouted):
        routes.routed({"task_id": {"taskset": "other", "task_id": "1"}, "task_input": {}}, where="prompt_idx=2")
    with pytest.raises(InvalidGymRow, match=r"taskset 'broken' routes nowhere: environment_server_routes names"):
        routes.routed({"task_id": {"taskset": "broken", "task_id": "1"}, "task_input": {}}, where="prompt_idx=3")
    stamped = {**row, "_rowidx": 7}
    if EPISODES:
        assert episode_target(stamped, 0, routes) == (7, ENVIRONMENT_SERVER)
        with pytest.raises(InvalidGymRow, match="has no taskset routes"):
            episode_target(stamped, 0, GymRoutes(agents=(TOOL_AGENT,)))


# ---- on real Gym servers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def episode_actor(ray_session, scripted_policy, tiny_tokenizer, tmp_path_factory) -> Iterator[Any]:
    if not EPISODES:
        pytest.skip(f"{installed_gym().label} has no episode protocol")
    configs = [
        str(wheel_config_path("responses_api_models/vllm_model/configs/vllm_model_for_training.yaml")),
        str(wheel_config_path("resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml")),
        str(ENVIRONMENT_DIR / "configs" / "episode_environment.yaml"),
    ]
    config = gym_actor_config([scripted_policy.base_url], tmp_path_factory.mktemp("episode-logs")).model_copy(
        update={"config_paths": configs, "server_dirs": {f"environment_servers/{ENVIRONMENT_SERVER}": ENVIRONMENT_DIR}}
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    stop_nemo_gym_actors([actor])


def _group(actor: Any, template: dict[str, Any], n: int, *, task_index: int, attempts: int = 1) -> Any:
    rows = build_rows(validate_row(template, prompt_idx=task_index), n, SAMPLING, 64, task_index=task_index)
    client = GymClient([actor], max_gym_row_attempts=attempts)
    return asyncio.run(client.run_group(rows, prompt_idx=task_index, deadline_s=180))


@pytest.mark.gym
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_materialized_row_completes_through_the_environment_server(episode_actor):
    routes = ray.get(episode_actor.routes.remote())
    assert isinstance(routes, EpisodeRoutes) and routes.tasksets == {TASKSET: ENVIRONMENT_SERVER}, routes
    group = _group(episode_actor, materialized(0), 2, task_index=0)
    assert [row.reward for row in group.rows] == [1.0, 1.0], "the scripted policy calls the weather tool"
    for i, row in enumerate(group.rows):
        record = row.full_result
        assert record["_ng_task_id"] == {"taskset": TASKSET, "task_id": "sf-0"}
        assert (record[ENVIRONMENT_SERVER_KEY], record["_ng_result_type"]) == (ENVIRONMENT_SERVER, ENVIRONMENT_SERVER)
        assert (record["_ng_task_index"], record["_ng_rollout_index"], record["_ng_rollout_id"]) == (0, i, f"0-{i}")
        assistant = [m for m in row.message_log if m["role"] == "assistant"]
        assert len(assistant) == 2 and all(
            m["token_ids"].numel() == m["generation_logprobs"].numel() > 0 for m in assistant
        )
    ordinary = _group(episode_actor, tool_call_rows()[1], 1, task_index=1)  # an ordinary row on the same set
    assert ordinary.rows[0].reward == 1.0 and ENVIRONMENT_SERVER_KEY not in ordinary.rows[0].full_result


@pytest.mark.gym
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_our_records_are_those_of_gyms_own_collection(episode_actor):
    from nemo_gym.rollout_collection import _episode_record

    routes = ray.get(episode_actor.routes.remote())
    rows = []
    for i in range(2):
        template = routes.routed(validate_row(materialized(i), prompt_idx=i), where=f"prompt_idx={i}")
        row = build_rows(template, 1, SAMPLING, 64, task_index=i)[0]
        row["_rowidx"] = i
        rows.append(row)
    theirs = [_episode_record(reply) for reply in gyms_own_collection(episode_actor, rows)]
    ours = asyncio.run(GymClient([episode_actor]).run_group(rows, prompt_idx=0, deadline_s=180)).rows
    assert [row.reward for row in ours] == [record["reward"] for record in theirs] == [1.0, 1.0]
    for row, record in zip(ours, theirs, strict=True):
        assert row.full_result["_ng_task_id"] == record["_ng_task_id"]
        assistant = [m for m in row.message_log if m["role"] == "assistant"]
        assert [m["token_ids"].tolist() for m in assistant] == [
            t["generation_token_ids"] for t in gym_token_turns(record)
        ]


@pytest.mark.gym
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_handled_failures_are_recorded_as_gym_records_them(episode_actor, tmp_path):
    """A terminal failure fails the group at once (data, never re-sent); a non-terminal one is re-sent with the next
    attempt index, as Gym's resume re-dispatches it, until the row budget is spent (then infrastructure)."""
    terminal_log, retry_log = tmp_path / "terminal.jsonl", tmp_path / "retry.jsonl"
    with pytest.raises(GymRunError, match=r"environment_server_failed \(terminal, stage agent\): the task asked"):
        _group(episode_actor, materialized(0, fail="terminal", attempts_log=str(terminal_log)), 1, task_index=0,
               attempts=3)  # fmt: skip
    assert [json.loads(line) for line in terminal_log.read_text().splitlines()] == [{"rollout_id": "0-0", "attempt": 0}]
    with pytest.raises(GymTransportError, match=r"environment_server_failed \(not terminal: Gym retries it"):
        _group(episode_actor, materialized(0, fail="retryable", attempts_log=str(retry_log)), 1, task_index=0,
               attempts=3)  # fmt: skip
    seen = [json.loads(line) for line in retry_log.read_text().splitlines()]
    assert seen == [{"rollout_id": "0-0", "attempt": attempt} for attempt in range(3)]


@pytest.mark.gym
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_taskset_without_a_route_is_refused_naming_the_routes(episode_actor):
    template = {"task_id": {"taskset": "nowhere", "task_id": "1"}, "task_input": weather_input()}
    with pytest.raises(InvalidGymRow, match=r"no environment server route is configured for taskset 'nowhere'"):
        _group(episode_actor, template, 1, task_index=0)
