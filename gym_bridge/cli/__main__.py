"""``python -m gym_bridge.cli``: the ``gym-bridge`` command."""

import sys

from gym_bridge.cli import main

sys.exit(main())
