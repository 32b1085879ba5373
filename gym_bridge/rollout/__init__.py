"""Rollout components: the manager, its backend registry, and the rollout backends."""
