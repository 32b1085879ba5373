"""What ``gym-bridge train --smoke`` reads before it rewrites a recipe (:func:`smoke_facts`): the training and
validation rows, the Gym configs they use, and the smoke model's tokenizer and context, so the rewrite itself
(:func:`~gym_bridge.config.smoke.smoke_config`) stays a pure function of the config and these facts."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from gym_bridge.config.chat_template import chat_template_kwargs
from gym_bridge.config.data_files import GYM_SECTION, TRAIN_KEY, data_paths, is_train_key, recipe_gym_configs
from gym_bridge.config.grpo import row_routing
from gym_bridge.config.keys import TrainingConfigError, config_section, config_value
from gym_bridge.config.smoke import SmokeFacts
from gym_bridge.config.training import CONTEXT_LENGTH_KEY
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.servers.config_files import GymConfigs
from gym_bridge.json_types import JsonMapping
from gym_bridge.recipes.pre_start import RowFile, read_rows
from gym_bridge.recipes.prompt_length import ModelFacts, longest_prompt, model_facts
from gym_bridge.recipes.smoke_rows import fitted_paths, fitted_rows
from gym_bridge.recipes.smoke_servers import copies_without_vllm, served_by_policy


def smoke_facts(
    config: JsonMapping, model: str, *, pinned: Iterable[str] = (), run_dir: Path | None = None
) -> SmokeFacts:
    """What :func:`~gym_bridge.config.smoke.smoke_config` needs for ``config`` and the smoke ``model``: the training
    rows (the recipe's file, or when it is missing and the command line did not name it, the example rows Gym ships
    for the recipe's first agent that has them), which validation files exist, the longest prompt under ``model``'s
    template, the model's own context, the agent for rows that name none, and the Gym configs those rows use. With
    ``run_dir``, each data file with rows past the smoke context is copied without them into it
    (:mod:`gym_bridge.recipes.smoke_rows`)."""
    pinned = tuple(pinned)
    gym = recipe_gym_configs(config)
    routing = row_routing(config)
    paths = data_paths(config)
    train_key = next((k for k in paths if is_train_key(k)), TRAIN_KEY)
    train = read_rows(train_key, paths[train_key], routing) if train_key in paths else None
    train_path = paths.get(train_key) if train is not None else None
    example_agent = None
    if train is None and train_key not in pinned and TRAIN_KEY not in pinned:
        example = gym.example_rows()
        if example is not None:
            example_agent, example_path = example
            train = read_rows(TRAIN_KEY, example_path, routing)
            train_path = str(example_path) if train is not None else None
    validation: dict[str, str | None] = {}
    files = [train] if train is not None else []
    for key, path in paths.items():
        if key == train_key:
            continue
        found = read_rows(key, path, routing)
        validation[key] = path if found is not None else None
        if found is not None:
            files.append(found)
    route_to = None
    if routing.is_empty and any(f.unrouted() for f in files):
        agents = gym.agents()
        declared = gym.agent_declaring(train.path) if train is not None else None
        route_to = declared or (agents[0] if len(agents) == 1 else None)
    config_paths, unused = _needed_configs(config, gym, files, route_to)
    _refuse_containers(gym, files, route_to)
    kept_paths = config_paths if config_paths is not None else gym.config_paths
    swaps = gym.vllm_swaps(kept_paths, GYM_SECTION)
    copies = copies_without_vllm(gym, swaps, run_dir) if run_dir is not None else {}
    served = served_by_policy(swaps, run_dir) if run_dir is not None else None
    if copies or served:
        kept = [copies.get(p, p) for p in kept_paths]
        config_paths = (*kept, *([served] if served else []))
    facts = model_facts(model)
    kwargs = chat_template_kwargs(config)
    fitted: dict[str, tuple[str, int, int, int]] = {}
    if facts is not None and run_dir is not None:
        files, fitted = _fitted(files, facts, _smoke_context(config, facts), kwargs, routing, run_dir)
    longest = longest_prompt(files, facts.tokenizer, template_kwargs=kwargs) if facts is not None else None
    return SmokeFacts(
        train_path=train_path,
        train_rows=len(train.rows) if train is not None else None,
        validation_paths=validation,
        longest_prompt=longest.tokens if longest is not None else None,
        model_context=facts.context if facts is not None else None,
        route_to=route_to,
        example_agent=example_agent,
        config_paths=config_paths,
        unused_instances=unused,
        vllm_swaps=swaps,
        cohort_servers=tuple(gym.cohort_servers(kept_paths, GYM_SECTION)),
        judge_budgets=gym.judge_budgets(kept_paths, GYM_SECTION),
        config_copies=copies,
        served_file=served,
        fitted=fitted,
    )


def _smoke_context(config: JsonMapping, facts: ModelFacts) -> int | None:
    """The context a smoke run has: the recipe's, cut to the smoke model's own."""
    context = config_value(config, CONTEXT_LENGTH_KEY, None)
    if isinstance(context, bool) or not isinstance(context, int):
        return None
    return min(context, facts.context) if facts.context is not None else context


def _fitted(
    files: list[RowFile],
    facts: ModelFacts,
    context: int | None,
    kwargs: JsonMapping,
    routing: RowRouting,
    run_dir: Path,
) -> tuple[list[RowFile], dict[str, tuple[str, int, int, int]]]:
    """``files`` with each one that has rows past ``context`` replaced by its fitted copy in ``run_dir``, and the
    copies (key -> path, rows left out, rows, context)."""
    if context is None:
        return files, {}
    fits = {
        f.key: fit for f in files if (fit := fitted_rows(f.key, f.path, facts.tokenizer, context, kwargs)) is not None
    }
    written = fitted_paths(fits, run_dir)
    kept = [read_rows(f.key, written[f.key][0], routing) if f.key in written else f for f in files]
    return [f for f in kept if f is not None], written


def _refuse_containers(gym: GymConfigs, files: list[RowFile], route_to: str | None) -> None:
    """One line when every agent the rows use runs its rollouts in a container image (nothing is left to run).

    Raises:
        TrainingConfigError: naming each agent and the container keys it sets.
    """
    used = set().union(*(f.agents() for f in files)) | ({route_to} if route_to is not None else set())
    containers = gym.container_agents(sorted(a for a in used if a is not None))
    if used and containers and set(containers) >= used:
        named = "; ".join(f"{agent} ({', '.join(keys)})" for agent, keys in containers.items())
        raise TrainingConfigError(
            f"--smoke: every agent the rows use runs each rollout in a container image, which a CPU run does not "
            f"start: {named}. Point the data at an environment without containers"
        )


def _needed_configs(
    config: JsonMapping, gym: GymConfigs, files: list[RowFile], route_to: str | None
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The config paths the rows' agents need (None: all of them, or unknown) and the recipe's ``env.nemo_gym``
    sections that configure servers of the paths left out."""
    used: set[str] = set()
    for file in files:
        used |= file.agents()
    if route_to is not None:
        used.add(route_to)
    if not (gym.complete and used and used <= set(gym.agents())):
        return None, ()
    kept, left_out = gym.needed(sorted(used))
    if kept == list(gym.config_paths):
        return None, ()
    recipe_sections = config_section(config, GYM_SECTION)
    kept_names = {i.name for i in gym.instances if i.config_path in kept}
    return tuple(kept), tuple(n for n in left_out if n in recipe_sections and n not in kept_names)
