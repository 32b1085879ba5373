"""``BatchedDataDict`` and the message-log flattening helpers.

Behaviour follows NeMo-RL's ``BatchedDataDict`` and ``llm_message_utils`` where a
training loop relies on it (shallow ``copy``, shared list elements in
``select_indices``, padding in ``from_batches``). Text only: NeMo-RL's
``PackedTensor`` (multimodal) keys are not supported.

Differences, each raising where NeMo-RL silently produced something odd:

- ``slice`` checks bounds for list values too, not only tensors.
- ``from_batches`` takes the sorted union of keys; a key missing from a non-empty
  batch raises ``KeyError``, mixed tensor dtypes raise ``TypeError``.
- Flattening never lets an empty tensor change a key's dtype, so an empty
  ``token_ids`` stays int64; non-empty tensors of different dtypes raise.
- Lengths returned by ``batched_message_log_to_flat_message`` are int32 even when
  empty.
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch

from gym_bridge.failures.errors import GymBridgeError, SettingError

IndicesType = Sequence[int] | torch.Tensor


class BatchShapeError(GymBridgeError, RuntimeError):
    """Tensors of one key that cannot be joined: their shapes, dtypes or devices differ (the message names the key).

    A ``RuntimeError``, as the torch operation it stands in for raises."""


def _length(key: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise TypeError(f"key {key!r} holds a 0-d tensor, which has no batch dimension")
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    raise TypeError(f"key {key!r} holds a {type(value).__name__}; expected a tensor or a list")


def _mapping_size(mapping: Mapping[str, object]) -> int:
    for key, value in mapping.items():
        return _length(key, value)
    return 0


def _as_index_list(indices: IndicesType) -> list[int]:
    if isinstance(indices, torch.Tensor):
        if indices.ndim != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
            shape = tuple(indices.shape)
            raise TypeError(f"indices must be a 1-D integer tensor, got {indices.dtype} with shape {shape}")
        return [int(i) for i in indices.tolist()]
    return [int(i) for i in indices]


def _pad_dim1(tensor: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """Right-pad a [B, S, ...] tensor along dim 1 to ``length``."""
    if tensor.shape[1] == length:
        return tensor
    padded = tensor.new_full((tensor.shape[0], length, *tensor.shape[2:]), value)
    padded[:, : tensor.shape[1]] = tensor
    return padded


def _pad_dim0(tensor: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """Right-pad a [S, ...] tensor along dim 0 to ``length``."""
    if tensor.shape[0] == length:
        return tensor
    padded = tensor.new_full((length, *tensor.shape[1:]), value)
    padded[: tensor.shape[0]] = tensor
    return padded


class BatchedDataDict[DictT: Mapping[str, object]](UserDict[str, Any]):
    """A dict of per-sample columns: tensors with the batch on dim 0, or lists.

    ``DictT`` names the TypedDict the keys follow, for annotations only:
    ``BatchedDataDict[GenerationOutputSpec]``.
    """

    @property
    def size(self) -> int:
        """Number of samples, read from the first key's value; 0 when empty."""
        return _mapping_size(self.data)

    def copy(self) -> Self:
        """A shallow copy: a new dict holding the same tensors and lists."""
        return type(self)(self.data)

    def get_dict(self) -> dict[str, Any]:
        """The underlying plain dict (not a copy)."""
        return self.data

    def to(self, device: str | torch.device) -> Self:
        """Move every tensor to ``device`` in place and return ``self``."""
        for key, value in self.data.items():
            if isinstance(value, torch.Tensor):
                self.data[key] = value.to(device)
        return self

    def select_indices(self, indices: IndicesType) -> Self:
        """Rows ``indices`` of every column; list columns keep the same element objects.

        The rollout appends to message logs in place through a selection, so list
        elements are shared, never copied.
        """
        idx = _as_index_list(indices)
        out = type(self)()
        for key, value in self.data.items():
            _length(key, value)
            if isinstance(value, torch.Tensor):
                out[key] = value[torch.tensor(idx, dtype=torch.long, device=value.device)]
            else:
                out[key] = [value[i] for i in idx]
        return out

    def slice(self, start: int, end: int) -> Self:
        """Rows ``start`` (inclusive) to ``end`` (exclusive) of every column."""
        out = type(self)()
        for key, value in self.data.items():
            n = _length(key, value)
            if not 0 <= start <= end <= n:
                raise SettingError(f"slice({start}, {end}) is out of range for key {key!r} with {n} rows")
            out[key] = value[start:end]
        return out

    def repeat_interleave(self, num_repeats: int) -> Self:
        """Repeat each row ``num_repeats`` times in place order: rows a, b → a, a, b, b.

        Tensors use ``repeat_interleave(dim=0)``; list items are deep-copied so that
        repeated message logs can be extended independently.
        """
        if isinstance(num_repeats, bool) or not isinstance(num_repeats, int) or num_repeats < 1:
            raise SettingError(f"num_repeats must be a positive int, got {num_repeats!r}")
        out = type(self)()
        for key, value in self.data.items():
            _length(key, value)
            if isinstance(value, torch.Tensor):
                out[key] = value.repeat_interleave(num_repeats, dim=0)
            else:
                out[key] = [copy.deepcopy(item) for item in value for _ in range(num_repeats)]
        return out

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, object]],
        pad_value_dict: Mapping[str, int | float] | None = None,
    ) -> Self:
        """Concatenate batches along the batch dimension.

        Keys are the sorted union over the non-empty batches; a key missing from one
        of them raises ``KeyError``. Empty batches (no keys or zero rows) are skipped.
        Lists are concatenated; 1-D tensors concatenated; tensors of 2 or more
        dimensions are right-padded along dim 1 with ``pad_value_dict[key]``
        (default 0) to the longest, then concatenated.
        """
        pad_value_dict = pad_value_dict or {}
        non_empty = [b for b in batches if _mapping_size(b) > 0]
        keys = sorted({key for batch in non_empty for key in batch})
        out = cls()
        for key in keys:
            for i, batch in enumerate(non_empty):
                if key not in batch:
                    raise KeyError(f"key {key!r} is missing from batch {i} of {len(non_empty)} non-empty batches")
            values = [batch[key] for batch in non_empty]
            out[key] = _concat_column(key, values, pad_value_dict.get(key, 0))
        return out


