"""Assemble a GRPO run through NeMo-Gym from a NeMo-RL-style config: engine, server, Gym, manager, policy.

The settings are one :class:`~gym_bridge.config.run_settings.GRPORunSettings`, read before anything starts; nothing
here reads a config key. The engine is :class:`~gym_bridge.generation.hf.HFGeneration` behind our
:class:`~gym_bridge.serving.OpenAIServer` (a thread of this process), which Gym's model
server calls; the trained copy is an :class:`~gym_bridge.policy.hf.HFPolicy`. A run folder
with a checkpoint resumes from it: both copies load the checkpoint's weights (safetensors only), once
:func:`check_checkpoint` has passed its files, before anything starts (a pickle naming code is refused, never run).
``grpo.seed`` seeds torch before the models load, and on the CPU the run uses ``torch.use_deterministic_algorithms``
(restored by :meth:`GRPORun.close`). With ``env.nemo_gym.gym_head`` the run starts no Gym: its server listens where
that running Gym's model server calls (:func:`running_gym_policy`), and the Gym is left running when the run closes.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import torch

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import check_no_links
from gym_bridge.config.grpo import result_logging
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.run_settings import GRPORunSettings, grpo_run_settings
from gym_bridge.data import datum_from_gym_row
from gym_bridge.failures import CheckpointError, SettingError
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.gym.protocol.rows import ValidGymRow
from gym_bridge.gym.servers.log_folder import check_gym_logs, gym_log_dir
from gym_bridge.gym.servers.running import read_policy_endpoint
from gym_bridge.gym.transport.admission import AdmissionControl
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.json_types import JsonMapping
from gym_bridge.models.loading import check_safetensors_weights
from gym_bridge.models.vocab import vocab_size_of
from gym_bridge.policy.hf import HFPolicy
from gym_bridge.policy.optimizer_file import check_optimizer_file
from gym_bridge.recipes.engine_server import ServeOptions, build_engine_server
from gym_bridge.recipes.gym_pre_start import route_on_gym
from gym_bridge.recipes.launch import NemoGymRollouts, start_nemo_gym
from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.serving import OpenAIServer, ServerFeatures
from gym_bridge.serving.listen import ServerBindError, listening_socket
from gym_bridge.training.loop import GRPOTrainer
from gym_bridge.training.loop_config import GRPOLoopConfig
from gym_bridge.training.trainer_state import TrainerState, load_trainer_state
from gym_bridge.training.validation import GymValidator, ValidationSet
from gym_bridge.types import ActorHandle, Tokenizer

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
"""The run folder's checkpoint (:attr:`GRPOTrainer.checkpoint_dir`), which a resumed run loads."""


def validator_from(
    settings: GRPORunSettings,
    actors: list[ActorHandle],
    out_dir: Path,
    *,
    admission: AdmissionControl | None = None,
    reward_shaper: RewardShaper | None = None,
) -> GymValidator | None:
    """A :class:`GymValidator` over the run's Gym actors, or None when the config has no validation data.

    Validation rewards are shaped as training's are (``reward_shaper``; NeMo-RL's ``validate`` does the same);
    each held-out group has the training groups' deadline, and its rows the run seed. ``admission``: the training
    client's, shared, since a validation runs beside the next step's rollouts on the same engine (None: a control of
    its own with ``env.nemo_gym.admission``'s settings)."""
    if not settings.validation_sets:
        return None
    sets = [
        ValidationSet(held.name, routed_rows([ValidGymRow(r) for r in held.rows], actors[0], f"validation {held.name}"))
        for held in settings.validation_sets
    ]
    options = settings.validation
    return GymValidator(
        GymClient(
            actors,
            timer_prefix="timing/validation",
            admission=admission or settings.rollout.launch.manager_options.admission,
        ),
        sets,
        sampling=options.sampling,
        max_new_tokens=options.max_new_tokens,
        num_generations=options.num_generations,
        pass_threshold=settings.loop.pass_threshold,
        results_path=out_dir / "val_results.jsonl",
        reward_shaper=reward_shaper,
        deadline_s=settings.rollout.launch.timeouts.rollout_s,
        seed=settings.seed,
    )


