"""The policy endpoint an eval run rolls out against: the configured endpoints, or an embedded server for the run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from gym_bridge.eval.config import EvalConfig, EvalConfigError
from gym_bridge.eval.shutdown import sigint_deferred
from gym_bridge.generation.factory import EngineSpec
from gym_bridge.recipes.engine_server import ServeOptions, StopStep, serve_engine

if TYPE_CHECKING:
    from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)


_STOP_STEPS: dict[StopStep, str] = {"server": "stopping the embedded server", "engine": "stopping the embedded policy"}
"""Each stop step of the embedded policy, as a SIGINT during it names it."""


@contextmanager
def policy_endpoint(config: EvalConfig) -> Iterator[tuple[list[str], Tokenizer]]:
    """``(base_urls, tokenizer)``: the configured endpoints, or the embedded server for the run's duration (built by
    :func:`~gym_bridge.recipes.engine_server.serve_engine`; each stop step finishes through a SIGINT)."""
    if not config.embedded:
        yield list(config.base_urls), endpoint_tokenizer(config)
        return
    spec = EngineSpec(
        policy="scripted" if config.embedded_policy == "scripted" else "hf",
        model=config.tokenizer,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        seed=config.seed,
        max_model_len=config.max_seq_len,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    options = ServeOptions(served_model_name=config.model_name)
    with serve_engine(spec, options, step=lambda name: sigint_deferred(_STOP_STEPS[name])) as served:
        logger.info("embedded %s policy at %s", config.embedded_policy, served.base_url)
        yield [served.base_url], served.tokenizer


def endpoint_tokenizer(config: EvalConfig) -> Tokenizer:
    """The served model's tokenizer (``config.tokenizer``: a built-in name or a local folder)."""
    from gym_bridge.models.folder_check import load_tokenizer
    from gym_bridge.models.registry import resolve_model_path

    path = resolve_model_path(config.tokenizer)
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvalConfigError(f"tokenizer: cannot load a tokenizer from {path}: {first}") from exc
    return cast("Tokenizer", tokenizer)  # a Hugging Face tokenizer has the protocol's methods; its stubs differ
