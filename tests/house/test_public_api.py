"""The public API: every name in ``gym_bridge.__all__`` imports, and ``import gym_bridge`` stays light."""

from __future__ import annotations

import subprocess
import sys

import gym_bridge


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout


def test_importing_the_package_imports_neither_torch_nor_ray():
    out = _run("import sys, gym_bridge; print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    assert out.strip() == "[]"


def test_every_public_name_imports_from_the_package():
    code = (
        "import gym_bridge\n"
        "missing = [n for n in gym_bridge.__all__ if getattr(gym_bridge, n, None) is None]\n"
        "print(len(gym_bridge.__all__), missing)\n"
    )
    count, missing = _run(code).strip().split(" ", 1)
    assert missing == "[]"
    assert int(count) == len(gym_bridge.__all__) > 30


def test_public_names_point_at_the_modules_that_define_them():
    import importlib
    import inspect

    for name, module in gym_bridge._MODULE_OF.items():
        value = getattr(gym_bridge, name)
        assert value is getattr(importlib.import_module(module), name), name
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__ == module, f"{name} is defined in {value.__module__}, listed under {module}"
    assert set(dir(gym_bridge)) >= set(gym_bridge.__all__)


def test_the_type_checkers_import_list_names_the_same_exports():
    """``_public.py`` (read by type checkers) imports exactly ``_EXPORTS``, each name from its listed module."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(gym_bridge.__file__).parent / "_public.py").read_text())
    imported: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gym_bridge."):
            imported.setdefault(node.module, []).extend(alias.asname or alias.name for alias in node.names)
    assert {module: sorted(names) for module, names in imported.items()} == {
        module: sorted(names) for module, names in gym_bridge._EXPORTS.items()
    }


def test_an_unknown_name_is_an_attribute_error():
    try:
        gym_bridge.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("gym_bridge.NoSuchThing resolved")


def test_the_public_surface_is_named_in_one_place():
    """``gym_bridge.__all__`` (and the package ``__init__`` files that gather a folder's names) is the API: no other
    module names an ``__all__``, so nothing deep in the package looks like API. ``failures/errors.py`` keeps its list
    for the one star import that draws the exception tree."""
    import ast
    from pathlib import Path

    package = Path(gym_bridge.__file__).parent
    named = sorted(
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if path.name != "__init__.py"
        and any(
            isinstance(target, ast.Name) and target.id == "__all__"
            for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    )
    assert named == ["failures/errors.py"]


def _deep_imports(source: str) -> list[str]:
    """Each import in ``source`` of a module below ``gym_bridge`` (``gym_bridge.x``), as ``line: module``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name.startswith("gym_bridge.")]
    return found


def test_the_examples_import_only_the_public_api():
    """Every example (scripts, configs' helpers, the plugin suite) imports from ``gym_bridge`` itself, never a module
    below it: what an example needs is public (``__all__``), so a user copying one depends on nothing internal."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    files = sorted(examples.rglob("*.py"))
    assert files
    deep = {path.relative_to(examples).as_posix(): _deep_imports(path.read_text()) for path in files}
    assert {path: lines for path, lines in deep.items() if lines} == {}


def test_a_deep_import_in_an_example_is_caught():
    planted = (
        "from gym_bridge import init_ray\n"
        "import gym_bridge\n"
        "from gym_bridge.rollout.manager import RolloutManager\n"
        "def f():\n"
        "    import gym_bridge.serving.server\n"
    )
    assert _deep_imports(planted) == ["3: gym_bridge.rollout.manager", "5: gym_bridge.serving.server"]


GYM_STARTS = {"start_nemo_gym", "launch_nemo_gym", "start_nemo_gym_actors", "start_nemo_gym_actor"}
"""The public functions that start Gym: one stack starter and one actor starter, each with a thin wrapper. NeMo-RL's
``spinup_nemo_gym_actor`` keeps NeMo-RL's signature and is not one of ours."""


def test_gym_starts_one_public_way_with_wrappers_that_share_its_parameter_names():
    import inspect

    starters = {name for name in gym_bridge.__all__ if name.startswith(("start_", "launch_", "build_")) and "gym" in name}
    assert starters == GYM_STARTS
    for wrapper, core in (("launch_nemo_gym", "start_nemo_gym"), ("start_nemo_gym_actor", "start_nemo_gym_actors")):
        wrapped = list(inspect.signature(getattr(gym_bridge, wrapper)).parameters)
        shared = list(inspect.signature(getattr(gym_bridge, core)).parameters)
        assert wrapped[:2] == shared[:2] == (["spec", "tokenizer"] if core == "start_nemo_gym" else ["config", "tokenizer"])
        assert set(wrapped) - {"stop_timeout_s"} <= set(shared), (wrapper, wrapped, shared)
