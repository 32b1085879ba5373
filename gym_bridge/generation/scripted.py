"""``ScriptedGeneration``: a deterministic, rule-based policy that speaks through a real tokenizer.

It reads the prompt back as text (a ChatML render, as the Hermes/Qwen templates
produce) and answers by rule:

(a) tools are offered (``<tools>`` in the system turn) and no ``<tool_response>``
    follows the last user message → one Hermes tool call to the first tool, whose
    first required string parameter (else the first parameter) gets the last word
    of the user message;
(b) the last user message contains ``Reply with exactly: X`` → ``X``;
(c) otherwise → ``default_reply``.

With ``think=True`` every reply starts with a short ``<think>…</think>`` block.
The reply is encoded with the tokenizer and ends with its EOS token. Every
generated token gets the logprob ``log(0.5)`` (a fixed, documented stand-in).
Stop strings and ``max_new_tokens`` / ``max_model_len`` cut the reply at token
granularity like :class:`~gym_bridge.generation.hf.HFGeneration` (the token that
completes a stop string is kept; a cut by the cap sets ``truncated``).

The context is ``max_model_len``, else the tokenizer's ``model_max_length`` (2,048 for the
tiny tokenizer, 8,192 for SmolLM2's), which our server also reads as its own: a prompt
longer than that is refused as vLLM refuses it (HTTP 400), and a Gym row gets an empty,
cut turn (docs/nemo_gym.md, the ``gym dataset collate`` walk-through).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.json_io import loads
from gym_bridge.failures.errors import SettingError
from gym_bridge.generation.batch import assemble_output
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.models.vocab import vocab_size_of
from gym_bridge.types import TOKEN_DTYPE, GenerationDatumSpec, GenerationOutputSpec, Tokenizer

SCRIPTED_LOGPROB = math.log(0.5)


@dataclass
class ScriptedRow:
    """One scripted reply; every token's logprob is :data:`SCRIPTED_LOGPROB`."""

    tokens: list[int]
    truncated: bool

    @property
    def logprobs(self) -> list[float]:
        return [SCRIPTED_LOGPROB] * len(self.tokens)


_EXACT = re.compile(r"Reply with exactly:\s*(.+?)\s*$", re.DOTALL)
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


class ScriptedGeneration(GenerationInterface):
    """A deterministic rule-based engine; see the module docstring."""

    #: The serving layer may take any temperature / top_p: this engine ignores them.
    supports_per_request_sampling = True

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_new_tokens: int = 256,
        max_model_len: int | None = None,
        stop_strings: list[str] | None = None,
        default_reply: str = "I am a scripted assistant.",
        think: bool = False,
    ) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise SettingError("ScriptedGeneration needs a tokenizer with an EOS token (its eos_token_id is None)")
        self.tokenizer = tokenizer
        self.eos_token_id: int = eos
        self.max_new_tokens = max_new_tokens
        length = max_model_len or getattr(tokenizer, "model_max_length", None)
        self.max_model_len = int(length) if isinstance(length, int) and 0 < length < 2**31 else 2**31 - 1
        self.stop_strings = list(stop_strings or [])
        self.default_reply = default_reply
        self.think = think
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.vocab_size = vocab_size_of(tokenizer)
        self.calls = 0

    # ------------------------------------------------------------------ GenerationInterface

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        input_ids, lengths, stops = _unpack(data)
        caps = self._caps(data, input_ids.shape[0])
        self.calls += 1
        rows = [
            self._row(input_ids[i, : int(lengths[i])].tolist(), stops[i], caps[i]) for i in range(input_ids.shape[0])
        ]
        return assemble_output(input_ids, lengths, rows, self.pad_token_id)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        input_ids, lengths, stops = _unpack(data)
        caps = self._caps(data, input_ids.shape[0])
        self.calls += 1
        for i in range(input_ids.shape[0]):
            await asyncio.sleep(0)
            row = self._row(input_ids[i, : int(lengths[i])].tolist(), stops[i], caps[i])
            yield i, assemble_output(input_ids[i : i + 1], lengths[i : i + 1], [row], self.pad_token_id)

    def _caps(self, data: BatchedDataDict[GenerationDatumSpec], batch: int) -> list[int]:
        """Per-row ``max_new_tokens`` when the batch carries it, else the configured one."""
        given = data.get("max_new_tokens") or [None] * batch
        return [self.max_new_tokens if cap is None else int(cap) for cap in given]

    # ------------------------------------------------------------------ the script

    def reply_text(self, prompt_text: str) -> str:
        """The full reply (before EOS, caps and stop strings) for a rendered prompt."""
        turns = _turns(prompt_text)
        user_index = max(
            (i for i, (role, body) in enumerate(turns) if role == "user" and not _is_tool_result(body)), default=None
        )
        user = turns[user_index][1] if user_index is not None else ""
        answered = user_index is not None and any(_is_tool_result(body) for _, body in turns[user_index + 1 :])
        tools = _offered_tools(prompt_text)
        if tools and not answered:
            reply = _tool_call(tools[0], user)
        elif match := _EXACT.search(user):
            reply = match.group(1)
        else:
            reply = self.default_reply
        if self.think:
            reply = "<think>\nI follow my script.\n</think>\n" + reply
        return reply

    def _row(self, prompt: list[int], row_stops: list[str], max_new_tokens: int) -> ScriptedRow:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        tokens = list(self.tokenizer.encode(self.reply_text(text), add_special_tokens=False))
        tokens.append(self.eos_token_id)
        stops = self.stop_strings + [s for s in row_stops if s]
        if stops:
            for end in range(1, len(tokens) + 1):
                if any(s in self.tokenizer.decode(tokens[:end], skip_special_tokens=False) for s in stops):
                    tokens = tokens[:end]
                    break
        cap = max(0, min(max_new_tokens, self.max_model_len - len(prompt)))
        if len(tokens) > cap:
            return ScriptedRow(tokens[:cap], True)
        return ScriptedRow(tokens, False)


