"""Generation engines implementing :class:`gym_bridge.interfaces.GenerationInterface`.

- :mod:`gym_bridge.generation.hf`: local transformers causal LMs (CPU or GPU).
"""
