"""convert_gym_result on hand-built results shaped like NeMo-Gym 0.4.0's /run output."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from gym_bridge.failures import GymResultError, MissingGenerationData, NaNLogprobs, RolloutDataFailure, TokenDrift
from gym_bridge.gym.protocol.convert import convert_gym_result, detect_tool_call_and_thinking_flags

LP = math.log(0.5)


def _tokens(item: dict, prompt: list[int], gen: list[int]) -> dict:
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [LP] * len(gen),
        "routed_experts": None,
        **item,
    }


def _message(text: str) -> dict:
    return {
        "id": "msg_1",
        "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }


def _call() -> dict:
    return {
        "arguments": '{"city": "sf"}',
        "call_id": "call_1",
        "name": "get_weather",
        "type": "function_call",
        "id": "call_1",
        "status": "completed",
    }


def _tool_output() -> dict:
    output = '{"weather": "cold"}'
    return {"call_id": "call_1", "output": output, "type": "function_call_output", "id": None, "status": None}


def _result(output: list[dict], **extra) -> dict:
    return {
        "responses_create_params": {"input": [{"content": "hi", "role": "user", "type": "message"}], "tools": []},
        "response": {"id": "resp_1", "object": "response", "output": output, "incomplete_details": None},
        "reward": 1.0,
        **extra,
    }


P1, G1 = [10, 11, 12, 13], [20, 21, 2]
P2 = P1 + G1 + [30, 31]
G2 = [40, 41, 2]


def _two_turns() -> dict:
    return _result([_tokens(_call(), P1, G1), _tool_output(), _tokens(_message("cold"), P2, G2)])


def test_single_turn(tiny_tokenizer):
    result = _result([_tokens(_message("4"), P1, [52, 2])])
    out = convert_gym_result(result, tiny_tokenizer)
    log = out.message_log
    assert [m["role"] for m in log] == ["user", "assistant"]
    assert log[0]["token_ids"].tolist() == P1 and log[1]["token_ids"].tolist() == [52, 2]
    assert torch.allclose(log[1]["generation_logprobs"], torch.tensor([LP, LP]))
    assert log[0]["content"] == log[1]["content"] == ""
    assert out.input_message_log == log[:1] and out.input_message_log[0] is log[0]
    assert out.full_result is result and out.token_drift is None
    item = result["response"]["output"][0]
    assert item["prompt_str"] == tiny_tokenizer.decode(P1)
    assert item["generation_str"] == tiny_tokenizer.decode([52, 2])


def test_multi_turn_tool_call_deltas_dtypes_and_popped_arrays(tiny_tokenizer):
    result = _two_turns()
    out = convert_gym_result(result, tiny_tokenizer)
    log = out.message_log
    assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]
    assert log[2]["token_ids"].tolist() == [30, 31]
    assert torch.cat([m["token_ids"] for m in log]).tolist() == P2 + G2
    for m in log:
        assert m["token_ids"].dtype == torch.int64
        if m["role"] == "assistant":
            assert m["generation_logprobs"].dtype == torch.float32
            assert len(m["generation_logprobs"]) == len(m["token_ids"])
    for item in result["response"]["output"]:
        for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts"):
            assert key not in item
    first, tool, last = result["response"]["output"]
    assert "prompt_str" in first and "prompt_str" in last and "prompt_str" not in tool
    assert last["generation_str"] == tiny_tokenizer.decode(G2)


def test_empty_user_delta_is_int64(tiny_tokenizer):
    # A second call whose prompt is exactly the history: the delta is empty but still int64.
    result = _result([_tokens(_call(), P1, G1), _tokens(_message("x"), P1 + G1, G2)])
    log = convert_gym_result(result, tiny_tokenizer).message_log
    assert log[2]["token_ids"].numel() == 0 and log[2]["token_ids"].dtype == torch.int64


def test_items_without_generation_tokens_are_skipped(tiny_tokenizer):
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}
    empty = _tokens(_message(""), P1, [])
    result = _result([reasoning, empty, _tokens(_message("4"), P1, [52, 2])])
    log = convert_gym_result(result, tiny_tokenizer).message_log
    assert len(log) == 2
    assert "prompt_token_ids" in result["response"]["output"][1]  # not a model call: left untouched


def test_drift_raises_with_position_and_tokens(tiny_tokenizer):
    result = _two_turns()
    result["response"]["output"][2]["prompt_token_ids"] = P1 + [20, 99, 2, 30, 31]
    with pytest.raises(TokenDrift, match=r"model call 1: .* position 5") as info:
        convert_gym_result(copy.deepcopy(result), tiny_tokenizer)
    assert "history [11, 12, 13, 20, 21, 2]" in str(info.value)
    assert "prompt [11, 12, 13, 20, 99, 2, 30, 31]" in str(info.value)
    assert isinstance(info.value, RolloutDataFailure)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


def test_drift_from_shorter_prompt(tiny_tokenizer):
    result = _two_turns()
    result["response"]["output"][2]["prompt_token_ids"] = P1[:2]
    with pytest.raises(TokenDrift, match="position 2"):
        convert_gym_result(result, tiny_tokenizer)


def test_drift_truncate_keeps_good_turns_and_reports(tiny_tokenizer):
    result = _two_turns()
    result["response"]["output"][2]["prompt_token_ids"] = P1 + [20, 99, 2, 30, 31]
    out = convert_gym_result(result, tiny_tokenizer, on_drift="truncate")
    assert [m["role"] for m in out.message_log] == ["user", "assistant"]
    assert out.token_drift == {"turn": 1, "position": 5, "expected": [21, 2], "got": [99, 2, 30, 31]}
    assert "generation_token_ids" in result["response"]["output"][2]  # the drifting turn keeps its arrays


def test_nan_logprobs(tiny_tokenizer):
    result = _result([_tokens(_message("4"), P1, [52, 2])])
    result["response"]["output"][0]["generation_log_probs"] = [LP, float("nan")]
    with pytest.raises(NaNLogprobs, match="NaN"):
        convert_gym_result(result, tiny_tokenizer)


def test_missing_generation_data_names_item_types(tiny_tokenizer):
    # What Gym returns when the endpoint reports a context-length 400.
    result = _result([_message("")])
    result["response"]["incomplete_details"] = {"reason": "max_output_tokens"}
    with pytest.raises(MissingGenerationData, match=r"no generation data.*\['message'\].*max_output_tokens") as info:
        convert_gym_result(result, tiny_tokenizer)
    assert "max_model_len" in str(info.value) and "return_token_id_information" in str(info.value)
    assert "first prompt" in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args


@pytest.mark.parametrize(
    "result",
    [[], {"response": None}, {"response": {"output": "x"}}],
    ids=["not-a-dict", "no-response", "output-not-list"],
)
def test_malformed_results(tiny_tokenizer, result):
    with pytest.raises(GymResultError):
        convert_gym_result(result, tiny_tokenizer)


@pytest.mark.parametrize(
    ("field", "values", "error"),
    [
        ("generation_log_probs", [LP, None], NaNLogprobs),
        ("generation_log_probs", [LP, "x"], GymResultError),
        ("generation_log_probs", [LP, [LP]], GymResultError),
        ("generation_token_ids", [52, True], GymResultError),
        ("generation_token_ids", [52, 2.0], GymResultError),
        ("generation_token_ids", [52, 2**64], GymResultError),
        ("prompt_token_ids", [*P1[:-1], "13"], GymResultError),
        ("generation_token_ids", [52, -1], GymResultError),
        ("prompt_token_ids", [*P1[:-1], -13], GymResultError),
    ],
    ids=[
        "null-logprob", "str-logprob", "nested-logprob", "bool-token", "float-token", "huge-token", "str-prompt",
        "negative-token", "negative-prompt",
    ],
)
def test_bad_token_data(tiny_tokenizer, field, values, error):
    result = _result([_tokens(_message("4"), P1, [52, 2])])
    result["response"]["output"][0][field] = values
    with pytest.raises(error) as caught:
        convert_gym_result(result, tiny_tokenizer)
    if error is GymResultError:
        assert field in str(caught.value)


def test_values_are_exact(tiny_tokenizer):
    logprobs = [-0.1, -1e-9, -123.456]
    result = _result([_tokens(_message("4"), [0, 2**31 - 1, 7], [2**32 - 1, 0, 5])])
    result["response"]["output"][0]["generation_log_probs"] = logprobs
    log = convert_gym_result(result, tiny_tokenizer, on_drift="raise").message_log
    assert log[0]["token_ids"].tolist() == [0, 2**31 - 1, 7]
    assert log[1]["token_ids"].tolist() == [2**32 - 1, 0, 5]
    assert torch.equal(log[1]["generation_logprobs"], torch.tensor(logprobs, dtype=torch.float32))


def test_logprob_length_mismatch(tiny_tokenizer):
    result = _result([_tokens(_message("4"), P1, [52, 2])])
    result["response"]["output"][0]["generation_log_probs"] = [LP]
    with pytest.raises(GymResultError, match="1 entries for 2"):
        convert_gym_result(result, tiny_tokenizer)


def test_bad_on_drift(tiny_tokenizer):
    with pytest.raises(ValueError):
        convert_gym_result(_two_turns(), tiny_tokenizer, on_drift="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("item", "flags"),
    [
        (_message("fine"), (False, False)),
        (_message('<tool_call>{"name": "f"}</tool_call>'), (True, False)),
        (_message("<function_call>"), (True, False)),
        (_message("<think>x</think> 4"), (False, True)),
        (_message("</think>"), (False, True)),
        ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "<think>a</think>"}]}, (False, False)),
        ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "<think><think>"}]}, (False, True)),
        ({"type": "reasoning", "summary": [{"type": "summary_text", "text": "<tool_call>"}]}, (True, False)),
        ({"type": "reasoning", "summary": []}, (False, False)),
        (_call(), (False, False)),
    ],
)
def test_flags(item, flags):
    assert detect_tool_call_and_thinking_flags(item) == flags


def test_flags_reach_the_log_with_custom_patterns(tiny_tokenizer):
    result = _result([_tokens(_message("CALL: f() [[r]]x[[/r]]"), P1, [52, 2])])
    log = convert_gym_result(
        result, tiny_tokenizer, invalid_tool_call_patterns=("CALL:",), thinking_tags=("[[r]]", "[[/r]]")
    ).message_log
    assert log[1]["is_invalid_tool_call"] is True and log[1]["has_malformed_thinking"] is True


def test_numpy_round_trip_keeps_dtypes_values_and_the_shared_input_message():
    """A GymRowResult pickles (Ray's transport) its tensors as numpy arrays and unpickles the same tensors."""
    import numpy as np

    from gym_bridge.gym.protocol.result_fields import gym_row_result

    log = [
        {"role": "user", "content": "", "token_ids": torch.tensor([1, 2, 3], dtype=torch.int64)},
        {"role": "assistant", "content": "", "token_ids": torch.tensor([4], dtype=torch.int64),
         "generation_logprobs": torch.tensor([-0.5], dtype=torch.float32), "is_invalid_tool_call": False},
    ]
    row = gym_row_result(7, log, {"reward": 1})
    state = row.__getstate__()
    assert isinstance(state["message_log"][0]["token_ids"], np.ndarray)
    assert isinstance(row.message_log[0]["token_ids"], torch.Tensor)  # pickling leaves the original alone
    back = pickle.loads(pickle.dumps(row, protocol=5))
    assert back.row_index == 7 and back.reward == 1.0
    assert back.input_message_log[0] is back.message_log[0]
    assert back.message_log[0]["token_ids"].dtype == torch.int64
    assert back.message_log[0]["token_ids"].tolist() == [1, 2, 3]
    assert back.message_log[1]["generation_logprobs"].dtype == torch.float32
    assert back.message_log[1]["is_invalid_tool_call"] is False
    back.message_log[0]["token_ids"][0] = 9  # writable: copied out of the (read-only) received buffer


def test_the_converted_row_reads_gyms_schema(tiny_tokenizer):
    """Reward, incomplete reason and scalar fields come from Gym's result; a missing or non-finite reward is named."""
    result = _result([_tokens(_message("4"), P1, [52, 2])])
    result["response"]["incomplete_details"] = {"reason": "max_output_tokens"}
    result.update(solved=True, label="text", _private=1.0, instance_config={"mask_sample": True, "k": 1})
    row = convert_gym_result(result, tiny_tokenizer, row_index=3)
    assert row.row_index == 3
    assert row.reward == 1.0 and row.incomplete_reason == "max_output_tokens" and row.token_drift is None
    assert row.metrics == {"reward": 1.0, "solved": 1.0, "_private": 1.0}
    assert row.mask_sample is True and row.full_result["instance_config"] == {"mask_sample": True, "k": 1}
    for reward, needle in [(None, "no 'reward'"), (math.nan, "reward is nan"), ("x", "'x' is not a number")]:
        bad = _result([_tokens(_message("4"), P1, [52, 2])])
        if reward is None:
            del bad["reward"]
        else:
            bad["reward"] = reward
        with pytest.raises(GymResultError, match=needle):
            convert_gym_result(bad, tiny_tokenizer)



_DECODE_TEXT = (
    "<|im_start|>user\nWeather in 東京 and Zürich? 🌧️🌤️ ok.<|im_end|>\n<|im_start|>assistant\n"
    "It's 12°C — drizzle; naïve café ☕ résumé.<|im_end|>\n<|im_start|>user\n🙂 thanks!<|im_end|>\n"
)


def _random_turns(ids: list[int], rng, turns: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cuts = sorted(rng.sample(range(1, len(ids)), 2 * turns - 1))
    bounds = [0, *cuts, len(ids)]
    pieces = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    return pieces[0::2], pieces[1::2]


def _check_decode_turns(tokenizer, users: list[list[int]], gens: list[list[int]]) -> None:
    from gym_bridge.gym.protocol.decode import decode_turns

    prompts, generations = decode_turns(tokenizer, users, gens)
    for k in range(len(users)):
        whole = [t for pair in zip(users[: k + 1], [*gens[:k], []]) for piece in pair for t in piece]
        assert prompts[k] == tokenizer.decode(whole)
        assert generations[k] == tokenizer.decode(gens[k])


def test_decode_turns_equals_whole_prompt_decodes_at_any_split(tiny_tokenizer):
    """Split points inside multi-byte characters (U+FFFD pieces alone) still give the whole prompt's text."""
    import random

    from gym_bridge.gym.protocol.decode import token_bytes_table

    assert token_bytes_table(tiny_tokenizer) is not None  # the fast path is the one under test
    ids = tiny_tokenizer.encode(_DECODE_TEXT * 3, add_special_tokens=False)
    rng = random.Random(0)
    split_chars = 0
    for _ in range(300):
        users, gens = _random_turns(ids, rng, rng.randint(1, 8))
        _check_decode_turns(tiny_tokenizer, users, gens)
        split_chars += any("\ufffd" in tiny_tokenizer.decode(t) for t in users + gens)
    assert split_chars > 0  # some splits did cut a character


def test_decode_turns_equals_the_tokenizer_on_random_ids_of_the_whole_vocabulary(tiny_tokenizer):
    """Any id sequence, special tokens and invalid UTF-8 included, decodes as the tokenizer decodes it."""
    import random

    rng = random.Random(1)
    vocab = len(tiny_tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(2, 80))]
        _check_decode_turns(tiny_tokenizer, *_random_turns(ids, rng, 1))


def test_decode_turns_decodes_whole_prompts_for_other_decoders(tiny_tokenizer):
    """A tokenizer without a byte-level decoder (or with space clean-up), or an id outside the vocabulary,
    gets each prompt decoded whole by the tokenizer."""
    from gym_bridge.gym.protocol.decode import decode_turns, token_bytes_table

    class CleanUp:
        backend_tokenizer = tiny_tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True
        calls: list[list[int]] = []

        def batch_decode(self, seqs):
            self.calls.extend(list(s) for s in seqs)
            return [tiny_tokenizer.decode(s) for s in seqs]

    tok = CleanUp()
    assert token_bytes_table(tok) is None
    prompts, generations = decode_turns(tok, [[1, 2], [5]], [[3, 4], [6]])
    assert tok.calls == [[1, 2], [1, 2, 3, 4, 5], [3, 4], [6]]
    assert prompts == [tiny_tokenizer.decode([1, 2]), tiny_tokenizer.decode([1, 2, 3, 4, 5])]
    assert generations == [tiny_tokenizer.decode([3, 4]), tiny_tokenizer.decode([6])]

    class Calls:
        calls: list[list[int]] = []

        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def batch_decode(self, seqs):
            self.calls.extend(list(s) for s in seqs)
            return tiny_tokenizer.batch_decode(seqs)

    unknown = len(tiny_tokenizer) + 5
    tok = Calls()
    decode_turns(tok, [[1, unknown]], [[3]])
    assert tok.calls == [[1, unknown], [3]]  # left to the tokenizer
