"""The builders' layer: settings from a NeMo-RL config, and the assembly of Gym servers, actors and the GRPO run.

Nothing below this layer imports it (tests/test_layers.py); recipes and tools call it.
"""
