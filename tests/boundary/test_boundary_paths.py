"""The boundary's writes inside a folder someone else may have filled: no component below the folder followed as a
link, no file with a second hard link appended to or truncated, a user's folder made or refused in one line, and
YAML that yields JSON's types only. Driven by generated folder trees (Hypothesis) as well as the named cases."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import folder_under, make_dir, open_append, open_nofollow, write_atomic
from gym_bridge.boundary.yaml_io import load_yaml

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
COMPONENT_KINDS = ["folder", "link_to_outside_folder", "link_to_inside_folder", "file", "missing", "fifo"]


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every name under ``folder`` (links not followed) with its bytes, or its kind."""
    seen: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            seen[key] = f"link -> {os.readlink(path)}"
        elif path.is_file():
            seen[key] = path.read_bytes()
        else:
            seen[key] = "folder" if path.is_dir() else "other"
    return seen


def _plant_component(parent: Path, name: str, kind: str, outside: Path) -> None:
    path = parent / name
    if kind == "folder":
        path.mkdir()
    elif kind == "link_to_outside_folder":
        path.symlink_to(outside, target_is_directory=True)
    elif kind == "link_to_inside_folder":
        (parent / f"{name}-real").mkdir()
        path.symlink_to(parent / f"{name}-real", target_is_directory=True)
    elif kind == "file":
        path.write_bytes(b"planted")
    elif kind == "fifo":
        os.mkfifo(path)


@FUZZ
@given(kinds=st.lists(st.sampled_from(COMPONENT_KINDS), min_size=1, max_size=3), create=st.booleans())
def test_a_write_under_a_run_folder_stays_in_it_or_is_one_line(tmp_path_factory, kinds, create):
    base = tmp_path_factory.mktemp("tree")
    root, outside = base / "run", base / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "victim.log").write_bytes(b"keep me")
    before = _snapshot(outside)
    folder, planted = root, []
    for depth, kind in enumerate(kinds):
        if not folder.is_dir() or folder.is_symlink():
            break
        _plant_component(folder, f"c{depth}", kind, outside)
        planted.append(kind)
        folder = folder / f"c{depth}"
    target = folder / "victim.log"
    try:
        if create:
            make_dir(folder, root=root)
        write_atomic(target, b"new", root=root)
        with open_append(folder / "other.log", root=root) as log:
            log.write(b"appended")
    except UntrustedInputError as exc:
        assert "\n" not in str(exc)
        if any(k.startswith("link_to") for k in planted):
            assert "a link inside the run folder" in str(exc)
    else:
        assert not any(k.startswith("link_to") for k in planted), "no link below the root is followed"
        assert Path(os.path.realpath(target)).is_relative_to(os.path.realpath(root))
    assert _snapshot(outside) == before


def test_a_link_planted_as_a_log_folder_is_refused_naming_it(tmp_path):
    (tmp_path / "outside").mkdir()
    root = tmp_path / "run"
    root.mkdir()
    (root / "gym-logs").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(UntrustedInputError, match=r"gym-logs: a link inside the run folder"):
        open_append(root / "gym-logs" / "server.log", root=root)
    assert not list((tmp_path / "outside").iterdir())


def test_the_root_itself_may_be_a_link_the_user_chose(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    make_dir(tmp_path / "alias" / "a" / "b", root=tmp_path / "alias")
    write_atomic(tmp_path / "alias" / "a" / "b" / "f.json", "{}", root=tmp_path / "alias")
    assert (tmp_path / "real" / "a" / "b" / "f.json").read_text() == "{}"


def test_dot_dot_never_leaves_the_root(tmp_path):
    with pytest.raises(UntrustedInputError, match=r"leaves .* through '\.\.'"):
        write_atomic(tmp_path / "run" / ".." / "x", b"", root=tmp_path / "run")


@pytest.mark.parametrize("flags", [os.O_WRONLY | os.O_APPEND, os.O_RDWR])
def test_a_file_with_a_second_hard_link_is_never_appended_to_or_truncated(tmp_path, flags):
    outside = tmp_path / "snapshot-results.jsonl"
    outside.write_bytes(b'{"prompt_idx": 0}\n')
    os.link(outside, tmp_path / "results.jsonl")
    with pytest.raises(UntrustedInputError, match=r"results\.jsonl: has 2 hard links"):
        open_nofollow(tmp_path / "results.jsonl", flags)
    assert outside.read_bytes() == b'{"prompt_idx": 0}\n'


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p.parent.mkdir() or p.write_text("x"), "exists and is not a folder"),
        (lambda p: p.parent.mkdir() or p.parent.chmod(0o500), "cannot be made"),
        (lambda p: None, None),
    ],
    ids=["a-file", "unwritable-parent", "fine"],
)
def test_a_users_folder_is_made_or_refused_in_one_line(tmp_path, setup, message):
    path = tmp_path / "parent" / "out"
    setup(path)
    if message is None or os.geteuid() == 0 and message == "cannot be made":
        assert make_dir(path).is_dir()
        return
    with pytest.raises(UntrustedInputError, match=message):
        make_dir(path)


def test_a_folder_under_a_file_names_the_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UntrustedInputError, match=r"out: cannot be made, .*file is a file"):
        make_dir(tmp_path / "file" / "deeper" / "out")


@pytest.mark.parametrize(
    ("text", "key", "kind"),
    [
        ("gym_overrides:\n  server:\n    key: !!binary aGVsbG8=\n", "gym_overrides.server.key", "bytes"),
        ("when: 2026-12-01\n", "when", "a date"),
        ("at: 2026-12-01 10:00:00\n", "at", "a datetime"),
        ("s: !!set {a: null}\n", "s", "a set"),
        ("items:\n  - {2026-12-01: x}\n", "items[0]", "a key of type date"),
    ],
)
def test_yaml_yields_json_types_only_naming_the_key(text, key, kind):
    with pytest.raises(
        UntrustedInputError, match=rf"cfg\.yaml: key {key.replace('[', '\\[').replace(']', '\\]')}: {kind}"
    ):
        load_yaml(text, "cfg.yaml")


def test_quoted_dates_and_plain_values_load_as_they_are():
    value = load_yaml("when: '2026-12-01'\nn: 1\nx: 1.5\nok: true\nnone: null\n", "cfg.yaml")
    assert value == {"when": "2026-12-01", "n": 1, "x": 1.5, "ok": True, "none": None}
    assert not isinstance(value["when"], datetime.date)


def test_a_folder_descriptor_is_closed_after_use(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with folder_under(tmp_path, tmp_path / "a" / "b", create=True):
            pass
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_integer_past_pythons_digit_limit_is_one_line():
    with pytest.raises(UntrustedInputError, match=r"cfg\.yaml: a value that cannot be read"):
        load_yaml("n: " + "9" * 5000, "cfg.yaml")


def test_a_secret_file_and_a_private_folder_keep_their_modes(tmp_path):
    private = make_dir(tmp_path / "private", mode=0o700)
    write_atomic(private / "launch.json", b"{}", root=private, mode=0o600)
    assert (private.stat().st_mode & 0o777, (private / "launch.json").stat().st_mode & 0o777) == (0o700, 0o600)
