"""The exception tree drawn in ``gym_bridge/failures/__init__.py`` is complete and true: every exception class the
package defines (a leading ``_`` aside: a module's own control flow) is drawn once, under its real base class, and
nothing is drawn that the package does not define. Read from the source (AST), so no module is imported."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gym_bridge"
DRAWING = PACKAGE / "failures" / "__init__.py"
BUILTIN_EXCEPTIONS = {
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
}
_ENTRY = re.compile(r"^(?P<prefix>(?:    | {5}[ │├└─]*))(?P<name>[A-Z]\w*)(?:\s|$)")


def class_bases(sources: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """Every class in ``sources`` (module -> source): name -> (module, the names of its bases)."""
    found = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                found[node.name] = (module, bases)
    return found


def exception_classes(classes: dict[str, tuple[str, list[str]]]) -> dict[str, list[str]]:
    """The public exception classes among ``classes``: name -> its bases that are exceptions (the package's first)."""
    found: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, (_, bases) in classes.items():
            if name not in found and any(b in found or b in BUILTIN_EXCEPTIONS for b in bases):
                found.add(name)
                grew = True
    return {
        name: [b for b in classes[name][1] if b in found] + [b for b in classes[name][1] if b in BUILTIN_EXCEPTIONS]
        for name in found
        if not name.startswith("_")
    }


def drawn_parents(docstring: str) -> dict[str, list[str | None]]:
    """Each class drawn in ``docstring``'s trees -> the class drawn above it at a shallower depth (None: a root)."""
    drawn: dict[str, list[str | None]] = {}
    path: list[tuple[int, str]] = []
    for line in docstring.splitlines():
        match = _ENTRY.match(line)
        is_branch = match is not None and ("├" in match["prefix"] or "└" in match["prefix"])
        if match is None or not (is_branch or match["prefix"] == "    "):
            continue
        depth = len(match["prefix"])
        while path and path[-1][0] >= depth:
            path.pop()
        drawn.setdefault(match["name"], []).append(path[-1][1] if path and is_branch else None)
        path.append((depth, match["name"]))
    return drawn


def tree_problems(exceptions: dict[str, list[str]], drawn: dict[str, list[str | None]]) -> list[str]:
    """What the drawing gets wrong, one line each: a class not drawn, drawn under another base, or drawn twice, and
    a drawn class the package does not define. A class with no base of the package is drawn as a root, or under its
    builtin base drawn as one."""
    problems = []
    for name, bases in sorted(exceptions.items()):
        places = drawn.get(name, [])
        package_bases = [b for b in bases if b not in BUILTIN_EXCEPTIONS]
        expected: list[str | None] = [*package_bases] or [None, *bases]
        base = (package_bases or bases)[0]
        if not places:
            problems.append(f"{name} is not drawn (its base: {base})")
        elif package_bases and len(places) > 1:
            problems.append(f"{name} is drawn {len(places)} times")
        elif any(place not in expected for place in places):
            wrong = next(place for place in places if place not in expected)
            problems.append(f"{name} is drawn under {wrong or 'nothing'}, its base is {base}")
    undefined = set(drawn) - set(exceptions) - BUILTIN_EXCEPTIONS
    problems += [f"{name} is drawn but not defined" for name in sorted(undefined)]
    return problems


def package_sources() -> dict[str, str]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def drawing() -> dict[str, list[str | None]]:
    docstring = ast.get_docstring(ast.parse(DRAWING.read_text()))
    assert docstring is not None
    return drawn_parents(docstring)


def test_every_exception_class_is_drawn_under_its_base():
    assert tree_problems(exception_classes(class_bases(package_sources())), drawing()) == []


def test_the_drawing_is_read_as_drawn():
    drawn = drawing()
    assert drawn["GymBridgeError"] == [None]
    assert drawn["RolloutTimeout"] == ["RolloutInfraFailure"]
    assert drawn["NemoGymRestarted"] == ["NemoGymUnavailable"]
    assert drawn["RunReadError"] == ["UntrustedInputError"]
    assert drawn["EvalInterrupted"] == ["KeyboardInterrupt"]


def test_a_planted_class_missing_from_the_drawing_is_caught():
    sources = {
        **package_sources(),
        "gym_bridge.planted": (
            "class PlantedError(GymBridgeError, ValueError): ...\n"
            "class PlantedChild(PlantedError): ...\n"
            "class _PlantedPrivate(GymBridgeError): ...\n"
        ),
    }
    assert tree_problems(exception_classes(class_bases(sources)), drawing()) == [
        "PlantedChild is not drawn (its base: PlantedError)",
        "PlantedError is not drawn (its base: GymBridgeError)",
    ]


def test_a_class_drawn_under_another_base_or_not_defined_is_caught():
    exceptions = {"GymBridgeError": ["Exception"], "A": ["GymBridgeError"], "B": ["A", "ValueError"]}
    tree = "    GymBridgeError\n     ├── B    under the root\n     │    └── A\n     └── Gone\n"
    assert tree_problems(exceptions, drawn_parents(tree)) == [
        "A is drawn under B, its base is GymBridgeError",
        "B is drawn under GymBridgeError, its base is A",
        "Gone is drawn but not defined",
    ]
