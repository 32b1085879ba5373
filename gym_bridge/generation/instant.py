"""``InstantGeneration``: a fixed answer with no model, so a benchmark measures only the plumbing around it.

Every row gets the same reply: ``answer_tokens - 1`` filler tokens (the tokenizer's
ids of ``filler``, repeated; ``" the"`` is one token in BPE vocabularies, so the
reply decodes and re-encodes to the same ids) and the EOS token, each with the
logprob :data:`INSTANT_LOGPROB`. Nothing depends on the prompt, so the cost per
row is building the output tensors. ``max_new_tokens`` (per row when the batch
carries it) and ``max_model_len`` cut the reply like
:class:`~gym_bridge.generation.scripted.ScriptedGeneration` does, and a cut sets
``truncated``. Stop strings are not applied: the filler is meant not to contain any.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.batch import assemble_output, check_input
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.types import GenerationDatumSpec, GenerationOutputSpec

INSTANT_LOGPROB = math.log(0.5)
_NO_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class InstantRow:
    """One reply; every token's logprob is :data:`INSTANT_LOGPROB`."""

    tokens: list[int]
    truncated: bool

    @property
    def logprobs(self) -> list[float]:
        return [INSTANT_LOGPROB] * len(self.tokens)


class InstantGeneration(GenerationInterface):
    """A generation engine that answers every prompt at once with the same fixed tokens."""

    #: The serving layer may send any temperature / top_p: this engine ignores them.
    supports_per_request_sampling = True

    def __init__(
        self,
        tokenizer: Any,
        answer_tokens: int = 16,
        *,
        filler: str = " the",
        max_new_tokens: int = 256,
        max_model_len: int | None = None,
    ) -> None:
        if answer_tokens < 1:
            raise ValueError(f"answer_tokens must be >= 1 (the EOS token), got {answer_tokens}")
        if tokenizer.eos_token_id is None:
            raise ValueError("InstantGeneration needs a tokenizer with an EOS token")
        filler_ids = list(tokenizer.encode(filler, add_special_tokens=False))
        if not filler_ids:
            raise ValueError(f"the filler {filler!r} encodes to no tokens")
        body = [filler_ids[i % len(filler_ids)] for i in range(answer_tokens - 1)]
        self.answer: tuple[int, ...] = (*body, int(tokenizer.eos_token_id))
        self.max_new_tokens = max_new_tokens
        length = max_model_len or getattr(tokenizer, "model_max_length", None)
        self.max_model_len = int(length) if isinstance(length, int) and 0 < length < _NO_LIMIT else _NO_LIMIT
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.calls = 0

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        input_ids, lengths = check_input(data)
        caps = self._caps(data, input_ids.shape[0])
        self.calls += 1
        rows = [self.reply(int(lengths[i]), caps[i]) for i in range(input_ids.shape[0])]
        return assemble_output(input_ids, lengths, rows, self.pad_token_id)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        input_ids, lengths = check_input(data)
        caps = self._caps(data, input_ids.shape[0])
        self.calls += 1
        for i in range(input_ids.shape[0]):
            await asyncio.sleep(0)
            row = self.reply(int(lengths[i]), caps[i])
            yield i, assemble_output(input_ids[i : i + 1], lengths[i : i + 1], [row], self.pad_token_id)

    def reply(self, prompt_len: int, max_new_tokens: int) -> InstantRow:
        """The answer for a prompt of ``prompt_len`` tokens, cut to the token budget."""
        cap = max(0, min(max_new_tokens, self.max_model_len - prompt_len))
        if len(self.answer) > cap:
            return InstantRow(list(self.answer[:cap]), True)
        return InstantRow(list(self.answer), False)

    def _caps(self, data: Mapping[str, Any], batch: int) -> list[int]:
        """Per-row ``max_new_tokens`` when the batch carries it, else the configured one."""
        given = data.get("max_new_tokens") or [None] * batch
        return [self.max_new_tokens if cap is None else int(cap) for cap in given]