def _unpack(data: BatchedDataDict[GenerationDatumSpec]) -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    """``(input_ids, input_lengths, each row's stop strings)`` of a generation batch."""
    input_ids = torch.as_tensor(data["input_ids"]).to(TOKEN_DTYPE)
    lengths = torch.as_tensor(data["input_lengths"]).to(torch.int64).reshape(-1)
    if input_ids.ndim != 2 or lengths.shape[0] != input_ids.shape[0]:
        raise SettingError(f"input_ids must be [B, S] with B input_lengths, got {tuple(input_ids.shape)}")
    raw = data.get("stop_strings")
    stops: list[list[str]] = []
    for i in range(input_ids.shape[0]):
        row = raw[i] if raw is not None else None
        stops.append([row] if isinstance(row, str) else list(row or []))
    return input_ids, lengths, stops


def _turns(text: str) -> list[tuple[str, str]]:
    """ChatML turns as (role, body)."""
    turns = []
    for chunk in text.split("<|im_start|>")[1:]:
        role, _, body = chunk.partition("\n")
        turns.append((role.strip(), body.split("<|im_end|>")[0]))
    return turns


def _is_tool_result(body: str) -> bool:
    return body.lstrip().startswith("<tool_response>")


def _offered_tools(text: str) -> list[JsonObject]:
    # The last <tools>…</tools> pair: templates mention the tags in prose before the block.
    end = text.rfind("</tools>")
    start = text.rfind("<tools>", 0, max(end, 0))
    if start < 0 or end < 0:
        return []
    tools = []
    for line in text[start + len("<tools>") : end].splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            tool = loads(line, "a <tools> line")
        except UntrustedInputError:
            continue
        if isinstance(tool, dict):
            tool = tool.get("function", tool)
            if isinstance(tool.get("name"), str):
                tools.append(tool)
    return tools


def _tool_call(tool: JsonMapping, user: str) -> str:
    params = tool.get("parameters") or {}
    props = params.get("properties") or {}
    required = [p for p in params.get("required") or [] if isinstance(p, str)]
    strings = [p for p in required if (props.get(p) or {}).get("type") == "string"]
    name = (strings or required or list(props))[:1]
    words = _WORD.findall(user)
    args = {name[0]: words[-1] if words else ""} if name else {}
    call = json.dumps({"name": tool["name"], "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"
