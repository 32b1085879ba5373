"""Loading a local transformers causal LM and its tokenizer, and reading the other files of a checkpoint folder.

The model is a folder, or a built-in name: ``"tiny"``, ``"smollm2"``, checked before anything loads
(:mod:`gym_bridge.models.folder_check`). Its weights load from safetensors only: a
folder whose only weights are pickle files (``pytorch_model.bin``, ...) is refused in one line, since unpickling can
run code and model folders are passed around. The other files of a checkpoint are untrusted too:
:func:`read_checkpoint_bytes` and :func:`load_tensor_file` open them through the trust boundary
(:mod:`gym_bridge.boundary.files`: regular files only, under a size cap, never blocking) and load tensors and plain
containers only (``torch.load(..., weights_only=True)``); anything else is one
:class:`~gym_bridge.failures.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import open_regular, read_bytes
from gym_bridge.boundary.text import shown
from gym_bridge.failures import CheckpointError, SettingError
from gym_bridge.models.folder_check import ModelLoadError, load_checked_causal_lm
from gym_bridge.models.registry import resolve_model_path

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that ``torch.load`` unpickles; a model folder holding only these is refused."""
NOT_WEIGHTS = ("optimizer.pt", "scheduler.pt", "training_args.bin", "rng_state")
"""Pickle files a checkpoint folder holds beside its weights (ours, and transformers' ``Trainer``'s)."""
_WEIGHTS_UNPICKLER = "WeightsUnpickler error:"
MAX_PICKLE_BYTES = 64 * 2**20
"""The largest ``data.pkl`` a tensor file may hold: its containers and tensor headers, not the tensors' bytes."""


def check_safetensors_weights(folder: Path) -> None:
    """Refuse a model folder whose weights are all pickle files: loading them can run code the folder's author
    chose. A folder with any ``*.safetensors`` file, or no weights at all (transformers names what is missing), passes.
    """
    if not folder.is_dir():
        return
    names = sorted(entry.name for entry in folder.iterdir())
    if any(name.endswith(".safetensors") for name in names):
        return
    pickled = [name for name in names if name.endswith(PICKLE_WEIGHT_SUFFIXES) and not name.startswith(NOT_WEIGHTS)]
    if pickled:
        shown = ", ".join(pickled[:3]) + (f" and {len(pickled) - 3} more" if len(pickled) > 3 else "")
        raise ModelLoadError(
            f"{folder} holds only pickle weights ({shown}), which can run code when loaded; convert them to "
            "safetensors (save_pretrained(folder, safe_serialization=True) where you trust them) and load that folder"
        )


def load_causal_lm(name_or_path: str, dtype: DType = "float32") -> tuple[Any, Any]:
    """``(tokenizer, model)`` from a local folder (safetensors weights only); a built-in name builds that model
    first. The folder is checked before anything loads (:func:`~gym_bridge.models.folder_check.check_model_folder`)
    and no code in it is ever run (:func:`~gym_bridge.models.folder_check.load_checked_causal_lm`).

    Raises:
        UntrustedInputError: the folder is refused (one line naming the path and what is wrong).
        ModelLoadError: only pickle weights, or transformers cannot load the checked folder.
    """
    path = resolve_model_path(name_or_path)
    check_safetensors_weights(path)
    return load_checked_causal_lm(path, DTYPES[dtype])


def causal_lm_on_device(
    name_or_path: str, dtype: DType, device: str, *, model: Any = None, tokenizer: Any = None
) -> tuple[Any, Any]:
    """``(tokenizer, model)`` in eval mode on ``device``: the given pair, or loaded from ``name_or_path``."""
    if (model is None) != (tokenizer is None):
        raise SettingError("causal_lm_on_device: pass both model and tokenizer, or neither")
    if model is None:
        tokenizer, model = load_causal_lm(name_or_path, dtype)
    model = model.to(torch.device(device))
    model.eval()
    return tokenizer, model


# ---------------------------------------------------------------------- checkpoint files


