"""Each model call's ``prompt_str`` and ``generation_str``, with every token turned into bytes once.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) without space clean-up decodes
ids as UTF-8 over the concatenation of its tokens' bytes (invalid sequences replaced).
So a per-tokenizer table of each token's bytes, checked once against ``tokenizer.decode``
for every id, turns a whole multi-turn row into text with one bytes join per prompt,
instead of decoding every prompt whole (O(turns²) tokens through the tokenizer) or
even once (the tokenizer's decode costs ~0.25 µs per token, a join ~0.03 µs).
Any other tokenizer gets each prompt decoded whole, so the strings always equal
``tokenizer.decode(prompt)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from tokenizers.decoders import ByteLevel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from gym_bridge.types import Tokenizer

_CHAR_BYTES: dict[str, int] = {char: byte for byte, char in bytes_to_unicode().items()}
_TABLES: weakref.WeakKeyDictionary[Tokenizer, list[bytes] | None] = weakref.WeakKeyDictionary()


def decode_turns(
    tokenizer: Tokenizer, user_ids: Sequence[Sequence[int]], generation_ids: Sequence[Sequence[int]]
) -> tuple[list[str], list[str]]:
    """Each model call's ``prompt_str`` (``user_ids[0] + generation_ids[0] + ... + user_ids[k]`` decoded)
    and ``generation_str`` (``generation_ids[k]`` decoded); ids are non-negative ints, as lists."""
    table = token_bytes_table(tokenizer)
    if table is not None:
        try:
            return _decode_by_table(table, user_ids, generation_ids)
        except IndexError:  # an id outside the vocabulary: left to the tokenizer to decode or reject
            pass
    prompts = [[t for piece in _interleave(user_ids[: k + 1], generation_ids[:k]) for t in piece]
               for k in range(len(user_ids))]  # fmt: skip
    return tokenizer.batch_decode(prompts), tokenizer.batch_decode([list(g) for g in generation_ids])


def _decode_by_table(
    table: list[bytes], user_ids: Sequence[Sequence[int]], generation_ids: Sequence[Sequence[int]]
) -> tuple[list[str], list[str]]:
    """:func:`decode_turns` by joining token bytes (ids must be non-negative: the caller checked them)."""
    lookup = table.__getitem__
    prompt_strs: list[str] = []
    generation_strs: list[str] = []
    history: list[bytes] = []
    for k, user in enumerate(user_ids):
        history.append(b"".join(map(lookup, user)))
        prompt_strs.append(b"".join(history).decode("utf-8", "replace"))
        if k < len(generation_ids):
            generation = b"".join(map(lookup, generation_ids[k]))
            generation_strs.append(generation.decode("utf-8", "replace"))
            history.append(generation)
    return prompt_strs, generation_strs


def token_bytes_table(tokenizer: Tokenizer) -> list[bytes] | None:
    """Each token id's bytes for a byte-level tokenizer without clean-up, else None; built once per tokenizer.

    Built from the vocabulary the way the byte-level decoder maps it (a token with a character
    outside the byte alphabet, as an added token may have, stands for its own UTF-8), and
    checked against ``tokenizer.decode`` id by id; any mismatch means None (decode whole), as does a
    tokenizer that cannot be cached (not weak-referenceable).
    """
    try:
        return _TABLES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable, so not cacheable: building per row would cost more than it saves
        return None
    table = _TABLES[tokenizer] = _build_table(tokenizer)
    return table


def _build_table(tokenizer: Tokenizer) -> list[bytes] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or not isinstance(backend.decoder, ByteLevel)
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None:
            return None
        try:
            table.append(bytes(_CHAR_BYTES[char] for char in token))
        except KeyError:
            table.append(token.encode("utf-8"))
    singles = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    if any(text != raw.decode("utf-8", "replace") for text, raw in zip(singles, table, strict=True)):
        return None
    return table


def _interleave[T](first: Sequence[T], second: Sequence[T]) -> list[T]:
    """``first[0], second[0], first[1], ...`` (``second`` may be one shorter)."""
    out: list[T] = []
    for i, piece in enumerate(first):
        out.append(piece)
        if i < len(second):
            out.append(second[i])
    return out
