"""Gym's server processes: one bounded, leak-free set of Gym servers (``server_set``), started by a launcher in its
own session (``_launcher``, ``_forkserver``, ``_server_preload``, ``_gym_routes``), reaped with its owner
(``reaper``), or a running Gym read from its head server (``running``)."""
