"""Model and tokenizer folders checked before anything loads from them: a folder is untrusted input.

A model folder is trusted for its weights, loaded under bounds, and never for code. Before transformers opens
anything: every file is a regular file inside the folder (a FIFO, a device or a link out of the folder is refused),
every JSON file decodes through :mod:`gym_bridge.boundary.json_io`, no file asks for remote code (``auto_map``,
``trust_remote_code``), every safetensors header agrees with its file (:mod:`.safetensors_header`), and the model
``config.json`` builds has every parameter in the weights with its shape (:mod:`.config_check`), so nothing is
initialised at random. Each refusal is one
:class:`~gym_bridge.boundary.UntrustedInputError` naming the path and what is wrong.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError, json_io
from gym_bridge.boundary.files import file_kind, read_bytes
from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymBridgeError
from gym_bridge.models.config_check import check_config_against_weights, first_line
from gym_bridge.models.safetensors_header import TensorHeader, read_header

MAX_JSON_BYTES = 256 * 2**20
"""The largest JSON file of a folder decoded (``config.json``, ``tokenizer_config.json``, a shard index, ...)."""
MAX_FILE_BYTES = 4 * 2**30
"""The largest file of a folder other than its weights (``tokenizer.json``, ``merges.txt``, ...)."""
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""A tokenizer folder holds at least one of these."""
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
"""Keys that ask transformers to import code shipped in the folder."""
UNCHECKED_JSON = ("tokenizer.json",)
"""JSON files read only by the ``tokenizers`` library (Rust, its own bounds): size-checked, not decoded here."""


class ModelLoadError(GymBridgeError, OSError):
    """A local folder that transformers cannot load as a causal LM and its tokenizer, once checked."""


@dataclass(frozen=True)
class CheckedModelFolder:
    """A model folder that passed :func:`check_model_folder`: its config and its tensors as the headers give them."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorHeader]


def check_tokenizer_folder(path: str | Path) -> Path:
    """``path`` once it is a folder of regular files holding a tokenizer, with no file asking for remote code.

    Raises:
        UntrustedInputError: not a local folder, a file that is not regular, a bad JSON file, ``auto_map`` /
            ``trust_remote_code``, or no tokenizer file (one line naming the path).
    """
    folder = Path(path).expanduser()
    files = folder_files(folder)
    json_files(folder, files)
    if not any(name in files for name in TOKENIZER_FILES):
        raise UntrustedInputError(
            f"{shown(folder)}: holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)} is expected)"
        )
    return folder


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer in the local folder ``path``, loaded after :func:`check_tokenizer_folder` with
    ``trust_remote_code=False`` (never code, never a prompt).

    Raises:
        UntrustedInputError: the folder is refused (:func:`check_tokenizer_folder`).
        ModelLoadError: transformers cannot load it (the path and its first line).
    """
    from transformers import AutoTokenizer

    folder = check_tokenizer_folder(path)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:  # transformers and tokenizers raise many types on a hostile folder; each is a refusal
        raise ModelLoadError(f"{shown(folder)}: cannot load a tokenizer from it ({first_line(exc)})") from None


def load_checked_causal_lm(path: str | Path, dtype: Any) -> tuple[Any, Any]:
    """``(tokenizer, model)`` from the local folder ``path`` once :func:`check_model_folder` passed it: safetensors
    weights only, ``trust_remote_code=False``, and a load that left a parameter at random or skipped one of another
    shape refused.

    Raises:
        UntrustedInputError: the folder is refused (one line naming the path and what is wrong).
        ModelLoadError: transformers cannot load the checked folder.
    """
    from transformers import AutoModelForCausalLM

    folder = check_model_folder(path).path
    tokenizer = load_tokenizer(folder)
    try:
        # with output_loading_info, from_pretrained returns (model, loading report); its stubs name the model only
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, use_safetensors=True, trust_remote_code=False, output_loading_info=True
        )
        model, info = loaded
    except Exception as exc:  # transformers raises many types on a hostile folder; each is a refusal
        raise ModelLoadError(f"cannot load a causal LM from {shown(folder)}: {first_line(exc)}") from None
    _check_loading_info(folder, info)
    return tokenizer, model


def _check_loading_info(folder: Path, info: dict[str, Any]) -> None:
    """Refuse a load that left parameters at random (missing) or skipped weights of another shape (mismatched)."""
    for key, what in (("missing_keys", "missing from"), ("mismatched_keys", "of another shape in")):
        names = sorted(str(name) for name in info.get(key) or ())
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise UntrustedInputError(
                f"{shown(folder)}: {shown(names[0])}{more} {what} the weights; loading would initialise it at random"
            )


