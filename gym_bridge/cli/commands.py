"""What each ``gym-bridge`` subcommand runs: its parsed options handed to the recipe or eval module that does the work,
and the outcome printed as the command's lines; each returns the command's exit code."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from gym_bridge.boundary.text import shown

if TYPE_CHECKING:
    from gym_bridge.eval.config import EvalConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def backends(args: argparse.Namespace) -> int:
    """``gym-bridge backends``: one line per registered rollout backend."""
    from gym_bridge.rollout.registry import available_backends

    for name, entry in available_backends().items():
        print(f"{name:16} {entry.value}  ({entry.distribution})")
    return 0


def build_tiny(args: argparse.Namespace) -> int:
    """``gym-bridge build-tiny``: the embedded tiny model's folder, built if missing."""
    from gym_bridge.models.tiny import build_tiny_model

    print(build_tiny_model(cache_dir=args.cache_dir, seed=args.seed))
    return 0


def serve(args: argparse.Namespace) -> int:
    """``gym-bridge serve``: :func:`~gym_bridge.recipes.serve.serve` with the command's options."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    from gym_bridge.recipes.serve import ServeSettings, serve as serve_until_stopped

    return serve_until_stopped(
        ServeSettings(**{field.name: getattr(args, field.name) for field in fields(ServeSettings)})
    )


def eval_run(args: argparse.Namespace) -> int:
    """``gym-bridge eval``: one run (or one per policy); exit code 1 when a prompt group failed, 130 interrupted."""
    from gym_bridge.eval import EvalInterrupted, load_config, run_eval

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
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
    from gym_bridge.eval.policies import run_policies

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


def train(args: argparse.Namespace) -> int:
    """``gym-bridge train``: a NeMo-RL GRPO config trained into a run folder; a bad key or value is one error line
    (the command's error boundary), 130 interrupted."""
    import time

    from gym_bridge.config.overrides import load_with_overrides
    from gym_bridge.failures.errors import SettingError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "gym_bridge.gym", "gym_bridge.serving", "gym_bridge.rollout", "ray", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.model is not None and not args.smoke:
        raise SettingError(f"--model goes with --smoke; without it set policy.model_name={args.model}")
    if args.out is None and args.resume:
        raise SettingError("--resume needs --out, the run folder to continue")
    stem = args.config.rstrip("/").split("/")[-1].rsplit(".", 1)[0] + ("-smoke" if args.smoke else "")
    out = args.out or f"runs/{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.smoke:  # the launcher's unset variables get scratch values: before torch loads, as any config error
        from gym_bridge.recipes.smoke_env import load_with_scratch_env

        config, scratch = load_with_scratch_env(args.config, args.overrides, Path(out))
    else:
        config = load_with_overrides(args.config, args.overrides)  # an unreadable config or bad key: before torch
    from gym_bridge.recipes.train import smoke_recipe, train as train_run

    try:
        if args.smoke:
            from dataclasses import replace

            from gym_bridge.config.overrides import override_keys
            from gym_bridge.config.smoke import SMOKE_MODEL

            pinned = override_keys(args.overrides)
            plan = smoke_recipe(config, model=args.model or SMOKE_MODEL, pinned=pinned, run_dir=Path(out))
            plan = replace(plan, changes=(*scratch, *plan.changes))
            print(plan.table(), flush=True)
            config = plan.config
        outcome = train_run(
            config, out, resume=args.resume, progress=not args.no_progress, list_gpu_keys=not args.smoke
        )
    except BaseException as exc:
        if args.smoke:
            from gym_bridge.recipes.smoke_rows import remove_unstarted_copies

            remove_unstarted_copies(Path(out))
        if not isinstance(exc, KeyboardInterrupt):
            raise
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


def check_endpoint(args: argparse.Namespace) -> int:
    """``gym-bridge check-endpoint``: one line per check; exit code 2 when one failed."""
    from gym_bridge.preflight import check_endpoints
    from gym_bridge.recipes.serve import env_api_key

    api_key = args.api_key or env_api_key("OPENAI_API_KEY")
    checks = check_endpoints(args.urls, args.model, tools=args.tools, timeout_s=args.timeout, api_key=api_key)
    for check in checks:
        print(shown(check.line), file=sys.stdout if check.ok else sys.stderr)
    return 0 if all(check.ok for check in checks) else 2


def report(args: argparse.Namespace) -> int:
    """Rebuild a run folder's report (an eval run's report, or a training run's plots: which one,
    :func:`~gym_bridge.eval.runs.run_folder_kind` decides); a folder that cannot be read or written is one error
    line (the command's error boundary)."""
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


def compare(args: argparse.Namespace) -> int:
    """Compare runs; a run folder that cannot be read or compared is one error line (the command's error boundary)."""
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


def rescore(args: argparse.Namespace) -> int:
    """Grade a run's stored responses again; a folder, option or Gym start that fails is one error line (the
    command's error boundary)."""
    from gym_bridge.eval.rescore import rescore_run

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    out = args.out or f"{args.run_dir.rstrip('/')}-rescored"
    outcome = rescore_run(args.run_dir, out, config_file=args.config, overrides=args.overrides)
    print(
        f"{outcome.completions} completions verified again: {outcome.changed} rewards changed, "
        f"{len(outcome.unverified)} could not be verified (listed in {outcome.out_dir / 'rescore.json'})"
    )
    print(f"report: {shown(outcome.out_dir / 'report.md')}")
    return 1 if outcome.unverified else 0
