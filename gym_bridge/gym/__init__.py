"""NeMo-Gym server lifecycle: start Gym's servers on this environment, bounded and leak-free.

See :mod:`gym_bridge.gym.servers` (``GymServers``, ``GymServersConfig``).
"""
