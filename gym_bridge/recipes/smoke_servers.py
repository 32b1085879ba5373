"""``--smoke``'s copies of Gym config files without the servers that start vLLM.

A model server that starts vLLM itself (``local_vllm_model``, ``genrm_model``: a judge, a GenRM, a safety model)
needs GPUs and the ``vllm`` package (:meth:`~gym_bridge.gym.servers.config_files.GymConfigs.vllm_swaps`). Gym
merges a recipe's block over a file's, so a block cannot take a server out of a file: a file that defines one is
copied into ``<run>/smoke-gym/`` without it. Each one a kept server calls is then defined again, as a
``vllm_model`` to the run's own policy endpoint, in ``<run>/smoke-gym/vllm_servers.yaml``: a Gym config file, so
Gym resolves its ``${policy_base_url}`` (a recipe's own blocks are resolved before Gym reads them). The run names
the copies and that file in ``config_paths``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from gym_bridge.boundary.files import make_dir, write_atomic
from gym_bridge.gym.servers.config_files import GymConfigs, VllmSwap, config_path, read_config_blocks
from gym_bridge.recipes.smoke_rows import SMOKE_GYM

SERVED_FILE = "vllm_servers.yaml"


def copies_without_vllm(gym: GymConfigs, swaps: Iterable[VllmSwap], run_dir: Path) -> dict[str, str]:
    """Each config path that defines a server of ``swaps``, copied without those servers into
    ``<run_dir>/smoke-gym/<path>``: path -> its copy."""
    by_file: dict[str, list[str]] = {}
    for swap in swaps:
        if swap.config_path in gym.config_paths:
            by_file.setdefault(swap.config_path, []).append(swap.name)
    return {path: str(_copy_without(path, names, run_dir)) for path, names in by_file.items()}


def served_by_policy(swaps: Iterable[VllmSwap], run_dir: Path) -> str | None:
    """The swaps that have callers, each as its ``vllm_model`` block to the policy endpoint, written as
    ``<run_dir>/smoke-gym/vllm_servers.yaml`` (None: none has callers, nothing is written)."""
    blocks = {swap.name: swap.block for swap in swaps if swap.callers}
    if not blocks:
        return None
    target = make_dir(Path(run_dir) / SMOKE_GYM) / SERVED_FILE
    write_atomic(target, yaml.safe_dump(blocks, sort_keys=False), root=run_dir)
    return str(target)


def _copy_without(relative: str, names: list[str], run_dir: Path) -> Path:
    """The Gym config ``relative`` without the blocks ``names``, written as ``<run_dir>/smoke-gym/<relative>``."""
    blocks = {k: v for k, v in read_config_blocks(config_path(relative)).items() if k not in names}
    safe = re.sub(r"[^A-Za-z0-9._/-]", "_", relative).replace("..", "__").lstrip("/")
    target = Path(run_dir) / SMOKE_GYM / safe
    make_dir(Path(run_dir) / SMOKE_GYM)
    make_dir(target.parent, root=run_dir)
    write_atomic(target, yaml.safe_dump(blocks, sort_keys=False), root=run_dir)
    return target
