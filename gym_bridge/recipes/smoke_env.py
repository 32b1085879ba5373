"""``--smoke``'s scratch values for the environment variables a recipe's launcher sets: a recipe that reads
``${oc.env:NAME}`` (NeMo-RL's Nemotron recipes: ``PERSISTENT_CACHE``, ...) cannot be read where ``NAME`` is unset.
:func:`load_with_scratch_env` gives each unset one a scratch folder in the run folder, for this process and the
Gym servers it starts, and lists it in the smoke table; a variable that is set keeps its value."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from gym_bridge.boundary.files import make_dir
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.smoke_table import ABSENT, KeyChange
from gym_bridge.json_types import JsonObject
from gym_bridge.recipes.smoke_rows import SMOKE_ENV, remove_unstarted_copies

MAX_VARIABLES = 32
_MISSING = re.compile(r"Environment variable '([A-Za-z_][A-Za-z0-9_]*)' not found")


def load_with_scratch_env(
    path: str | Path, overrides: Sequence[str], run_dir: Path
) -> tuple[JsonObject, list[KeyChange]]:
    """The config at ``path`` with ``overrides``, each unset ``${oc.env:NAME}`` it reads set to
    ``<run_dir>/smoke-env/NAME`` (a folder made for it), and those variables as smoke-table rows."""
    changes: list[KeyChange] = []
    while True:
        try:
            return load_with_overrides(path, overrides), changes
        except TrainingConfigError as exc:
            missing = _MISSING.search(str(exc))
            if missing is None or len(changes) >= MAX_VARIABLES or missing.group(1) in os.environ:
                remove_unstarted_copies(run_dir)  # a config refused leaves no run folder
                raise
            name = missing.group(1)
            scratch = make_dir(run_dir / SMOKE_ENV / name)
            os.environ[name] = str(scratch)
            why = "unset here (the recipe's launcher sets it): a scratch folder in the run folder"
            changes.append(KeyChange(f"${{oc.env:{name}}}", ABSENT, str(scratch), why))