def _concat_column(key: str, columns: list[object], pad_value: float) -> torch.Tensor | list[object]:
    if all(isinstance(v, (list, tuple)) for v in columns):
        return [item for v in columns if isinstance(v, (list, tuple)) for item in v]
    values = [v for v in columns if isinstance(v, torch.Tensor)]
    if len(values) != len(columns):
        kinds = sorted({type(v).__name__ for v in columns})
        raise TypeError(f"key {key!r} mixes value types across batches: {kinds}")
    ndims = {v.ndim for v in values}
    if len(ndims) != 1 or 0 in ndims:
        raise SettingError(f"key {key!r} has tensors of different or zero rank across batches: {sorted(ndims)}")
    dtypes = {v.dtype for v in values}
    if len(dtypes) != 1:
        raise TypeError(f"key {key!r} has tensors of different dtypes across batches: {sorted(map(str, dtypes))}")
    if ndims == {1}:
        return torch.cat(values)
    longest = max(v.shape[1] for v in values)
    try:
        return torch.cat([_pad_dim1(v, longest, pad_value) for v in values])
    except RuntimeError as exc:
        raise BatchShapeError(f"cannot concatenate key {key!r}: {exc}") from exc


def get_keys_from_message_log(
    message_log: Sequence[Mapping[str, object]], keys: Sequence[str]
) -> list[dict[str, object]]:
    """New message dicts holding only the listed keys each message has (e.g. role/content for an environment)."""
    return [{k: msg[k] for k in keys if k in msg} for msg in message_log]