def model_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of the model folder ``path``, read and decoded through the boundary.

    Raises:
        FileNotFoundError: there is none.
        UntrustedInputError: not a regular file, over :data:`MAX_JSON_BYTES`, not a JSON object, or remote code.
    """
    config_path = Path(path).expanduser() / "config.json"
    config = json_io.loads_object(read_bytes(config_path, MAX_JSON_BYTES), shown(config_path))
    _refuse_remote_code(config_path, config)
    return config


def check_model_folder(path: str | Path) -> CheckedModelFolder:
    """``path`` checked as a model folder before anything loads from it (see the module docstring).

    Raises:
        UntrustedInputError: the first thing wrong, in one line naming the path (and tensor or key).
    """
    folder = Path(path).expanduser()
    files = folder_files(folder)
    decoded = json_files(folder, files)
    config = decoded.get("config.json")
    if config is None:
        raise UntrustedInputError(f"{shown(folder)}: holds no config.json; a model folder is save_pretrained's output")
    tensors = weight_headers(folder, files, decoded.get(WEIGHTS_INDEX))
    check_config_against_weights(folder / "config.json", config, tensors)
    return CheckedModelFolder(folder, config, tensors)


# ---------------------------------------------------------------------- the folder's files


def folder_files(folder: Path) -> set[str]:
    """The names of the regular files in ``folder`` (sub-folders are not read). A link is followed only when it
    stays inside the folder, or reaches the Hugging Face hub cache's ``blobs`` of the same model.

    Raises:
        UntrustedInputError: ``folder`` is missing or not a folder, or an entry is a FIFO, a device, a socket, a
            link out of the folder, or a file over :data:`MAX_FILE_BYTES` (weights aside).
    """
    try:
        info = os.stat(folder)
    except FileNotFoundError:
        raise UntrustedInputError(
            f"{shown(folder)}: no such folder (downloads are not supported: pass a local folder)"
        ) from None
    except OSError as exc:
        raise UntrustedInputError(f"{shown(folder)}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(info.st_mode):
        kind = "a file" if stat.S_ISREG(info.st_mode) else file_kind(info.st_mode)
        raise UntrustedInputError(f"{shown(folder)}: not a folder ({kind}); a model folder is expected")
    real = Path(os.path.realpath(folder))
    files = set()
    for entry in _entries(folder):
        entry_info = _entry_info(folder, real, entry)
        if stat.S_ISDIR(entry_info.st_mode):
            continue
        where = shown(folder / entry.name)
        if not stat.S_ISREG(entry_info.st_mode):
            raise UntrustedInputError(
                f"{where}: not a regular file ({file_kind(entry_info.st_mode)}); only regular files are read"
            )
        if entry_info.st_size > MAX_FILE_BYTES and not entry.name.endswith(".safetensors"):
            raise UntrustedInputError(f"{where}: {entry_info.st_size:,} bytes, over the {MAX_FILE_BYTES:,}-byte cap")
        files.add(entry.name)
    return files


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    """The entries of ``folder``, or a refusal naming it."""
    try:
        with os.scandir(folder) as scan:
            return list(scan)
    except OSError as exc:
        raise UntrustedInputError(f"{shown(folder)}: cannot be listed ({exc.strerror or exc})") from None


def _entry_info(folder: Path, real: Path, entry: os.DirEntry[str]) -> os.stat_result:
    """What ``entry`` is (its target's kind for a link that stays where a model's files may be)."""
    try:
        if entry.is_symlink():
            target = Path(os.path.realpath(entry.path))
            blobs = real.parent.parent / "blobs"
            if not (target.is_relative_to(real) or (real.parent.name == "snapshots" and target.is_relative_to(blobs))):
                raise UntrustedInputError(
                    f"{shown(folder / entry.name)}: a link out of the folder (to {shown(target)}); a model folder's "
                    "files are read only from inside it"
                )
        return os.stat(entry.path)
    except OSError as exc:
        raise UntrustedInputError(f"{shown(folder / entry.name)}: cannot be read ({exc.strerror or exc})") from None


def json_files(folder: Path, files: set[str]) -> dict[str, dict[str, Any]]:
    """Every ``*.json`` file of ``folder`` (but :data:`UNCHECKED_JSON`) decoded through the boundary, none asking
    for remote code.

    Raises:
        UntrustedInputError: a file over :data:`MAX_JSON_BYTES`, not a JSON object, or with a remote-code key.
    """
    decoded = {}
    for name in sorted(files):
        if name.endswith(".json") and name not in UNCHECKED_JSON:
            path = folder / name
            value = json_io.loads_object(read_bytes(path, MAX_JSON_BYTES), shown(path))
            _refuse_remote_code(path, value)
            decoded[name] = value
    return decoded


def _refuse_remote_code(path: Path, value: dict[str, Any]) -> None:
    """Refuse a file that asks transformers to import the folder's own code."""
    for key in REMOTE_CODE_KEYS:
        if key in value:
            raise UntrustedInputError(
                f"{shown(path)}: {key} asks to run code shipped in the folder; gym-bridge never runs a model "
                "folder's code (remove the key to load the built-in architecture)"
            )


def weight_headers(folder: Path, files: set[str], index: dict[str, Any] | None) -> dict[str, TensorHeader]:
    """Every tensor of the folder's safetensors weights (``model.safetensors``, or the shards its index names),
    each file's header checked against the file.

    Raises:
        UntrustedInputError: no weights, an index naming a file outside the folder or a tensor its shard lacks, or
            a header that lies.
    """
    if index is None:
        if WEIGHTS_FILE not in files:
            raise UntrustedInputError(f"{shown(folder)}: holds no {WEIGHTS_FILE} (or {WEIGHTS_INDEX})")
        return read_header(folder / WEIGHTS_FILE)
    where = shown(folder / WEIGHTS_INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UntrustedInputError(f"{where}: weight_map is not an object of file names")
    shards = {name: _shard(folder, files, where, name) for name in sorted(set(weight_map.values()))}
    tensors: dict[str, TensorHeader] = {}
    for shard in shards.values():
        tensors.update(shard)
    for tensor, name in weight_map.items():
        if tensor not in shards[name]:
            raise UntrustedInputError(f"{where}: names {shown(tensor)} in {shown(name)}, whose header lacks it")
    return tensors


def _shard(folder: Path, files: set[str], where: str, name: str) -> dict[str, TensorHeader]:
    """The tensors of the shard ``name``, a safetensors file of the folder itself."""
    if name not in files or not name.endswith(".safetensors"):
        raise UntrustedInputError(f"{where}: names {shown(name)}, which is not a safetensors file in the folder")
    return read_header(folder / name)
