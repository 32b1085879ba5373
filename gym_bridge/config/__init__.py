"""Settings from a NeMo-RL-style config: the Gym path, async and failure sections, the GRPO loop and loss.

It reads and checks configs into typed values; it starts nothing (that is :mod:`gym_bridge.recipes`).
"""
