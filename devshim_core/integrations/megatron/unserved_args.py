"""Megatron-LM's command-line flags, classified: each is a config field (judged by ``unserved_flags``), becomes one
under another name, or is an args-only flag served or refused here. Checked in ``validate_args``, at start-up.

``ARGS_ONLY`` holds one entry per argparse destination of Megatron-LM's ``megatron/training/arguments.py`` (tag
``core_v0.16.1``) that is not a config field; a test walks a checkout's parser (``MEGATRON_LM_PATH``) so that a
new flag forces a decision. The config fields' refusals run here too, on the flags as the user wrote them, so a
Megatron-LM job stops before it initialises anything; ``TransformerConfig`` checks them again when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.integrations.megatron.unserved_flags import (
    Refused,
    Served,
    Unserved,
    problems,
    refusal,
)
from devshim_core.patching import Patch, PatchSet, RebindReferences, SetAttribute, replaced_functions

if TYPE_CHECKING:
    from devshim_core.device import Device

ARGUMENTS = "megatron.training.arguments"
NAME = "megatron-training-flags"

# config field -> the args destination Megatron-LM's core_transformer_config_from_args reads it from
RENAMED: dict[str, str] = {
    "num_moe_experts": "num_experts",
    "fp8_param": "fp8_param_gather",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
}


# the args destination each config field's flag sets, where the names differ (for the table's test)
FLAG_DESTS: dict[str, str] = {**RENAMED, "persist_layer_norm": "no_persist_layer_norm"}
# destinations Megatron-LM's parser has only when NVIDIA Kitchen is installed
KITCHEN_ONLY = frozenset({"kitchen_config_file", "kitchen_recipe_number"})


def _on(name: str) -> Refused:
    return lambda a, d: bool(getattr(a, name, None))


def _given(name: str) -> Refused:
    return lambda a, d: getattr(a, name, None) is not None


def _positive(name: str) -> Refused:
    return lambda a, d: (getattr(a, name, None) or 0) > 0


def _moot(flag: str) -> Served:
    return Served(f"only read with {flag}, which is refused")


def _served(note: str, names: str) -> dict[str, Served]:
    return {name: Served(note) for name in names.split()}


_NVML = "it reads NVIDIA's NVML ({what}), which only NVIDIA GPUs have"
_MEMORY = "--log-memory-to-tensorboard (the device allocator's statistics)"
_TE = "it runs only in TransformerEngine, which is CUDA-only"
_UVM = "a CUDA unified-virtual-memory mempool, which no devshim device has"
_MAMBA = "Mamba layers run mamba-ssm's and causal-conv1d's CUDA/Triton kernels (megatron-core has no PyTorch path)"

ARGS_ONLY: dict[str, Served | Unserved] = {
    # -- refused ------------------------------------------------------------------------------------------------
    "te_rng_tracker": Unserved(
        _on("te_rng_tracker"), _TE, "leave it off: Megatron's own RNG tracker, on the plugin's generator",
        "--te-rng-tracker"),
    "use_flash_attn": Unserved(
        _on("use_flash_attn"), "the legacy models' flash attention calls flash-attn, which is CUDA-only",
        "megatron-core's models (the default) with --attention-backend auto", "--use-flash-attn"),
    "use_legacy_models": Unserved(
        _on("use_legacy_models"),
        "the legacy models' fused LayerNorm needs apex's fused_layer_norm_cuda, a CUDA extension; devshim serves "
        "megatron-core's models", "megatron-core's models (the default)", "--use-legacy-models"),
    "record_memory_history": Unserved(
        _on("record_memory_history"),
        "it records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history, _snapshot), "
        "which the CUDA redirect does not answer", f"{_MEMORY}, or --profile --use-pytorch-profiler",
        "--record-memory-history"),
    "high_priority_stream_groups": Unserved(
        _on("high_priority_stream_groups"),
        "it sets NCCL communicator options (high-priority CUDA streams), which the plugin's backend does not take",
        "leave it unset", "--high-priority-stream-groups"),
    "nccl_communicator_config_path": Unserved(
        _given("nccl_communicator_config_path"),
        "it configures NCCL communicators (ProcessGroupNCCL options), which the plugin's backend does not take",
        "leave it unset", "--nccl-communicator-config-path"),
    "nccl_ub": Unserved(
        _on("nccl_ub"), "user-buffer registration is NCCL's (CUDA memory registered with NCCL)",
        "leave it off", "--use-nccl-ub"),
    "use_sharp": Unserved(
        _on("use_sharp"), "SHARP in-network reductions are NCCL's, over InfiniBand", "leave it off", "--use-sharp"),
    "reuse_grad_buf_for_mxfp8_param_ag": Unserved(
        _on("reuse_grad_buf_for_mxfp8_param_ag"), f"MXFP8 is TransformerEngine's: {_TE}", "leave it off",
        "--reuse-grad-buf-for-mxfp8-param-ag"),
    "te_precision_config_file": Unserved(
        _given("te_precision_config_file"),
        "per-module precision recipes are applied by TransformerEngine's layers; Megatron's local layers would "
        "silently ignore them", "--bf16 or --fp16", "--te-precision-config-file"),
    # present only when NVIDIA Kitchen is installed: they become TransformerConfig.use_kitchen and quant_recipe
    "kitchen_config_file": Unserved(
        _given("kitchen_config_file"), "NVIDIA Kitchen's quantized layers are CUDA-only", "--bf16 or --fp16",
        "--kitchen-config-file"),
    "kitchen_recipe_number": Unserved(
        _given("kitchen_recipe_number"), "NVIDIA Kitchen's quantized layers are CUDA-only", "--bf16 or --fp16",
        "--kitchen-recipe-number"),
    "use_precision_aware_optimizer": Unserved(
        _on("use_precision_aware_optimizer"), "the precision-aware optimizer is TransformerEngine's FusedAdam",
        "leave it off: devshim's FusedAdam on the plugin's fused_adamw kernel", "--use-precision-aware-optimizer"),
    "log_device_memory_used": Unserved(
        _on("log_device_memory_used"), _NVML.format(what="torch.cuda.device_memory_used"), _MEMORY,
        "--log-device-memory-used"),
    "log_energy": Unserved(
        _on("log_energy"), _NVML.format(what="EnergyMonitor's energy counter"), "leave it off", "--log-energy"),
    "log_straggler": Unserved(
        _on("log_straggler"),
        _NVML.format(what="StragglerDetector's temperature, power_draw, utilization and clock_rate"),
        "--log-timers-to-tensorboard with --timing-log-level 1 or 2 compares ranks' timings", "--log-straggler"),
    "refit_method": Unserved(
        lambda a, d: getattr(a, "refit_method", None) == "nvshmem", "NVSHMEM is CUDA-only",
        "--refit-method gloo (the default) or nccl, which the redirect maps to the plugin's backend",
        "--refit-method"),
    "rl_inference_model_unified_memory_level": Unserved(
        _positive("rl_inference_model_unified_memory_level"), f"level 1 allocates {_UVM}", "level 0 (the default)",
        "--rl-inference-model-unified-memory-level"),
    "inference_dynamic_batching_unified_memory_level": Unserved(
        _positive("inference_dynamic_batching_unified_memory_level"), f"level 1 allocates {_UVM}",
        "level 0 (the default)", "--inference-dynamic-batching-unified-memory-level"),
    "hybrid_override_pattern": Unserved(
        _given("hybrid_override_pattern"), _MAMBA, "a transformer (GPT) model", "--hybrid-override-pattern"),
    "hybrid_attention_ratio": Unserved(
        _positive("hybrid_attention_ratio"), _MAMBA, "a transformer (GPT) model", "--hybrid-attention-ratio"),
    "hybrid_mlp_ratio": Unserved(
        _positive("hybrid_mlp_ratio"), _MAMBA, "a transformer (GPT) model", "--hybrid-mlp-ratio"),
    # -- only read with a refused flag --------------------------------------------------------------------------
    "tp_comm_overlap_cfg": _moot("--tp-comm-overlap"),
    "memory_snapshot_path": _moot("--record-memory-history"),
    **{n: _moot("--use-nccl-ub") for n in ("disable_symmetric_registration", "fsdp_manual_registration")},
    "sharp_enabled_group": _moot("--use-sharp"),
    "keep_fp8_transpose_cache": _moot("--fp8-format"),
    **{n: _moot("--use-precision-aware-optimizer") for n in (
        "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")},
    **{n: _moot("--log-straggler") for n in (
        "disable_straggler_on_startup", "straggler_ctrlr_port", "straggler_minmax_count")},
    **{n: _moot("CUDA graphs (--cuda-graph-impl)") for n in (
        "decode_only_cuda_graphs", "rl_reset_cuda_graphs", "rl_training_cuda_graphs",
        "inference_dynamic_batching_num_cuda_graphs", "inference_dynamic_batching_cuda_graph_max_tokens",
        "inference_dynamic_batching_cuda_graph_mixed_prefill_count", "moe_pad_experts_for_cuda_graph_inference")},
    "nccl_all_reduce_for_prefill": _moot("--symmetric-ar-type"),
    "rl_offload_inference_model_weights_when_idle": _moot("--rl-inference-model-unified-memory-level 1"),
    # -- become config fields under other names (RENAMED, or core_transformer_config_from_args' derivations) -----
    **_served("becomes a TransformerConfig field, judged by unserved_flags.CONFIG_FIELDS",
              " ".join(RENAMED.values()) + " no_persist_layer_norm bias_gelu_fusion bias_swiglu_fusion swiglu "
              "squared_relu quick_geglu group_query_attention init_method_xavier_uniform"),
    # -- served -------------------------------------------------------------------------------------------------
    "profile": Served("--profile without --use-pytorch-profiler (Nsight via the CUDA runtime) is refused by "
                      "devshim's validate-args patch (training.py), naming the flags to use"),
    **_served("model shape: Megatron-LM's builders, plain PyTorch",
              "add_position_embedding bert_binary_head decoder_num_layers encoder_num_layers "
              "make_vocab_size_divisible_by max_position_embeddings onnx_safe openai_gelu position_embedding_type "
              "relative_attention_max_distance relative_attention_num_buckets rope_scaling_factor "
              "rotary_seq_len_interpolation_factor untie_embeddings_and_output_weights use_rope_scaling "
              "use_rotary_position_embeddings spec yaml_cfg heterogeneous_layers_config_encoded_json "
              "heterogeneous_layers_config_path moe_upcycling_granularity moe_use_upcycling enable_experimental"),
    **_served("optimizer: torch's, or devshim's FusedAdam on the plugin's kernel; CPU offload runs torch's on the host",
              "adam_beta1 adam_beta2 adam_eps apply_wd_to_qk_layernorm clip_grad muon_extra_scale_factor "
              "muon_fp32_matmul_prec muon_momentum muon_num_ns_steps muon_scale_mode muon_split_qkv muon_tp_mode "
              "muon_use_nesterov no_weight_decay_cond_type sgd_momentum weight_decay optimizer optimizer_cpu_offload "
              "optimizer_offload_fraction overlap_cpu_optimizer_d2h_h2d pin_cpu_grads pin_cpu_params "
              "use_torch_optimizer_for_cpu_offload dump_param_to_param_group_map decoupled_lr decoupled_min_lr "
              "end_weight_decay lr lr_decay_iters lr_decay_samples lr_decay_style lr_warmup_fraction lr_warmup_init "
              "lr_warmup_iters lr_warmup_samples lr_wsd_decay_iters lr_wsd_decay_samples lr_wsd_decay_style min_lr "
              "override_opt_param_scheduler start_weight_decay use_checkpoint_opt_param_scheduler warmup "
              "weight_decay_incr_style"),
    **_served("profiling through torch.profiler, on the plugin's device",
              "profile_ranks profile_step_end profile_step_start use_pytorch_profiler"),
    **_served("the training loop: Megatron-LM's own Python; its torch.cuda calls are answered by the CUDA redirect",
              "batch_size check_for_large_grads check_for_nan_in_loss_and_grad "
              "check_weight_hash_across_dp_replicas_interval checkpoint_activations dataloader_type "
              "decrease_batch_size_if_needed deprecated_use_mcore_models disable_jit_fuser empty_unused_memory_level "
              "enable_gloo_process_groups exit_duration_in_mins exit_interval exit_signal exit_signal_handler "
              "exit_signal_handler_for_dataloader global_batch_size iterations_to_skip manual_gc manual_gc_eval "
              "manual_gc_interval micro_batch_size rampup_batch_size recompute_activations "
              "result_rejected_tracker_filename train_iters train_samples train_sync_interval seed "
              "data_parallel_random_init eval_interval eval_iters full_validation multiple_validation_sets skip_train "
              "adlr_autoresume adlr_autoresume_interval check_for_spiky_loss error_injection_rate "
              "error_injection_type rerun_mode sft sft_tokenizer_prompt_format"),
    **_served("mixed precision and loss scaling: PyTorch on the device",
              "accumulate_allreduce_grads_in_fp32 fp16_lm_cross_entropy grad_reduce_in_bf16 hysteresis "
              "initial_loss_scale loss_scale loss_scale_window min_loss_scale"),
    **_served("checkpoints: torch.save or dist_checkpointing, through the host",
              "async_save auto_detect_ckpt_format ckpt_assume_constant_structure ckpt_convert_format "
              "ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format ckpt_format ckpt_fully_parallel_load "
              "ckpt_fully_parallel_save ckpt_fully_parallel_save_deprecated ckpt_step dist_ckpt_format_deprecated "
              "dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014 dist_ckpt_strictness "
              "distrib_optim_fully_reshardable_mem_efficient exit_on_missing_checkpoint finetune load "
              "load_main_params_from_ckpt no_load_optim no_load_rng no_save_optim no_save_rng "
              "non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo "
              "non_persistent_local_ckpt_dir non_persistent_save_interval pretrained_checkpoint replication "
              "replication_factor replication_jump save save_dgrads_interval save_interval save_retain_interval "
              "save_wgrads_interval strict_fsdp_dtensor_load use_checkpoint_args use_dist_ckpt_deprecated "
              "use_mp_args_from_checkpoint_args use_persistent_ckpt_worker use_tokenizer_model_from_checkpoint_args"),
    **_served("distributed layout and data parallelism: torch.distributed on the plugin's backend (nccl is mapped)",
              "align_grad_reduce align_param_gather create_all_gather_group data_parallel_sharding_strategy "
              "ddp_average_in_collective ddp_bucket_size ddp_num_buckets ddp_pad_buckets_for_high_nccl_busbw "
              "ddp_reduce_scatter_with_fp32_accumulation distributed_backend distributed_timeout_minutes "
              "distributed_timeout_seconds_after_init enable_full_sharding_in_hsdp fake_process_group "
              "fsdp_double_buffer gradient_reduce_div_fusion lazy_mpu_init local_rank model_parallel_size "
              "num_distributed_optimizer_instances num_layers_per_virtual_pipeline_stage "
              "num_virtual_stages_per_pipeline_rank outer_dp_sharding_strategy overlap_grad_reduce "
              "overlap_param_gather overlap_param_gather_with_optimizer_step scatter_gather_tensors_in_pipeline "
              "suggested_communication_unit_size torch_fsdp2_reshard_after_forward use_distributed_optimizer "
              "use_megatron_fsdp use_torch_fsdp2 use_tp_pp_dp_mapping"),
    **_served("data, tokenizers and datasets: host-side Python",
              "allow_ambiguous_pad_tokens create_attention_mask_in_dataloader data_args_path data_cache_path "
              "data_path dataloader_defer_npy_index_mmap dataloader_fast_cache_load decoder_seq_length "
              "encoder_seq_length eod_mask_loss fim_data fim_eod_token fim_fragment_rate fim_middle_token "
              "fim_no_prefix fim_pad_token fim_prefix_token fim_rate fim_split_sample fim_spm_rate fim_suffix_token "
              "mask_prob mid_level_dataset_surplus mmap_bin_files mock_data num_dataset_builder_threads num_workers "
              "object_storage_cache_path per_dataset_sequences_path per_split_data_args_path "
              "phase_transition_iterations reset_attention_mask reset_position_ids sample_rate seq_length "
              "short_seq_prob split test_data_path train_data_path valid_data_path legacy_tokenizer merge_file "
              "padded_vocab_size tiktoken_num_special_tokens tiktoken_pattern tiktoken_special_tokens "
              "tokenizer_hf_include_special_tokens tokenizer_hf_use_fast tokenizer_metadata tokenizer_model "
              "tokenizer_sentencepiece_legacy tokenizer_special_tokens tokenizer_type trust_remote_code "
              "vocab_extra_ids vocab_file vocab_size"),
    **_served("other model families (BERT retrieval, vision): Megatron-LM's PyTorch models",
              "bert_load biencoder_projection_dim biencoder_shared_query_context_model block_data_path embedding_path "
              "evidence_data_path ict_head_size ict_load indexer_batch_size indexer_log_interval query_in_block_prob "
              "retriever_report_topk_accuracies retriever_score_scaling titles_data_path use_one_sent_docs "
              "classes_fraction data_per_class_fraction data_sharding dino_bottleneck_size dino_freeze_last_layer "
              "dino_head_hidden_size dino_local_crops_number dino_local_img_size dino_norm_last_layer "
              "dino_teacher_temp dino_warmup_teacher_temp dino_warmup_teacher_temp_epochs head_lr_mult img_h img_w "
              "iter_per_epoch mask_factor mask_type num_channels num_classes patch_dim swin_backbone_type "
              "vision_backbone_type vision_pretraining vision_pretraining_type"),
    **_served("logging: host-side, with the device allocator's statistics through the CUDA redirect",
              "log_interval log_loss_scale_to_tensorboard log_memory_interval log_memory_to_tensorboard "
              "log_num_zeros_in_grad log_params_norm log_progress log_throughput log_timers_to_tensorboard "
              "log_validation_ppl_to_tensorboard log_world_size_to_tensorboard logging_level tensorboard_dir "
              "tensorboard_log_interval tensorboard_queue_size timing_log_level timing_log_option wandb_entity "
              "wandb_exp_name wandb_project wandb_save_dir"),
    **_served("RL and inference: Megatron's own engines and PyTorch (CUDA graphs and unified memory are refused "
              "by their own flags)",
              "grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_entropy_term_weight grpo_filter_groups_with_same_reward "
              "grpo_group_size grpo_iterations grpo_kl_beta grpo_prompts_per_step langrl_env_config "
              "langrl_external_server langrl_inference_server_conversation_template langrl_inference_server_type "
              "perform_rl_step rl_default_temperature rl_default_top_k rl_default_top_p "
              "rl_importance_sampling_truncation_coef rl_inference_expert_model_parallel_size "
              "rl_inference_expert_tensor_model_parallel_size rl_inference_logprobs_is_correction "
              "rl_inference_pipeline_model_parallel_size rl_inference_tensor_model_parallel_size "
              "rl_offload_kv_cache_during_training rl_offload_optimizer_during_inference rl_parallel_generation_tasks "
              "rl_partial_rollouts rl_prompts_per_eval rl_remove_kv_cache_during_training rl_sequence_packing_algo "
              "rl_sequence_packing_max_sequences_per_bin rl_skip_bos_token rl_use_sequence_packing "
              "rl_verify_model_weights_swap bert_embedder_type disable_chunked_prefill "
              "inference_batch_times_seqlen_threshold inference_coordinator_port inference_dynamic_batching "
              "inference_dynamic_batching_block_size inference_dynamic_batching_buffer_size_gb "
              "inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens "
              "inference_dynamic_batching_paused_buffer_size_gb "
              "inference_dynamic_batching_track_paused_request_events inference_logging_step_interval "
              "inference_max_batch_size inference_max_seq_length inference_wandb_logging max_tokens_to_oom "
              "output_bert_embeddings use_legacy_static_engine"),
    **_served("NVIDIA's optional packages (one-logger, resiliency, MSC, workload inspector): not device features; "
              "each fails at import where it is not installed",
              "app_tag_run_name app_tag_run_version enable_one_logger one_logger_async one_logger_project "
              "one_logger_run_name inprocess_active_world_size inprocess_barrier_timeout inprocess_completion_timeout "
              "inprocess_empty_cuda_cache inprocess_granularity inprocess_hard_timeout inprocess_heartbeat_interval "
              "inprocess_heartbeat_timeout inprocess_last_call_wait inprocess_max_iterations "
              "inprocess_monitor_process_interval inprocess_monitor_thread_interval "
              "inprocess_progress_watchdog_interval inprocess_restart inprocess_soft_timeout "
              "inprocess_termination_grace_time calc_ft_timeouts enable_ft_package ft_num_warmup_iters enable_msc "
              "run_workload_inspector_server"),
}

UNSERVED_ARGS: dict[str, Unserved] = {name: e for name, e in ARGS_ONLY.items() if isinstance(e, Unserved)}


class ArgsView:
    """Megatron-LM's args under the config's field names, so ``unserved_flags``' checks read them as written."""

    def __init__(self, args: Any) -> None:
        self._args = args

    def __getattr__(self, name: str) -> Any:
        if name == "persist_layer_norm" and hasattr(self._args, "no_persist_layer_norm"):
            return not self._args.no_persist_layer_norm  # core_transformer_config_from_args' derivation
        return getattr(self._args, RENAMED.get(name, name))


