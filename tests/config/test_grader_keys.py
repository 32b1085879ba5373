"""The grader settings (what decides a reward) are one tuple: ``compare`` refuses runs that differ in them and
``rescore`` may change only them, so the two cannot drift apart."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gym_bridge"


def test_grader_keys_are_defined_once_and_rescore_uses_compares() -> None:
    from gym_bridge.eval import compare, rescore

    def names(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.AnnAssign):
            return [getattr(node.target, "id", "")]
        return [getattr(target, "id", "") for target in node.targets] if isinstance(node, ast.Assign) else []

    defined = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.parse(path.read_text()).body
        if "GRADER_KEYS" in names(node)
    ]
    assert defined == ["eval/compare.py"]
    assert rescore.GRADER_KEYS is compare.GRADER_KEYS
