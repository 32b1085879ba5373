"""Training through the bridge: GRPO advantages, the loss, on-policy fidelity, refit, staleness, the loop."""

from gym_bridge.training.advantages import baseline_and_std_per_group, grpo_advantages
from gym_bridge.training.batch import GroupStats, train_batch
from gym_bridge.training.fidelity import OnPolicyError, on_policy_error
from gym_bridge.training.loop import GRPOLoopConfig, GRPOTrainer, TrainerState, load_trainer_state
from gym_bridge.training.loss import GRPOLoss, sum_on_policy_errors
from gym_bridge.training.metrics import append_metrics, plot_reward_curve, read_metrics
from gym_bridge.training.refit import refit
from gym_bridge.training.staleness import StalenessBuffer

__all__ = [
    "GRPOLoopConfig",
    "GRPOLoss",
    "GRPOTrainer",
    "GroupStats",
    "OnPolicyError",
    "StalenessBuffer",
    "TrainerState",
    "append_metrics",
    "baseline_and_std_per_group",
    "grpo_advantages",
    "load_trainer_state",
    "on_policy_error",
    "plot_reward_curve",
    "read_metrics",
    "refit",
    "sum_on_policy_errors",
    "train_batch",
]
