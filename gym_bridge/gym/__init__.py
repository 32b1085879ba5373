"""The NeMo-Gym client side: start Gym's servers, send rows to its agents, and turn results into message logs.

- :mod:`~gym_bridge.gym.servers` (``GymServers``), with :mod:`~gym_bridge.gym.reaper` and the fork server:
  one bounded, leak-free set of Gym servers;
- :mod:`~gym_bridge.gym.actor` (``NemoGym``, the Ray actor), :mod:`~gym_bridge.gym.actor_config`
  (``NemoGymConfig``) and :mod:`~gym_bridge.gym.spinup` (starting and stopping actors);
- :mod:`~gym_bridge.gym.client` (``GymClient``): one prompt group through the actors, lost rows re-sent;
- :mod:`~gym_bridge.gym.rows` (rows checked and stamped), :mod:`~gym_bridge.gym.convert` and
  :mod:`~gym_bridge.gym.result` (a ``/run`` result as a typed ``GymRowResult``);
- :mod:`~gym_bridge.gym.versions`: everything that differs between nemo-gym versions, in one place.
"""
