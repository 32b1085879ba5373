"""Each model call's ``prompt_str`` and ``generation_str``, decoding every token once where that is exact."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tokenizers.decoders import ByteLevel

__all__ = ["decode_turns"]

_REPLACEMENT_CHAR = "\ufffd"


def decode_turns(
    tokenizer: Any, user_ids: Sequence[torch.Tensor], generation_ids: Sequence[torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Each model call's ``prompt_str`` (its whole prompt decoded) and ``generation_str``.

    Turn k's prompt is ``user_ids[0] + generation_ids[0] + ... + user_ids[k]``, so
    decoding every prompt whole costs O(turns²) tokens. With a byte-level decoder and
    no space clean-up (GPT-2, Llama 3, Qwen, SmolLM2), decoding is UTF-8 over the
    concatenated token bytes, so a prompt's text is the concatenation of its pieces'
    texts wherever the earlier pieces end on a character boundary, which holds when
    their texts contain no U+FFFD (a split character decodes to one). Each token is
    then decoded once; a prompt that fails that test, or any other tokenizer, is
    decoded whole, so the strings always equal ``tokenizer.decode(prompt)``.
    """
    # Tensors, not lists: transformers checks a list's every element in Python before decoding it.
    if not _decodes_by_concatenation(tokenizer):
        prompts = [torch.cat(_interleave(user_ids[: k + 1], generation_ids[:k])) for k in range(len(user_ids))]
        return tokenizer.batch_decode(prompts), tokenizer.batch_decode(list(generation_ids))
    # What transformers' decode does for a fast tokenizer without clean-up, minus its per-call overhead.
    pieces = tokenizer.backend_tokenizer.decode_batch(
        [t.tolist() for t in _interleave(user_ids, generation_ids)], skip_special_tokens=False
    )
    user_strs, generation_strs = pieces[0::2], pieces[1::2]
    prompt_strs: list[str] = []
    whole: list[int] = []
    text = ""
    on_boundary = True
    for k, (user_str, generation_str) in enumerate(zip(user_strs, generation_strs, strict=True)):
        if on_boundary:
            prompt_strs.append(text + user_str)
        else:
            prompt_strs.append("")
            whole.append(k)
        on_boundary = on_boundary and _REPLACEMENT_CHAR not in user_str and _REPLACEMENT_CHAR not in generation_str
        text = text + user_str + generation_str
    if whole:
        prompts = [torch.cat(_interleave(user_ids[: k + 1], generation_ids[:k])) for k in whole]
        for k, prompt_str in zip(whole, tokenizer.batch_decode(prompts), strict=True):
            prompt_strs[k] = prompt_str
    return prompt_strs, generation_strs


def _interleave(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``first[0], second[0], first[1], ...`` (``second`` may be one shorter)."""
    out: list[torch.Tensor] = []
    for i, tensor in enumerate(first):
        out.append(tensor)
        if i < len(second):
            out.append(second[i])
    return out


def _decodes_by_concatenation(tokenizer: Any) -> bool:
    """Whether ``decode(a + b) == decode(a) + decode(b)`` when ``a`` ends on a character boundary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (
        backend is not None
        and isinstance(backend.decoder, ByteLevel)
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )
