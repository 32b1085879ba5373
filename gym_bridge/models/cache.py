"""The local model cache: where built-in models live, and how a build gets there atomically.

A build is written into a private temporary folder beside its final place and
renamed into place only once complete (a marker file, written last, says so). So
concurrent builders never see or leave a half-written folder: the first rename
wins and the others discard their copy; an interrupted build leaves at most a
dot-named temporary folder, which the next build of the same model sweeps away
when the process that wrote it is gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import make_dir, write_atomic
from gym_bridge.failures import GymBridgeError
from gym_bridge.json_types import JsonObject

logger = logging.getLogger(__name__)


class ModelCacheError(GymBridgeError, OSError):
    """The model cache folder cannot be created or written, or a finished build cannot be moved into place."""


#: Environment variable naming the default cache folder.
CACHE_ENV = "GYM_BRIDGE_CACHE"


def default_cache_dir() -> Path:
    """``$GYM_BRIDGE_CACHE`` or ``~/.cache/gym-bridge``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gym-bridge"


def cache_base(cache_dir: Path | str | None) -> Path:
    """``cache_dir`` (expanded), or the default cache folder."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def is_complete(path: Path, marker_file: str) -> bool:
    """Whether ``path`` holds a finished build (its marker file exists)."""
    return (path / marker_file).is_file()


def build_atomically(final: Path, marker_file: str, write: Callable[[Path], JsonObject]) -> Path:
    """Return ``final``, building it first with ``write(tmp_folder)`` unless a finished build is there.

    ``write`` fills the empty temporary folder and returns the marker's content; the
    marker is written last, then the folder is renamed to ``final``. Whatever goes
    wrong (an exception, a ``KeyboardInterrupt``), the temporary folder is removed.
    A folder at ``final`` without the marker (left by something else) is moved
    aside and replaced.
    """
    if is_complete(final, marker_file):
        return final
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        make_dir(final.parent)
        _sweep_abandoned(final)
        make_dir(tmp, root=final.parent)
    except UntrustedInputError as exc:
        raise ModelCacheError(f"cannot write the model cache folder: {exc}") from None
    try:
        marker = write(tmp)
        write_atomic(tmp / marker_file, json.dumps(marker, indent=2, sort_keys=True) + "\n", root=tmp)
        for _ in range(3):
            try:
                os.rename(tmp, final)
                return final
            except OSError:
                if is_complete(final, marker_file):
                    return final  # another process finished first; ours is discarded below
                if final.exists():  # incomplete leftover: move it aside, then retry
                    _remove(final, f".{final.name}.stale-{uuid.uuid4().hex[:8]}")
        if is_complete(final, marker_file):
            return final
        raise ModelCacheError(f"could not move the model build into place at {final}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: Path, aside_name: str) -> None:
    aside = path.parent / aside_name
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _sweep_abandoned(final: Path) -> None:
    """Remove temporary folders of earlier builds of ``final`` whose process no longer runs."""
    for leftover in final.parent.glob(f".{final.name}.tmp-*"):
        pid_text = leftover.name.removeprefix(f".{final.name}.tmp-").split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        logger.info("removing an abandoned model build: %s", leftover)
        _remove(leftover, f".{final.name}.stale-{uuid.uuid4().hex[:8]}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
