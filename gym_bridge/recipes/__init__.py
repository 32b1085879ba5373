"""Assembly: the Gym rollout stack (preflight, Ray, actors, manager) and the GRPO run, from settings.

Each recipe reads top to bottom as the steps it takes; the settings come from :mod:`gym_bridge.config`.
"""
