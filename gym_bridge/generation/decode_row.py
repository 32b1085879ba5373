"""A row of :mod:`~gym_bridge.generation.hf_decode`'s decode loop, its result and its failure, and what the loop
needs from the engine (:class:`DecodeContext`): the types the engine, its worker and the loop share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gym_bridge.failures import GymBridgeError
from gym_bridge.generation.hf_config import HFGenerationStats, RowSampling
from gym_bridge.generation.packed_linear import PackedLinears
from gym_bridge.generation.prefix_cache import PrefixCache
from gym_bridge.types import Tokenizer


class RowFailure(GymBridgeError, RuntimeError):
    """One row of a decode batch failed on its own (its token choice or stop check raised, its logprob is NaN, or its
    prefill raised); it left the batch and the rows beside it go on."""


@dataclass
class RowResult:
    """What one row produced, and with which weights."""

    tokens: list[int]
    logprobs: list[float]
    truncated: bool
    weight_version: int


@dataclass(eq=False)
class Row:
    """One row to decode; ``deliver`` (worker path) receives a RowResult or an exception."""

    prompt: list[int]
    stop_strings: tuple[str, ...]
    greedy: bool
    sampling: RowSampling
    deliver: Callable[[RowResult | BaseException], None] | None = None
    generator: torch.Generator | None = None  # a seeded row's own generator (see token_choice.pick_tokens)
    cancelled: bool = False
    result: RowResult | None = None
    failure: RowFailure | None = None  # why the row left the batch unfinished (see RowFailure)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cap: int = 0
    window: int = 0
    kv_start: int = 0  # the batch cache column of the row's first token
    kv_blocks: tuple[torch.Tensor, ...] = ()  # prefix-cache blocks the row's first columns are copies of, bit for bit


@dataclass
class DecodeContext:
    """What decoding needs from the engine: the model and how rows stop."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    device: torch.device
    pad_token_id: int
    stop_token_ids: frozenset[int]
    max_model_len: int
    generator: torch.Generator
    stats: HFGenerationStats
    logits_to_keep: bool
    is_closed: Callable[[], bool]
    prefix_cache: PrefixCache | None = None
    growing_kv_cache: bool = True  # False: transformers' DynamicCache (the reference for tests and benchmarks)
    shared_prefix: bool = False  # decode steps attend to a prefix shared by several rows once (cascade_attention.py)
    packed: PackedLinears | None = None  # the linear layers' oneDNN-packed weights (packed_linear.py)
