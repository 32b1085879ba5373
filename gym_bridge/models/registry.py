"""Built-in model names (``tiny``, ``smollm2``) to local folders, built on demand; anything else is a path.

Every place that takes a model (``gym-bridge serve --model``, the eval config's
``embedded_policy`` / ``tokenizer``, ``HFGeneration``, ``HFPolicy``) resolves it here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gym_bridge.failures import GymBridgeError


class ModelNotFoundError(GymBridgeError, FileNotFoundError):
    """A model name that is neither a built-in model nor an existing local path."""


def _build_tiny() -> Path:
    from gym_bridge.models.tiny import build_tiny_model

    return build_tiny_model()


def _build_smollm2() -> Path:
    from gym_bridge.models.smollm2 import build_smollm2

    return build_smollm2()


#: Built-in models: name -> a builder returning the folder in the default cache (reused once built).
BUILTIN_MODELS: dict[str, Callable[[], Path]] = {"tiny": _build_tiny, "smollm2": _build_smollm2}


def check_model_reference(name_or_path: str | Path) -> None:
    """Raise :class:`ModelNotFoundError` unless ``name_or_path`` names a built-in model or an existing local path;
    builds and loads nothing, so a config can be checked before anything starts."""
    if str(name_or_path) in BUILTIN_MODELS or Path(name_or_path).expanduser().exists():
        return
    names = ", ".join(repr(n) for n in BUILTIN_MODELS)
    raise ModelNotFoundError(
        f"model {str(name_or_path)!r} is neither a built-in model ({names}) nor an existing local path "
        "(downloads are not supported: pass a folder saved with save_pretrained)"
    )


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A built-in model's folder (built on demand), or ``name_or_path`` when it is an existing local path
    (else :class:`ModelNotFoundError`)."""
    check_model_reference(name_or_path)
    builder = BUILTIN_MODELS.get(str(name_or_path))
    if builder is not None:
        return builder()
    return Path(name_or_path).expanduser()
