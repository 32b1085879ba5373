"""A safetensors file's header, read and checked against the file's size before safetensors or torch sees it.

The format: 8 bytes (little-endian, unsigned) giving the header's length, the header (JSON: tensor name ->
``{"dtype", "shape", "data_offsets"}``, plus an optional ``__metadata__`` of strings), then the data section. A header
that lies (a length of 2^63, offsets past the file, a shape larger than its bytes, two tensors over the same bytes)
is one :class:`~gym_bridge.boundary.UntrustedInputError` naming the file and the tensor; nothing is allocated from
what the header claims before it is checked.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.files import open_regular
from gym_bridge.boundary.text import shown

MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted: safetensors' own limit."""
MAX_WEIGHTS_FILE_BYTES = 1 << 50
"""A bound on one weights file (1 PiB): only its header is read here."""
MAX_TENSOR_DIMS = 64
"""The most dimensions a tensor's shape may have."""
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""Every dtype accepted, and its size in bytes (safetensors' names)."""


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as its file's checked header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorHeader]:
    """The tensors of the safetensors file ``path``, each checked against the file: a known dtype, a shape of
    non-negative integers, and offsets inside the data section that hold exactly ``shape x dtype size`` bytes, the
    tensors back to back from the first byte to the last.

    Raises:
        UntrustedInputError: not a regular file, or a header that disagrees with the file (one line naming it).
    """
    with open_regular(path, MAX_WEIGHTS_FILE_BYTES) as file:
        size = os.fstat(file.fileno()).st_size
        prefix = file.read(8)
        if len(prefix) < 8:
            raise UntrustedInputError(f"{shown(path)}: {size} bytes, too short for a safetensors header")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise UntrustedInputError(
                f"{shown(path)}: its header claims {length:,} bytes but the file holds {size - 8:,} after the length"
            )
        if length > MAX_HEADER_BYTES:
            raise UntrustedInputError(f"{shown(path)}: a {length:,}-byte header, over the {MAX_HEADER_BYTES:,} cap")
        raw = file.read(length)
    if len(raw) != length:
        raise UntrustedInputError(f"{shown(path)}: shorter than its header claims (the file shrank while read)")
    header = json_io.loads_object(raw, f"{shown(path)}: header")
    return _tensors(path, header, size - 8 - length)


def _tensors(path: Path, header: dict[str, Any], data_bytes: int) -> dict[str, TensorHeader]:
    """The header's tensors, checked against a data section of ``data_bytes`` bytes."""
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise UntrustedInputError(f"{shown(path)}: header __metadata__ is not an object of strings")
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorHeader] = {}
    for name, entry in header.items():
        where = f"{shown(path)}: tensor {shown(name)}"
        tensor, begin, end = _tensor(where, path, entry, data_bytes)
        tensors[name] = tensor
        spans.append((begin, end, name))
    _check_contiguous(path, sorted(spans), data_bytes)
    return tensors


def _tensor(where: str, path: Path, entry: object, data_bytes: int) -> tuple[TensorHeader, int, int]:
    """One header entry as a tensor and its byte span, or a refusal naming it."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise UntrustedInputError(f"{where}: not an object of dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise UntrustedInputError(f"{where}: unknown dtype {shown(dtype)!s}")
    if not _ints(shape, MAX_TENSOR_DIMS):
        raise UntrustedInputError(f"{where}: shape is not a list of at most {MAX_TENSOR_DIMS} non-negative integers")
    if not (_ints(offsets, 2) and len(offsets) == 2):
        raise UntrustedInputError(f"{where}: data_offsets is not two non-negative integers")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise UntrustedInputError(
            f"{where}: data_offsets [{begin}, {end}] fall outside the {data_bytes:,}-byte data section"
        )
    needed = math.prod(shape) * DTYPE_BYTES[dtype]
    if needed != end - begin:
        raise UntrustedInputError(
            f"{where}: shape {list(shape)} of {dtype} needs {needed:,} bytes, its data_offsets hold {end - begin:,}"
        )
    return TensorHeader(path, dtype, tuple(shape)), begin, end


def _ints(value: object, most: int) -> bool:
    """Whether ``value`` is a list of at most ``most`` non-negative integers (not booleans)."""
    return (
        isinstance(value, list)
        and len(value) <= most
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def _check_contiguous(path: Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """Refuse tensors that overlap or leave a gap: safetensors' own rule, the data section covered end to end."""
    position = 0
    for begin, end, name in spans:
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else f"leaves bytes {position}-{begin} unused"
            raise UntrustedInputError(f"{shown(path)}: tensor {shown(name)} {what}")
        position = end
    if position != data_bytes:
        raise UntrustedInputError(
            f"{shown(path)}: its tensors cover {position:,} of the {data_bytes:,}-byte data section"
        )
