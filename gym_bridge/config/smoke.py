"""``gym-bridge train RECIPE --smoke``: a NeMo-RL Gym recipe rewritten into a short CPU run of its Gym environments.

:func:`smoke_config` is a pure function over the plain (resolved) config dict: it returns the rewritten config and every
key it changed (key, recipe value, smoke value, why), and every GPU-only key it leaves as it is because nothing here
reads it. What it needs to know beyond the config (how many rows the data has, how long the longest prompt is under the
small model's chat template, the model's own context, which Gym configs the rows use) comes in a :class:`SmokeFacts`,
read by :func:`gym_bridge.recipes.smoke_facts.smoke_facts`; so the rewrite is tested without files, a model or Ray.

What changes: the model (``--model``, default ``smollm2``), the batch (``grpo.num_prompts_per_step`` and
``num_generations_per_prompt`` cut to :data:`SMOKE_PROMPTS` / :data:`SMOKE_GENERATIONS` and to the dataset,
``policy.train_global_batch_size`` to their product), one step, the lengths (the context cut to the model's own, the
engine's copies of it with it, ``max_new_tokens`` to :data:`SMOKE_MAX_NEW_TOKENS` and to the room the longest prompt
leaves), validation shrunk (:data:`SMOKE_VAL_SAMPLES` rows, one generation each; a missing validation file replaced
by the training rows), a missing training file replaced by the example rows Gym ships for the recipe's agent, rows
without an agent routed to the agent that declares their file, the Gym configs of environments the rows do not use
left out, no checkpoint, the experiment logs in the run folder, a chat template of the recipe's own left out (the
smoke model renders with its own), and every GPU feature off (:data:`GPU_KEYS`: Megatron, DTensor, colocation,
``precision: float32``, parallel sizes 1, GPU monitoring, ...). A key the command line set (``pinned``) is never
changed.

:func:`~gym_bridge.config.gpu_keys.gpu_only_keys` lists the GPU-only keys a config sets that a CPU run ignores: a run
without ``--smoke`` names them once (``gym_bridge.recipes.train``) instead of ignoring them silently.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gym_bridge.config.chat_template import TEMPLATE_KEYS
from gym_bridge.config.gpu_keys import GPU_KEYS, is_active
from gym_bridge.config.keys import config_value
from gym_bridge.config.smoke_table import ABSENT, REMOVED, IgnoredKey, KeyChange, format_table, shown_value
from gym_bridge.config.training import CONTEXT_LENGTH_KEY, ENGINE_CONTEXT_KEYS
from gym_bridge.gym.servers.config_files import VllmSwap
from gym_bridge.json_types import JsonMapping, JsonObject

SMOKE_MODEL = "smollm2"
"""The model a smoke run trains unless ``--model`` names another (a built-in name or a local folder)."""
SMOKE_PROMPTS = 2
"""The most prompts a smoke step draws (``grpo.num_prompts_per_step``)."""
SMOKE_GENERATIONS = 2
"""The most samples per prompt (``grpo.num_generations_per_prompt``): two, so a group can have a reward spread."""
SMOKE_MAX_NEW_TOKENS = 64
"""The most tokens a smoke turn generates (``policy.generation.max_new_tokens``)."""
SMOKE_JUDGE_MAX_TOKENS = 512
"""The most tokens a judge's turn generates (a server's ``*_responses_create_params.max_output_tokens``): room for the
smoke model to finish an answer, since a judge cut by its budget counts as failed (GenRM's ``judge_failed``)."""
SMOKE_VAL_SAMPLES = 2
"""The most rows of each validation set (``grpo.max_val_samples``)."""
SMOKE_STEPS = 1


_MODEL_KEYS = ("policy.model_name", "policy.tokenizer.name", "policy.generation.model_name", "teacher.model_name")


@dataclass(frozen=True)
class SmokeFacts:
    """What the rewrite needs beyond the config (:func:`gym_bridge.recipes.smoke_facts.smoke_facts` reads it)."""

    train_path: str | None = None
    """The training rows the smoke run uses: the recipe's file, or Gym's example rows when that file is missing
    (None: no readable rows; the run will name the key)."""
    train_rows: int | None = None
    """How many prompts ``train_path`` holds."""
    validation_paths: Mapping[str, str | None] = field(default_factory=dict)
    """Each validation key (``data.validation.data_path``, ``data.validation.extra_sets.<name>``) -> its file, or
    None when the file is missing."""
    longest_prompt: int | None = None
    """The longest first prompt of the rows (training and validation) in tokens, under the smoke model's template."""
    model_context: int | None = None
    """The smoke model's own context (``max_position_embeddings``)."""
    route_to: str | None = None
    """The agent for rows that name none (the one that declares their file, or the recipe's only agent)."""
    example_agent: str | None = None
    """The agent whose example rows replaced a missing training file."""
    config_paths: tuple[str, ...] | None = None
    """The recipe's ``env.nemo_gym.config_paths`` the rows need (None: unknown, all are kept)."""
    unused_instances: tuple[str, ...] = ()
    """``env.nemo_gym`` sections that configure servers of the Gym configs left out."""
    fitted: Mapping[str, tuple[str, int, int, int]] = field(default_factory=dict)
    """Data key -> (a copy without its rows past the smoke context, rows left out, rows, the context)."""
    vllm_swaps: tuple[VllmSwap, ...] = ()
    """The kept Gym servers that start vLLM: each replaced by a ``vllm_model`` block to the run's endpoint when a
    kept server calls it, left out when none does."""
    config_copies: Mapping[str, str] = field(default_factory=dict)
    """Config path -> its copy without the vLLM servers it defines (``config_paths`` names the copies)."""
    cohort_servers: tuple[str, ...] = ()
    """Kept servers that score a prompt's samples together, as ``<instance>.<type>.<folder>``: their
    ``num_rollouts_per_prompt`` follows the smoke's ``grpo.num_generations_per_prompt``."""
    judge_budgets: Mapping[str, int] = field(default_factory=dict)
    """Kept servers' own generation budgets (a judge's ``max_output_tokens``), by key under ``env.nemo_gym``."""
    served_file: str | None = None
    """The Gym config file that defines each called vLLM server again as a ``vllm_model`` to the run's endpoint
    (``config_paths`` names it)."""


@dataclass(frozen=True)
class SmokePlan:
    """The smoke run's config, what changed, what is ignored, and which command-line keys were kept."""

    config: JsonObject
    changes: tuple[KeyChange, ...]
    ignored: tuple[IgnoredKey, ...]
    pinned: tuple[str, ...] = ()

    def table(self) -> str:
        """One table: every key changed (recipe -> smoke value) and every GPU-only key ignored."""
        rows = [(c.key, shown_value(c.recipe), shown_value(c.smoke), c.why) for c in self.changes]
        rows += [(i.key, shown_value(i.value), "(ignored)", i.why) for i in self.ignored]
        title = f"--smoke: {len(self.changes)} key(s) changed, {len(self.ignored)} GPU-only key(s) ignored"
        if self.pinned:
            title += f"; kept as the command line set them: {', '.join(self.pinned)}"
        return format_table(title, ("key", "recipe", "smoke", "why"), rows)


class _Rewrite:
    """The config being rewritten and the changes so far; a pinned key is never touched."""

    def __init__(self, config: JsonMapping, pinned: Iterable[str]) -> None:
        self.config: JsonObject = copy.deepcopy(dict(config))
        self.changes: list[KeyChange] = []
        self.pinned = tuple(pinned)

    def is_pinned(self, key: str) -> bool:
        return any(key == p or key.startswith(f"{p}.") or p.startswith(f"{key}.") for p in self.pinned)

    def get(self, key: str) -> object:
        return config_value(self.config, key, ABSENT)

    def set(self, key: str, value: object, why: str, *, add: bool = False) -> None:
        """``key`` to ``value`` when the config has it (or ``add``), differs, and the command line did not set it."""
        before = self.get(key)
        if (before is ABSENT and not add) or before == value or self.is_pinned(key):
            return
        node: dict[str, Any] = self.config
        *parents, last = key.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[last] = copy.deepcopy(value)
        self.changes.append(KeyChange(key, copy.deepcopy(before), copy.deepcopy(value), why))

    def remove(self, key: str, why: str) -> None:
        before = self.get(key)
        if before is ABSENT or self.is_pinned(key):
            return
        *parents, last = key.split(".")
        node: Any = self.config
        for part in parents:
            node = node[part]
        del node[last]
        self.changes.append(KeyChange(key, copy.deepcopy(before), REMOVED, why))

    def cut(self, key: str, most: int, why: str) -> int | None:
        """``key`` (a positive int) cut to at most ``most``; its value afterwards (None: absent or not an int)."""
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        if value > most:
            self.set(key, most, why)
        after = self.get(key)
        return after if isinstance(after, int) else None


def smoke_config(
    config: JsonMapping, facts: SmokeFacts, *, model: str = SMOKE_MODEL, pinned: Iterable[str] = ()
) -> SmokePlan:
    """``config`` (a plain, resolved NeMo-RL Gym recipe) as a short CPU run: see the module docstring. ``pinned``: the
    keys the command line set, never changed. Pure: reads nothing but its arguments."""
    r = _Rewrite(config, pinned)
    _model(r, model)
    _data(r, facts)
    _batch(r, facts)
    _lengths(r, facts, model)
    _judge_budgets(r, facts)
    _validation(r)
    _gym(r, facts)
    _run(r)
    ignored = _gpu(r)
    return SmokePlan(r.config, tuple(r.changes), tuple(ignored), tuple(r.pinned))


def _model(r: _Rewrite, model: str) -> None:
    """The smoke model in every model key the recipe sets, and in ``policy.model_name`` even when its launcher fills
    it (``null``, or absent)."""
    r.set(_MODEL_KEYS[0], model, "the smoke run's model (--model)", add=True)
    for key in _MODEL_KEYS[1:]:
        if r.get(key) not in (ABSENT, None):
            r.set(key, model, "the smoke run's model (--model)")
    for key in TEMPLATE_KEYS:
        if r.get(key) not in (ABSENT, None):
            r.remove(key, f"a chat template for the recipe's model; {model} renders with its own")


def _data(r: _Rewrite, facts: SmokeFacts) -> None:
    key = "data.train.data_path" if r.get("data.train.data_path") not in (ABSENT, None) else "data.path"
    if facts.train_path is not None and r.get(key) != facts.train_path:
        example = f"the recipe's file is missing: Gym's example rows of {facts.example_agent}"
        r.set(key, facts.train_path, example if facts.example_agent else "the smoke run's training rows", add=True)
    for fit_key, (fit_path, out, total, context) in facts.fitted.items():
        r.set(fit_key, fit_path, f"{out} of {total} rows render past the {context}-token context: left out of a copy")
    for val_key, path in facts.validation_paths.items():
        if path is not None or r.get(val_key) is ABSENT:
            continue
        train = facts.fitted.get(key, (facts.train_path,))[0]  # its copy without the rows past the context
        if val_key == "data.validation.data_path" and train is not None:
            r.set(val_key, train, "the recipe's file is missing: the smoke run's training rows")
        else:
            r.remove(val_key, "the recipe's file is missing")


def _batch(r: _Rewrite, facts: SmokeFacts) -> None:
    most = SMOKE_PROMPTS if facts.train_rows is None else max(1, min(SMOKE_PROMPTS, facts.train_rows))
    prompts = r.cut("grpo.num_prompts_per_step", most, f"at most {SMOKE_PROMPTS} prompts and the dataset's rows")
    generations = r.cut("grpo.num_generations_per_prompt", SMOKE_GENERATIONS, f"{SMOKE_GENERATIONS} samples a prompt")
    if prompts is not None and generations is not None:
        r.set("policy.train_global_batch_size", prompts * generations, "one step's samples (prompts x generations)")
    for server in facts.cohort_servers if generations is not None else ():
        key = f"env.nemo_gym.{server}.num_rollouts_per_prompt"
        r.set(key, generations, "a cohort it scores together is one prompt's samples", add=True)
    r.cut("grpo.max_num_steps", SMOKE_STEPS, "one step")
    if r.get("grpo.use_dynamic_sampling") is True:
        r.set(
            "grpo.use_dynamic_sampling",
            False,
            "a small model's first groups often all agree; dynamic sampling would draw past the smoke's rows",
        )
        r.set("grpo.batch_multiplier", 1, "dynamic sampling is off")


def _lengths(r: _Rewrite, facts: SmokeFacts, model: str) -> None:
    context = r.get(CONTEXT_LENGTH_KEY)
    if isinstance(context, int) and not isinstance(context, bool):
        if facts.model_context is not None and context > facts.model_context:
            r.set(CONTEXT_LENGTH_KEY, facts.model_context, f"{model}'s own context (max_position_embeddings)")
        context = r.get(CONTEXT_LENGTH_KEY)
        for key in ENGINE_CONTEXT_KEYS:
            if r.get(key) not in (ABSENT, None):
                r.set(key, context, f"equal to {CONTEXT_LENGTH_KEY}")
    key = "policy.generation.max_new_tokens"
    budget = r.get(key)
    if isinstance(budget, bool) or not isinstance(budget, int):
        return
    most = SMOKE_MAX_NEW_TOKENS
    why = f"at most {SMOKE_MAX_NEW_TOKENS} tokens a turn"
    if isinstance(context, int) and facts.longest_prompt is not None and context - facts.longest_prompt >= 1:
        room = context - facts.longest_prompt
        if room < most:
            most, why = room, f"the room the longest prompt ({facts.longest_prompt} tokens) leaves in the context"
    r.cut(key, most, why)


def _judge_budgets(r: _Rewrite, facts: SmokeFacts) -> None:
    """A judge's own generation budget cut as the policy's is: the smoke model answers for the judges too."""
    for judge, tokens in facts.judge_budgets.items():
        if tokens > SMOKE_JUDGE_MAX_TOKENS:
            why = f"at most {SMOKE_JUDGE_MAX_TOKENS} tokens a judge's turn (the smoke model judges)"
            r.set(f"env.nemo_gym.{judge}", SMOKE_JUDGE_MAX_TOKENS, why, add=True)


def _validation(r: _Rewrite) -> None:
    has_sets = r.get("data.validation.data_path") not in (ABSENT, None) or bool(r.get("data.validation.extra_sets"))
    if not has_sets:
        return
    limit = r.get("grpo.max_val_samples")
    if limit in (ABSENT, None) or (isinstance(limit, int) and limit > SMOKE_VAL_SAMPLES):
        r.set("grpo.max_val_samples", SMOKE_VAL_SAMPLES, f"{SMOKE_VAL_SAMPLES} rows of each validation set", add=True)
    r.cut("grpo.val_num_generations_per_prompt", 1, "one sample a validation row")


def _gym(r: _Rewrite, facts: SmokeFacts) -> None:
    if facts.route_to is not None:
        r.set(
            "env.nemo_gym.agent_name",
            facts.route_to,
            "the rows name no agent (agent_ref): the agent that declares their file, or the recipe's only one",
            add=True,
        )
    if facts.config_paths is not None:
        why = "only the Gym configs the rows use (the model server, their agents and what those call)"
        if facts.config_copies:
            why += f"; {len(facts.config_copies)} copied into the run folder without their vLLM servers"
        if facts.served_file:
            why += "; vllm_servers.yaml: those a kept server calls, served by the smoke model"
        r.set("env.nemo_gym.config_paths", list(facts.config_paths), why)
    for name in facts.unused_instances:
        r.remove(f"env.nemo_gym.{name}", "configures a server of a Gym config left out")
    for swap in facts.vllm_swaps:
        _swap_vllm_server(r, swap)
    r.remove("env.nemo_gym.uv_venv_dir", "a cluster's per-server venvs; a smoke run's servers run in this environment")
    r.set("env.nemo_gym.skip_venv_if_present", True, "no per-server venv is made: the servers run in this environment")


def _swap_vllm_server(r: _Rewrite, swap: VllmSwap) -> None:
    """A server that starts vLLM: out of the recipe's blocks, and one row saying what answers for it instead."""
    key = f"env.nemo_gym.{swap.name}"
    if r.is_pinned(key):
        return
    recipe = r.get(key)
    if recipe is not ABSENT:
        del r.config["env"]["nemo_gym"][swap.name]
    else:
        recipe = f"{swap.folder} in {swap.config_path.rsplit('/', 1)[-1]}"
    vllm = f"{swap.folder} starts vLLM on GPUs"
    if swap.callers:
        why = f"{vllm}: the smoke model answers {', '.join(swap.callers)} on the run's own endpoint (vllm_servers.yaml)"
        r.changes.append(KeyChange(key, recipe, "vllm_model: the run's endpoint", why))
    else:
        r.changes.append(KeyChange(key, recipe, REMOVED, f"{vllm}, and no server of the smoke run calls it"))


def _run(r: _Rewrite) -> None:
    r.set("checkpointing.enabled", False, "no checkpoint (the weights, tokenizer and optimizer of a smoke step)")
    if r.get("logger.log_dir") not in (ABSENT, None):
        r.remove("logger.log_dir", "the experiment logs go in the run folder (<run>/logs)")


def _gpu(r: _Rewrite) -> list[IgnoredKey]:
    """Every GPU feature off where it has an off value; the other GPU-only keys listed as ignored."""
    ignored = []
    for spec in GPU_KEYS:
        value = r.get(spec.key)
        if not is_active(spec, value):
            continue
        if spec.off is ABSENT or r.is_pinned(spec.key):
            ignored.append(IgnoredKey(spec.key, value, spec.why))
        else:
            r.set(spec.key, spec.off, f"off on the CPU: {spec.why}")
    return ignored
