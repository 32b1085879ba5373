"""The ``gym-bridge`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _backends(args: argparse.Namespace) -> int:
    from gym_bridge.rollout.registry import available_backends

    for name, entry in available_backends().items():
        print(f"{name:16} {entry.value}  ({entry.distribution})")
    return 0


def _build_tiny(args: argparse.Namespace) -> int:
    from gym_bridge.models.tiny import build_tiny_model

    print(build_tiny_model(cache_dir=args.cache_dir, seed=args.seed))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from transformers import AutoTokenizer

    from gym_bridge.models.tiny import resolve_model_path
    from gym_bridge.serving import OpenAIServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("gym_bridge.cli")
    path = resolve_model_path(args.model)
    if args.policy == "scripted":
        from gym_bridge.generation.scripted import ScriptedGeneration

        tokenizer = AutoTokenizer.from_pretrained(path)
        generation = ScriptedGeneration(tokenizer, max_new_tokens=args.max_new_tokens, think=args.reasoning_parser)
    else:
        from gym_bridge.generation.hf import HFGeneration, HFGenerationConfig

        cfg = HFGenerationConfig(
            model=str(path), max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p
        )
        generation = HFGeneration(cfg)
        tokenizer = generation.tokenizer

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        server = OpenAIServer(
            generation,
            tokenizer,
            served_model_name=args.served_model_name or str(args.model),
            host=args.host,
            port=args.port,
            reasoning_parser=args.reasoning_parser,
            model_path=str(path),
        )
        url = await server.start()
        log.info("serving %s at %s", args.model, url)
        try:
            await stop.wait()
        finally:
            log.info("stopping")
            await server.stop()

    try:
        asyncio.run(run())
    finally:
        generation.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gym-bridge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("backends", help="list the registered rollout backends").set_defaults(func=_backends)
    tiny = commands.add_parser("build-tiny", help="build (or reuse) the embedded tiny model and print its folder")
    tiny.add_argument("--cache-dir", default=None)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_build_tiny)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API until SIGINT/SIGTERM")
    serve.add_argument("--model", default="tiny", help='"tiny" or a local model folder')
    serve.add_argument("--policy", choices=["hf", "scripted"], default="hf")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="default: the --model value")
    serve.add_argument("--max-new-tokens", type=int, default=256)
    serve.add_argument("--temperature", type=float, default=1.0)
    serve.add_argument("--top-p", type=float, default=1.0)
    serve.add_argument("--reasoning-parser", action="store_true", help="split <think> blocks into reasoning_content")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