def args_problems(args: Any, device: Device) -> list[str]:
    """One line per flag in ``args`` (Megatron-LM's namespace) set to a value ``device`` cannot serve."""
    return problems(ArgsView(args), device) + problems(args, device, UNSERVED_ARGS)


def _validate_args(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def validate_args(args: Any, defaults: dict[str, Any] | None = None) -> Any:
        found = args_problems(args, device)
        if found:
            raise refusal(found, device, "when Megatron-LM's arguments are validated")
        return original(args, defaults or {})

    validate_args.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return validate_args


def args_patches() -> list[Patch]:
    return [
        SetAttribute(name="refuse-unserved-args", target=f"{ARGUMENTS}:validate_args", make=_validate_args,
                     reason="every Megatron-LM flag the device cannot serve (unserved_args.ARGS_ONLY and the config "
                            "fields' flags) fails with its name at start-up, before anything is initialised"),
        RebindReferences(name="refuse-unserved-args-references", scope="megatron",
                         pairs=replaced_functions(f"{ARGUMENTS}:validate_args"),
                         reason="initialize.py imports validate_args by name"),
    ]


def args_patch_set(device: Device) -> PatchSet:
    return PatchSet(name=NAME, requires=(MEGATRON_CORE,), patches=tuple(args_patches()),
                    reason=f"refuse Megatron-LM flags {device.type} cannot serve, by name, at start-up")