@contextlib.contextmanager
def open_checkpoint_file(path: Path, max_bytes: int) -> Iterator[BinaryIO]:
    """``path`` open for reading through the trust boundary (:func:`~gym_bridge.boundary.files.open_regular`): a
    regular file (links followed) of at most ``max_bytes``, checked before opening and on the open descriptor, opened
    non-blocking, so a FIFO never blocks and a device is never read.

    Raises:
        CheckpointError: missing, not a regular file, over ``max_bytes``, or unreadable (the file named).
    """
    try:
        with open_regular(path, max_bytes) as file:
            yield file
    except FileNotFoundError:
        raise CheckpointError(f"{shown(path)}: missing; the checkpoint is incomplete") from None
    except UntrustedInputError as exc:
        raise CheckpointError(str(exc)) from None


def read_checkpoint_bytes(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, read as :func:`open_checkpoint_file` allows (a regular file of at most ``max_bytes``)."""
    try:
        return read_bytes(path, max_bytes)
    except FileNotFoundError:
        raise CheckpointError(f"{shown(path)}: missing; the checkpoint is incomplete") from None
    except UntrustedInputError as exc:
        raise CheckpointError(str(exc)) from None


def _check_archive(file: BinaryIO, path: Path, max_bytes: int) -> None:
    """Refuse a file that is not what ``torch.save`` writes: a zip of stored (uncompressed) entries, whose sizes
    add up to at most ``max_bytes`` and whose pickle is at most :data:`MAX_PICKLE_BYTES`."""
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except Exception as exc:  # zipfile raises several types on hostile bytes; every one means "not an archive"
        raise CheckpointError(f"{shown(path)}: not a torch.save archive ({_first_line(exc)})") from None
    if any(e.compress_type != zipfile.ZIP_STORED or e.compress_size != e.file_size for e in entries):
        raise CheckpointError(f"{shown(path)}: holds compressed entries, which torch.save never writes")
    if sum(e.file_size for e in entries) > max_bytes:
        raise CheckpointError(f"{shown(path)}: its entries add up to more than the {max_bytes}-byte cap for this file")
    if any(e.filename.endswith("data.pkl") and e.file_size > MAX_PICKLE_BYTES for e in entries):
        raise CheckpointError(f"{shown(path)}: its pickle is over {MAX_PICKLE_BYTES} bytes")


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as ``Type: first line``, shortened: the cause a one-line refusal can show. For what
    ``weights_only`` refuses, only its reason (not its advice to allow the global)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    refused = next((line for line in lines if line.startswith(_WEIGHTS_UNPICKLER)), None)
    if refused is not None:
        text = refused.removeprefix(_WEIGHTS_UNPICKLER).strip().split(". ")[0]
    else:
        text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_tensor_file(path: Path, max_bytes: int, *, meta: bool = False) -> object:
    """What ``torch.save`` wrote into ``path``, when it is tensors and plain containers only: ``torch.load`` with
    ``weights_only=True`` onto the CPU, from a regular file of at most ``max_bytes`` (:func:`open_checkpoint_file`).
    ``meta`` loads tensors as shapes without data, which reads only the pickle: a cheap check of the whole file.

    Raises:
        CheckpointError: the file cannot be opened as allowed, is not a ``torch.save`` archive, or holds anything
            ``weights_only`` refuses (a pickle naming code or other objects); nothing in it is run.
    """
    with open_checkpoint_file(path, max_bytes) as file:
        _check_archive(file, path, max_bytes)
        file.seek(0)
        try:
            return torch.load(file, map_location="meta" if meta else "cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            why = _first_line(exc)
            raise CheckpointError(
                f"{shown(path)}: refused, it names objects other than tensors and plain containers ({why}); nothing "
                "in it was run"
            ) from None
        except Exception as exc:  # torch.load raises many types on hostile bytes; every one is a refusal
            raise CheckpointError(
                f"{shown(path)}: not a torch.save file of tensors and plain containers ({_first_line(exc)})"
            ) from None
