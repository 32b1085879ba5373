"""Docs that run: every command block of README.md and docs/*.md is run, or marked with the reason it is not.

``make test-docs`` runs this module. What it collects, from each fenced block of README.md and docs/*.md:

- **```bash blocks** (also ``sh``, ``shell``): each one is a test item (``test_a_command_block_runs[docs/x.md:12]``):
  the block as one ``bash -euo pipefail`` script, in a fresh folder of its own that holds ``examples/`` and
  ``benchmarks/`` (links to this checkout's) and ``runs/base``, ``runs/candidate``, ``runs/qwen3`` and
  ``runs/demo-20250101-120000``: copies of one finished ``gym-bridge eval`` of the scripted policy, built once for the
  module. ``uv`` runs this checkout's environment there (``UV_PROJECT``, ``UV_NO_SYNC``), every ``gym-bridge eval``
  joins one Ray (``eval_ray_env``), and a block has :data:`BLOCK_TIMEOUT_S` seconds. A block that cannot run here
  carries, on the line above its fence, ``<!-- docs-test: skip (the reason) -->``: it is reported as skipped with
  that reason (pytest's ``-rs`` lists them; ``test_the_collector_reports_what_ran_and_what_was_skipped`` prints the
  counts). An unmarked block that fails fails the test: mark it, or make it run.
- **Every shell block, skipped or not, and the ``$ `` lines of ```console transcripts**
  (``test_the_commands_of_a_block_name_what_exists``): each ``gym-bridge`` command parses with the real argument
  parser, each ``make`` target is in the Makefile, each ``python x.py`` file is in the checkout. This is all a
  skipped block is checked for.
- **```python blocks**: their ``gym_bridge`` imports import, and each name they import exists
  (``test_a_python_snippets_gym_bridge_imports_import``); every ``gym_bridge.a.b`` named in backticks anywhere in
  the docs resolves (``test_every_dotted_gym_bridge_name_the_docs_give_resolves``).
- **The markup**: an untagged block whose first line is a command (``uv``, ``make``, ``gym-bridge``, ...) fails: tag
  it ``bash`` (or ``console`` for a transcript with output), so no command escapes the collector; a marker must sit
  right above a shell block and say why.

Under pytest-xdist (``make test``'s lanes) the blocks are not run (the static checks are): ``make test-docs`` runs
them, after ``make test`` in ``.ci/run``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SHELL = ("bash", "sh", "shell")
BLOCK_TIMEOUT_S = 540
"""Seconds one block may run (the slowest, the ``gym dataset collate`` walk-through, takes ~1 min on 2 cores)."""
RUN_FOLDERS = ("base", "candidate", "qwen3", "demo-20250101-120000")
"""The run folders the docs' ``report`` / ``compare`` / ``rescore`` lines name: copies of one scripted eval."""
LINKED = ("examples", "benchmarks")
"""The checkout's folders a block's commands read (configs, data, scripts), linked into its folder."""
COMMAND_START = re.compile(r"^(\$ )?(uv|make|gym-bridge|gym|python|vllm|curl|ray|export|mkdir)( |$)")

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*\((?P<reason>.*\S.*)\)\s*-->\s*$")
_ANY_MARKER = re.compile(r"^\s*<!--\s*docs-test")
"""A line that is a docs-test marker (one that only mentions the syntax, inside other text, is not)."""


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (the fence's line, 1-based), its language tag, its text, and the reason
    of its ``docs-test: skip`` marker (None: run it)."""

    path: Path
    line: int
    lang: str
    text: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _parse(path: Path) -> tuple[list[Block], list[str]]:
    """The blocks of one Markdown file and the markup problems found (a bad, stray or misplaced marker, an
    unclosed fence)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    rel = path.relative_to(REPO)
    blocks: list[Block] = []
    problems: list[str] = []
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening["fence"]
        end = next(
            (j for j in range(i + 1, len(lines)) if re.fullmatch(rf" *{re.escape(fence[0])}{{{len(fence)},}}\s*", lines[j])),
            None,
        )
        if end is None:
            problems.append(f"{rel}:{i + 1}: a fenced block that never closes")
            break
        skip = None
        if i > 0 and _ANY_MARKER.match(lines[i - 1]):
            marker = _MARKER.match(lines[i - 1])
            used_markers.add(i - 1)
            if marker is None:
                problems.append(f"{rel}:{i}: write the marker as <!-- docs-test: skip (the reason) -->")
            else:
                skip = marker["reason"].strip()
            if opening["lang"] not in SHELL:
                problems.append(f"{rel}:{i}: a docs-test marker above a {opening['lang'] or 'untagged'} block")
        text = "\n".join(line.removeprefix(opening["indent"]) for line in lines[i + 1 : end])
        blocks.append(Block(path, i + 1, opening["lang"], text, skip))
        i = end + 1
    for n, line in enumerate(lines):
        if _ANY_MARKER.match(line) and n not in used_markers:
            problems.append(f"{rel}:{n + 1}: a docs-test marker not right above a fenced block")
    return blocks, problems


PARSED = [_parse(path) for path in DOCS]
BLOCKS = [block for blocks, _ in PARSED for block in blocks]
MARKUP_PROBLEMS = [problem for _, problems in PARSED for problem in problems]
SHELL_BLOCKS = [block for block in BLOCKS if block.lang in SHELL]
CONSOLE_BLOCKS = [block for block in BLOCKS if block.lang == "console"]
"""Transcripts: ``$ command`` lines and what they print. Their commands are checked, never run."""
PYTHON_BLOCKS = [block for block in BLOCKS if block.lang == "python"]


def commands(block: Block) -> list[list[str]]:
    """A block's commands as argument lists: continuation lines joined, comments dropped, leading ``VAR=value``
    assignments and ``uv run`` left out (so ``uv run gym-bridge x`` is ``["gym-bridge", "x"]``). A transcript's
    commands are its ``$ `` lines."""
    lines = block.text.split("\n")
    if block.lang == "console":
        lines = [line.removeprefix("$ ") for line in lines if line.startswith("$ ")]
    logical: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    out = []
    for line in logical:
        argv = shlex.split(line, comments=True)
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv[:2] == ["uv", "run"]:
            argv = argv[2:]
        if argv:
            out.append(argv)
    return out


# ---------------------------------------------------------------------------------------------- the markup


def test_the_docs_markup_is_well_formed():
    assert not MARKUP_PROBLEMS, "\n".join(MARKUP_PROBLEMS)


def test_every_block_of_commands_is_tagged_so_the_collector_sees_it():
    untagged = [
        f"{block.id}: tag it ```bash (or ```console for a transcript with output)"
        for block in BLOCKS
        if block.lang == "" and COMMAND_START.match(next((ln.strip() for ln in block.text.split("\n") if ln.strip()), ""))
    ]
    assert not untagged, "\n".join(untagged)


# ---------------------------------------------------------------------------------------------- static checks


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))


