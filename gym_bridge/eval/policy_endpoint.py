"""The policy endpoint an eval run rolls out against: the configured endpoints, or an embedded server for the run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from gym_bridge.eval.config import EvalConfig, EvalConfigError
from gym_bridge.eval.shutdown import sigint_deferred

if TYPE_CHECKING:
    from gym_bridge.types import Tokenizer

logger = logging.getLogger(__name__)


@contextmanager
def policy_endpoint(config: EvalConfig) -> Iterator[tuple[list[str], Tokenizer]]:
    """``(base_urls, tokenizer)``: the configured endpoints, or the embedded server for the run's duration."""
    if not config.embedded:
        yield list(config.base_urls), endpoint_tokenizer(config)
        return
    from gym_bridge.models.registry import check_model_reference

    check_model_reference(config.tokenizer)  # an unknown model is one line before torch is imported
    from gym_bridge.generation.factory import EngineSpec, build_engine
    from gym_bridge.serving import OpenAIServer

    built = build_engine(
        EngineSpec(
            policy="scripted" if config.embedded_policy == "scripted" else "hf",
            model=config.tokenizer,
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=config.seed,
            max_model_len=config.max_seq_len,
            enable_prefix_caching=config.enable_prefix_caching,
        )
    )
    generation, tokenizer, path = built.generation, built.tokenizer, built.model_path
    server = OpenAIServer(generation, tokenizer, served_model_name=config.model_name, model_path=str(path))
    try:
        url = server.start_in_thread()
        logger.info("embedded %s policy at %s", config.embedded_policy, url)
        yield [url], tokenizer
    finally:
        with sigint_deferred("stopping the embedded server"):
            server.stop_thread()
        with sigint_deferred("stopping the embedded policy"):
            shutdown = getattr(generation, "shutdown", None)
            if shutdown is not None:
                shutdown()


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
