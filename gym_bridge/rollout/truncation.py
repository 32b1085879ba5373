"""What "truncated" means on each rollout path: NeMo-RL's documented rules, written once.

- **native** (:class:`~gym_bridge.rollout.native.AsyncRolloutImpl`) and **sync**
  (:func:`~gym_bridge.rollout.sync.run_multi_turn_rollout`): a trajectory is truncated
  when a response hit the engine's token cap (finish reason ``length``), or when the
  observation does not fit: if ``input + generated + observation >= max_seq_len`` the
  observation keeps only ``max(0, max_seq_len - input - generated)`` tokens
  (:func:`fit_observation`). The paths differ, as in NeMo-RL, only in what a capped
  response does next: native ends the trajectory, sync keeps it going.
- **nemo_gym**: Gym drives the episode, so the only signal left is the length: a
  completion is truncated when its tokens total exactly ``max_seq_len``
  (:func:`gym_completion_truncated`, NeMo-RL's equality test).

Token drift (a Gym turn whose prompt does not extend the previous turn) is not
truncation: it is :attr:`~gym_bridge.types.Completion.token_drift`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ObservationFit:
    """The observation tokens that fit, and whether cutting them (or a full sequence) truncates the trajectory."""

    token_ids: torch.Tensor
    truncated: bool


def fit_observation(
    obs_ids: torch.Tensor, *, input_len: int, gen_len: int, max_seq_len: int, response_truncated: bool = False
) -> ObservationFit:
    """NeMo-RL's native rule for one turn: cut the observation to what ``max_seq_len`` leaves."""
    if input_len + gen_len + int(obs_ids.numel()) >= max_seq_len:
        return ObservationFit(obs_ids[: max(0, max_seq_len - input_len - gen_len)], True)
    return ObservationFit(obs_ids, response_truncated)


def gym_completion_truncated(total_tokens: int, max_seq_len: int | None) -> bool:
    """NeMo-RL's Gym rule: truncated when the completion's tokens total exactly ``max_seq_len``."""
    return max_seq_len is not None and total_tokens == max_seq_len
