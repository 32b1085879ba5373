"""Gym's server processes behind one surface (``gym_set``), chosen once from the config (``server_set``): a bounded,
leak-free set of Gym servers launched here (``owned``: a launcher in its own session, ``_launcher``, ``_forkserver``,
``_server_preload``, ``_gym_routes``, reaped with its owner by ``reaper``), or a running Gym attached to and read from
its head server (``attached``, ``running``). Gym's config files are read before Gym starts in one place
(``config_files``)."""
