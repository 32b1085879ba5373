"""``python -m gym_bridge.cli``: the ``gym-bridge`` command."""

import sys

from gym_bridge.cli import main

if __name__ == "__main__":
    sys.exit(main())
