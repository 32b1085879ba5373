"""The ``gym-bridge`` command line: one small function per subcommand adds its options and its handler
(:mod:`gym_bridge.cli.commands`)."""

from __future__ import annotations

import argparse
import math

from gym_bridge.cli import commands
from gym_bridge.cli.options import MAX_SEED, MAX_TOKENS, CommandParser, number

type Subcommands = argparse._SubParsersAction[CommandParser]
"""What each subcommand's function adds its parser to."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand, each also taking ``--traceback``."""
    parser = CommandParser(prog="gym-bridge", description="The ``gym-bridge`` command.")
    parser.add_argument("--traceback", action="store_true", help="on an error, show the whole traceback")
    subcommands = parser.add_subparsers(dest="command", required=True)
    subcommands.add_parser("backends", help="list the registered rollout backends").set_defaults(func=commands.backends)
    for add in (_build_tiny, _serve, _eval, _check_endpoint, _train, _report, _compare, _rescore):
        add(subcommands)
    for sub in subcommands.choices.values():
        sub.add_argument(
            "--traceback",
            action="store_true",
            default=argparse.SUPPRESS,
            help="on an error, show the whole traceback instead of one line",
        )
    return parser


def _build_tiny(subcommands: Subcommands) -> None:
    tiny = subcommands.add_parser("build-tiny", help="build (or reuse) the embedded tiny model and print its folder")
    tiny.add_argument("--cache-dir", default=None)
    tiny.add_argument("--seed", type=number(int, 0, MAX_SEED), default=0)
    tiny.set_defaults(func=commands.build_tiny)