def routed_rows(rows: list[ValidGymRow], actor: ActorHandle, what: str = "training") -> list[ValidGymRow]:
    """``what`` rows with the agent the launched Gym config routes each to
    (:func:`~gym_bridge.recipes.gym_pre_start.route_on_gym`); :class:`TrainingConfigError` naming every row that
    routes nowhere, before any step runs."""
    routed, problems = route_on_gym(rows, actor, [f"{what} row {i}" for i in range(len(rows))])
    if problems:
        raise TrainingConfigError(
            f"{len(problems)} {what} row(s) route to no running agent: " + "; ".join(problems[:5])
        )
    return [row if isinstance(row, ValidGymRow) else ValidGymRow(row) for row in routed]


def reward_shaper_from(loop_cfg: GRPOLoopConfig, tokenizer: Tokenizer) -> RewardShaper:
    """The loop's effort levels, reward penalties and thinking tags over ``tokenizer``."""
    return RewardShaper(
        tokenizer,
        effort_levels=loop_cfg.effort_levels,
        reward_penalties=loop_cfg.reward_penalties,
        thinking_tags=loop_cfg.thinking_tags,
    )


@dataclass(frozen=True)
class PolicyAddress:
    """Where a training run serves its policy for a Gym that is already running: the endpoint that Gym's model server
    calls (its ``policy_base_url``), under the model name it asks for (its ``policy_model_name``)."""

    url: str
    host: str
    port: int
    model_name: str
    gym_head: str


def running_gym_policy(gym_head: str, default_model_name: str) -> PolicyAddress:
    """The address at which the run must serve its policy for the Gym running at ``gym_head``: read from its head
    server (:func:`~gym_bridge.gym.servers.running.read_policy_endpoint`), it must be one ``http://HOST:PORT/v1`` on
    this machine's loopback (the run serves its policy on this machine). The model name is Gym's ``policy_model_name``
    (``default_model_name``, ``policy.model_name``, when its config names none).

    Raises:
        TrainingConfigError: ``gym_head`` is not ``http://host:port``, or the endpoint is not one loopback
            ``http://HOST:PORT/v1`` (one line naming the URL and why).
        GymStartupError: the head server did not answer, or its config names no ``policy_base_url``.
    """
    try:
        policy = read_policy_endpoint(gym_head)
    except SettingError as exc:
        raise TrainingConfigError(f"env.nemo_gym.gym_head: {exc}") from None
    where = f"env.nemo_gym.gym_head: the running NeMo-Gym at {policy.head.url} calls its policy at"
    if len(policy.base_urls) != 1:
        raise TrainingConfigError(
            f"{where} {list(policy.base_urls)} (its policy_base_url); a training run serves one policy endpoint on "
            "this machine, so start that Gym with one policy_base_url, http://127.0.0.1:PORT/v1"
        )
    url = policy.base_urls[0]
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        parts, host, port = None, None, None
    why = None
    if parts is None or parts.scheme != "http" or not host or parts.query or parts.fragment or parts.username:
        why = "which is not an http://HOST:PORT/v1 URL"
    elif not _is_loopback(host):
        why = (
            f"whose host {host} is not this machine's loopback (127.0.0.1, localhost, ::1): the run serves its "
            "policy on this machine; start that Gym with policy_base_url=[http://127.0.0.1:PORT/v1]"
        )
    elif not port:
        why = "which names no port: start that Gym with policy_base_url=[http://127.0.0.1:PORT/v1]"
    elif parts.path.rstrip("/") != "/v1":
        why = "whose path is not /v1, where the run's server serves the OpenAI API"
    if why is not None:
        raise TrainingConfigError(f"{where} {url!r} (its policy_base_url), {why}")
    assert host is not None and port is not None
    return PolicyAddress(url, host, port, policy.model_name or default_model_name, policy.head.url)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def claim_policy_address(address: PolicyAddress) -> socket.socket:
    """The listening socket the run's server will serve on at ``address``, bound now, before any model loads.

    Raises:
        ServerBindError: the port is taken (one line naming the URL: stop what listens there, or start the Gym with
            another ``policy_base_url``), or the address cannot be bound here.
    """
    try:
        return listening_socket(address.host, address.port)
    except ServerBindError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
            raise ServerBindError(
                f"the running NeMo-Gym at {address.gym_head} calls its policy at {address.url}, where this run would "
                "serve it, but something already listens there: stop it, or start the Gym with another "
                "policy_base_url"
            ) from None
        raise ServerBindError(
            f"the running NeMo-Gym at {address.gym_head} calls its policy at {address.url}, where this run would "
            f"serve it: {exc}"
        ) from None


