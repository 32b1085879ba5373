"""Rows to Gym's servers and back: the ``NemoGym`` Ray actor (``actor``, ``actor_config``, ``health``,
``stream_window``, ``endpoint_load``), the driver's ``GymClient`` with its ``admission`` control, and ``spinup``."""
