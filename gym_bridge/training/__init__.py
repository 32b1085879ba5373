"""Training through the bridge: GRPO advantages, the loss, on-policy fidelity, refit, staleness, validation,
the loop."""

from gym_bridge.training.advantages import baseline_and_std_per_group, grpo_advantages
from gym_bridge.training.batch import GroupStats, train_batch
from gym_bridge.training.fidelity import OnPolicyError, on_policy_error
from gym_bridge.training.loop import GRPOLoopConfig, GRPOTrainer, TrainerState, load_trainer_state
from gym_bridge.training.loss import ClippedPGLoss, ClippedPGLossConfig, sum_on_policy_errors
from gym_bridge.training.metrics import append_metrics, plot_reward_curve, read_metrics
from gym_bridge.training.prompts import PromptQueue, PromptQueueState
from gym_bridge.training.refit import check_refit, refit
from gym_bridge.training.staleness import StalenessBuffer
from gym_bridge.training.validation import GymValidator, McNemarResult, ValidationSet, Validator, mcnemar_exact

__all__ = [
    "ClippedPGLoss",
    "ClippedPGLossConfig",
    "GRPOLoopConfig",
    "GRPOTrainer",
    "GroupStats",
    "GymValidator",
    "McNemarResult",
    "OnPolicyError",
    "PromptQueue",
    "PromptQueueState",
    "StalenessBuffer",
    "TrainerState",
    "ValidationSet",
    "Validator",
    "append_metrics",
    "baseline_and_std_per_group",
    "check_refit",
    "grpo_advantages",
    "load_trainer_state",
    "mcnemar_exact",
    "on_policy_error",
    "plot_reward_curve",
    "read_metrics",
    "refit",
    "sum_on_policy_errors",
    "train_batch",
]
