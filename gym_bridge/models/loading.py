"""Loading a local transformers causal LM and its tokenizer.

The model is a folder, or a built-in name: ``"tiny"``, ``"smollm2"``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from gym_bridge.failures import GymBridgeError, SettingError
from gym_bridge.models.registry import resolve_model_path


class ModelLoadError(GymBridgeError, OSError):
    """A local folder that transformers cannot load as a causal LM and its tokenizer."""


DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(name_or_path: str, dtype: DType = "float32") -> tuple[Any, Any]:
    """``(tokenizer, model)`` from a local folder; a built-in name builds that model first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load a causal LM and its tokenizer from {path}: {first}") from exc


def causal_lm_on_device(
    name_or_path: str, dtype: DType, device: str, *, model: Any = None, tokenizer: Any = None
) -> tuple[Any, Any]:
    """``(tokenizer, model)`` in eval mode on ``device``: the given pair, or loaded from ``name_or_path``."""
    if (model is None) != (tokenizer is None):
        raise SettingError("causal_lm_on_device: pass both model and tokenizer, or neither")
    if model is None:
        tokenizer, model = load_causal_lm(name_or_path, dtype)
    model = model.to(torch.device(device))
    model.eval()
    return tokenizer, model