def _gym_bridge_parses(argv: list[str]) -> str | None:
    """None when ``gym-bridge ARGV`` parses (``--help`` included), else what the parser said."""
    from gym_bridge.cli import build_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else f"exit {exc.code}"
    return None


@pytest.mark.parametrize("block", SHELL_BLOCKS + CONSOLE_BLOCKS, ids=lambda b: b.id)
def test_the_commands_of_a_block_name_what_exists(block: Block):
    targets = _makefile_targets()
    problems = []
    for argv in commands(block):
        shown = " ".join(argv)
        if argv[0] == "gym-bridge":
            said = _gym_bridge_parses(argv[1:])
            if said:
                problems.append(f"`{shown}`: {said}")
        elif argv[0] == "make":
            missing = [a for a in argv[1:] if not a.startswith("-") and "=" not in a and a not in targets]
            if missing:
                problems.append(f"`{shown}`: no Makefile target {', '.join(missing)}")
        elif argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py") and not (REPO / argv[1]).is_file():
            problems.append(f"`{shown}`: no file {argv[1]} in the checkout")
        elif argv[0].startswith("-"):
            problems.append(f"`{shown}`: an option on a line of its own (a continuation without its backslash?)")
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


def _imports(block: Block) -> list[ast.Import | ast.ImportFrom]:
    """The ``gym_bridge`` import statements of a snippet (a snippet that is not valid Python, such as one with
    ``...`` placeholders, gives the import statements found line by line)."""
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    try:
        tree = compile(block.text, block.id, "exec", flags=flags)
        nodes = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    except SyntaxError:
        statements = re.findall(r"^\s*((?:from\s+gym_bridge\S*\s+import\s+(?:\([^)]*\)|.*))|import\s+gym_bridge.*)$",
                                block.text, flags=re.MULTILINE)  # fmt: skip
        nodes = [node for s in statements for node in ast.parse(s.strip()).body]
    return [
        node
        for node in nodes
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gym_bridge")
        or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "gym_bridge" for a in node.names))
    ]


def _import_problem(node: ast.Import | ast.ImportFrom) -> list[str]:
    problems = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            try:
                importlib.import_module(alias.name)
            except ImportError as exc:
                problems.append(f"import {alias.name}: {exc}")
        return problems
    module_name = node.module or ""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return [f"from {module_name} import ...: {exc}"]
    for alias in node.names:
        if alias.name == "*" or hasattr(module, alias.name):
            continue
        try:
            importlib.import_module(f"{module_name}.{alias.name}")
        except ImportError:
            problems.append(f"from {module_name} import {alias.name}: {module_name} has no {alias.name}")
    return problems


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_a_python_snippets_gym_bridge_imports_import(block: Block):
    problems = [problem for node in _imports(block) for problem in _import_problem(node)]
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


