from __future__ import annotations

import pickle

import pytest
import torch

from gym_bridge.batched import (
    BatchedDataDict,
    BatchShapeError,
    batched_message_log_to_flat_message,
    get_keys_from_message_log,
    message_log_to_flat_messages,
)
from gym_bridge.failures import SettingError
from gym_bridge.types import GenerationOutputSpec, token_tensor


def _batch() -> BatchedDataDict:
    return BatchedDataDict(
        {
            "ids": torch.tensor([[1, 2], [3, 4], [5, 6]]),
            "logs": [[{"role": "user"}], [{"role": "assistant"}], [{"role": "tool"}]],
        }
    )


def test_generic_alias_constructs_a_batched_data_dict():
    data = BatchedDataDict[GenerationOutputSpec]({"output_ids": torch.zeros(2, 3)})
    assert isinstance(data, BatchedDataDict)
    assert data.size == 2


def test_size_reads_the_first_key_and_is_zero_when_empty():
    assert BatchedDataDict().size == 0
    assert BatchedDataDict({"a": [1, 2, 3], "b": torch.zeros(5)}).size == 3
    assert BatchedDataDict({"b": torch.zeros(5, 2), "a": [1]}).size == 5


def test_copy_is_shallow():
    batch = _batch()
    clone = batch.copy()
    assert type(clone) is BatchedDataDict
    assert clone is not batch
    assert clone["logs"] is batch["logs"]
    assert clone["ids"] is batch["ids"]
    clone["new"] = [0, 0, 0]
    assert "new" not in batch


def test_select_indices_shares_list_elements_and_indexes_tensors():
    batch = _batch()
    picked = batch.select_indices([2, 0])
    assert picked["ids"].tolist() == [[5, 6], [1, 2]]
    assert picked["logs"][0] is batch["logs"][2]
    assert picked["logs"][1] is batch["logs"][0]
    # Appending through the selection is visible in the original: the sync rollout relies on it.
    picked["logs"][0].append({"role": "user"})
    assert len(batch["logs"][2]) == 2


def test_select_indices_accepts_an_index_tensor_and_rejects_a_float_one():
    batch = _batch()
    assert batch.select_indices(torch.tensor([1]))["ids"].tolist() == [[3, 4]]
    assert batch.select_indices([])["ids"].shape == (0, 2)
    with pytest.raises(TypeError, match="integer"):
        batch.select_indices(torch.tensor([1.0]))


def test_slice_is_half_open_and_checks_bounds():
    batch = _batch()
    part = batch.slice(1, 3)
    assert part["ids"].tolist() == [[3, 4], [5, 6]]
    assert part["logs"][0] is batch["logs"][1]
    assert batch.slice(1, 1).size == 0
    with pytest.raises(SettingError, match="'ids'"):
        batch.slice(0, 4)
    with pytest.raises(SettingError, match="'logs'"):
        BatchedDataDict({"logs": [1, 2]}).slice(0, 3)


def test_unsupported_value_type_is_named():
    with pytest.raises(TypeError, match="'x'"):
        BatchedDataDict({"x": 3}).size


