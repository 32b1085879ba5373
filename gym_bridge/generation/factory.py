"""One place that builds a generation engine from a name, for ``gym-bridge serve`` and ``gym-bridge eval``
(through :mod:`gym_bridge.recipes.engine_server`, which serves it).

``policy`` is ``hf`` (the model itself, :class:`~gym_bridge.generation.hf.HFGeneration`),
``scripted`` (rule-based replies over the model's tokenizer) or ``instant`` (a fixed
reply, no model); ``model`` is a built-in name (``tiny``, ``smollm2``) or a folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from gym_bridge.failures.errors import SettingError

if TYPE_CHECKING:  # torch: imported by the engines only, so a spec is cheap to build
    from gym_bridge.interfaces import GenerationInterface
    from gym_bridge.types import Tokenizer

Policy = Literal["hf", "scripted", "instant"]
POLICIES: tuple[str, ...] = ("hf", "scripted", "instant")


@dataclass(frozen=True)
class EngineSpec:
    """What to build: the policy, the model (name or folder) and its sampling."""

    policy: Policy = "hf"
    model: str = "tiny"
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = 0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True  # hf only
    answer_tokens: int = 16  # instant only
    think: bool = False  # scripted only


@dataclass
class BuiltEngine:
    """An engine, the tokenizer it speaks, and the model folder it came from."""

    generation: GenerationInterface
    tokenizer: Any
    """The Hugging Face tokenizer the engine speaks, as transformers types it (callers keep that type)."""
    model_path: Path


def build_engine(spec: EngineSpec) -> BuiltEngine:
    """Build the engine ``spec`` names; the model folder is resolved (and built if built-in) first."""
    from gym_bridge.models.registry import resolve_model_path

    if spec.policy not in POLICIES:
        raise SettingError(f"unknown policy {spec.policy!r}; known: {', '.join(POLICIES)}")
    path = resolve_model_path(spec.model)
    if spec.policy == "hf":
        from gym_bridge.generation.hf import HFGeneration
        from gym_bridge.generation.hf_config import HFGenerationConfig

        generation = HFGeneration(
            HFGenerationConfig(
                model=str(path),
                max_new_tokens=spec.max_new_tokens,
                temperature=spec.temperature,
                top_p=spec.top_p,
                seed=spec.seed,
                max_model_len=spec.max_model_len,
                enable_prefix_caching=spec.enable_prefix_caching,
            )
        )
        return BuiltEngine(generation, generation.tokenizer, path)
    from gym_bridge.models.folder_check import load_tokenizer

    tokenizer = load_tokenizer(path)  # the folder checked first: regular files, no remote code
    # transformers 5 types ``decode`` as returning ``str | list[str]``; for a list of ids it is a str.
    speaks = cast("Tokenizer", tokenizer)
    if spec.policy == "scripted":
        from gym_bridge.generation.scripted import ScriptedGeneration

        return BuiltEngine(
            ScriptedGeneration(
                speaks, max_new_tokens=spec.max_new_tokens, max_model_len=spec.max_model_len, think=spec.think
            ),
            tokenizer,
            path,
        )
    from gym_bridge.generation.instant import InstantGeneration

    return BuiltEngine(
        InstantGeneration(
            speaks, spec.answer_tokens, max_new_tokens=spec.max_new_tokens, max_model_len=spec.max_model_len
        ),
        tokenizer,
        path,
    )
