"""Training through the bridge: GRPO advantages, the loss, on-policy fidelity, refit, staleness, validation,
the loop."""

from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.training.advantages import (
    baseline_and_std_per_group,
    clip_advantages,
    grpo_advantages,
    message_level_advantages,
)
from gym_bridge.training.batch import AdvantageSettings, GroupStats, TrainBatchSpec, train_batch
from gym_bridge.training.fidelity import OnPolicyError, on_policy_error, seq_logprob_error_mask
from gym_bridge.training.loop import GRPOTrainer
from gym_bridge.training.loop_config import GRPOLoopConfig
from gym_bridge.training.loss import ClippedPGLoss, ClippedPGLossConfig, sum_on_policy_errors
from gym_bridge.training.metrics import MetricsLine, append_metrics, read_metrics
from gym_bridge.training.plots import TrainingPlots, write_training_plots
from gym_bridge.training.prompts import PromptQueue, PromptQueueState
from gym_bridge.training.refit import RefitTarget, check_refit, refit
from gym_bridge.training.staleness import StalenessBuffer
from gym_bridge.training.step_rollouts import RolloutCollector
from gym_bridge.training.trainer_state import TrainerState, load_trainer_state
from gym_bridge.training.update import TrainablePolicy
from gym_bridge.training.validation import GymValidator, ValidationSet, Validator

__all__ = [
    "AdvantageSettings",
    "ClippedPGLoss",
    "ClippedPGLossConfig",
    "GRPOLoopConfig",
    "GRPOTrainer",
    "GroupStats",
    "GymValidator",
    "MetricsLine",
    "OnPolicyError",
    "PromptQueue",
    "PromptQueueState",
    "RefitTarget",
    "RewardShaper",
    "RolloutCollector",
    "StalenessBuffer",
    "TrainBatchSpec",
    "TrainablePolicy",
    "TrainerState",
    "TrainingPlots",
    "ValidationSet",
    "Validator",
    "append_metrics",
    "baseline_and_std_per_group",
    "check_refit",
    "clip_advantages",
    "grpo_advantages",
    "load_trainer_state",
    "message_level_advantages",
    "on_policy_error",
    "read_metrics",
    "refit",
    "seq_logprob_error_mask",
    "sum_on_policy_errors",
    "train_batch",
    "write_training_plots",
]
