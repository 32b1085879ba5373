"""A generation batch as :class:`~gym_bridge.generation.decode_row.Row`s for
:class:`~gym_bridge.generation.hf.HFGeneration`: checked ids, merged stop strings, per-row sampling and seeds.

Every row's sampling is checked and bounded here, as vLLM's ``SamplingParams`` bounds a request's, so nothing a
caller sends can make the batched token choice of :mod:`~gym_bridge.generation.token_choice` fail for the rows
beside it: a temperature is a finite number >= 0 (one in ``(0, MIN_TEMPERATURE)`` is raised to
:data:`MIN_TEMPERATURE`, vLLM's ``_MAX_TEMP``), ``top_p`` lies in ``(0, 1]``, ``top_k`` is -1, 0 (all tokens) or
positive (at least the vocabulary: all tokens, as vLLM's input batch clamps it), and no bool passes for a number.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Mapping
from typing import Any, SupportsFloat, SupportsIndex

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures.errors import SettingError
from gym_bridge.generation.batch import check_input
from gym_bridge.generation.decode_row import Row
from gym_bridge.generation.hf_config import PER_ROW_SAMPLING_KEYS, HFGenerationConfig, RowSampling
from gym_bridge.types import GenerationDatumSpec


def rows_from_batch(
    data: BatchedDataDict[GenerationDatumSpec],
    greedy: bool,
    cfg: HFGenerationConfig,
    *,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, list[Row]]:
    """The batch's ids and lengths, and one :class:`Row` per input row (a bad id or per-row list is a SettingError)."""
    input_ids, lengths = check_input(data)
    batch = input_ids.shape[0]
    row_stops = data.get("stop_strings")
    if row_stops is not None and len(row_stops) != batch:
        raise SettingError(f"stop_strings has {len(row_stops)} rows, input_ids {batch}")
    if batch and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        # Padding positions may hold anything; check only the real tokens.
        for i in range(batch):
            real = input_ids[i, : int(lengths[i])]
            if int(real.min()) < 0 or int(real.max()) >= vocab_size:
                raise SettingError(f"row {i} holds token ids outside [0, {vocab_size})")
    overrides = {key: data[key] for key in PER_ROW_SAMPLING_KEYS if data.get(key) is not None}
    for key, values in overrides.items():
        if len(values) != batch:
            raise SettingError(f"{key} has {len(values)} rows, input_ids {batch}")
    rows = []
    for i in range(batch):
        stops = list(cfg.stop_strings or [])
        extra = row_stops[i] if row_stops is not None else None
        if isinstance(extra, str):
            extra = [extra]
        for s in extra or []:
            if s and s not in stops:
                stops.append(s)
        sampling = row_sampling(
            cfg, {key: values[i] for key, values in overrides.items()}, row=i, vocab_size=vocab_size
        )
        rows.append(
            Row(
                prompt=input_ids[i, : int(lengths[i])].tolist(),
                stop_strings=tuple(stops),
                greedy=greedy or sampling.greedy,
                sampling=sampling,
                generator=None if sampling.seed is None else _seeded_generator(device, sampling.seed, row=i),
            )
        )
    return input_ids, lengths, rows


#: The lowest sampling temperature: a row asking for less (but more than 0) samples at this one, as vLLM raises a
#: request's temperature to its ``_MAX_TEMP`` (``logits / 1e-300`` overflows to inf and NaN probabilities).
MIN_TEMPERATURE = 1e-2


def row_sampling(
    cfg: HFGenerationConfig, override: Mapping[str, Any], *, row: int, vocab_size: int | None = None
) -> RowSampling:
    """The config's sampling with this row's overrides (None means "use the config"), checked and bounded as
    vLLM bounds a request's (see the module docstring); a value out of bounds is a SettingError naming the row."""
    given = {key: value for key, value in override.items() if value is not None}
    temperature = _real(given.get("temperature", cfg.temperature), "temperature", row=row)
    top_p = _real(given.get("top_p", cfg.top_p), "top_p", row=row)
    top_k = given.get("top_k", cfg.top_k)
    max_new_tokens = _integer(given.get("max_new_tokens", cfg.max_new_tokens), "max_new_tokens", row=row)
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 0:
        raise SettingError(
            f"row {row}: invalid sampling temperature={temperature} top_p={top_p} max_new_tokens={max_new_tokens}"
        )
    return RowSampling(
        temperature=MIN_TEMPERATURE if 0 < temperature < MIN_TEMPERATURE else temperature,
        top_p=top_p,
        top_k=row_top_k(top_k, vocab_size, row=row),
        max_new_tokens=max_new_tokens,
        seed=_row_seed(override.get("seed"), row=row),
    )


def row_top_k(value: object, vocab_size: int | None, *, row: int) -> int | None:
    """A row's ``top_k``: None (every token) for None, 0, -1 or at least ``vocab_size``; below -1 is refused."""
    if value is None:
        return None
    top_k = _integer(value, "top_k", row=row)
    if top_k < -1:
        raise SettingError(f"row {row}: top_k must be -1, 0 (all tokens) or positive, got {top_k}")
    if top_k in (0, -1) or (vocab_size is not None and top_k >= vocab_size):
        return None
    return top_k


def _real(value: object, name: str, *, row: int) -> float:
    """``value`` as a finite float; a bool, a non-number or NaN/inf is a SettingError naming the row and field."""
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, SupportsFloat):
        raise SettingError(f"row {row}: {name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise SettingError(f"row {row}: {name} must be finite, got {number}")
    return number


def _integer(value: object, name: str, *, row: int) -> int:
    """``value`` as an int (numpy ints and integral floats too); a bool or anything else is a SettingError naming the
    row and field."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, bool) and isinstance(value, SupportsIndex):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise SettingError(f"row {row}: {name} must be an int, got {type(value).__name__}")


def _seeded_generator(device: torch.device, seed: int, *, row: int) -> torch.Generator:
    """A row's own generator on the engine's device, seeded as vLLM seeds a request's."""
    generator = torch.Generator(device=device)
    try:
        generator.manual_seed(seed)
    except RuntimeError as exc:
        raise SettingError(f"row {row}: seed {seed} is outside torch's seed range [-2**63, 2**64)") from exc
    return generator


def _row_seed(value: object, *, row: int) -> int | None:
    """A row's ``seed`` as an int (None: unseeded); a bool or a value that is not an integer is refused."""
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, SupportsIndex):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise SettingError(f"row {row}: seed must be an int or None, got {value!r}")


def first_id(*candidates: object, default: int) -> int:
    """The first candidate that is an id, or the first id of a list of them (config eos ids may be lists)."""
    for c in candidates:
        if isinstance(c, int):
            return c
        if isinstance(c, (list, tuple)) and c:
            return int(c[0])
    return default
