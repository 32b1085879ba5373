"""The Gym server set a config asks for, chosen once: a running Gym to attach to, or one to launch.

``GymServersConfig.head_url`` names a Gym that is already running (``gym env start``, ``ng_run``, another tool's):
the set is an :class:`~gym_bridge.gym.servers.attached.AttachedGym`, read from its head server and never stopped.
Without it the set is an :class:`~gym_bridge.gym.servers.owned.OwnedGym`, launched and stopped here. Both have the
one surface of :class:`~gym_bridge.gym.servers.gym_set.GymSet`, so no caller asks which it has.
"""

from __future__ import annotations

from gym_bridge.gym.servers.attached import AttachedGym
from gym_bridge.gym.servers.gym_set import GymSet
from gym_bridge.gym.servers.owned import OwnedGym
from gym_bridge.gym.servers.server_config import GymServersConfig


def GymServers(config: GymServersConfig) -> GymSet:
    """The set ``config`` describes (a function named as the set it makes): the running Gym at ``head_url``, else
    a set launched from its config files."""
    if config.head_url is not None:
        return AttachedGym(config)
    return OwnedGym(config)
