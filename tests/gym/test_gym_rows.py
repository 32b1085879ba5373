"""Gym rows: validation that names the prompt and field, and building N stamped rows."""

from __future__ import annotations

import pickle

import pytest

from gym_bridge.failures import FailureClass, classify_rollout_failure
from gym_bridge.gym.protocol.rows import InvalidGymRow, ValidGymRow, build_rows, validate_row
from gym_bridge.types import GenerationSamplingParams

ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 100},
    "agent_ref": {"type": "responses_api_agents", "name": "simple_agent"},
    "expected_answer": "42",
}


def test_a_good_row_passes_and_keeps_extra_fields():
    valid = validate_row(ROW, prompt_idx=0, known_agents=["simple_agent"])
    assert isinstance(valid, ValidGymRow) and valid == ROW and valid.agent_name == "simple_agent"
    assert valid["expected_answer"] == "42"


def test_a_valid_row_is_not_validated_again_but_its_agent_is_checked():
    """The row is validated where it enters; later steps take the ValidGymRow as it is."""
    valid = validate_row(ROW, prompt_idx=0)
    assert validate_row(valid, prompt_idx=0) is valid
    with pytest.raises(InvalidGymRow, match="'simple_agent' is not a running agent"):
        validate_row(valid, prompt_idx=0, known_agents=["other"])
    stamped = build_rows(valid, 2, GenerationSamplingParams(temperature=0.5, top_p=0.9), 8)
    assert [type(row) for row in stamped] == [dict, dict] and valid == ROW  # copies; the entered row is unchanged


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"agent_ref": ROW["agent_ref"]}, "responses_create_params: Field required"),
        ({"responses_create_params": {"input": "x"}}, "agent_ref: Field required"),
        ({**ROW, "responses_create_params": {"tools": []}}, "responses_create_params.input: Field required"),
        ({**ROW, "responses_create_params": {"input": 5}}, "responses_create_params.input"),
        ({**ROW, "agent_ref": {"name": 3}}, "agent_ref.name: Input should be a valid string"),
        ({**ROW, "agent_ref": {"type": "other", "name": "a"}}, "agent_ref.type"),
        ("not a dict", "must be a dict, got str"),
        ({**ROW, "responses_create_params": {"input": "x", "bogus": 1}}, "unknown key(s) ['bogus']"),
    ],
)
def test_bad_rows_name_the_prompt_and_field(row, needle):
    with pytest.raises(InvalidGymRow) as info:
        validate_row(row, prompt_idx=17)
    assert "prompt_idx=17" in str(info.value) and needle in str(info.value)
    assert classify_rollout_failure(info.value) is FailureClass.DATA
    assert isinstance(pickle.loads(pickle.dumps(info.value)), InvalidGymRow)


def test_unknown_agent_lists_the_known_ones():
    with pytest.raises(InvalidGymRow, match="'simple_agent' is not a running agent; known agents: a, b"):
        validate_row(ROW, prompt_idx=1, known_agents=["b", "a"])


def test_build_rows_stamps_sampling_cap_and_index_on_copies():
    rows = build_rows(ROW, 3, GenerationSamplingParams(temperature=0.6, top_p=0.9), max_new_tokens=64)
    assert [r["_rowidx"] for r in rows] == [0, 1, 2]
    for r in rows:
        params = r["responses_create_params"]
        assert params["temperature"] == 0.6 and params["top_p"] == 0.9
        assert params["max_output_tokens"] == 64  # min(100, 64)
        assert r["expected_answer"] == "42"
    rows[0]["responses_create_params"]["input"].append("mutated")
    assert len(rows[1]["responses_create_params"]["input"]) == 1
    assert "_rowidx" not in ROW and ROW["responses_create_params"]["max_output_tokens"] == 100
    larger = build_rows(ROW, 1, GenerationSamplingParams(), max_new_tokens=1000)
    assert larger[0]["responses_create_params"]["max_output_tokens"] == 100
    uncapped = build_rows({**ROW, "responses_create_params": {"input": "x"}}, 1, GenerationSamplingParams(), 32)
    assert uncapped[0]["responses_create_params"]["max_output_tokens"] == 32


def test_build_rows_copies_every_level():
    template = {**ROW, "meta": {"tags": ["a", ("b", ["c"])], "n": 1.5, "ok": True, "none": None}}
    rows = build_rows(template, 2, GenerationSamplingParams(), max_new_tokens=None)
    first, second = rows
    assert first["meta"] == template["meta"] and first["meta"] is not template["meta"]
    first["meta"]["tags"][1][1].append("d")
    first["meta"]["tags"].append("e")
    assert template["meta"]["tags"] == ["a", ("b", ["c"])] and second["meta"]["tags"] == ["a", ("b", ["c"])]


def test_known_create_params_fields_match_the_installed_gym():
    from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming as GymParams

    from gym_bridge.gym_versions import installed_gym

    assert GymParams.model_config.get("extra") == "forbid"
    assert set(GymParams.model_fields) == installed_gym().request_fields


def test_a_materialized_row_is_refused_in_one_line_naming_it():
    row = {"task_id": "math-17", "task_input": {"question": "2+2"}}
    with pytest.raises(InvalidGymRow, match=r"^prompt_idx=4: a materialized Gym row \(task_id='math-17'.*task_source$"):
        validate_row(row, prompt_idx=4)


def test_rows_with_the_installed_gyms_newer_request_fields_are_accepted():
    """Gym 0.6+ adds seven request fields (prompt_cache_key, ...): accepted exactly where the installed Gym has them."""
    from gym_bridge.gym_versions import installed_gym

    row = {**ROW, "responses_create_params": {**ROW["responses_create_params"], "prompt_cache_key": "k"}}
    if "prompt_cache_key" in installed_gym().request_fields:
        assert validate_row(row, prompt_idx=0)["responses_create_params"]["prompt_cache_key"] == "k"
    else:
        with pytest.raises(InvalidGymRow, match=r"unknown key\(s\) \['prompt_cache_key'\] \(nemo-gym 0\.[45]"):
            validate_row(row, prompt_idx=0)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("session_lost", FailureClass.INFRA),
        ("transport_timeout", FailureClass.INFRA),
        ("provider_oom_killed", FailureClass.INFRA),
        ("judge_failed", FailureClass.DATA),
        ("session_release_failed", FailureClass.DATA),
        ("my_server:odd", FailureClass.DATA),
        (None, None),
    ],
)
def test_gym_failure_kinds_map_onto_our_failure_classes(kind, expected):
    from gym_bridge.failures import gym_failure_kind_class

    assert gym_failure_kind_class(kind) is expected


def test_the_version_seam_reads_the_installed_gym_and_refuses_unsupported_ones():
    import importlib.metadata

    from gym_bridge.gym_versions import UnsupportedGymVersion, gym_version, installed_gym

    assert str(installed_gym().version) == importlib.metadata.version("nemo-gym")
    for unsupported in ("0.3.1", "0.8.0"):
        with pytest.raises(UnsupportedGymVersion, match=f"nemo-gym {unsupported} is not supported"):
            gym_version(unsupported)
    old, new = gym_version("0.4.0"), gym_version("0.7.0")
    assert new.head_readiness_path == "/readyz" and old.head_readiness_path == "/"
    assert "environment_servers" in new.server_types and "environment_servers" not in old.server_types
    assert old.request_fields < new.request_fields
