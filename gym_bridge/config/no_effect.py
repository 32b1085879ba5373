"""Keys of NeMo-RL's Gym recipes that change nothing in a gym-bridge GRPO run, each with the reason.

Every key NeMo-RL 7ea279a's Gym recipes set (``tests/data/nemo_rl_gym_recipe_keys.yaml``) is applied (it
changes a setting), refused (:class:`~gym_bridge.config.training.TrainingConfigError` naming it), or listed
here. An entry covers its key and every key under it. ``tests/config/test_nemo_rl_keys.py`` walks them all.
"""

from __future__ import annotations

NO_EFFECT_KEYS: dict[str, str] = {
    "cluster": "the Ray cluster's shape (nodes, GPUs per node, ports): gym-bridge's run is one process and a local Ray",
    "logger.tensorboard": (
        "NeMo-RL's Logger writes TensorBoard under log_dir/tensorboard and never reads this section; so does "
        "gym-bridge (logger.tensorboard_enabled and logger.log_dir are read: gym_bridge.config.logger)"
    ),
    "logger.swanlab": "SwanLab's project and run name: read only with logger.swanlab_enabled: true, which is refused",
    "logger.monitor_gpus": "NeMo-RL's Ray GPU monitoring (Prometheus scrapes of GPU nodes); gym-bridge runs none",
    "logger.gpu_monitoring": "the GPU monitor's intervals: read only with logger.monitor_gpus, which changes nothing",
    "logger.num_val_samples_to_print": (
        "how many validation samples NeMo-RL prints; gym-bridge writes every held-out answer to val_results.jsonl"
    ),
    "checkpointing": (
        "NeMo-RL's checkpoint store (paths, formats, top-k by metric, fault-tolerance saves); gym-bridge "
        "keeps one checkpoint in the run folder. checkpointing.enabled and save_period are read"
    ),
    "sif_dir": "a container image folder for sandboxed environments; no effect on the trainer",
    "_teachers": "YAML anchors of the on-policy-distillation recipes (on_policy_distillation.enabled is refused)",
    "teacher": (
        "in a GRPO config, the teacher of NeMo-RL's on-policy-distillation variant (refused); a distillation config "
        "(a distillation section and no grpo one: gym_bridge.config.distillation) reads teacher.model_name"
    ),
    "distillation": (
        "in a GRPO config, NeMo-RL's distillation loop's section (only num_generations_per_prompt is read, as N when "
        "grpo has none); a distillation config (no grpo section) reads it as its loop and loss"
    ),
    "on_policy_distillation": "read only with on_policy_distillation.enabled: true, which is refused",
    "data_plane": "read only with data_plane.enabled: true, which is refused",
    "data.num_workers": "dataloader worker processes: the order and content of batches do not depend on it",
    "data.max_input_seq_length": (
        "NeMo-RL's dataset processor drops long prompts; Gym rows carry no token ids before the rollout, and "
        "policy.max_total_sequence_length bounds every sample"
    ),
    "data.default.env_name": "NeMo-RL's dataset processor's environment name; every row goes to NeMo-Gym here",
    "data.default.processor": (
        "NeMo-RL's nemo_gym_data_processor, which passes the Gym row through as gym-bridge reads it"
    ),
    "data.default.video_maintain_aspect_ratio": (
        "video preprocessing; the Gym path is text only (policy.is_vlm is refused)"
    ),
    "data.default.video_target_num_patches": (
        "video preprocessing; the Gym path is text only (policy.is_vlm is refused)"
    ),
    "data.train.split": "a Hugging Face dataset split; gym-bridge reads JSONL Gym rows from data.train.data_path",
    "data.train.split_validation_size": "read by NeMo-RL's HF dataset loaders only, not by NemoGymDataset's JSONL path",
    "data.train.seed": "read by NeMo-RL's HF dataset loaders only, not by NemoGymDataset's JSONL path",
    "grpo.max_rollout_turns": (
        "NeMo-RL's Gym path passes max_rollout_turns=None whatever this says: the Gym agent ends each episode"
    ),
    "grpo.val_batch_size": "how many validation prompts one rollout call takes; every prompt is rolled out either way",
    "grpo.calculate_advantages_on_gpu": "where the advantages are computed, not what they are",
    "grpo.deduplicate_multimodal_data": "shares multimodal payloads between rows; the Gym path is text only",
    "grpo.debug_payload_metrics": "payload-size metrics of multimodal rows; the Gym path is text only",
    "grpo.reward_scaling": "read only with grpo.reward_scaling.enabled: true, which is refused",
    "grpo.reward_shaping": "read only with grpo.reward_shaping.enabled: true, which is refused",
    "grpo.adv_estimator.minus_baseline": (
        "read only by NeMo-RL's reinforce_plus_plus estimator; grpo.adv_estimator.name other than 'grpo' or "
        "'gdpo' is refused"
    ),
    "grpo.skip_reference_policy_logprobs_calculation": (
        "the loop computes reference logprobs only when loss_fn.reference_policy_kl_penalty > 0, and true "
        "with a penalty is refused (NeMo-RL asserts the same), so true changes nothing that runs"
    ),
    "grpo.num_val_generations_per_prompt": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there"
        " either (grpo.val_num_generations_per_prompt is the key)"
    ),
    "grpo.penalize_invalid_tool_call": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there"
        " either (grpo.invalid_tool_call_advantage is the key)"
    ),
    "grpo.penalize_malformed_thinking": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there"
        " either (grpo.malformed_thinking_advantage is the key)"
    ),
    "grpo.invalid_tool_call_strategy": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.use_best_at_k": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.best_at_k_k": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.best_at_k_m": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.use_combined_training": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.combined_training_best_at_k_weight": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.combined_training_pass_at_1_weight": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.combined_training_weight_mode": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.zero_variance_prompt_filtering": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "grpo.dynamic_sampling_oversample_ratio": (
        "NeMo-RL 7ea279a reads this key nowhere (its GRPOConfig allows extra keys), so it has no effect there either"
    ),
    "loss_fn.kl_type": "a distillation loss key (a distillation config reads it); ClippedPGLossFn does not",
    "loss_fn.mixed_kl_weight": "a distillation loss key (a distillation config reads it); ClippedPGLossFn does not",
    "loss_fn.zero_outside_topk": "a distillation loss key (a distillation config reads it); ClippedPGLossFn does not",
    "policy.dtensor_cfg": (
        "DTensor parallelism, CPU offload and activation checkpointing: how NeMo-RL's GPU workers shard the "
        "same computation; HFPolicy runs it in one process"
    ),
    "policy.megatron_cfg": "read only with policy.megatron_cfg.enabled: true, which is refused",
    "policy.draft": "read only with policy.draft.enabled: true, which is refused",
    "policy.disable_modelopt_layer_spec": "a Megatron/ModelOpt layer spec (policy.megatron_cfg.enabled is refused)",
    "policy.quant_batch_size": "read only with policy.quant_cfg, which is refused",
    "policy.quant_calib_data": "read only with policy.quant_cfg, which is refused",
    "policy.quant_calib_size": "read only with policy.quant_cfg, which is refused",
    "policy.quant_sequence_length": "read only with policy.quant_cfg, which is refused",
    "policy.dynamic_batching": (
        "packs micro-batches by token count for GPU throughput; the loss is normalised by the global batch's "
        "tokens either way"
    ),
    "policy.sequence_packing": (
        "packs sequences for GPU throughput; the loss is normalised by the global batch's tokens either way"
    ),
    "policy.generation_batch_size": (
        "the colocated generation batch of NeMo-RL's workers; our engine batches as requests arrive"
    ),
    "policy.logprob_chunk_size": "chunks the vocabulary in the logprob kernel to save GPU memory",
    "policy.make_sequence_length_divisible_by": "pads sequences for tensor-parallel kernels; padding is masked",
    "policy.offload_optimizer_for_logprob": "moves optimizer state off the GPU during the logprob pass",
    "policy.refit_buffer_size_gb": "the GPU buffer that carries weights to vLLM; our refit passes a state dict",
    "policy.precision": (
        "the dtype of NeMo-RL's GPU training workers; HFPolicy trains in float32 on the CPU "
        "(HFPolicyConfig.dtype is ours)"
    ),
    "policy.optimizer": (
        "null in Megatron recipes, whose optimizer is policy.megatron_cfg.optimizer "
        "(policy.megatron_cfg.enabled is refused); lr, weight_decay, betas and eps under "
        "policy.optimizer.kwargs are read"
    ),
    "policy.optimizer.kwargs.foreach": "torch AdamW's kernel choice, not its update",
    "policy.optimizer.kwargs.fused": "torch AdamW's kernel choice, not its update",
    "policy.tokenizer.name": (
        "NeMo-RL's tokenizer path, set to the model's own in every Gym recipe; gym-bridge loads the tokenizer"
        " of policy.model_name"
    ),
    "policy.tokenizer.use_fastokens": "a faster tokenizer implementation with the same token ids",
    "policy.generation.stop_strings": (
        "NeMo-RL clears stop strings on the Gym path; gym-bridge clears them with a warning"
    ),
}
"""Dotted key (or section) -> why setting it changes nothing here."""


def no_effect_reason(key: str) -> str | None:
    """The reason ``key`` (dotted) has no effect, from its own entry or its nearest listed section; else None."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        reason = NO_EFFECT_KEYS.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None