def test_repeat_interleave_repeats_rows_consecutively_and_deep_copies_lists():
    batch = _batch()
    rep = batch.repeat_interleave(2)
    assert rep["ids"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert [log[0]["role"] for log in rep["logs"]] == ["user", "user", "assistant", "assistant", "tool", "tool"]
    assert rep["logs"][0] == batch["logs"][0]
    assert rep["logs"][0] is not batch["logs"][0]
    assert rep["logs"][0] is not rep["logs"][1]
    rep["logs"][0].append({"role": "x"})
    assert len(rep["logs"][1]) == 1 and len(batch["logs"][0]) == 1
    with pytest.raises(SettingError, match="num_repeats must be a positive int, got 0"):
        batch.repeat_interleave(0)


def test_from_batches_concatenates_lists_and_1d_tensors_with_sorted_keys():
    a = {"z": [1, 2], "r": torch.tensor([0.5, 1.5])}
    b = {"r": torch.tensor([2.5]), "z": [3]}
    out = BatchedDataDict.from_batches([a, b])
    assert list(out) == ["r", "z"]
    assert out["z"] == [1, 2, 3]
    assert out["r"].tolist() == [0.5, 1.5, 2.5]


def test_from_batches_right_pads_2d_tensors_with_the_key_pad_value():
    a = {"ids": torch.tensor([[1, 2, 3]]), "mask": torch.tensor([[1, 1, 1]])}
    b = {"ids": torch.tensor([[4], [5]]), "mask": torch.tensor([[1], [1]])}
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": 99})
    assert out["ids"].tolist() == [[1, 2, 3], [4, 99, 99], [5, 99, 99]]
    assert out["mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]


def test_from_batches_pads_3d_tensors_along_dim_1():
    a = {"topk": torch.ones(1, 3, 2)}
    b = {"topk": torch.ones(2, 1, 2)}
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"topk": -1.0})
    assert out["topk"].shape == (3, 3, 2)
    assert out["topk"][1, 1:].eq(-1).all() and out["topk"][1, 0].eq(1).all()


def test_from_batches_missing_key_in_a_non_empty_batch_raises_key_error():
    with pytest.raises(KeyError, match="'b'"):
        BatchedDataDict.from_batches([{"a": [1], "b": [2]}, {"a": [3]}])


def test_from_batches_skips_empty_batches():
    out = BatchedDataDict.from_batches([{}, {"a": [1]}, BatchedDataDict({"a": [], "other": []})])
    assert dict(out) == {"a": [1]}
    assert BatchedDataDict.from_batches([]).size == 0


def test_from_batches_rejects_mixed_types_and_dtypes():
    with pytest.raises(TypeError, match="'a'"):
        BatchedDataDict.from_batches([{"a": [1]}, {"a": torch.tensor([2])}])
    with pytest.raises(TypeError, match="'a'"):
        BatchedDataDict.from_batches([{"a": torch.tensor([1])}, {"a": torch.tensor([2.0])}])


def test_to_moves_tensors_in_place():
    batch = _batch()
    assert batch.to("cpu") is batch
    assert batch["ids"].device.type == "cpu"


def test_pickles():
    batch = _batch()
    restored = pickle.loads(pickle.dumps(batch))
    assert isinstance(restored, BatchedDataDict)
    assert restored["ids"].equal(batch["ids"]) and restored["logs"] == batch["logs"]


def test_get_keys_from_message_log_keeps_only_present_listed_keys():
    log = [
        {"role": "user", "content": "hi", "token_ids": token_tensor([1])},
        {"role": "assistant", "token_ids": token_tensor([2])},
    ]
    out = get_keys_from_message_log(log, ["role", "content"])
    assert out == [{"role": "user", "content": "hi"}, {"role": "assistant"}]
    assert out[0] is not log[0]
    assert "token_ids" in log[0]


def test_message_log_to_flat_messages_concatenates_only_messages_with_the_key():
    log = [
        {"role": "user", "content": "q", "token_ids": token_tensor([1, 2])},
        {
            "role": "assistant",
            "content": "a",
            "token_ids": token_tensor([3]),
            "generation_logprobs": torch.tensor([-0.5]),
        },
    ]
    flat = message_log_to_flat_messages(log)
    assert flat["token_ids"].tolist() == [1, 2, 3]
    assert flat["generation_logprobs"].tolist() == [-0.5]
    assert flat["role"] == ["user", "assistant"]
    assert flat["content"] == ["q", "a"]


def test_empty_token_ids_stay_int64():
    flat = message_log_to_flat_messages([{"token_ids": token_tensor([])}])
    assert flat["token_ids"].dtype == torch.int64
    # An empty float tensor (torch.tensor([]) is float32) must not promote int64 ids to float.
    flat = message_log_to_flat_messages([{"token_ids": token_tensor([7])}, {"token_ids": torch.tensor([])}])
    assert flat["token_ids"].dtype == torch.int64 and flat["token_ids"].tolist() == [7]
    assert message_log_to_flat_messages([]) == {}


