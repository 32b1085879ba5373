"""``optimizer.pt``, the optimizer half of an ``HFPolicy`` checkpoint, written and read as untrusted input.

The file holds the optimizer's ``state_dict()``, the learning-rate scheduler's and the step count, tensors and
plain containers only. Checkpoints are passed around, so it is read with ``torch.load(..., weights_only=True)``
under a size cap the model sets, then its structure is checked against the live optimizer and scheduler before
either loads it; anything else is one :class:`~gym_bridge.failures.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import torch

from gym_bridge.boundary.text import shown
from gym_bridge.failures.errors import CheckpointError
from gym_bridge.models.loading import MAX_PICKLE_BYTES, load_tensor_file

OPTIMIZER_FILE = "optimizer.pt"
"""What :meth:`HFPolicy.save_checkpoint` writes beside the weights: optimizer, scheduler and step count."""
MAX_STEPS_TAKEN = 10**7
"""The most optimizer steps a checkpoint may claim: a schedule saved without state is replayed that many times."""
OPTIMIZER_FILE_KEYS = frozenset({"optimizer", "scheduler", "steps_taken"})
ADAMW_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
ADAMW_REQUIRED_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


def optimizer_file_cap(optimizer: torch.optim.Optimizer) -> int:
    """The largest ``optimizer.pt`` this optimizer writes: AdamW keeps at most three tensors the size of each
    parameter (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), plus step counters and the pickle."""
    weights: int = sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    return 3 * weights + MAX_PICKLE_BYTES + 16 * 2**20


def read_optimizer_file(file: Path, max_bytes: int, *, meta: bool = False) -> dict[str, Any]:
    """``optimizer.pt`` loaded with ``weights_only=True`` (:func:`~gym_bridge.models.loading.load_tensor_file`) and
    its top level checked: ``optimizer`` (``state``, ``param_groups``), ``scheduler`` (a mapping or None) and
    ``steps_taken``. ``meta`` reads only the pickle (tensors without data), a cheap check before anything starts.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    saved = load_tensor_file(file, max_bytes, meta=meta)
    problem = _top_level_problem(saved)
    if problem is not None:
        raise CheckpointError(f"{shown(file)}: {problem}; not an optimizer state HFPolicy.save_checkpoint wrote")
    assert isinstance(saved, dict)  # _top_level_problem checked it
    return saved


def check_optimizer_file(folder: Path) -> None:
    """``folder``'s ``optimizer.pt`` checked without its tensors' data: a ``torch.save`` archive of tensors and plain
    containers with the top level :meth:`~gym_bridge.policy.hf.HFPolicy.load_optimizer` reads. Only the pickle is
    read, so a run checks it before anything starts; the size cap (:func:`optimizer_file_cap`) needs the model and
    waits for the load."""
    read_optimizer_file(folder / OPTIMIZER_FILE, sys.maxsize, meta=True)


def state_problem(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> str | None:
    """Why a :func:`read_optimizer_file` result is not a state of ``optimizer`` and ``scheduler`` (None: it is)."""
    return _optimizer_problem(saved["optimizer"], optimizer) or _scheduler_problem(saved.get("scheduler"), scheduler)


def optimizer_file_writer(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, steps_taken: int
) -> Callable[[BinaryIO], None]:
    """What writes ``optimizer.pt`` into an open file: the optimizer's and the scheduler's ``state_dict()`` and the
    step count, tensors and plain containers only (:func:`read_optimizer_file` reads them with ``weights_only=True``).
    ``torch.save`` streams into the file, so the state is never held a second time as bytes in memory."""

    def write(file: BinaryIO) -> None:
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "steps_taken": steps_taken}
        torch.save(state, file)

    return write


def _top_level_problem(saved: object) -> str | None:
    """Why ``saved`` is not ``{optimizer: {state, param_groups}, scheduler, steps_taken}`` (None: it is)."""
    if not isinstance(saved, dict) or not {"optimizer", "steps_taken"} <= saved.keys() <= OPTIMIZER_FILE_KEYS:
        return "not a mapping of optimizer, scheduler and steps_taken"
    optimizer = saved["optimizer"]
    if not isinstance(optimizer, dict) or optimizer.keys() != {"state", "param_groups"}:
        return "optimizer is not a mapping of state and param_groups"
    if not isinstance(optimizer["state"], dict) or not isinstance(optimizer["param_groups"], list):
        return "optimizer.state is not a mapping or optimizer.param_groups not a list"
    if saved.get("scheduler") is not None and not isinstance(saved["scheduler"], dict):
        return "scheduler is not a mapping"
    steps = saved["steps_taken"]
    if type(steps) is not int or not 0 <= steps <= MAX_STEPS_TAKEN:
        return f"steps_taken is {_shown(steps)}, not a count from 0 to {MAX_STEPS_TAKEN}"
    return None


