"""Models gym-bridge builds locally, with no downloads.

``tiny`` (:mod:`gym_bridge.models.tiny`) is a random-initialised test model; ``smollm2``
(:mod:`gym_bridge.models.smollm2`) is SmolLM2-135M-Instruct. :mod:`gym_bridge.models.registry`
turns either name, or a folder, into a local model folder.
"""
