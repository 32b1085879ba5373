"""The rollout-backend registry: backends are found through Python entry points.

Any installed distribution can add a backend by declaring, in its pyproject::

    [project.entry-points."gym_bridge.rollout_backends"]
    my_backend = "my_package.module:MyRolloutBackend"

The class must meet :class:`gym_bridge.rollout.backend.BackendClass` (an ``Options`` model and a
``from_context`` constructor), its instances :class:`gym_bridge.interfaces.RolloutBackend`; ``load_backend`` checks
it when it loads the class, before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from gym_bridge.failures import GymBridgeError
from gym_bridge.rollout.backend import BackendClass, backend_contract_problem

ENTRY_POINT_GROUP = "gym_bridge.rollout_backends"


class BackendNotFoundError(GymBridgeError, LookupError):
    """No installed distribution registers a backend of that name."""

    def __str__(self) -> str:
        return str(self.args[0])


class BackendLoadError(GymBridgeError, ImportError):
    """A registered backend could not be imported, or is not a rollout backend."""


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend: its name, the object it points at, and who registered it."""

    name: str
    value: str
    distribution: str

    @classmethod
    def from_entry_point(cls, ep: EntryPoint) -> BackendEntry:
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an unknown distribution"
        return cls(name=ep.name, value=ep.value, distribution=dist)


def _entry_points() -> dict[str, list[EntryPoint]]:
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, []).append(ep)
    return found


def available_backends() -> dict[str, BackendEntry]:
    """Every registered backend name, mapped to where it comes from."""
    return {name: BackendEntry.from_entry_point(eps[0]) for name, eps in sorted(_entry_points().items())}


def load_backend(name: str) -> type[BackendClass]:
    """Import the class registered as ``name``.

    Raises :class:`BackendNotFoundError` listing the registered names, or
    :class:`BackendLoadError` naming the distribution whose entry point is broken, ambiguous (two
    distributions register the same name) or not a backend class (what of the contract it lacks).
    """
    found = _entry_points()
    if name not in found:
        names = ", ".join(sorted(found)) or "(none)"
        raise BackendNotFoundError(f"no rollout backend named {name!r}; registered backends: {names}")
    eps = found[name]
    entries = [BackendEntry.from_entry_point(ep) for ep in eps]
    if len({(e.value, e.distribution) for e in entries}) > 1:
        who = "; ".join(f"{e.distribution} -> {e.value}" for e in entries)
        raise BackendLoadError(f"rollout backend {name!r} is registered more than once: {who}")
    entry = entries[0]
    try:
        backend = eps[0].load()
    except Exception as exc:
        raise BackendLoadError(
            f"rollout backend {name!r} registered by {entry.distribution} as {entry.value!r} "
            f"failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    problem = backend_contract_problem(backend)
    if problem is not None:
        raise BackendLoadError(
            f"rollout backend {name!r} registered by {entry.distribution} as {entry.value!r} {problem}"
        )
    return backend  # type: ignore[no-any-return]  # checked against the contract just above