@dataclass
class GRPORun:
    """Everything a run started; :meth:`close` stops it all (Gym servers, actors, server, engine)."""

    trainer: GRPOTrainer
    engine: HFGeneration
    server: OpenAIServer
    rollouts: NemoGymRollouts
    policy: HFPolicy
    deterministic_before: bool = False
    """``torch.are_deterministic_algorithms_enabled()`` before the run set it; :meth:`close` restores it."""

    def close(self) -> None:
        try:
            self.rollouts.shutdown()
        finally:
            self.server.stop_thread()
            self.engine.shutdown()
            self.policy.shutdown()
            torch.use_deterministic_algorithms(self.deterministic_before)


def check_checkpoint(out_dir: str | Path) -> TrainerState | None:
    """The run folder's checkpoint, checked before anything starts: its trainer state (None: no complete checkpoint
    to resume), weights in safetensors, and an ``optimizer.pt`` of tensors and plain containers (its pickle only).
    Training folders are passed around, so a planted pickle is refused here in one line and never run, and a
    checkpoint folder that is a link, or holds one, is refused rather than read through.

    Raises:
        CheckpointError: the trainer state or the optimizer file is refused (the message names the file).
        ModelLoadError: the checkpoint's only weights are pickle files.
    """
    checkpoint = Path(out_dir) / CHECKPOINT_DIR
    if os.path.lexists(checkpoint):
        try:
            check_no_links(checkpoint, root=out_dir)
        except UntrustedInputError as exc:
            raise CheckpointError(str(exc)) from None
    state = load_trainer_state(checkpoint)
    if state is not None:
        check_safetensors_weights(checkpoint)
        check_optimizer_file(checkpoint)
    return state


def build_grpo_run(config: JsonMapping, out_dir: str | Path, *, resume: bool = True) -> GRPORun:
    """Read every setting (:func:`~gym_bridge.config.run_settings.grpo_run_settings`: a bad key stops here, before
    any model loads), then :func:`start_grpo_run`. Ray must be initialised (:func:`gym_bridge.ray_utils.init_ray`)."""
    settings = grpo_run_settings(config)
    return start_grpo_run(settings, out_dir, resume=resume, save_checkpoints=settings.save_checkpoints)


def _engine_and_server(settings: GRPORunSettings, address: PolicyAddress | None) -> tuple[HFGeneration, OpenAIServer]:
    """The run's engine and the server in front of it (not yet started), built by
    :func:`~gym_bridge.recipes.engine_server.build_engine_server`. With ``address`` (a running Gym's policy endpoint)
    its port is claimed first (:func:`claim_policy_address`), so a busy port fails before a model loads, and the server
    serves there under that Gym's model name."""
    options = ServeOptions(  # a max_tokens past the prompt's room is cut to it, as NeMo-RL's training server does
        served_model_name=address.model_name if address is not None else settings.served_model_name,
        host=address.host if address is not None else "127.0.0.1",
        sock=claim_policy_address(address) if address is not None else None,
        max_model_len=settings.max_model_len,
        features=ServerFeatures(clamp_max_tokens=True),
        chat_template_kwargs=settings.chat_template_kwargs,
    )
    served = build_engine_server(settings.engine, options)
    return served.generation, served.server