def test_message_log_to_flat_messages_rejects_mixed_non_empty_dtypes():
    with pytest.raises(BatchShapeError, match="'token_ids'"):
        message_log_to_flat_messages([{"token_ids": token_tensor([1])}, {"token_ids": torch.tensor([2.0])}])


def test_batched_flatten_pads_stacks_and_reports_lengths():
    batch = [
        [
            {"role": "user", "content": "What is 2+2?", "token_ids": token_tensor([1, 2, 3, 4, 5])},
            {"role": "assistant", "content": "4", "token_ids": token_tensor([6, 7])},
        ],
        [
            {"role": "user", "content": "x+10=15", "token_ids": token_tensor([1, 8, 9, 10, 11, 12])},
            {"role": "assistant", "content": "x=5", "token_ids": token_tensor([13, 14, 15])},
        ],
    ]
    flat, lengths = batched_message_log_to_flat_message(batch, pad_value_dict={"token_ids": -1})
    assert flat["token_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, -1, -1], [1, 8, 9, 10, 11, 12, 13, 14, 15]]
    assert flat["token_ids"].dtype == torch.int64
    assert flat["role"] == [["user", "assistant"], ["user", "assistant"]]
    assert flat["content"][1] == ["x+10=15", "x=5"]
    assert lengths.dtype == torch.int32 and lengths.tolist() == [7, 9]


def test_batched_flatten_rounds_length_up_to_the_divisor():
    batch = [[{"token_ids": token_tensor([1, 2, 3])}], [{"token_ids": token_tensor([4])}]]
    flat, lengths = batched_message_log_to_flat_message(batch, make_sequence_length_divisible_by=4)
    assert flat["token_ids"].shape == (2, 4)
    assert lengths.tolist() == [3, 1]
    flat, _ = batched_message_log_to_flat_message(batch, make_sequence_length_divisible_by=3)
    assert flat["token_ids"].shape == (2, 3)


def test_batched_flatten_fills_missing_tensor_keys_with_same_dtype():
    batch = [
        [
            {"role": "user", "token_ids": token_tensor([1, 2])},
            {"role": "assistant", "token_ids": token_tensor([3]), "generation_logprobs": torch.tensor([-1.0])},
        ],
        [{"role": "user", "token_ids": token_tensor([4, 5, 6])}],
    ]
    flat, lengths = batched_message_log_to_flat_message(batch)
    assert flat["generation_logprobs"].dtype == torch.float32
    assert flat["generation_logprobs"].tolist() == [[-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert lengths.tolist() == [3, 3]


def test_batched_flatten_missing_key_in_the_first_sample_is_still_a_tensor():
    batch = [
        [{"token_ids": token_tensor([1])}],
        [{"token_ids": token_tensor([2]), "token_loss_mask": torch.tensor([1], dtype=torch.bool)}],
    ]
    flat, _ = batched_message_log_to_flat_message(batch)
    assert flat["token_loss_mask"].tolist() == [[False], [True]]


def test_batched_flatten_dtype_mismatch_names_the_key():
    batch = [
        [{"token_ids": token_tensor([1]), "logprobs": torch.tensor([0.1], dtype=torch.float32)}],
        [{"token_ids": token_tensor([2]), "logprobs": torch.tensor([0.2], dtype=torch.float64)}],
    ]
    with pytest.raises(BatchShapeError, match="'logprobs'") as info:
        batched_message_log_to_flat_message(batch)
    assert isinstance(info.value, RuntimeError)  # what torch raises where NeMo-RL lets it
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)


def test_batched_flatten_empty_batch_and_no_tensor_keys():
    flat, lengths = batched_message_log_to_flat_message([])
    assert len(flat) == 0 and lengths.numel() == 0
    flat, lengths = batched_message_log_to_flat_message(
        [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [{"role": "user"}]]
    )
    assert flat["role"] == ["user", "user"]
    assert flat["content"] == ["a", None]
    assert lengths.numel() == 0
