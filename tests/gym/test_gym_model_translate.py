"""gym-bridge's model server translates Responses <-> chat exactly as Gym's ``vllm_model`` (no servers started).

The reference is the installed nemo-gym itself (0.7.0 by default, 0.5.1 and 0.4.0 in the compat lanes): its ``ResponsesConverter`` and
``VLLMModel._preprocess_chat_completion_create_params``, run on the same bodies.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import orjson
import pytest

from gym_bridge.gym_model.translate import (
    TranslationError,
    empty_output_items,
    output_items,
    response_body,
    responses_to_chat,
)
from gym_bridge.serving.chat import build_chat_prompt
from gym_bridge.testing.gym_rows import tool_call_rows


def _gym_chat(body: dict[str, Any], **config: Any) -> dict[str, Any]:
    """The chat body ``vllm_model`` sends upstream for ``body`` (its converter + preprocessing, no I/O).

    A real ``VLLMModel`` with the installed version's config defaults, built without a server, so a method
    or option a newer Gym adds is run too (never a stand-in object that lacks it).
    """
    from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
    from nemo_gym.responses_converter import VLLMConverter
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    settings = {
        "host": "127.0.0.1",
        "port": 1,
        "entrypoint": "app.py",
        "name": "policy_model",
        "base_url": "http://127.0.0.1:1/v1",
        "api_key": "dummy",
        "model": "tiny",
        "return_token_id_information": True,
        "uses_reasoning_parser": True,
        **config,
    }
    model_config = VLLMModelConfig.model_validate(settings)
    converter = VLLMConverter(
        return_token_id_information=True, uses_reasoning_parser=model_config.uses_reasoning_parser
    )
    params = converter.responses_to_chat_completion_create_params(
        NeMoGymResponseCreateParamsNonStreaming.model_validate(copy.deepcopy(body))
    )
    class OfflineVLLMModel(VLLMModel):
        def model_post_init(self, context: Any) -> None:  # no server client, no endpoint checks
            self._converter = converter

    server = OfflineVLLMModel.model_construct(config=model_config)
    return server._preprocess_chat_completion_create_params(None, params.model_dump(exclude_unset=True))


def _bodies() -> list[dict[str, Any]]:
    tool_row = tool_call_rows()[0]["responses_create_params"]
    call = {
        "arguments": '{"city": "SF"}',
        "call_id": "call_1",
        "name": "get_weather",
        "type": "function_call",
        "id": "call_1",
        "status": "completed",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -0.25],
    }
    second_turn = {
        **tool_row,
        "input": [
            *tool_row["input"],
            {"id": "rs_1", "summary": [{"text": "let me look", "type": "summary_text"}], "type": "reasoning"},
            call,
            {"call_id": "call_1", "output": '{"weather": "cold"}', "type": "function_call_output"},
        ],
    }
    think_history = {
        "input": [
            {"role": "user", "content": "hi"},
            {
                "id": "msg_1",
                "role": "assistant",
                "type": "message",
                "status": "completed",
                "content": [{"type": "output_text", "text": "<think>greet</think>hello", "annotations": []}],
                "prompt_token_ids": [7],
                "generation_token_ids": [8, 9],
                "generation_log_probs": [-1.0, -2.0],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
        ],
        "max_output_tokens": 32,
        "temperature": 0.7,
        "metadata": {"chat_template_kwargs": '{"enable_thinking": false}', "extra_body": '{"seed": 3, "top_k": 5}'},
    }
    return [
        tool_row,
        second_turn,
        think_history,
        {"input": "What is 2+2? Reply with exactly: 4", "max_output_tokens": 64, "temperature": 1.0, "top_p": 1.0},
    ]


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("reasoning", [True, False])
def test_chat_equals_vllm_model(index, reasoning, tiny_tokenizer):
    body = _bodies()[index]
    gym = _gym_chat(body, uses_reasoning_parser=reasoning)
    ours = responses_to_chat(copy.deepcopy(body), uses_reasoning_parser=reasoning)
    assert ours.messages == gym["messages"]
    # the template dumps tools with tojson: key order is part of the tokens
    assert orjson.dumps(ours.tools) == orjson.dumps(gym.get("tools"))
    assert ours.chat_template_kwargs == gym.get("chat_template_kwargs", {})
    for key in ("max_tokens", "temperature", "top_p", "seed", "top_k"):
        assert ours.sampling.get(key) == gym.get(key), key
    kwargs = ours.chat_template_kwargs or None
    rendered = build_chat_prompt(tiny_tokenizer, ours.messages, tools=ours.tools, chat_template_kwargs=kwargs)
    expected = build_chat_prompt(tiny_tokenizer, gym["messages"], tools=gym.get("tools"), chat_template_kwargs=kwargs)
    assert rendered.token_ids == expected.token_ids
    if index == 1:  # the carried ids of the tool-call turn are spliced in front of the tool result
        assert rendered.spliced and rendered.token_ids[:4] == [1, 2, 3, 4]


def test_developer_role_mapping_matches():
    body = tool_call_rows()[0]["responses_create_params"]
    gym = _gym_chat(body, replace_developer_role_with_system=True)
    ours = responses_to_chat(copy.deepcopy(body), uses_reasoning_parser=True, replace_developer_role_with_system=True)
    assert ours.messages == gym["messages"] and ours.messages[0]["role"] == "system"


def test_output_items_equal_gym_postprocessing():
    from nemo_gym.responses_converter import VLLMConverter

    tokens = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.1, -0.2]}
    calls = [{"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}}]
    converter = VLLMConverter(return_token_id_information=True, uses_reasoning_parser=True)
    for content, tool_calls in [("<think>hm</think>hello", []), (None, calls), ("sure", calls), ("", [])]:
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls, **tokens}
        gym = [item.model_dump() for item in converter.postprocess_assistant_message_dict(copy.deepcopy(message))]
        ours = output_items(content, tool_calls, uses_reasoning_parser=True, token_fields=tokens)
        assert _without_ids(ours) == _without_ids(gym)
    empty = converter.postprocess_assistant_message_dict({"role": "assistant", "content": None, "tool_calls": None})
    assert _without_ids(empty_output_items()) == _without_ids([i.model_dump() for i in empty])


def test_response_has_exactly_nemo_gym_response_fields():
    from nemo_gym.openai_utils import NeMoGymResponse

    body = tool_call_rows()[0]["responses_create_params"]
    items = output_items("hi", [], uses_reasoning_parser=True, token_fields=None)
    ours = response_body(body, "tiny", items, finish_reason="length", usage=(10, 2))
    parsed = NeMoGymResponse.model_validate(json.loads(orjson.dumps(ours)))
    assert parsed.model_dump(mode="json").keys() == ours.keys()
    assert ours["incomplete_details"] == {"reason": "max_output_tokens"}
    assert ours["usage"]["total_tokens"] == 12 and parsed.usage.input_tokens == 10


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": 3}, "input must be a string or a list"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0] (function_call) lacks the field"),
        ({"input": [{"type": "telepathy"}]}, "input[0] has an unsupported type 'telepathy'"),
        ({"input": "x", "metadata": {"extra_body": "{nope"}}, "metadata.extra_body is not JSON"),
    ],
)
def test_bad_requests_name_the_field(body, message):
    with pytest.raises(TranslationError, match=re.escape(message)):
        responses_to_chat(body, uses_reasoning_parser=True)


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items with the random ids (``msg_``/``rs_``) blanked; tool-call ids are kept."""
    return [{**item, "id": None} if item.get("type") in ("message", "reasoning") else item for item in items]


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/v1/responses", "/v1/responses"),
        ("/ng-rollout/r-17/v1/responses", "/v1/responses"),
        ("/ng-rollout/r-17/training-token-capture/v1/responses", "/v1/responses"),
        ("/elsewhere/v1/responses", "/elsewhere/v1/responses"),
    ],
)
def test_gym_07_rollout_prefixed_routes_reach_the_responses_route(path, served):
    from gym_bridge.gym_model.app import served_path

    assert served_path(path) == served
