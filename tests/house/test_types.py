"""The data contracts: field names, positional order, dtypes."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import torch

from gym_bridge import types as T
from gym_bridge.data import datum_from_chat
from gym_bridge.interfaces import RolloutBackend


def test_environment_return_positional_order():
    ret = T.EnvironmentReturn([{"role": "user", "content": "x"}], [None], None, torch.ones(1), torch.ones(1), None)
    observations, metadata, stops, rewards, terminateds, answers = ret
    assert T.EnvironmentReturn._fields == (
        "observations", "metadata", "next_stop_strings", "rewards", "terminateds", "answers"
    )
    assert observations[0]["content"] == "x" and metadata == [None] and stops is None and answers is None
    assert rewards.item() == 1.0 and terminateds.item() == 1.0


def test_completion_and_record_fields_and_pickling():
    # NeMo-RL's four fields in its positional order, then ours (each with a default)
    assert [f.name for f in dataclasses.fields(T.Completion)] == [
        "message_log", "env_extras", "truncated", "reward", "token_drift", "masked", "failure_kind", "incomplete_reason",
        "seed", "agent", "reward_components",
    ]
    assert [f.name for f in dataclasses.fields(T.PromptGroupRecord)] == [
        "prompt_idx", "prompt", "extra_env_info", "metadata", "completions", "rollout_metrics"
    ]
    log = [T.MessageEntry(role="user", content="hi", token_ids=T.token_tensor([1, 2]))]
    record = T.PromptGroupRecord(3, log, None, {"task_name": "t"}, [T.Completion(log, None, False, 1.0)])
    again = pickle.loads(pickle.dumps(record))
    assert again.prompt_idx == 3 and again.rollout_metrics == {}
    assert not again.completions[0].masked and again.completions[0].failure_kind is None
    assert again.completions[0].seed is None
    assert torch.equal(again.completions[0].message_log[0]["token_ids"], log[0]["token_ids"])


def test_token_tensors_are_int64_even_when_empty():
    assert torch.tensor([]).dtype == torch.float32  # the trap the helper exists for
    assert T.token_tensor([]).dtype == torch.int64
    assert T.token_tensor([]).shape == (0,)
    assert T.token_tensor(torch.tensor([[1.0, 2.0]])).tolist() == [1, 2]
    assert T.logprob_tensor([-0.5]).dtype == torch.float32


def test_typed_dict_keys_match_the_reference():
    assert {"message_log", "length", "extra_env_info", "loss_multiplier", "idx", "task_name", "stop_strings"} == set(
        typing.get_type_hints(T.DatumSpec)
    )
    # The reference's keys, plus ours: which policy weights produced each row (NotRequired).
    assert {"output_ids", "generation_lengths", "unpadded_sequence_lengths", "logprobs", "truncated"} | {
        "weight_version"
    } == set(typing.get_type_hints(T.GenerationOutputSpec))
    assert {"input_ids", "input_lengths", "stop_strings"} == set(typing.get_type_hints(T.GenerationDatumSpec))


def test_sampling_params_profiles():
    cfg = T.GenerationConfig(temperature=0.7, top_p=0.9, val_temperature=0.0, val_top_p=1.0)
    assert T.GenerationSamplingParams.from_generation_config(cfg) == T.GenerationSamplingParams(0.7, 0.9, None)
    assert T.GenerationSamplingParams.from_generation_config(cfg, validation=True).temperature == 0.0


def test_datum_from_chat(tiny_tokenizer):
    datum = datum_from_chat(tiny_tokenizer, [{"role": "user", "content": "2+2?"}], idx=5, task_name="math")
    (message,) = datum["message_log"]
    assert message["token_ids"].dtype == torch.int64
    assert datum["length"] == message["token_ids"].numel() > 0
    assert tiny_tokenizer.decode(message["token_ids"].tolist()) == message["content"]
    assert message["content"].endswith("<|im_start|>assistant\n")
    assert datum["idx"] == 5 and datum["task_name"] == "math" and "stop_strings" not in datum


def test_rollout_backend_is_a_runtime_protocol():
    class Backend:
        async def run_rollout(self, datum):
            return None

    assert isinstance(Backend(), RolloutBackend)
    assert not isinstance(object(), RolloutBackend)
