"""Config values checked where a config enters: finite numbers, bounded nesting, override keys with a name.

The eval and training configs and their ``key=value`` overrides are read through these checks before anything
starts, so a non-finite number (``temperature: .inf``, or an unquoted ``inf``, which YAML reads as a string that every
number reader then takes for infinity), an integer past 64 bits, a config nested past :data:`MAX_CONFIG_DEPTH` or an
override key with an empty part is one line naming the key. The annotated types below carry the same rules into the
pydantic models of the eval config.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.json_io import MAX_DEPTH
from gym_bridge.boundary.text import shown
from gym_bridge.boundary.yaml_io import load_yaml
from gym_bridge.config.keys import TrainingConfigError

MAX_CONFIG_DEPTH = MAX_DEPTH // 2
"""How deeply a config may nest (NeMo-RL's recipes and Gym's configs nest under 10): half the run files' limit
(:data:`~gym_bridge.boundary.json_io.MAX_DEPTH`), so a run file that holds the config (``run.json``) reads back."""
MAX_KEY_PARTS = 32
"""The most dotted parts an override key may have."""
MAX_KEY_CHARS = 1000
"""The longest override key."""
INT64_MAX = 2**63 - 1
"""The largest integer a config may hold (NeMo-RL's recipes: 10^10 scheduler iterations, 2^39-byte buffers)."""
MAX_SECONDS = 30 * 86_400.0
"""The longest timeout: 30 days, effectively none."""
MAX_COUNT = 1_000_000
"""The most generations per prompt, groups in flight, actors or attempts a config may ask for."""
MAX_TOKENS = 1 << 24
"""The longest sequence, in tokens, a config may ask for."""

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A finite number (``inf``, ``nan`` and their spellings as text refused)."""
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A timeout: finite, > 0, at most :data:`MAX_SECONDS`."""
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
"""A count of things made at once: 1 to :data:`MAX_COUNT`."""
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
"""A number of tokens: 1 to :data:`MAX_TOKENS`."""
Temperature = Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]
"""A sampling temperature: 0 (greedy) to 100, as ``gym-bridge serve --temperature``."""
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
"""Nucleus sampling's mass: (0, 1]."""
Seed = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A run seed: 0 to 2^63 - 1."""


def non_finite(value: object) -> bool:
    """Whether ``value`` is a float that is not finite, or text a number reader takes for one (``inf``, ``-Infinity``,
    ``nan``, ``1e999``)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str) and value.strip()[:1] in set("+-.0123456789iInN"):
        try:
            return not math.isfinite(float(value))
        except ValueError:
            return False
    return False


def _problem(value: object) -> str | None:
    """What is wrong with one scalar of a config, or None."""
    if non_finite(value):
        return f"{shown(repr(value)[:40])} is not a finite number (a config's numbers are finite)"
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        return f"an integer of {value.bit_length():,} bits, past 64 bits"
    return None


def check_values(data: object, where: str, *, prefix: str = "") -> None:
    """Refuse ``data`` (a config as plain containers) when it nests deeper than :data:`MAX_CONFIG_DEPTH`, or holds a
    non-finite number or an integer past 64 bits; iterative, so any depth is refused rather than recursed into.

    Raises:
        UntrustedInputError: ``where: key.path: <what is wrong>``.
    """
    stack: list[tuple[Any, str, int]] = [(data, prefix, 0)]
    while stack:
        item, key, level = stack.pop()
        if isinstance(item, dict | list | tuple):
            if level >= MAX_CONFIG_DEPTH:
                raise _refused(where, key, f"nested deeper than {MAX_CONFIG_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((child, f"{key}.{name}" if key else str(name), level + 1) for name, child in pairs)
            continue
        problem = _problem(item)
        if problem is not None:
            raise _refused(where, key, problem)


def _refused(where: str, key: str, problem: str) -> UntrustedInputError:
    named = f"{shown(key[:200])}: " if key else ""
    return UntrustedInputError(f"{where}: {named}{problem}" if where else f"{named}{problem}")


def key_parts(key: str, where: str) -> list[str]:
    """The dotted parts of an override key, each non-empty, at most :data:`MAX_KEY_PARTS` of them.

    Raises:
        UntrustedInputError: ``where: ...`` saying what is wrong with the key.
    """
    if not key.strip():
        raise UntrustedInputError(f"{where}: the key is empty (the form is key=value)")
    if len(key) > MAX_KEY_CHARS:
        raise UntrustedInputError(f"{where}: the key is {len(key):,} characters long (at most {MAX_KEY_CHARS:,})")
    parts = key.strip().split(".")
    if len(parts) > MAX_KEY_PARTS:
        raise UntrustedInputError(f"{where}: the key has {len(parts):,} dotted parts (at most {MAX_KEY_PARTS})")
    if any(not part.strip() for part in parts):
        raise UntrustedInputError(f"{where}: the key has an empty part (a.b.c, each part named)")
    return parts


def config_yaml(text: str, where: str) -> Any:
    """The YAML document ``text`` as plain data (:func:`~gym_bridge.boundary.yaml_io.load_yaml`: aliases bounded, JSON
    types only), then :func:`check_values`; an integer past Python's digit limit is one line too.

    Raises:
        UntrustedInputError: ``where: ...`` naming the key.
    """
    try:
        value = load_yaml(text, where)
    except UntrustedInputError:
        raise
    except ValueError as exc:  # PyYAML's int() of a number past Python's 4,300-digit limit
        raise UntrustedInputError(f"{where}: {shown(str(exc).splitlines()[0][:200])}") from None
    check_values(value, where)
    return value


def count(value: object, key: str) -> int:
    """A count the config gives (an integer, or a float with no fraction, from 1 to ``MAX_COUNT``), else a
    :class:`TrainingConfigError` naming ``key``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise TrainingConfigError(f"{key} must be an integer from 1 to {MAX_COUNT:,}, got {shown(repr(value)[:40])}")
    return value


def seconds(value: object, key: str) -> float:
    """A timeout the config gives (a number > 0, at most ``MAX_SECONDS``), else a :class:`TrainingConfigError`
    naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_SECONDS:
        raise TrainingConfigError(
            f"{key} must be a number of seconds > 0 and at most {MAX_SECONDS:,.0f}, got {shown(repr(value)[:40])}"
        )
    return float(value)
