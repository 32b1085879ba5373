"""Every module of the package ships: each folder is a regular package and no file is git-ignored.

Hatchling leaves git-ignored files out of the wheel, and an editable install hides that, so a broad
ignore pattern (such as ``build/``) matching a package folder would ship a wheel without it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gym_bridge"
SCRIPT_FOLDERS = {"gym_bridge/gym_model/gym_server"}  # a Gym server folder: Gym runs its app.py as a script


def package_files(pattern: str = "*.py") -> list[Path]:
    return [p for p in PACKAGE.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts]


def test_every_folder_of_the_package_is_a_regular_package():
    folders = {path.parent for path in package_files()}
    plain = {f.relative_to(ROOT).as_posix() for f in folders if not (f / "__init__.py").exists()}
    assert plain == SCRIPT_FOLDERS


def test_no_file_of_the_package_is_git_ignored():
    files = [path.relative_to(ROOT).as_posix() for path in package_files("*")]  # configs and templates too
    found = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", *files], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert found.returncode == 1, f"git-ignored, so left out of the wheel:\n{found.stdout}{found.stderr}"


def test_the_wheel_carries_py_typed_and_every_module(tmp_path):
    """Users' type checkers read our annotations only from a wheel with ``py.typed`` (PEP 561); the wheel is built
    as a user's installer builds it, and every module, template and config of the package is in it."""
    uv = shlex.split(os.environ.get("UV", "uv"))
    built = subprocess.run(
        [*uv, "build", "--wheel", "--out-dir", str(tmp_path), "-q"], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("gym_bridge-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gym_bridge/py.typed" in names
    expected = {path.relative_to(ROOT).as_posix() for path in package_files("*") if path.suffix != ".pyc"}
    assert expected - names == set()
