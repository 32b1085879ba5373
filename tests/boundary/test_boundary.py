"""The trust boundary (gym_bridge/boundary/) driven by generated hostile input: files of every type and size, JSON of
any depth and number, YAML with aliases, text with control characters. The contract: a value, or one
``UntrustedInputError`` line naming where; never another exception, never a block, never a write outside the folder.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import open_nofollow, read_bytes, read_text, write_atomic
from gym_bridge.boundary.json_io import dumps, loads, loads_object
from gym_bridge.boundary.text import markdown_cell, shown
from gym_bridge.boundary.yaml_io import MAX_NODES, check_yaml, load_yaml

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------------------------------------------------- files

FILE_KINDS = ["regular", "empty", "fifo", "socket", "folder", "dev_zero", "link_to_regular", "link_to_fifo", "dangling"]


def _plant(folder: Path, kind: str, size: int) -> Path:
    path = folder / f"planted-{kind}"
    if kind in ("regular", "empty"):
        path.write_bytes(os.urandom(size if kind == "regular" else 0))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "folder":
        path.mkdir()
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "link_to_regular":
        (folder / "target").write_bytes(b"x" * size)
        path.symlink_to(folder / "target")
    elif kind == "link_to_fifo":
        os.mkfifo(folder / "fifo-target")
        path.symlink_to(folder / "fifo-target")
    elif kind == "dangling":
        path.symlink_to(folder / "nowhere")
    return path


def _within(seconds: float, fn, *args):
    """``fn(*args)`` on a thread that must finish within ``seconds`` (a reader that blocks on a FIFO fails here)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{fn.__name__} blocked"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


@FUZZ
@given(kind=st.sampled_from(FILE_KINDS), size=st.integers(0, 4096), cap=st.integers(0, 4096))
def test_reads_take_regular_files_under_the_cap_and_refuse_everything_else_in_one_line(tmp_path_factory, kind, size, cap):
    folder = tmp_path_factory.mktemp("files")
    path = _plant(folder, kind, size)
    try:
        data = _within(5, read_bytes, path, cap)
    except FileNotFoundError:
        assert kind == "dangling"
        return
    except UntrustedInputError as exc:
        message = str(exc)
        assert "\n" not in message and str(path) in message
        if kind in ("fifo", "socket", "folder", "dev_zero", "link_to_fifo"):
            assert "not a regular file" in message
        else:
            assert "over the limit" in message and size > cap
        return
    assert kind in ("regular", "empty", "link_to_regular") and len(data) <= cap


def test_text_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n\xff\n')
    with pytest.raises(UntrustedInputError, match=r"data.jsonl: not UTF-8 text \(byte 9\)"):
        read_text(path, 100)


@FUZZ
@given(planted=st.sampled_from(["link_out", "link_dir", "regular", "missing"]), payload=st.binary(max_size=64))
def test_writes_replace_a_planted_link_and_never_touch_its_target(tmp_path_factory, planted, payload):
    folder, outside = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("outside")
    secret = outside / "token"
    secret.write_bytes(b"API-TOKEN")
    name = folder / "metrics.json"
    if planted == "link_out":
        name.symlink_to(secret)
    elif planted == "link_dir":
        name.symlink_to(outside, target_is_directory=True)
    elif planted == "regular":
        name.write_bytes(b"old")
    write_atomic(name, payload)
    assert name.read_bytes() == payload and not name.is_symlink()
    assert secret.read_bytes() == b"API-TOKEN" and sorted(p.name for p in outside.iterdir()) == ["token"]
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.json"], "no temporary file left behind"


def test_appends_and_repairs_refuse_a_planted_link_in_one_line(tmp_path):
    secret = tmp_path / "token"
    secret.write_bytes(b"API-TOKEN")
    link = tmp_path / "failures.jsonl"
    link.symlink_to(secret)
    with pytest.raises(UntrustedInputError, match="failures.jsonl: a link"):
        open_nofollow(link, os.O_WRONLY | os.O_APPEND)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UntrustedInputError, match="not a regular file \\(a FIFO\\)"):
        _within(5, open_nofollow, tmp_path / "fifo", os.O_RDWR)
    assert secret.read_bytes() == b"API-TOKEN"


# ----------------------------------------------------------------------------------------------------------- JSON

JSON_TOKENS = st.sampled_from(
    ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 5000, "1" * 400, '"\\ud800"', '"\\u0000\\u001b"', "[]"]
)


