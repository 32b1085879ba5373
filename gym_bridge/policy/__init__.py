"""Trainable policies implementing :class:`~gym_bridge.interfaces.PolicyInterface`."""

from gym_bridge.policy.hf import HFPolicy, HFPolicyConfig
from gym_bridge.policy.loss import LossFunction, policy_gradient_loss

__all__ = ["HFPolicy", "HFPolicyConfig", "LossFunction", "policy_gradient_loss"]
