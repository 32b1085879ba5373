"""The bridge from a request's sampling fields to one ``generate_async`` call.

An engine that sets ``supports_per_request_sampling = True`` (such as
:class:`~gym_bridge.generation.hf.HFGeneration`) receives the request's
temperature / top-p / top-k / max_tokens per row, as vLLM does. Any other engine
samples with the profile of its config, and a request is served only when its
sampling matches that profile (NeMo-RL's off-policy guard); a mismatch is a 400
naming both values. ``temperature == 0`` asks for greedy decoding, which every
engine supports per call.

``seed`` goes to an engine with per-request sampling per row, as vLLM's: choice ``i``
of an ``n``-choice request is seeded ``seed + i`` (vLLM's ``ParentRequest`` gives each
of its ``n`` child requests ``seed + index``), so the ``n`` choices differ and a request
repeated with its seed repeats every choice. An engine without per-request sampling
samples from its own generator and ignores it, as it ignores the other sampling fields
it cannot take per row (the off-policy guard above refuses those that differ).

``max_tokens`` is sent to the engine per row; for an engine that ignores it, a
longer generation is cut after the fact (finish ``length``). Without per-request
sampling the engine's ``max_new_tokens`` also caps it. A ``max_tokens`` beyond the
room the prompt leaves in the context is vLLM's 400, unless the server clamps it
(:class:`~gym_bridge.serving.state.ServerFeatures` ``clamp_max_tokens``, NeMo-RL's chat server).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.serving.errors import IncompleteGeneration, ServingError
from gym_bridge.serving.protocol import SamplingFields
from gym_bridge.types import GenerationDatumSpec

#: Logprobs are floored here so that -inf never reaches JSON (NeMo-RL uses the same floor).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class EngineProfile:
    """What the server knows about an engine's sampling and limits."""

    temperature: float
    top_p: float
    top_k: int | None
    max_new_tokens: int
    max_model_len: int
    per_request_sampling: bool

    @classmethod
    def of(cls, generation: GenerationInterface, tokenizer: object, max_model_len: int | None = None) -> EngineProfile:
        """The profile an engine declares (its attributes, else its ``cfg``'s), with the tokenizer's length limit."""
        length = (
            max_model_len
            or _engine_setting(generation, "max_model_len", None)
            or getattr(tokenizer, "model_max_length", None)
        )
        if not isinstance(length, int) or length <= 0 or length > 2**31:
            length = 2**31 - 1
        top_k = _engine_setting(generation, "top_k", None)
        return cls(
            temperature=float(_engine_setting(generation, "temperature", 1.0)),
            top_p=float(_engine_setting(generation, "top_p", 1.0)),
            top_k=None if top_k in (None, 0, -1) else int(top_k),
            max_new_tokens=int(_engine_setting(generation, "max_new_tokens", 2**31 - 1)),
            max_model_len=int(length),
            per_request_sampling=bool(getattr(generation, "supports_per_request_sampling", False)),
        )


def _engine_setting(generation: GenerationInterface, name: str, default: object) -> Any:
    """The engine's attribute ``name``, else its ``cfg``'s, else ``default``: engines declare settings either way."""
    value = getattr(generation, name, None)
    cfg = getattr(generation, "cfg", None)
    if value is None and cfg is not None:
        value = getattr(cfg, name, None)
    return default if value is None else value


class SamplingOverrides(TypedDict, total=False):
    """A request's sampling fields, sent per row to an engine with per-request sampling (None: the engine's)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None


@dataclass
class Sample:
    """One generated row: ids, logprobs, why it ended, and the weight version that generated it (if known)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    weight_version: int | None = None


def effective_top_k(top_k: int | None, vocab_size: int | None) -> int | None:
    """A request's ``top_k`` with vLLM's clamp: at least the vocabulary means every token (-1)."""
    if top_k is not None and vocab_size is not None and top_k >= vocab_size:
        return -1
    return top_k


