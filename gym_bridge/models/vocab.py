"""A tokenizer's vocabulary size, read one way by the engines, the server and Gym's model server (no torch)."""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING

from gym_bridge.failures import SettingError

if TYPE_CHECKING:  # gym_bridge.types imports torch, which the Gym model server does without
    from gym_bridge.types import Tokenizer


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """``len(tokenizer)``: its vocabulary with added tokens, which every Hugging Face tokenizer reports."""
    if not isinstance(tokenizer, Sized):
        raise SettingError(f"the tokenizer {type(tokenizer).__name__} has no len(), so its vocabulary size is unknown")
    return len(tokenizer)