@st.composite
def hostile_json(draw) -> str:
    """Text that is JSON, nearly JSON, or JSON nested to any depth around a hostile token."""
    nest = draw(st.integers(0, 3000))
    inner = draw(st.one_of(JSON_TOKENS, st.text(max_size=40)))
    shape = draw(st.sampled_from(["list", "object", "mixed"]))
    if shape == "list":
        return "[" * nest + inner + "]" * nest
    if shape == "object":
        return '{"a":' * nest + inner + "}" * nest
    return "".join(draw(st.sampled_from(['[', '{"k":'])) for _ in range(min(nest, 50))) + inner


@FUZZ
@given(text=hostile_json(), max_depth=st.integers(1, 200))
def test_untrusted_json_is_a_finite_shallow_value_or_one_line(text, max_depth):
    try:
        value = loads(text.encode("utf-8", "surrogatepass"), "data.jsonl:7", max_depth=max_depth)
    except UntrustedInputError as exc:
        assert str(exc).startswith("data.jsonl:7: ") and "\n" not in str(exc)
        return
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, float):
            assert math.isfinite(item)
        if isinstance(item, list | dict):
            assert level <= max_depth
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))


def test_a_json_line_that_is_not_an_object_is_named():
    with pytest.raises(UntrustedInputError, match=r"^results.jsonl:3: not a JSON object$"):
        loads_object(b"[1, 2]", "results.jsonl:3")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(-(2**200), 2**200) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4),
    max_leaves=30,
)


@FUZZ
@given(value=JSON_VALUES)
def test_json_out_is_strict_json_that_any_reader_accepts(value):
    out = dumps(value)
    parsed = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} written"))
    assert json.dumps(parsed, allow_nan=False)  # no NaN or Infinity anywhere


# ----------------------------------------------------------------------------------------------------------- YAML


@st.composite
def alias_yaml(draw) -> tuple[str, int]:
    """A document of ``levels`` anchored lists, each holding ``width`` aliases of the one before: width**levels
    nodes once expanded, from a few hundred bytes."""
    levels, width = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    lines = ["l0: &l0 [x]"]
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    expanded = sum(_list_nodes(level, width) for level in range(levels + 1)) + 2 * (levels + 1) + 1
    return "\n".join(lines), expanded


def _list_nodes(level: int, width: int) -> int:
    """Nodes of the level-``level`` list once expanded: itself plus ``width`` copies of the level below."""
    return 2 if level == 0 else 1 + width * _list_nodes(level - 1, width)


@FUZZ
@given(doc=alias_yaml())
def test_yaml_aliases_are_expanded_only_within_the_node_budget(doc):
    text, expanded = doc
    if expanded <= MAX_NODES:
        assert isinstance(load_yaml(text, "eval.yaml"), dict)
        return
    with pytest.raises(UntrustedInputError, match=r"^eval.yaml: its aliases expand to more than 1,000,000 nodes"):
        check_yaml(text, "eval.yaml")


@FUZZ
@given(text=st.text(max_size=300))
def test_any_text_is_a_yaml_value_or_one_line(text):
    try:
        load_yaml(text, "train.yaml")
    except UntrustedInputError as exc:
        assert str(exc).startswith("train.yaml: ") and "\n" not in str(exc)


def test_the_billion_laughs_is_refused_in_milliseconds_and_python_tags_build_nothing():
    bomb = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    with pytest.raises(UntrustedInputError, match="aliases expand"):
        load_yaml(bomb, "bomb.yaml")
    with pytest.raises(UntrustedInputError, match="not valid YAML"):
        load_yaml("x: !!python/object/apply:os.system ['touch /tmp/pwned']", "evil.yaml")
    with pytest.raises(UntrustedInputError, match="nested too deeply"):
        load_yaml("[" * 50_000, "deep.yaml")
    assert yaml.safe_load("a: 1") == load_yaml("a: 1", "fine.yaml")


# ----------------------------------------------------------------------------------------------------------- text


@FUZZ
@given(text=st.text(alphabet=st.characters(codec=None, categories=None), max_size=80))
def test_shown_text_is_one_printable_line(text):
    out = shown(text)
    assert out.isprintable() and "\x1b" not in out and "\u202e" not in out
    cell = markdown_cell(text)
    assert cell.isprintable() and "|" not in cell.replace("\\|", "")
