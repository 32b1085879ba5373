"""Gym's row and result protocol: rows checked, stamped and routed where they enter (``rows``, ``routing``,
``row_file``), and a ``/run`` result turned into a typed ``GymRowResult`` (``convert``, ``decode``, ``result``,
``token_capture``). Starts no process and opens no connection."""