def distillation_teacher(settings: GRPORunSettings, student: HFPolicy) -> HFPolicy | None:
    """With ``settings.loop.distillation``: the teacher (``teacher.model_name``), which must share the student's
    vocabulary (its top-k token ids index the student's logits); None for a GRPO run."""
    distillation = settings.loop.distillation
    if distillation is None:
        return None
    teacher = HFPolicy(settings.policy.model_copy(update={"model": distillation.teacher_model,
                                                          "keep_reference_model": False}))  # fmt: skip
    sizes = vocab_size_of(teacher.tokenizer), vocab_size_of(student.tokenizer)
    if sizes[0] != sizes[1]:
        teacher.shutdown()
        raise TrainingConfigError(
            f"teacher.model_name={distillation.teacher_model}'s vocabulary ({sizes[0]} tokens) is not the student's "
            f"({sizes[1]}): distillation through top-k logits needs one tokenizer"
        )
    return teacher


def start_grpo_run(
    settings: GRPORunSettings, out_dir: str | Path, *, resume: bool = True, save_checkpoints: bool = True
) -> GRPORun:
    """Start the engine, its server, Gym and the manager; load the policy; resume from ``out_dir`` if it can.
    ``save_checkpoints=False`` (``checkpointing.enabled: false``): the trainer writes no checkpoint.

    With ``env.nemo_gym.gym_head`` no Gym is started: the run's server listens where that running Gym's model server
    calls (:func:`running_gym_policy`, its port claimed before the engine is built), under the model name it asks
    for, and the actors attach to that Gym and leave it running when the run closes."""
    out_dir = Path(out_dir)
    torch.manual_seed(settings.seed)
    logger.info("grpo.seed %d", settings.seed)
    checkpoint = out_dir / CHECKPOINT_DIR
    state = check_checkpoint(out_dir) if resume else None
    check_gym_logs(out_dir)  # a received folder's gym-logs never leads a log append outside it
    if state is not None:
        logger.info("resuming from %s at step %d (weight version %d)", checkpoint, state.step, state.weight_version)
        settings = settings.resumed_from(str(checkpoint), state.step)
    address = running_gym_policy(settings.gym_head, settings.served_model_name) if settings.gym_head else None
    engine, server = _engine_and_server(settings, address)
    try:
        url = server.start_in_thread()
        settings = settings.serving_at([url], address.model_name if address is not None else None)
        spec = settings.rollout.launch.with_manager_options(**result_logging(settings.rollout, out_dir))
        if spec.gym.log_dir is None and spec.gym.gym_head is None:  # an owned Gym logs in the run folder
            spec = replace(spec, gym=spec.gym.model_copy(update={"log_dir": gym_log_dir(out_dir)}))
        rollouts = start_nemo_gym(spec, engine.tokenizer)
    except BaseException:
        server.stop_thread()
        engine.shutdown()
        raise
    try:
        policy = HFPolicy(settings.policy)
        teacher = distillation_teacher(settings, policy)
        deterministic_before = torch.are_deterministic_algorithms_enabled()
        if policy.device.type == "cpu" and engine.device.type == "cpu":
            # CPU kernels are deterministic already, so this costs nothing; on a GPU it would need
            # CUBLAS_WORKSPACE_CONFIG and slower kernels, and still not make batched decoding batch-invariant.
            torch.use_deterministic_algorithms(True)
        if state is not None:
            policy.load_optimizer(checkpoint)
            engine.update_weights(policy.state_dict_for_refit(), state.weight_version)
        rows = routed_rows(settings.train_rows, rollouts.actor)
        trainer = GRPOTrainer(
            settings.loop,
            manager=rollouts.manager,
            policy=policy,
            engine=engine,
            dataset=[datum_from_gym_row(row, idx=i) for i, row in enumerate(rows)],
            out_dir=out_dir,
            state=state,
            save_checkpoints=save_checkpoints,
            teacher=teacher,
            validator=validator_from(
                settings,
                rollouts.actors,
                out_dir,
                admission=rollouts.admission,
                reward_shaper=reward_shaper_from(settings.loop, engine.tokenizer),
            ),
        )
    except BaseException:
        rollouts.shutdown()
        server.stop_thread()
        engine.shutdown()
        raise
    return GRPORun(
        trainer=trainer,
        engine=engine,
        server=server,
        rollouts=rollouts,
        policy=policy,
        deterministic_before=deterministic_before,
    )
