"""The ``gym-bridge`` command."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from gym_bridge.boundary.text import shown

if TYPE_CHECKING:
    import socket

    from pydantic import SecretStr

    from gym_bridge.eval.config import EvalConfig
    from gym_bridge.serving.server import OpenAIServer


DEBUG_ENV = "GYM_BRIDGE_DEBUG"
"""Set to 1: an error shows its whole traceback (as ``--traceback`` does)."""
EXIT_BUG = 70
"""The exit code of an error no input explains (a bug in gym-bridge): sysexits' ``EX_SOFTWARE``."""
MAX_SEED = 2**32 - 1
MAX_TOKENS = 1 << 20


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, ``gym-bridge <command>: <message>``, with exit code 2, as every
    other refused input is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {shown(message)} (see {self.prog} --help)\n")


def _number(kind: type[int] | type[float], low: float, high: float, ends: str = "[]") -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` from ``low`` to ``high`` (``ends``: ``[`` or ``(`` and ``]`` or ``)``
    say whether each end is allowed); anything else is refused naming the range, before anything starts."""
    what = "an integer" if kind is int else "a finite number"
    span = f"{ends[0]}{low:g}, {high:g}{ends[1]}" if kind is float else f"{ends[0]}{low}, {high}{ends[1]}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            value = math.nan
        above = value > low if ends[0] == "(" else value >= low
        below = value < high if ends[1] == ")" else value <= high
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"must be {what} in {span}, got {shown(text[:40])!r}")
        return value

    return parse


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

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("gym_bridge.cli")
    from gym_bridge.serving.auth import inbound_api_key
    from gym_bridge.serving.listen import listening_socket

    api_key = inbound_api_key(args.api_key)
    sock = listening_socket(args.host, args.port)  # a busy port fails here, before a model or upstream is loaded
    try:
        if args.upstream:
            server = _proxy_server(args, api_key, sock)
            what = "a token-faithful proxy for " + ", ".join(args.upstream)
        else:
            server = _local_server(args, api_key, sock)
            what = args.model
    except BaseException:
        sock.close()
        raise
    generation = server.state.generation

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        url = await server.start()
        log.info("serving %s at %s", what, url)
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


def _proxy_server(args: argparse.Namespace, api_key: SecretStr | None, sock: socket.socket) -> OpenAIServer:
    """The token-faithful proxy for ``--upstream`` endpoints, on ``sock``."""
    from gym_bridge.serving import build_proxy

    return build_proxy(
        args.upstream,
        args.tokenizer,
        args.served_model_name,
        host=args.host,
        port=args.port,
        reasoning_parser=args.reasoning_parser,
        api_key=_env_key(args.upstream_api_key_env),
        inbound_api_key=api_key,
        sock=sock,
    )


def _env_key(name: str) -> SecretStr | None:
    """The API key in the environment variable ``name``; None when it is unset or empty."""
    from pydantic import SecretStr

    value = os.environ.get(name, "")
    return SecretStr(value) if value else None


def _local_server(args: argparse.Namespace, api_key: SecretStr | None, sock: socket.socket) -> OpenAIServer:
    """Our server over the local model (or the scripted or instant policy on its tokenizer), on ``sock``."""
    from gym_bridge.models.registry import check_model_reference

    check_model_reference(args.model)  # an unknown model is one line before torch is imported
    from gym_bridge.generation.factory import EngineSpec, build_engine
    from gym_bridge.serving import OpenAIServer

    built = build_engine(
        EngineSpec(
            policy=args.policy,
            model=args.model,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            answer_tokens=args.answer_tokens,
            think=args.reasoning_parser,
        )
    )
    return OpenAIServer(
        built.generation,
        built.tokenizer,
        served_model_name=args.served_model_name or str(args.model),
        host=args.host,
        port=args.port,
        reasoning_parser=args.reasoning_parser,
        model_path=str(built.model_path),
        api_key=api_key,
        sock=sock,
    )


def _eval(args: argparse.Namespace) -> int:
    import logging

    from gym_bridge.eval import EvalInterrupted, load_config, run_eval

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, args.overrides)
        if config.policies is not None:
            return _eval_policies(config, args)
        outcome = run_eval(config, resume=args.resume, progress=not args.no_progress)
    except EvalInterrupted as exc:
        print(f"gym-bridge eval: {shown(exc)}; continue with --resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("gym-bridge eval: interrupted; continue with --resume", file=sys.stderr)
        return 130
    agents = outcome.metrics.get("agents", {})
    overall = agents.get("all", {})
    print(
        f"{outcome.done_before + outcome.done_now} of {outcome.prompts_total} prompt groups done "
        f"({outcome.failed_now} failed this run); mean reward {overall.get('mean_reward', float('nan')):.3f}"
    )
    print(f"report: {shown(outcome.run_dir / 'report.md')}")
    print(f"metrics: {shown(outcome.run_dir / 'metrics.json')}")
    return 1 if outcome.metrics.get("prompts_failed") else 0


def _eval_policies(config: EvalConfig, args: argparse.Namespace) -> int:
    """``gym-bridge eval`` of a config with ``policies``: one line per policy, then the comparison."""
    from gym_bridge.eval.runner import run_policies

    done = run_policies(config, resume=args.resume, progress=not args.no_progress)
    failed = False
    for name, outcome in done.policies.items():
        overall = outcome.metrics.get("agents", {}).get("all", {})
        failed = failed or bool(outcome.metrics.get("prompts_failed"))
        print(
            f"{name}: {outcome.done_before + outcome.done_now} of {outcome.prompts_total} prompt groups done "
            f"({outcome.failed_now} failed this run); mean reward {overall.get('mean_reward', float('nan')):.3f}; "
            f"report: {shown(outcome.run_dir / 'report.md')}"
        )
    ray = f"; Ray started once ({done.ray_start_s:.1f} s)" if done.ray_start_s is not None else ""
    print(f"{len(done.policies)} policies in {done.seconds:.0f} s{ray}")
    if done.compare_dir is not None:
        print(f"comparison: {shown(done.compare_dir / 'compare.md')}")
    elif done.compare_error is not None:
        print(f"gym-bridge eval: no comparison: {shown(done.compare_error)}", file=sys.stderr)
    return 1 if failed or done.compare_error is not None else 0


def _train(args: argparse.Namespace) -> int:
    """Train a NeMo-RL GRPO config into a run folder; a bad key or value is one error line (main())."""
    import logging
    import time

    from gym_bridge.config.overrides import load_with_overrides
    from gym_bridge.failures.errors import SettingError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "gym_bridge.gym", "gym_bridge.serving", "gym_bridge.rollout", "ray", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.model is not None and not args.smoke:
        raise SettingError(f"--model goes with --smoke; without it set policy.model_name={args.model}")
    config = load_with_overrides(args.config, args.overrides)  # an unreadable config or bad key: before torch loads
    if args.out is None and args.resume:
        raise SettingError("--resume needs --out, the run folder to continue")
    from gym_bridge.recipes.train import smoke_recipe, train

    if args.smoke:
        from gym_bridge.config.overrides import override_keys
        from gym_bridge.config.smoke import SMOKE_MODEL

        plan = smoke_recipe(config, model=args.model or SMOKE_MODEL, pinned=override_keys(args.overrides))
        print(plan.table(), flush=True)
        config = plan.config
    stem = args.config.rstrip("/").split("/")[-1].rsplit(".", 1)[0] + ("-smoke" if args.smoke else "")
    out = args.out or f"runs/{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        outcome = train(config, out, resume=args.resume, progress=not args.no_progress, list_gpu_keys=not args.smoke)
    except KeyboardInterrupt:
        print(f"gym-bridge train: interrupted; continue with --resume --out {shown(out)}", file=sys.stderr)
        return 130
    print(f"run: {shown(outcome.run_dir)}")
    print(f"checkpoint: {shown(outcome.checkpoint or 'none (checkpointing.enabled: false)')}")
    if outcome.plots is not None:
        print(f"plots: {shown(outcome.plots.png)} {shown(outcome.plots.html)}")
        for name, (first, last, test) in outcome.plots.mcnemar.items():
            print(
                f"held-out {name}: {test.wrong_to_right} wrong->right, {test.right_to_wrong} right->wrong of "
                f"{test.n} answers (step {first:g} vs {last:g}), McNemar p={test.p_value:.3g}"
            )
    if outcome.loggers.enabled:
        print(f"experiment logs ({', '.join(outcome.loggers.enabled)}): {shown(outcome.loggers.log_dir)}")
    return 0


def _check_endpoint(args: argparse.Namespace) -> int:
    from gym_bridge.preflight import check_endpoints

    api_key = args.api_key or _env_key("OPENAI_API_KEY")
    checks = check_endpoints(args.urls, args.model, tools=args.tools, timeout_s=args.timeout, api_key=api_key)
    for check in checks:
        print(shown(check.line), file=sys.stdout if check.ok else sys.stderr)
    return 0 if all(check.ok for check in checks) else 2


def _report(args: argparse.Namespace) -> int:
    """Rebuild a run folder's report (an eval run's report, or a training run's plots: which one,
    :func:`~gym_bridge.eval.runs.run_folder_kind` decides); a folder that cannot be read or written is one error
    line (main())."""
    from pathlib import Path

    from gym_bridge.boundary import UntrustedInputError
    from gym_bridge.eval import RunDirError
    from gym_bridge.eval.runs import RunReadError, run_folder_kind

    where = f"cannot build the report of {shown(args.run_dir)}"
    folder = Path(args.run_dir)
    try:
        if run_folder_kind(folder) == "training":
            from gym_bridge.training.plots import write_training_plots

            plots = write_training_plots(folder)
            print(f"plots: {shown(plots.png)} {shown(plots.html)}")
            return 0
        from gym_bridge.eval.report import build_report

        build_report(folder)
    except UntrustedInputError as exc:  # a RunReadError too
        raise RunReadError(f"{where}: {exc}") from exc
    except OSError as exc:
        raise RunDirError(f"{where}: {shown(exc)}") from exc
    print(f"report: {shown(folder / 'report.md')}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    """Compare runs; a run folder that cannot be read or compared is one error line (main())."""
    from gym_bridge.eval.compare import compare_runs

    out = args.out or "compare-" + "-vs-".join(p.rstrip("/").split("/")[-1] for p in args.run_dirs)
    outcome = compare_runs(
        args.run_dirs,
        out,
        level=args.level,
        resamples=args.resamples,
        seed=args.seed,
        fail_if_worse=args.fail_if_worse,
    )
    print(f"comparison: {shown(outcome.out_dir / 'compare.md')}")
    for line in outcome.worse:
        print(f"gym-bridge compare: {shown(line)}", file=sys.stderr)
    return 1 if outcome.worse else 0


def _rescore(args: argparse.Namespace) -> int:
    """Grade a run's stored responses again; a folder, option or Gym start that fails is one error line (main())."""
    import logging

    from gym_bridge.eval.rescore import rescore_run

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = args.out or f"{args.run_dir.rstrip('/')}-rescored"
    outcome = rescore_run(args.run_dir, out, config_file=args.config, overrides=args.overrides)
    print(
        f"{outcome.completions} completions verified again: {outcome.changed} rewards changed, "
        f"{len(outcome.unverified)} could not be verified (listed in {outcome.out_dir / 'rescore.json'})"
    )
    print(f"report: {shown(outcome.out_dir / 'report.md')}")
    return 1 if outcome.unverified else 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gym-bridge", description=__doc__)
    parser.add_argument("--traceback", action="store_true", help="on an error, show the whole traceback")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("backends", help="list the registered rollout backends").set_defaults(func=_backends)
    tiny = commands.add_parser("build-tiny", help="build (or reuse) the embedded tiny model and print its folder")
    tiny.add_argument("--cache-dir", default=None)
    tiny.add_argument("--seed", type=_number(int, 0, MAX_SEED), default=0)
    tiny.set_defaults(func=_build_tiny)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API until SIGINT/SIGTERM")
    serve.add_argument("--model", default="tiny", help='a built-in model ("tiny", "smollm2") or a local model folder')
    serve.add_argument(
        "--policy",
        choices=["hf", "scripted", "instant"],
        default="hf",
        help="hf: the model; scripted: rule-based replies; instant: a fixed reply, no model (benchmarks)",
    )
    serve.add_argument(
        "--answer-tokens",
        type=_number(int, 1, MAX_TOKENS),
        default=16,
        help="with --policy instant: reply length, EOS included",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_number(int, 0, 65535), default=8000)
    serve.add_argument("--served-model-name", default=None, help="default: the --model value")
    serve.add_argument("--max-new-tokens", type=_number(int, 1, MAX_TOKENS), default=256)
    serve.add_argument("--temperature", type=_number(float, 0, 100), default=1.0, help="0: greedy")
    serve.add_argument("--top-p", type=_number(float, 0, 1, "(]"), default=1.0)
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
    serve.set_defaults(func=_serve)
    run = commands.add_parser("eval", help="evaluate a policy on a JSONL dataset of Gym rows (see docs/evaluation.md)")
    run.add_argument("config", help="the eval config (YAML)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. limit=2")
    run.add_argument("--resume", action="store_true", help="continue the run in output_dir")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=_eval)
    check = commands.add_parser(
        "check-endpoint",
        help="check OpenAI-compatible endpoints the way a run does before it starts (see docs/preflight.md)",
    )
    check.add_argument("urls", nargs="+", metavar="URL", help="base URL(s), http://host:port/v1")
    check.add_argument("--model", required=True, help="the served model name the run will send")
    check.add_argument("--tools", action="store_true", help="also check that chats offering tools are accepted")
    check.add_argument(
        "--timeout", type=_number(float, 0, 3600, "(]"), default=20.0, help="seconds for each endpoint's checks"
    )
    check.add_argument("--api-key", default=None, help="the endpoints' API key (default: $OPENAI_API_KEY)")
    check.set_defaults(func=_check_endpoint)
    train = commands.add_parser(
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
    train.set_defaults(func=_train)
    report = commands.add_parser(
        "report", help="rebuild an eval run's metrics.json, report.md and report.png, or a training run's plots"
    )
    report.add_argument("run_dir")
    report.set_defaults(func=_report)
    compare = commands.add_parser(
        "compare", help="compare eval runs of one dataset with the first, with intervals (see docs/evaluation.md)"
    )
    compare.add_argument("run_dirs", nargs="+", metavar="RUN", help="run folders; the first is the baseline")
    compare.add_argument("--out", default=None, help="output folder (default: ./compare-A-vs-B)")
    compare.add_argument(
        "--level", type=_number(float, 0, 1, "()"), default=0.95, help="confidence level of the intervals"
    )
    compare.add_argument(
        "--resamples", type=_number(int, 100, 1_000_000), default=10_000, help="paired bootstrap resamples"
    )
    compare.add_argument("--seed", type=_number(int, 0, MAX_SEED), default=0, help="bootstrap seed")
    compare.add_argument(
        "--fail-if-worse",
        type=_number(float, 0, math.inf, "[)"),
        default=None,
        metavar="DELTA",
        help="exit 1 when a run is worse than the first by more than DELTA (mean reward or pass@1) at --level",
    )
    compare.set_defaults(func=_compare)
    rescore = commands.add_parser(
        "rescore", help="grade a run's stored responses again through Gym's /verify, into a new run folder"
    )
    rescore.add_argument("run_dir", help="the finished run folder")
    rescore.add_argument(
        "overrides", nargs="*", metavar="key=value", help="grader settings to change, e.g. gym_overrides.x.y=z"
    )
    rescore.add_argument("--config", default=None, help="take config_paths, gym_overrides, pass_threshold from here")
    rescore.add_argument("--out", default=None, help="the new run folder (default: RUN_DIR-rescored)")
    rescore.set_defaults(func=_rescore)
    for sub in commands.choices.values():
        sub.add_argument(
            "--traceback",
            action="store_true",
            default=argparse.SUPPRESS,
            help="on an error, show the whole traceback instead of one line",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand and return its exit code. The one error boundary: a usage error or an option out of its
    range is one line before anything starts (exit 2, returned, not raised); any
    :class:`~gym_bridge.failures.GymBridgeError` (every error a user's input can cause) and any ``OSError`` (a
    path the system refused) end as ``gym-bridge <command>: <message>`` on stderr, one line per line of the
    message, with exit code 2; Ctrl-C is ``interrupted`` (130). Anything else is a bug: one line that says so, its
    traceback saved to a file (:func:`_bug`), exit code :data:`EXIT_BUG`. ``--traceback`` (or
    ``GYM_BRIDGE_DEBUG=1``) shows the whole traceback instead."""
    try:
        args = _parsed(argv)
    except SystemExit as exc:  # a usage error (2) or --help (0): the code returned, as for every other outcome
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except Exception as exc:
        if args.traceback or os.environ.get(DEBUG_ENV) == "1":
            raise
        code, lines = _explained(exc)
    except KeyboardInterrupt:
        if args.traceback or os.environ.get(DEBUG_ENV) == "1":
            raise
        code, lines = 130, ["interrupted"]
    for line in lines:
        print(f"gym-bridge {args.command}: {shown(line)}", file=sys.stderr)
    return code


def _parsed(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, ``key=value`` overrides after an option included; a usage error exits (argparse)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow an option (``rescore RUN --out DIR key=value``); argparse before Python 3.13
    # stops filling a ``nargs="*"`` positional once an option came between, so they are collected here.
    stray = [arg for arg in extra if arg.startswith("-") or "=" not in arg]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _explained(exc: Exception) -> tuple[int, list[str]]:
    """The exit code and the lines of an error: a refused input (2) in its own words, or a bug (:func:`_bug`)."""
    from gym_bridge.failures import GymBridgeError

    if isinstance(exc, GymBridgeError):
        return 2, str(exc).splitlines() or [type(exc).__name__]
    if isinstance(exc, OSError):
        names = [shown(name) for name in (exc.filename, exc.filename2) if name is not None]
        return 2, [": ".join([*names, shown(exc.strerror or exc)])]
    return EXIT_BUG, [_bug(exc)]


def _bug(exc: Exception) -> str:
    """The one line of an error no input explains, its traceback written to a file in the temporary folder
    (``$TMPDIR``): a run that failed after an hour keeps what a bug report needs without a second run, and the
    terminal and scripts still see one line."""
    import tempfile
    import time
    import traceback
    from pathlib import Path

    from gym_bridge.boundary.files import write_atomic
    from gym_bridge.failures import GymBridgeError

    saved = Path(tempfile.gettempdir()) / f"gym-bridge-traceback-{os.getpid()}-{time.time_ns()}.txt"
    try:
        write_atomic(saved, "".join(traceback.format_exception(exc)))
        where = f"traceback in {shown(saved)}"
    except (OSError, GymBridgeError):
        where = f"run again with --traceback or {DEBUG_ENV}=1 for the traceback"
    message = shown(" ".join(str(exc).split())[:300])
    return f"internal error, please report it: {type(exc).__name__}: {message} ({where})"


if __name__ == "__main__":
    sys.exit(main())
