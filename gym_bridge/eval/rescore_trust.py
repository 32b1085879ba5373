"""The trust boundary of a rescore: a run folder's grader settings are taken as data only, never as code or paths."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from gym_bridge.boundary.text import shown
from gym_bridge.eval.runs import RunReadError
from gym_bridge.json_types import JsonMapping

_SERVER_LEVELS = 3
"""A Gym config nests ``<server name>: {<server type>: {<implementation>: {settings}}}``."""
CODE_WORDS = frozenset(
    {"entrypoint", "path", "paths", "fpath", "dir", "dirs", "directory", "file", "files", "filename", "command",
     "cmd", "exec", "executable", "script", "scripts", "venv", "python", "pip", "uv", "install", "requirements",
     "module", "import", "target", "class", "host", "port", "url", "urls", "address", "env", "shell", "bin"}
)  # fmt: skip
"""Words that mark a setting as code, a path, a command or an address (``jsonl_fpath``, ``_target_``,
``base_url``): a run folder's ``gym_overrides`` may set none of them."""


def trusted_config_files(config_paths: list[str], run_json: Path | None) -> list[Path]:
    """The Gym config files a rescore loads: the user's (``run_json`` None) found as Gym finds them, in the cwd
    then in the installed nemo-gym; a run folder's only inside the installed nemo-gym, under a Gym server type,
    so a folder cannot name a config of its own (or one in the cwd) that starts a server of its choice.

    Raises:
        RunReadError: a path from ``run_json`` is absolute, climbs (``..``), or is not a config of the
            installed nemo-gym (the field named).
        GymConfigNotFound: a user's relative path is neither in the cwd nor in the installed nemo-gym.
    """
    from gym_bridge.gym.servers.config_files import GymConfigNotFound, config_path, wheel_config_path
    from gym_bridge.gym_versions import installed_gym

    if run_json is None:
        return [config_path(name) for name in config_paths]
    files = []
    for i, name in enumerate(config_paths):
        relative = PurePosixPath(name)
        problem = (
            f"{shown(run_json)}: field 'config.config_paths[{i}]': {shown(name)!r} is not a config of the installed "
            f"nemo-gym; {_FROM_THE_USER}"
        )
        climbs = relative.is_absolute() or ".." in relative.parts
        if climbs or relative.parts[:1] not in [(kind,) for kind in installed_gym().server_types]:
            raise RunReadError(problem)
        try:
            files.append(wheel_config_path(str(relative)))
        except GymConfigNotFound:
            raise RunReadError(problem) from None
    return files


_FROM_THE_USER = "a rescore takes only grader settings from a run folder: pass your own config with --config"


def check_stored_overrides(overrides: JsonMapping, blocks: JsonMapping, run_json: Path) -> None:
    """Refuse a run folder's ``gym_overrides`` unless they are grader settings as data: each names a server, server
    type and implementation that the config files define (no server of its own), and no setting below is code,
    a path, a command or an address (:data:`CODE_WORDS`) or an interpolation (``${...}``, which Gym's config
    resolves, reading the environment).

    Raises:
        RunReadError: the first setting refused, its field named.
    """
    stack: list[tuple[str, object, object, int]] = [("config.gym_overrides", overrides, blocks, 0)]
    while stack:
        name, value, known, level = stack.pop()
        if level < _SERVER_LEVELS:
            if not isinstance(value, dict) or not isinstance(known, dict):
                raise _refused(run_json, name, "is not a mapping of the servers config_paths define")
            for key, inner in value.items():
                if key not in known:
                    raise _refused(run_json, f"{name}.{key}", "names no server that config_paths define")
                stack.append((f"{name}.{key}", inner, known[key], level + 1))
        elif isinstance(value, dict):
            for key, inner in value.items():
                if _names_code(str(key)):
                    raise _refused(run_json, f"{name}.{key}", "names code, a path, a command or an address")
                stack.append((f"{name}.{key}", inner, None, level + 1))
        elif isinstance(value, list):
            stack.extend((f"{name}[{i}]", inner, None, level + 1) for i, inner in enumerate(value))
        elif isinstance(value, str) and "${" in value:
            raise _refused(run_json, name, "is an interpolation (${...}), which Gym's config would resolve")


def _names_code(key: str) -> bool:
    """Whether a setting's name holds a word of :data:`CODE_WORDS` (snake_case, kebab-case or camelCase)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower())
    return not CODE_WORDS.isdisjoint(words)


def _refused(run_json: Path, name: str, why: str) -> RunReadError:
    return RunReadError(f"{shown(run_json)}: field {shown(name)!r} {why}; {_FROM_THE_USER}")
