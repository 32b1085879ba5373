"""Import NeMo-RL's own modules from a checkout, unmodified.

Two things stand between NeMo-RL's rollout code and our environment, and both are handled at import level only:

- Packages NeMo-RL imports at module level that we do not install (GPU, logging and data-loading packages:
  ``STANDIN_PACKAGES``). Each gets a stand-in module in ``sys.modules``: every attribute is an inert placeholder
  class, so ``from tensordict import TensorDict`` or ``class X(SomeBase)`` succeeds. None of them is reached by
  the code under test; calling one raises, naming it, so a stand-in can never hide behaviour.
- ``nemo_rl/models/policy/__init__.py`` asserts ``transformers < 5.12`` at import (a guard on a tokenizer
  workaround for transformers 5.4-5.11; our lock has 5.23). ``transformers.__version__`` reads "5.11.0" for
  the duration of that one import and is restored right after; the module's patch itself then runs as written.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

STANDIN_PACKAGES = (
    "absl",
    "pynvml",
    "soundfile",
    "swanlab",
    "tensorboard",
    "tensordict",
    "torchdata",
    "zmq",
)
"""Top-level packages stood in (with every submodule) when they are not installed."""
STANDIN_VERSION = "99.0.0+standin"

NEMO_RL_MODULES = (
    "nemo_rl.experience.rollouts",
    "nemo_rl.experience.rollout_manager",
    "nemo_rl.environments.nemo_gym",
    "nemo_rl.algorithms.grpo",
    "nemo_rl.algorithms.advantage_estimator",
    "nemo_rl.algorithms.async_utils.trajectory_collector",
    "nemo_rl.distributed.batched_data_dict",
)
"""What the checks use; each is imported from the checkout as it is."""

TRANSFORMERS_GUARD_MODULE = "nemo_rl.models.policy"
TRANSFORMERS_GUARD_VERSION = "5.11.0"

stood_in: list[str] = []
"""Top-level names that got a stand-in in this process (reported in the summary)."""


class _StandInMeta(type):
    """Attribute access on a placeholder gives a further placeholder (``tf.io.gfile``), never a value."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls._standin_name}.{name}")


class StandIn(metaclass=_StandInMeta):
    """A placeholder for any name of a stood-in package: subclassable, usable in annotations, never instantiable."""

    _standin_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{self._standin_name} is a stand-in (scripts/nemo_rl_check/imports.py): the code under test reached it"
        )

    def __class_getitem__(cls, item: Any) -> type:
        return cls


def _placeholder(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (StandIn,), {"_standin_name": qualname})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so any submodule imports too
        # torch.utils.tensorboard checks tensorboard.__version__ >= 1.15 at import; a stand-in reads as new enough.
        module.__version__ = STANDIN_VERSION
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Answers only for ``STANDIN_PACKAGES`` that no other finder can import."""

    def __init__(self, names: set[str]) -> None:
        self._names = names

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".", 1)[0]
        if top not in self._names:
            return None
        if top not in stood_in:
            stood_in.append(top)
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


def install_standins() -> None:
    """Stand in every package of ``STANDIN_PACKAGES`` that is not installed (an installed one is used as is)."""
    missing = {name for name in STANDIN_PACKAGES if importlib.util.find_spec(name) is None}
    if missing and not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder(missing))


def check_checkout(src: str | None) -> Path:
    """The checkout's root, or SystemExit with one line when ``src`` is unset or not a NeMo-RL checkout."""
    if not src:
        raise SystemExit("check-nemo-rl: NEMO_RL_SRC is not set (make check-nemo-rl NEMO_RL_SRC=/path/to/NeMo-RL)")
    root = Path(src).expanduser().resolve()
    needed = ["nemo_rl/__init__.py", "nemo_rl/experience/rollouts.py", "nemo_rl/experience/rollout_manager.py"]
    absent = [p for p in needed if not (root / p).is_file()]
    if absent:
        raise SystemExit(f"check-nemo-rl: NEMO_RL_SRC={src} is not a NeMo-RL checkout (no {', '.join(absent)})")
    return root


def import_nemo_rl(root: Path) -> dict[str, types.ModuleType]:
    """Put ``root`` first on sys.path and import :data:`NEMO_RL_MODULES` from it, unmodified."""
    if "nemo_rl" in sys.modules:
        loaded = Path(sys.modules["nemo_rl"].__file__ or "").resolve()
        if root not in loaded.parents:
            raise RuntimeError(f"nemo_rl is already imported from {loaded}, not from {root}")
    sys.path.insert(0, str(root))
    install_standins()
    _import_past_transformers_guard()
    modules = {name: importlib.import_module(name) for name in NEMO_RL_MODULES}
    for name, module in modules.items():
        if root not in Path(module.__file__ or "").resolve().parents:
            raise RuntimeError(f"{name} was imported from {module.__file__}, not from {root}")
    return modules


def _import_past_transformers_guard() -> None:
    """Import ``nemo_rl.models.policy`` with ``transformers.__version__`` reading 5.11.0, then restore it."""
    import transformers

    real = transformers.__version__
    transformers.__version__ = TRANSFORMERS_GUARD_VERSION
    try:
        importlib.import_module(TRANSFORMERS_GUARD_MODULE)
    finally:
        transformers.__version__ = real


def comparison_main(description: str, compare: Callable[[Path], list[dict[str, Any]]], within: Callable[[dict[str, Any]], bool]) -> int:
    """A comparison script's command line: ``--nemo-rl-src``, one JSON line per case of ``compare(root)``, and exit
    status 0 only when every case is ``within`` its tolerance."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--nemo-rl-src", required=True, help="a NeMo-RL checkout (github NVIDIA-NeMo/RL)")
    results = compare(check_checkout(parser.parse_args().nemo_rl_src))
    for result in results:
        print(json.dumps(result))
    return 0 if all(within(r) for r in results) else 1