def _entry_point_groups() -> set[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(pyproject["project"].get("entry-points", {}))


def resolves(dotted: str) -> bool:
    """``gym_bridge.a.b.c`` names a module, or an attribute of the longest module prefix of it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            node: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(node, name):
                return False
            node = getattr(node, name)
        return True
    return False


def test_every_dotted_gym_bridge_name_the_docs_give_resolves():
    groups = _entry_point_groups()
    named = {
        (path.relative_to(REPO), name)
        for path in DOCS
        for name in re.findall(r"`(gym_bridge(?:\.[A-Za-z_]\w*)+)", path.read_text(encoding="utf-8"))
        if name not in groups
    }
    broken = sorted(f"{path}: {name}" for path, name in named if not resolves(name))
    assert not broken, "names the docs give that do not exist:\n" + "\n".join(broken)


# ---------------------------------------------------------------------------------------------- running them


def _uv() -> str:
    """The uv that runs this test (``uv run`` exports ``UV``), else the one on PATH."""
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        pytest.fail("the doc commands need uv (make test-docs runs them through it)")
    return found


def _block_env(ray_env: dict[str, str]) -> dict[str, str]:
    env = {key: value for key, value in ray_env.items() if not key.startswith(("PYTEST_", "COV_"))}
    env.update(
        UV_PROJECT=str(REPO),  # `uv run` in the block's folder runs this checkout's environment
        UV_NO_SYNC="1",  # and leaves it as it is
        PATH=f"{Path(_uv()).parent}{os.pathsep}{env.get('PATH', '')}",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run_script(script: str, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``bash -euo pipefail -x`` over ``script`` in its own session (killed whole on a timeout): (exit, output)."""
    path = cwd / ".docs-block.sh"
    path.write_text(f"set -euo pipefail -x\n{script}\n")
    proc = subprocess.Popen(["bash", str(path)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return 124, f"{output}\n[timed out after {timeout:.0f} s]"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left behind
    return proc.returncode, output


@pytest.fixture(scope="module")
def built_runs(eval_ray_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished eval of the scripted policy (2 prompts, 2 samples each), the run folder the docs' report,
    compare and rescore lines read."""
    folder = tmp_path_factory.mktemp("docs-runs")
    for name in LINKED:
        (folder / name).symlink_to(REPO / name)
    code, output = _run_script(
        "uv run gym-bridge eval examples/eval_equivalence_tools.yaml limit=2 num_generations_per_prompt=2 "
        "output_dir=runs/base --no-progress",
        folder, _block_env(eval_ray_env), BLOCK_TIMEOUT_S,
    )  # fmt: skip
    assert code == 0, f"the run folder the doc blocks read was not built:\n{output[-4000:]}"
    return folder / "runs" / "base"


def _block_folder(tmp_path: Path, base_run: Path) -> Path:
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    for name in RUN_FOLDERS:
        shutil.copytree(base_run, tmp_path / "runs" / name)
    return tmp_path


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S * 2 + 120)
@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.id)
def test_a_command_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path):
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("the doc commands run in `make test-docs` (the static checks of this module run here)")
    env = _block_env(request.getfixturevalue("eval_ray_env"))
    folder = _block_folder(tmp_path, request.getfixturevalue("built_runs"))
    code, output = _run_script(block.text, folder, env, BLOCK_TIMEOUT_S)
    assert code == 0, f"{block.id} exited {code} (mark it <!-- docs-test: skip (why) --> if it cannot run here):\n{output[-6000:]}"  # fmt: skip


def test_the_collector_reports_what_ran_and_what_was_skipped(capsys: pytest.CaptureFixture[str]):
    skipped = [block for block in SHELL_BLOCKS if block.skip is not None]
    importing = [block for block in PYTHON_BLOCKS if _imports(block)]
    lines = [
        f"docs commands: {len(SHELL_BLOCKS)} shell blocks in {len({b.path for b in SHELL_BLOCKS})} files: "
        f"{len(SHELL_BLOCKS) - len(skipped)} run, {len(skipped)} skipped as marked; "
        f"{len(PYTHON_BLOCKS)} python blocks, {len(importing)} with gym_bridge imports checked",
        *(f"  skipped {block.id}: {block.skip}" for block in skipped),
    ]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(SHELL_BLOCKS) - len(skipped) > 0, "no doc block runs"