def _serve(subcommands: Subcommands) -> None:
    serve = subcommands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API until SIGINT/SIGTERM"
    )
    serve.add_argument("--model", default="tiny", help='a built-in model ("tiny", "smollm2") or a local model folder')
    serve.add_argument(
        "--policy",
        choices=["hf", "scripted", "instant"],
        default="hf",
        help="hf: the model; scripted: rule-based replies; instant: a fixed reply, no model (benchmarks)",
    )
    serve.add_argument(
        "--answer-tokens",
        type=number(int, 1, MAX_TOKENS),
        default=16,
        help="with --policy instant: reply length, EOS included",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=number(int, 0, 65535), default=8000)
    serve.add_argument("--served-model-name", default=None, help="default: the --model value")
    serve.add_argument("--max-new-tokens", type=number(int, 1, MAX_TOKENS), default=256)
    serve.add_argument("--temperature", type=number(float, 0, 100), default=1.0, help="0: greedy")
    serve.add_argument("--top-p", type=number(float, 0, 1, "(]"), default=1.0)
    serve.add_argument("--reasoning-parser", action="store_true", help="split <think> blocks into reasoning_content")
    serve.add_argument(
        "--upstream",
        nargs="+",
        default=None,
        metavar="URL",
        help="proxy to these OpenAI-compatible servers (e.g. stock vLLM), keeping multi-turn token ids exact",
    )
    serve.add_argument(
        "--tokenizer", default=None, help="with --upstream: tokenizer folder (default: the upstream's model)"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key as 'Authorization: Bearer' on /v1/* (default: $VLLM_API_KEY; unset: no key), "
        "as vllm serve --api-key does",
    )
    serve.add_argument(
        "--upstream-api-key-env",
        default="OPENAI_API_KEY",
        metavar="VAR",
        help="with --upstream: the environment variable holding the upstreams' API key (default: OPENAI_API_KEY)",
    )
    serve.set_defaults(func=commands.serve)


def _eval(subcommands: Subcommands) -> None:
    run = subcommands.add_parser(
        "eval", help="evaluate a policy on a JSONL dataset of Gym rows (see docs/evaluation.md)"
    )
    run.add_argument("config", help="the eval config (YAML)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. limit=2")
    run.add_argument("--resume", action="store_true", help="continue the run in output_dir")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=commands.eval_run)


def _check_endpoint(subcommands: Subcommands) -> None:
    check = subcommands.add_parser(
        "check-endpoint",
        help="check OpenAI-compatible endpoints the way a run does before it starts (see docs/preflight.md)",
    )
    check.add_argument("urls", nargs="+", metavar="URL", help="base URL(s), http://host:port/v1")
    check.add_argument("--model", required=True, help="the served model name the run will send")
    check.add_argument("--tools", action="store_true", help="also check that chats offering tools are accepted")
    check.add_argument(
        "--timeout", type=number(float, 0, 3600, "(]"), default=20.0, help="seconds for each endpoint's checks"
    )
    check.add_argument("--api-key", default=None, help="the endpoints' API key (default: $OPENAI_API_KEY)")
    check.set_defaults(func=commands.check_endpoint)


def _train(subcommands: Subcommands) -> None:
    train = subcommands.add_parser(
        "train", help="train a NeMo-RL GRPO config through NeMo-Gym into a run folder (see docs/training.md)"
    )
    train.add_argument("config", help="the training config (NeMo-RL's YAML: defaults, ${...}, _override_)")
    train.add_argument(
        "overrides", nargs="*", metavar="key=value", help="NeMo-RL's overrides, e.g. grpo.max_num_steps=2 +a.b=1 ~c"
    )
    train.add_argument("--out", default=None, help="the run folder (default: runs/<config>-<time>)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    train.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    train.add_argument(
        "--smoke",
        action="store_true",
        help="a short CPU run of the recipe's real Gym environments: a small model, batch, lengths and one step "
        "scaled to fit, GPU features off; prints a table of every key changed (docs/training.md)",
    )
    train.add_argument(
        "--model", default=None, metavar="NAME", help="with --smoke: the model (a built-in name or a folder; smollm2)"
    )
    train.set_defaults(func=commands.train)


def _report(subcommands: Subcommands) -> None:
    report = subcommands.add_parser(
        "report", help="rebuild an eval run's metrics.json, report.md and report.png, or a training run's plots"
    )
    report.add_argument("run_dir")
    report.set_defaults(func=commands.report)


def _compare(subcommands: Subcommands) -> None:
    compare = subcommands.add_parser(
        "compare", help="compare eval runs of one dataset with the first, with intervals (see docs/evaluation.md)"
    )
    compare.add_argument("run_dirs", nargs="+", metavar="RUN", help="run folders; the first is the baseline")
    compare.add_argument("--out", default=None, help="output folder (default: ./compare-A-vs-B)")
    compare.add_argument(
        "--level", type=number(float, 0, 1, "()"), default=0.95, help="confidence level of the intervals"
    )
    compare.add_argument(
        "--resamples", type=number(int, 100, 1_000_000), default=10_000, help="paired bootstrap resamples"
    )
    compare.add_argument("--seed", type=number(int, 0, MAX_SEED), default=0, help="bootstrap seed")
    compare.add_argument(
        "--fail-if-worse",
        type=number(float, 0, math.inf, "[)"),
        default=None,
        metavar="DELTA",
        help="exit 1 when a run is worse than the first by more than DELTA (mean reward or pass@1) at --level",
    )
    compare.set_defaults(func=commands.compare)


def _rescore(subcommands: Subcommands) -> None:
    rescore = subcommands.add_parser(
        "rescore", help="grade a run's stored responses again through Gym's /verify, into a new run folder"
    )
    rescore.add_argument("run_dir", help="the finished run folder")
    rescore.add_argument(
        "overrides", nargs="*", metavar="key=value", help="grader settings to change, e.g. gym_overrides.x.y=z"
    )
    rescore.add_argument("--config", default=None, help="take config_paths, gym_overrides, pass_threshold from here")
    rescore.add_argument("--out", default=None, help="the new run folder (default: RUN_DIR-rescored)")
    rescore.set_defaults(func=commands.rescore)