def _optimizer_problem(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``saved`` (an ``optimizer`` entry) is not a state of ``optimizer`` (None: it is): the same param groups
    with the same parameter numbering, and per parameter AdamW's tensors in that parameter's shape."""
    live = optimizer.state_dict()["param_groups"]
    problem = _conform(saved["param_groups"], live, "optimizer.param_groups")
    if problem is not None:
        return problem
    if [g["params"] for g in saved["param_groups"]] != [g["params"] for g in live]:
        return "optimizer.param_groups number the parameters differently"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for key, entry in saved["state"].items():
        if type(key) is not int or not 0 <= key < len(params):
            return f"optimizer.state has a key {_shown(key)}, not a parameter index below {len(params)}"
        problem = _adamw_entry_problem(entry, params[key], f"optimizer.state[{key}]")
        if problem is not None:
            return problem
    tensors = [t for entry in saved["state"].values() for t in entry.values()]
    if len({t.untyped_storage().data_ptr() for t in tensors if t.numel()}) < sum(1 for t in tensors if t.numel()):
        return "optimizer.state has tensors that share memory, which in-place updates would mix"
    return None


def _adamw_entry_problem(entry: object, param: torch.Tensor, where: str) -> str | None:
    """Why ``entry`` is not AdamW's state of ``param`` (None: it is): a scalar ``step`` and moment tensors in the
    parameter's shape, all floating point."""
    if not isinstance(entry, dict) or not ADAMW_REQUIRED_KEYS <= entry.keys() <= ADAMW_STATE_KEYS:
        return f"{where} is not a mapping of {', '.join(sorted(ADAMW_REQUIRED_KEYS))} (and max_exp_avg_sq)"
    for name, value in entry.items():
        if not _plain_tensor(value) or not value.dtype.is_floating_point:
            return f"{where}.{name} is {_shown(value)}, not a dense contiguous floating-point tensor"
        shape = torch.Size([]) if name == "step" else param.shape
        if value.shape != shape:
            return f"{where}.{name} has shape {tuple(value.shape)}, not {tuple(shape)}"
    return None


def _scheduler_problem(saved: object, scheduler: torch.optim.lr_scheduler.LRScheduler) -> str | None:
    """Why ``saved`` is not a state of ``scheduler`` (None: it is, or there is none to restore)."""
    if saved is None:
        return None
    return _conform(saved, scheduler.state_dict(), "scheduler")


def _conform(saved: object, live: object, where: str) -> str | None:
    """Why ``saved`` does not have the shape of ``live``, a state the live object gives (None: it has).

    Mappings have ``live``'s keys (a flag, a bool or None, may be missing: torch fills it in), lists and tuples its
    length, leaves its kind. The walk follows ``live``, so a hostile nesting is never walked past its depth.
    """
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return f"{where} is {_shown(saved)}, not a mapping"
        unknown = [key for key in saved if key not in live]
        missing = [key for key, value in live.items() if key not in saved and not isinstance(value, bool | None)]
        if unknown or missing:
            return f"{where} has key {_shown((unknown or missing)[0])} {'extra' if unknown else 'missing'}"
        return next((p for key in saved if (p := _conform(saved[key], live[key], f"{where}.{key}"))), None)
    if isinstance(live, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(live):
            return f"{where} is {_shown(saved)}, not a sequence of {len(live)}"
        return next(
            (p for i, (s, v) in enumerate(zip(saved, live, strict=True)) if (p := _conform(s, v, f"{where}[{i}]"))),
            None,
        )
    if _same_kind(saved, live):
        return None
    return f"{where} is {_shown(saved)}, not {type(live).__name__}"


def _same_kind(saved: object, live: object) -> bool:
    """Whether a saved leaf may stand where the live state has ``live``: None, a bool, an int or a string as it is,
    a float as any finite number, a tensor with the same shape and dtype."""
    if live is None or isinstance(live, bool | int | str):
        return type(saved) is type(live)
    if isinstance(live, float):
        return type(saved) in (int, float) and abs(saved) <= 1e300 and math.isfinite(saved)  # type: ignore[arg-type]
    if isinstance(live, torch.Tensor):
        return _plain_tensor(saved) and saved.shape == live.shape and saved.dtype == live.dtype
    return False


def _plain_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a tensor an optimizer can update in place: dense, contiguous, outside autograd."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.is_contiguous()
        and not value.requires_grad
    )


def _shown(value: object, limit: int = 60) -> str:
    """A value as a refusal shows it: its type and a short repr."""
    try:
        text = repr(value) if isinstance(value, int | float | str | bool | None) else type(value).__name__
    except ValueError:  # an int too long to print
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
