"""Size kept by the suite: every module of the package is at most 450 lines and every function or method at most 80
(``end_lineno - lineno + 1``, decorators excluded), so a module keeps one job and a function one step. One function
is excepted by name (a verbatim chat template); :data:`NOT_YET` lists what is still over and only shrinks: an entry
that no longer violates fails the suite until it is removed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gym_bridge"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80

EXEMPT = {"gym_bridge.models.templates:hermes_chat_template": "a verbatim chat template: its lines are the model's"}

NOT_YET: dict[str, str] = {}
"""What is still over a limit, being split ("module" or "module:function" -> why it is listed); only shrinks."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def function_lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Every function and method in ``tree`` by qualified name (``Class.method``, ``outer.inner``), with its lines."""
    lengths: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                lengths[name] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            lengths.update(function_lengths(node, f"{name}."))
        else:
            lengths.update(function_lengths(node, prefix))
    return lengths


def violations(module: str, source: str) -> dict[str, int]:
    """What in one module's ``source`` is over a limit: ``module`` -> its lines, ``module:function`` -> its lines."""
    found = {}
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found[module] = lines
    for name, length in function_lengths(ast.parse(source)).items():
        key = f"{module}:{name}"
        if length > MAX_FUNCTION_LINES and key not in EXEMPT:
            found[key] = length
    return found


def package_violations() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found.update(violations(module_name(path), path.read_text()))
    return found


def over_limits(found: dict[str, int], not_yet: dict[str, str]) -> dict[str, int]:
    """The violations in ``found`` that :data:`NOT_YET` does not list."""
    return {key: lines for key, lines in found.items() if key not in not_yet}


def stale_entries(found: dict[str, int], not_yet: dict[str, str]) -> list[str]:
    """The entries of ``not_yet`` that are no longer over a limit."""
    return sorted(set(not_yet) - set(found))


def test_no_module_or_function_is_over_its_size():
    new = over_limits(package_violations(), NOT_YET)
    assert new == {}, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: split by concern"


def test_the_not_yet_list_only_shrinks():
    assert stale_entries(package_violations(), NOT_YET) == [], "no longer over a limit: remove from NOT_YET"


def test_a_listed_violation_passes_and_a_stale_entry_is_caught():
    found = {"gym_bridge.big": 500, "gym_bridge.big:f": 90}
    not_yet = {"gym_bridge.big": "being split", "gym_bridge.gone:g": "split already"}
    assert over_limits(found, not_yet) == {"gym_bridge.big:f": 90}
    assert stale_entries(found, not_yet) == ["gym_bridge.gone:g"]


def test_the_exemption_names_a_function_that_exists():
    for key in EXEMPT:
        module, name = key.split(":")
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        assert name in function_lengths(ast.parse(path.read_text())), f"{key}: no such function"


def test_a_planted_long_module_is_caught(tmp_path: Path):
    path = tmp_path / "planted.py"
    path.write_text('"""A module."""\n' + "x = 1\n" * MAX_MODULE_LINES)
    assert violations("gym_bridge.planted", path.read_text()) == {"gym_bridge.planted": MAX_MODULE_LINES + 1}
    path.write_text("x = 1\n" * MAX_MODULE_LINES)
    assert violations("gym_bridge.planted", path.read_text()) == {}


def test_a_planted_long_function_and_method_are_caught(tmp_path: Path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    short = "def short():\n" + "    return 1\n"
    method = "class Holder:\n    @staticmethod\n    def long():\n" + body.replace("    ", "        ")
    source = "@decorator\ndef long():\n" + body + short + method
    path = tmp_path / "planted.py"
    path.write_text(source)
    assert violations("gym_bridge.planted", path.read_text()) == {
        "gym_bridge.planted:long": MAX_FUNCTION_LINES + 1,
        "gym_bridge.planted:Holder.long": MAX_FUNCTION_LINES + 1,
    }


def test_the_exempt_function_is_excepted_by_name_only():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = "def hermes_chat_template():\n" + body
    assert violations("gym_bridge.models.templates", source) == {}
    assert violations("gym_bridge.models.other", source) == {
        "gym_bridge.models.other:hermes_chat_template": MAX_FUNCTION_LINES + 1
    }
