"""Loading a local transformers causal LM and its tokenizer (a folder, or ``"tiny"``)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from gym_bridge.models.tiny import resolve_model_path

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(name_or_path: str, dtype: DType = "float32") -> tuple[Any, Any]:
    """``(tokenizer, model)`` from a local folder; ``"tiny"`` builds the embedded tiny model first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