def resolve_greedy(req: SamplingFields, profile: EngineProfile, *, vocab_size: int | None = None) -> bool:
    """Check the request's sampling against the engine profile; return whether to decode greedily."""
    if req.temperature == 0.0:
        return True
    if profile.per_request_sampling:
        return False
    if profile.temperature == 0.0:
        if req.temperature is not None:
            raise ServingError(
                f"temperature {req.temperature} differs from the engine's (0, greedy); send 0 or omit it",
                param="temperature",
            )
        return True
    if req.temperature is not None and not math.isclose(req.temperature, profile.temperature, abs_tol=1e-6):
        raise ServingError(
            f"temperature {req.temperature} differs from the engine's temperature {profile.temperature}; "
            "this server samples only with its configured profile",
            param="temperature",
        )
    if req.top_p is not None and not math.isclose(req.top_p, profile.top_p, abs_tol=1e-6):
        raise ServingError(f"top_p {req.top_p} differs from the engine's top_p {profile.top_p}", param="top_p")
    top_k = effective_top_k(req.top_k, vocab_size)
    top_k = None if top_k in (None, 0, -1) else top_k
    if req.top_k is not None and top_k != profile.top_k:
        raise ServingError(f"top_k {req.top_k} differs from the engine's top_k {profile.top_k}", param="top_k")
    return False


def max_tokens_for(requested: int | None, prompt_len: int, profile: EngineProfile, *, clamp: bool = False) -> int:
    """The generation budget, with vLLM's 400s: a prompt that leaves no room, and a ``max_tokens`` beyond the room
    the prompt leaves (``clamp=True`` cuts that one to the room instead, as NeMo-RL's chat server does)."""
    room = profile.max_model_len - prompt_len
    if room <= 0:
        raise ServingError(
            f"This model's maximum context length is {profile.max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens, which leaves no room for generation (context length exceeded).",
            param="messages",
        )
    if requested is not None and requested > room:
        if not clamp:
            raise ServingError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum context "
                f"length is {profile.max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({requested} > {profile.max_model_len} - {prompt_len}).",
                param="max_tokens",
            )
        requested = room
    if requested is not None and profile.per_request_sampling:
        return requested
    budget = min(room, profile.max_new_tokens)
    return budget if requested is None else min(budget, requested)


async def generate_rows(
    generation: GenerationInterface,
    prompt_ids: list[int],
    n: int,
    *,
    greedy: bool,
    stop: list[str],
    max_tokens: int,
    sampling: SamplingOverrides | None = None,
) -> list[Sample]:
    """Submit ``n`` copies of one prompt in one ``generate_async`` call; return them in row order.

    ``sampling`` (temperature / top_p / top_k / seed) goes to the engine per row; send it
    only to an engine that supports per-request sampling. Row ``i`` gets ``seed + i``.
    """
    input_ids = torch.tensor([prompt_ids] * n, dtype=torch.int64)
    fields: dict[str, object] = {**(sampling or {}), "max_new_tokens": max_tokens}
    seed = (sampling or {}).get("seed")
    fields.pop("seed", None)
    per_row: dict[str, list[object]] = {key: [value] * n for key, value in fields.items()}
    if seed is not None:
        per_row["seed"] = list(choice_seeds(seed, n))
    data: BatchedDataDict[GenerationDatumSpec] = BatchedDataDict(
        {
            "input_ids": input_ids,
            "input_lengths": torch.full((n,), len(prompt_ids), dtype=torch.int64),
            "stop_strings": [list(stop) or None for _ in range(n)],
            **per_row,
        }
    )
    samples: list[Sample | None] = [None] * n
    start = len(prompt_ids)
    async for i, out in generation.generate_async(data, greedy=greedy):
        length = int(out["generation_lengths"][0])
        ids = out["output_ids"][0, start : start + length].tolist()
        lps = [max(float(v), LOGPROB_FLOOR) for v in out["logprobs"][0, start : start + length].tolist()]
        truncated = bool(out["truncated"][0]) if "truncated" in out else False
        if len(ids) > max_tokens:
            ids, lps, truncated = ids[:max_tokens], lps[:max_tokens], True
        version = int(out["weight_version"][0]) if "weight_version" in out else None
        samples[i] = Sample(ids, lps, "length" if truncated else "stop", version)
    missing = [i for i, s in enumerate(samples) if s is None]
    if missing:
        raise IncompleteGeneration(f"generation returned no output for rows {missing}")
    return [s for s in samples if s is not None]  # all of them, as checked above


def choice_seeds(seed: int, n: int) -> list[int]:
    """The seeds of an ``n``-choice request's rows: ``seed + i`` for choice ``i``, as vLLM's parallel sampling."""
    return [seed + i for i in range(n)]


def weight_version_of(samples: list[Sample]) -> int | None:
    """The oldest weight version among ``samples`` (what staleness is measured by), or None if unknown."""
    versions = [s.weight_version for s in samples if s.weight_version is not None]
    return min(versions) if versions else None
