"""The NeMo-Gym client side, in three concerns, each a sub-package that imports only the ones before it:

- :mod:`~gym_bridge.gym.protocol`: the row and result protocol (rows checked and stamped, routing, a ``/run`` result
  as a typed ``GymRowResult``), spoken as Gym 0.7 speaks it;
- :mod:`~gym_bridge.gym.servers`: Gym's server processes behind one surface (``GymSet``: an ``OwnedGym`` launched
  here with its launcher, fork server and reaper, or an ``AttachedGym`` read from a running Gym's head server);
- :mod:`~gym_bridge.gym.transport`: rows to the servers and back (``NemoGym``, the Ray actor; ``GymClient``;
  admission; starting and stopping actors).

What differs between nemo-gym versions lives below all of them, in :mod:`gym_bridge.gym_versions`.
"""