def _concat_message_tensors(key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    if any(t.ndim == 0 for t in tensors):
        raise BatchShapeError(f"key {key!r} holds a 0-d tensor in a message; expected a sequence")
    if len({t.shape[1:] for t in tensors}) != 1:
        raise BatchShapeError(f"key {key!r} has messages of incompatible shapes: {[tuple(t.shape) for t in tensors]}")
    if len({t.device for t in tensors}) != 1:
        raise BatchShapeError(
            f"key {key!r} has tensors on different devices: {sorted({str(t.device) for t in tensors})}"
        )
    # An empty tensor contributes no values, so it must not decide (or promote) the dtype.
    dtypes = {t.dtype for t in tensors if t.numel() > 0}
    if len(dtypes) > 1:
        raise BatchShapeError(f"key {key!r} has messages of different dtypes: {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else tensors[0].dtype
    return torch.cat([t.to(dtype) for t in tensors])


def message_log_to_flat_messages(message_log: Sequence[Mapping[str, object]]) -> dict[str, torch.Tensor | list[object]]:
    """Flatten one message log into one value per key.

    Tensor keys are concatenated along dim 0 over the messages that have the key
    (e.g. ``generation_logprobs`` may cover only assistant messages); other keys
    become lists of the per-message values.
    """
    collected: dict[str, list[object]] = {}
    for msg in message_log:
        for key, value in msg.items():
            collected.setdefault(key, []).append(value)
    flat: dict[str, torch.Tensor | list[object]] = {}
    for key, values in collected.items():
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if len(tensors) == len(values):
            flat[key] = _concat_message_tensors(key, tensors)
        elif tensors:
            raise TypeError(f"key {key!r} is a tensor in some messages and not in others")
        else:
            flat[key] = values
    return flat


def batched_message_log_to_flat_message(
    message_log_batch: Sequence[Sequence[Mapping[str, object]]],
    pad_value_dict: Mapping[str, int | float] | None = None,
    make_sequence_length_divisible_by: int = 1,
) -> tuple[BatchedDataDict[Any], torch.Tensor]:
    """Flatten and right-pad a batch of message logs into ``([B, L] columns, lengths)``.

    - ``L`` is the longest flattened tensor over all keys and samples, rounded up
      to a multiple of ``make_sequence_length_divisible_by``.
    - ``lengths[i]`` (int32) is the longest tensor among sample ``i``'s keys.
    - A sample lacking a tensor key gets a zero-length tensor of that key's dtype;
      every tensor is right-padded with ``pad_value_dict[key]`` (default 0).
      Different dtypes or devices across samples raise :class:`BatchShapeError` (a ``RuntimeError``) naming
      the key.
    - Non-tensor keys become one list per sample (``None`` for a sample lacking it).
    - With no tensor keys at all, each key holds the first value per sample and
      ``lengths`` is empty. An empty batch gives an empty dict and empty lengths.

    Text only: NeMo-RL's ``PackedTensor`` (multimodal) values are not supported.
    """
    if make_sequence_length_divisible_by < 1:
        raise SettingError(f"make_sequence_length_divisible_by must be >= 1, got {make_sequence_length_divisible_by}")
    pad_value_dict = pad_value_dict or {}
    empty_lengths = torch.empty(0, dtype=torch.int32)
    if not message_log_batch:
        return BatchedDataDict(), empty_lengths

    flats = [message_log_to_flat_messages(log) for log in message_log_batch]
    keys = list(dict.fromkeys(key for flat in flats for key in flat))
    tensor_keys = [k for k in keys if any(isinstance(flat.get(k), torch.Tensor) for flat in flats)]

    if not tensor_keys:
        first_values = {k: [flat[k][0] if k in flat else None for flat in flats] for k in keys}
        return BatchedDataDict(first_values), empty_lengths

    sample_lengths = [
        max((int(v.shape[0]) for v in flat.values() if isinstance(v, torch.Tensor)), default=0) for flat in flats
    ]
    max_len = max(sample_lengths)
    divisor = make_sequence_length_divisible_by
    max_len = -(-max_len // divisor) * divisor

    result: BatchedDataDict[Any] = BatchedDataDict()
    for key in keys:
        values = [flat.get(key) for flat in flats]
        if key not in tensor_keys:
            result[key] = values
            continue
        if any(v is not None and not isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"key {key!r} is a tensor in some samples and not in others")
        present = [v for v in values if isinstance(v, torch.Tensor)]
        for attr in ("dtype", "device"):
            seen = [str(getattr(t, attr)) for t in present]
            if len(set(seen)) > 1:
                raise BatchShapeError(f"key {key!r}: expected one {attr} across samples, got {seen}")
        template = present[0]
        filled = [v if isinstance(v, torch.Tensor) else template.new_zeros((0, *template.shape[1:])) for v in values]
        pad_value = pad_value_dict.get(key, 0)
        try:
            result[key] = torch.stack([_pad_dim0(t, max_len, pad_value) for t in filled])
        except RuntimeError as exc:
            raise BatchShapeError(f"cannot stack key {key!r}: {exc}") from exc
    return result, torch.tensor(sample_lengths, dtype=torch.int32)
