"""One factory builds the engine that ``gym-bridge serve`` and ``gym-bridge eval`` serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_bridge.generation.factory import EngineSpec, build_engine
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.instant import InstantGeneration
from gym_bridge.generation.scripted import ScriptedGeneration


@pytest.mark.parametrize(
    ("policy", "kind"), [("hf", HFGeneration), ("scripted", ScriptedGeneration), ("instant", InstantGeneration)]
)
def test_each_policy_builds_its_engine_on_the_model_folder(tiny_model_dir: Path, policy: str, kind: type) -> None:
    built = build_engine(EngineSpec(policy=policy, model=str(tiny_model_dir), max_new_tokens=7, temperature=0.5))  # type: ignore[arg-type]
    try:
        assert isinstance(built.generation, kind) and built.model_path == tiny_model_dir
        assert built.tokenizer.eos_token == "<|im_end|>"
        if policy == "hf":
            assert (built.generation.cfg.max_new_tokens, built.generation.cfg.temperature) == (7, 0.5)
    finally:
        built.generation.shutdown()


def test_unknown_policy_and_model_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown policy 'gpt'"):
        build_engine(EngineSpec(policy="gpt", model="tiny"))  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="built-in model"):
        build_engine(EngineSpec(model=str(tmp_path / "missing")))
