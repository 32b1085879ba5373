"""RolloutManager: picks a rollout backend by name and rolls out one prompt group at a time."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gym_bridge.failures import RolloutTimeouts
from gym_bridge.interfaces import GenerationInterface, RolloutBackend
from gym_bridge.rollout.registry import load_backend
from gym_bridge.types import DatumSpec, GenerationConfig, PromptGroupRecord

NATIVE_BACKEND = "native"
NEMO_GYM_BACKEND = "nemo_gym"


def backend_name_for(use_nemo_gym: bool, backend: str | None) -> str:
    """Resolve the backend name: an explicit ``backend`` wins; ``use_nemo_gym`` means ``nemo_gym``."""
    if backend is not None:
        if use_nemo_gym and backend != NEMO_GYM_BACKEND:
            raise ValueError(f"use_nemo_gym=True conflicts with backend={backend!r}; pass one or the other")
        return backend
    return NEMO_GYM_BACKEND if use_nemo_gym else NATIVE_BACKEND


class RolloutManager:
    """Rolls out prompts through one backend from the ``gym_bridge.rollout_backends`` registry.

    Every backend is constructed with the same keyword arguments and ignores the
    ones it does not use; ``backend_kwargs`` are passed through unchanged.
    """

    def __init__(
        self,
        tokenizer: Any,
        task_to_env: Mapping[str, Any] | None,
        num_generations_per_prompt: int,
        max_seq_len: int,
        max_rollout_turns: int = 1,
        policy_generation: GenerationInterface | None = None,
        generation_config: GenerationConfig | None = None,
        use_nemo_gym: bool = False,
        backend: str | None = None,
        timeouts: RolloutTimeouts | None = None,
        **backend_kwargs: Any,
    ) -> None:
        if num_generations_per_prompt < 1:
            raise ValueError(f"num_generations_per_prompt must be >= 1, got {num_generations_per_prompt}")
        if max_rollout_turns < 1:
            raise ValueError(f"max_rollout_turns must be >= 1, got {max_rollout_turns}")
        self.backend_name = backend_name_for(use_nemo_gym, backend)
        backend_cls = load_backend(self.backend_name)
        self.timeouts = timeouts or RolloutTimeouts()
        self.backend: RolloutBackend = backend_cls(
            tokenizer=tokenizer,
            task_to_env=dict(task_to_env or {}),
            num_generations_per_prompt=num_generations_per_prompt,
            max_seq_len=max_seq_len,
            max_rollout_turns=max_rollout_turns,
            policy_generation=policy_generation,
            generation_config=generation_config,
            timeouts=self.timeouts,
            **backend_kwargs,
        )
        self.num_generations_per_prompt = num_generations_per_prompt

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        """Roll out one prompt: a complete group of N completions, or a typed failure."""
        record = await self.backend.run_rollout(datum)
        if len(record.completions) != self.num_generations_per_prompt:
            raise RuntimeError(
                f"backend {self.backend_name!r} returned {len(record.completions)} completions "
                f"for prompt_idx={record.prompt_idx}; expected {self.num_generations_per_prompt}"
            )
        return record
