"""The boundary's one error."""

from __future__ import annotations

from gym_bridge.failures import GymBridgeError


class UntrustedInputError(GymBridgeError, ValueError):
    """Input from outside (a file, a config, a body, an answer) was refused at the boundary. The message is one line
    naming where: the file, its line and the field, or the request field."""
