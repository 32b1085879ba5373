"""A model folder's ``config.json`` checked against its weights before a model of that size is built or loaded.

The config builds its causal LM on the ``meta`` device (no memory for its weights) after its layer counts are
checked against the weights' tensor names (200,000 layers take minutes to build, even on ``meta``); every parameter
of that model is then in the weights with its shape, so loading initialises nothing at random. Tied weights (as
transformers ties them) need one copy. Each refusal is one :class:`~gym_bridge.boundary.UntrustedInputError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.text import shown
from gym_bridge.models.safetensors_header import TensorHeader

if TYPE_CHECKING:
    import torch

MAX_STACKED = 4096
"""The most layers or experts a config may ask for (a real model has a few hundred at most)."""
_STACK_KEY = re.compile(r"(^|_)(n_layer|layers|experts)$")
"""Config keys that say how many layers (or experts) the model stacks."""


def check_config_against_weights(config_path: Path, config: dict[str, Any], tensors: dict[str, TensorHeader]) -> None:
    """Refuse a ``config.json`` that asks for more layers than the weights hold, or a parameter (of its shape)
    that no weights file holds: loading would initialise it at random. Tied weights (as transformers ties them)
    need one copy.

    Raises:
        UntrustedInputError: naming the key or the parameter, and what the weights hold.
    """
    _check_stacks(config_path, config, stacked_count(tensors))
    model = _meta_model(config_path, config)
    _check_parameters(config_path, model, tensors)


def stacked_count(names: Iterable[str]) -> int:
    """How many numbered blocks the largest stack in the tensor names holds (``model.layers.0..29.x``: 30)."""
    stacks: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                stacks.setdefault(".".join(parts[:i]), set()).add(part)
    return max((len(indices) for indices in stacks.values()), default=0)


def _check_stacks(config_path: Path, config: dict[str, Any], stacked: int) -> None:
    """Refuse a count of layers the weights do not hold, or of layers or experts past :data:`MAX_STACKED`,
    before a model of that size is built (200,000 layers on ``meta`` take minutes)."""
    for key, value in _config_ints(config):
        if not _STACK_KEY.search(key):
            continue
        if stacked and value > stacked and not key.endswith("experts"):
            raise UntrustedInputError(
                f"{shown(config_path)}: {shown(key)} is {value:,}, but the weights hold {stacked} layers"
            )
        if value > MAX_STACKED:
            raise UntrustedInputError(f"{shown(config_path)}: {shown(key)} is {value:,}, over the {MAX_STACKED:,} cap")


def _config_ints(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, int]]:
    """Every integer of ``config`` (and of the configs nested in it) with its dotted key."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _config_ints(value, f"{prefix}{key}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def _meta_model(config_path: Path, config: dict[str, Any]) -> torch.nn.Module:
    """The causal LM ``config`` describes, built on the ``meta`` device (no memory for its weights)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UntrustedInputError(f"{shown(config_path)}: model_type is not a string")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        built = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
        with torch.device("meta"):
            model: torch.nn.Module = AutoModelForCausalLM.from_config(built, trust_remote_code=False)
    except Exception as exc:  # a hostile config raises many types inside transformers; each is a refusal
        raise UntrustedInputError(
            f"{shown(config_path)}: transformers cannot build a causal LM from it ({first_line(exc)})"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model


def _check_parameters(config_path: Path, model: torch.nn.Module, tensors: dict[str, TensorHeader]) -> None:
    """Refuse a parameter of ``model`` that the weights lack or hold in another shape."""
    lookup = _checkpoint_names(model, tensors)
    embedding = _input_embedding(model)
    missing = []
    for names, parameter in _parameter_groups(model):
        present = [name for name in names if name in lookup]
        if not present:
            missing.append(names[0])
            continue
        held = lookup[present[0]]
        if tuple(parameter.shape) != held.shape:
            raise _mismatch(config_path, present[0], tuple(parameter.shape), held, parameter is embedding, model)
    missing = [name for name in missing if not _may_be_missing(model, name)]
    if not missing:
        return
    wanted = sum(p.numel() for p in model.parameters())
    held_total = sum(math.prod(t.shape) for t in tensors.values())
    unexpected = set(lookup) - set(model.state_dict())
    if unexpected and wanted <= held_total:
        return  # transformers renames or fuses these checkpoint keys itself; its loading report is checked after
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise UntrustedInputError(
        f"{shown(config_path)}: asks for {shown(missing[0])}{more}, which no weights file holds; loading would "
        "initialise it at random"
    )


def _checkpoint_names(model: torch.nn.Module, tensors: dict[str, TensorHeader]) -> dict[str, TensorHeader]:
    """The checkpoint's tensors under the model's names: a base model's weights gain the model's prefix."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    own = model.state_dict()
    if prefix != "." and not any(n.startswith(prefix) for n in tensors) and any(k.startswith(prefix) for k in own):
        return {prefix + name: tensor for name, tensor in tensors.items()}
    return tensors


def _parameter_groups(model: torch.nn.Module) -> list[tuple[list[str], torch.nn.Parameter]]:
    """Each parameter with every name it has (a tied weight has two)."""
    groups: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), ([], parameter))[0].append(name)
    return list(groups.values())


def _input_embedding(model: torch.nn.Module) -> object:
    """The model's input embedding weight (None when it has none)."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    return getattr(embeddings, "weight", None)


def _may_be_missing(model: torch.nn.Module, name: str) -> bool:
    """Whether the model class lets ``name`` be absent (``_keys_to_ignore_on_load_missing``)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    return any(re.search(pattern, name) for pattern in patterns)


def _mismatch(
    config_path: Path, name: str, wanted: tuple[int, ...], held: TensorHeader, embedding: bool, model: torch.nn.Module
) -> UntrustedInputError:
    """The refusal for a parameter whose shape the weights disagree with."""
    where = f"{shown(name)} in {shown(held.file.name)} is {list(held.shape)}"
    if embedding and wanted[0] != held.shape[0]:
        vocab = getattr(getattr(model, "config", None), "vocab_size", wanted[0])
        return UntrustedInputError(
            f"{shown(config_path)}: vocab_size {vocab} disagrees with the weights ({where}, the config asks for "
            f"{list(wanted)})"
        )
    return UntrustedInputError(f"{shown(config_path)}: asks for {list(wanted)} where {where}")


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an exception, shortened: the cause a one-line refusal shows."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return shown(text if len(text) <= limit else text[: limit - 3] + "...")
