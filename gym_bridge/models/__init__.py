"""Models gym-bridge can build locally (no downloads): see :mod:`gym_bridge.models.tiny`."""
