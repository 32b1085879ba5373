"""YAML from outside (eval and training configs, Gym config blocks), with alias expansion bounded before anything is
built: a 1 KB "billion laughs" document names 10^9 nodes through nested aliases, and the readers after the parser
(OmegaConf, ``copy.deepcopy``, ``json.dumps`` of a run file) expand every alias they meet."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import read_text
from gym_bridge.boundary.text import shown

MAX_NODES = 1_000_000
"""How many nodes a YAML document may hold once every alias is expanded (NeMo-RL's largest recipe: ~2,000)."""
MAX_CONFIG_BYTES = 16 << 20
"""The largest config file read."""


def check_yaml(text: str, where: str, *, max_nodes: int = MAX_NODES) -> None:
    """Refuse ``text`` when it is not one YAML document, or when expanding its aliases gives more than ``max_nodes``
    nodes (or an alias refers to the node that holds it).

    Raises:
        UntrustedInputError: ``where: ...`` naming the problem and the line where the parser stopped.
    """
    with _loader(text, where) as loader:
        _composed(loader, where, max_nodes)


def load_yaml(text: str, where: str, *, max_nodes: int = MAX_NODES) -> Any:
    """The value of the YAML document ``text`` (YAML's safe schema: plain data only), once :func:`check_yaml` passed.
    Only JSON's types come out: a value YAML builds as bytes (``!!binary``), a date or time (an unquoted
    ``2026-12-01``), a set or a mapping key that is not a string, number, bool or null is refused naming its key.

    Raises:
        UntrustedInputError: as :func:`check_yaml`, or ``where: key a.b: a date, not a JSON value (quote it)``.
    """
    with _loader(text, where) as loader:
        node = _composed(loader, where, max_nodes)
        value = None if node is None else loader.construct_document(node)
    _check_plain(value, where)
    return value


def read_yaml_file(path: str | Path, *, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """The YAML document in the regular file ``path`` (at most ``max_bytes``), checked and loaded.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UntrustedInputError: not a regular file, too large, not UTF-8, not YAML, or its aliases expand too far.
    """
    return load_yaml(read_text(path, max_bytes), shown(path))


@contextlib.contextmanager
def _loader(text: str, where: str) -> Iterator[yaml.SafeLoader]:
    """A safe loader over ``text``; any YAML error inside (the reader's too) becomes one line naming ``where``."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        yield loader
    except yaml.YAMLError as exc:
        raise UntrustedInputError(f"{where}: not valid YAML ({_first_line(exc)})") from None
    except UntrustedInputError:
        raise
    except ValueError as exc:  # a value YAML's constructors cannot build: an integer past Python's digit limit
        raise UntrustedInputError(f"{where}: a value that cannot be read ({_first_line(exc)})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _composed(loader: yaml.SafeLoader, where: str, max_nodes: int) -> yaml.Node | None:
    """The document's node graph (aliases are shared nodes, not copies yet), its expanded size checked."""
    try:
        node = loader.get_single_node()
    except RecursionError:
        raise UntrustedInputError(f"{where}: nested too deeply to read") from None
    if node is not None:
        _check_size(node, where, max_nodes)
    return node


def _check_size(root: yaml.Node, where: str, max_nodes: int) -> None:
    """Count the nodes ``root`` expands to, each shared node's size computed once (post-order, no recursion)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > max_nodes:
                raise UntrustedInputError(
                    f"{where}: its aliases expand to more than {max_nodes:,} nodes "
                    f"(near line {node.start_mark.line + 1}); a config is refused before it is built"
                )
            continue
        if key in open_nodes:
            raise UntrustedInputError(
                f"{where}: an alias refers to the node that holds it (line {node.start_mark.line + 1})"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Refuse any value in ``value`` that JSON has no type for, naming its key path (iterative: no recursion)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, key = stack.pop()
        if isinstance(item, dict):
            for child_key, child in item.items():
                if not isinstance(child_key, _PLAIN):
                    raise _not_plain(where, key or "(top)", f"a key of type {type(child_key).__name__}")
                stack.append((child, f"{key}.{child_key}" if key else str(child_key)))
        elif isinstance(item, list):
            stack.extend((child, f"{key}[{i}]") for i, child in enumerate(item))
        elif not isinstance(item, _PLAIN):
            kinds: dict[type, str] = {bytes: "bytes (!!binary)", set: "a set"}
            kind = kinds.get(type(item), f"a {type(item).__name__}")
            raise _not_plain(where, key or "(top)", kind)


def _not_plain(where: str, key: str, kind: str) -> UntrustedInputError:
    return UntrustedInputError(f"{where}: key {shown(key)}: {kind}, not a JSON value (quote it, or write plain data)")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _first_line(exc: Exception) -> str:
    return shown(" ".join(str(exc).split())[:300])
