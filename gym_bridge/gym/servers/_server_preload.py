"""What the Gym servers' fork server imports once (:mod:`gym_bridge.gym.servers._forkserver`).

NeMo-Gym's heavy third-party dependencies, measured with ``-X importtime``: with these loaded,
a server's own ``import nemo_gym`` takes 0.3 s instead of 3.5 s (``scipy.stats``: Gym 0.7's
``reward_profile``, 0.75 s of every resources server's start). NeMo-Gym itself is left out on
purpose: its import-time state (``WORKING_DIR`` from the folder, cache variables, ``atexit``
hooks, OmegaConf resolvers) must be each server's own. A package that is missing or fails to
import only costs the servers that time back.
"""

from __future__ import annotations

import importlib

PACKAGES = (
    "aiohttp",
    "anthropic",
    "fastapi",
    "httpx",
    "hydra",
    "jsonschema",
    "numpy",
    "omegaconf",
    "openai",
    "opentelemetry",
    "orjson",
    "pandas",
    "pyarrow",
    "pydantic",
    "ray",
    "requests",
    "rich",
    "scipy.stats",
    "starlette",
    "tqdm",
    "uvicorn",
    "uvloop",
    "wandb",
    "yaml",
    "yappi",
)

for _name in PACKAGES:
    try:
        importlib.import_module(_name)
    except Exception:  # see the module docstring: only speed is lost
        continue
