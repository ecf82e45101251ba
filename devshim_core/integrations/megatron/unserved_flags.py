"""Every megatron-core config field, classified: served on a devshim device, or refused by name before the model
is built.

``CONFIG_FIELDS`` holds one entry per dataclass field of megatron-core 0.16's ``ModelParallelConfig``,
``TransformerConfig`` and ``MLATransformerConfig``, and of 0.12's where it differs (a test walks the installed
classes, so a new megatron-core field forces a decision; a field one release lacks is never read there). An
:class:`Unserved` entry says which values cannot run off CUDA, why, the Megatron-LM flag that sets it and what to
use instead; a :class:`Served` one why any value works. The check runs in ``TransformerConfig.__post_init__``,
before Megatron's own validation, so a job fails at its config instead of failing deep inside Megatron at build
time, or (``attention_backend=flash``, ``delay_wgrad_compute``, ``quant_recipe``) silently running something other
than what was asked for.

"Served" means no CUDA-only dependency was found in megatron-core 0.16.1's code for the field: Megatron's own
PyTorch runs, with ``torch.cuda`` calls answered by the CUDA redirect and the fused paths on the plugin's kernels.
It does not mean every combination has been trained under devshim (docs/megatron.md lists what has).
Megatron-LM's command-line flags that never reach a config are classified in ``unserved_args``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from devshim_core.errors import ConfigError

if TYPE_CHECKING:
    from devshim_core.device import Device

# (the config, or a view of Megatron-LM's args) and the device -> is a value it cannot serve asked for?
Refused = Callable[[Any, "Device"], bool]


@dataclass(frozen=True)
class Served:
    """Any value runs on a devshim device; ``note`` says why (or that only a refused feature reads it)."""

    note: str


@dataclass(frozen=True)
class Unserved:
    """Values of a field no devshim device (or, for a kernel-backed one, this device) can run."""

    refused: Refused
    why: str
    instead: str
    flag: str | None  # Megatron-LM's spelling; None: no flag reaches the field (set in code, or refused as an arg)

    def describe(self, field: str, value: Any) -> str:
        return f"{field}={_show(value)} ({self._spelling(value)}): {self.why}. Instead: {self.instead}"

    def _spelling(self, value: Any) -> str:
        if self.flag is None:
            return "no Megatron-LM flag"
        if self.flag.startswith("--no-"):  # a store_false flag: the setting is on unless the flag is given
            return f"on unless {self.flag}"
        if value is True:
            return self.flag
        return f"{self.flag} {_plain(value)}"


def _plain(value: Any) -> Any:
    return value.name if isinstance(value, enum.Enum) else value


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    shown = " ".join(repr(value).split())  # one line per setting, whatever the object's repr
    return shown if len(shown) <= 60 else f"{shown[:57]}..."


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def _on(name: str) -> Refused:
    return lambda c, d: bool(_get(c, name))


def _given(name: str) -> Refused:
    return lambda c, d: _get(c, name) is not None


def _one_of(name: str, *values: Any) -> Refused:
    return lambda c, d: _plain(_get(c, name)) in values


def _above_one(name: str) -> Refused:
    return lambda c, d: (_get(c, name) or 1) > 1


def _lacks(device: Device, op: str) -> bool:
    return getattr(device.attention, op, None) is None


def _without_kernel(name: str, op: str) -> Refused:
    """``name`` is on and the device has no ``op`` kernel, the only thing that serves it off CUDA."""
    return lambda c, d: bool(_get(c, name)) and _lacks(d, op)


def _moot(feature: str) -> Served:
    return Served(f"only read with {feature}, which is refused")


# why, shared
_TE = "it runs only in TransformerEngine, which is CUDA-only"
_GRAPHS = "CUDA graphs have no equivalent on other devices"
_CP = ("context parallelism runs in devshim's context-parallel attention (Ulysses, ring or both) around the device's "
       "attention kernel, and the {plugin} plugin provides none (megatron-core's local attention asserts it off)")
_HYBRID_CP = ("megatron-core's hybrid (dynamic) context parallelism schedules packed THD sequences of varying length "
              "over TransformerEngine's attention; devshim's context parallelism splits fixed-length sequences")
_FLEX = "the flex dispatcher runs DeepEP or HybridEP, CUDA-only kernels over NVSHMEM/NVLink"
_LOCAL_NORM = ("Megatron's local spec then builds torch's norm (WrappedTorchNorm), which asserts it off; devshim's "
               "norm, which serves it, needs the device's rms_norm kernel, and the {plugin} plugin provides none")
_MAX_LOGITS = ("only TransformerEngine's attention records the max attention logits it reads; Megatron's local "
               "attention has none (current_max_attn_logits)")
# what to use instead, shared
_BF16 = "bf16=True (--bf16) or fp16=True (--fp16)"
_NO_GRAPHS = "leave CUDA graphs off (cuda_graph_impl='none', the default)"
_ALLTOALL = ("moe_token_dispatcher_type='alltoall' (--moe-token-dispatcher-type alltoall) or 'allgather'; both run "
             "on the plugin's collectives")

SHAPE = Served("model shape or hyper-parameter: Megatron's own PyTorch")
LAYOUT = Served("parallel layout: torch.distributed on the plugin's backend")
CALLBACK = Served("a callable Megatron calls (the user's or Megatron's own)")
OWN = Served("Megatron's own PyTorch; its torch.cuda calls (streams, events, autocast) are answered by the CUDA "
             "redirect")

CONFIG_FIELDS: dict[str, Served | Unserved] = {
    # -- ModelParallelConfig ------------------------------------------------------------------------------------
    "tensor_model_parallel_size": LAYOUT,
    "pipeline_model_parallel_split_rank": LAYOUT,  # megatron-core 0.12 (encoder-decoder split); later removed
    "pipeline_model_parallel_comm_backend": Unserved(
        _one_of("pipeline_model_parallel_comm_backend", "ucc"),
        "torch's UCC backend is not built for the device; devshim maps only nccl to the plugin's backend",
        "leave it unset or nccl: pipeline transfers then use the plugin's backend",
        "--pipeline-model-parallel-comm-backend"),
    "pipeline_model_parallel_size": LAYOUT,
    "virtual_pipeline_model_parallel_size": LAYOUT,
    "sequence_parallel": Unserved(
        _without_kernel("sequence_parallel", "rms_norm"), _LOCAL_NORM,
        "sequence_parallel=False, or a plugin with an rms_norm kernel", "--sequence-parallel"),
    "context_parallel_size": Unserved(
        lambda c, d: (_get(c, "context_parallel_size") or 1) > 1 and _lacks(d, "attention"), _CP,
        "context_parallel_size=1 (--context-parallel-size 1); tensor/sequence parallelism or recompute for long "
        "sequences", "--context-parallel-size"),
    "hierarchical_context_parallel_sizes": Unserved(
        _without_kernel("hierarchical_context_parallel_sizes", "attention"), _CP,
        "leave it unset (context_parallel_size=1)", "--hierarchical-context-parallel-sizes"),
    "max_seqlen_per_dp_cp_rank": _moot("hybrid_context_parallel"),
    "hybrid_context_parallel": Unserved(
        _on("hybrid_context_parallel"), _HYBRID_CP,
        "context_parallel_size > 1 with cp_comm_type 'a2a+p2p' (--cp-comm-type a2a+p2p "
        "--hierarchical-context-parallel-sizes A2A RING), MindSpeed's hybrid_cp_algo", "--hybrid-context-parallel"),
    "expert_model_parallel_size": LAYOUT,
    "expert_tensor_parallel_size": LAYOUT,
    "moe_extended_tp": Served("deprecated; Megatron ignores it"),
    "perform_initialization": SHAPE,
    "use_cpu_initialization": SHAPE,
    "fp16": Served("fp16 tensors on the device; the plugin's kernels take them"),
    "bf16": Served("bf16 tensors on the device; the plugin's kernels take them"),
    "params_dtype": SHAPE,
    "timers": CALLBACK,
    "finalize_model_grads_func": CALLBACK,
    "grad_scale_func": CALLBACK,
    "no_sync_func": CALLBACK,
    "grad_sync_func": CALLBACK,
    "param_sync_func": CALLBACK,
    "deterministic_mode": Served("Megatron's own deterministic embedding lookup; its TE knobs go unused"),
    "enable_autocast": OWN,
    "autocast_dtype": OWN,
    "num_microbatches_with_partial_activation_checkpoints": SHAPE,
    "gradient_accumulation_fusion": Unserved(
        _without_kernel("gradient_accumulation_fusion", "wgrad_accumulate"),
        "it accumulates weight gradients through fused_weight_gradient_mlp_cuda, which devshim provides on the "
        "device's wgrad_accumulate kernel, and the {plugin} plugin provides none",
        "gradient_accumulation_fusion=False (--no-gradient-accumulation-fusion)",
        "--no-gradient-accumulation-fusion"),
    "async_tensor_model_parallel_allreduce": Served("deprecated; Megatron ignores it"),
    "use_te_rng_tracker": Unserved(
        _on("use_te_rng_tracker"), _TE,
        "use_te_rng_tracker=False: Megatron's own RNG tracker, which devshim runs on the plugin's generator",
        None),  # Megatron-LM's --te-rng-tracker never reaches the config: unserved_args refuses it
    "tp_comm_overlap": Unserved(
        _on("tp_comm_overlap"),
        "it overlaps TP communication with GEMMs through TransformerEngine's userbuffers (CUDA IPC over NVLink)",
        "tp_comm_overlap=False; overlap_grad_reduce and overlap_param_gather (DDP config) overlap data-parallel "
        "communication on any device", "--tp-comm-overlap"),
    **{name: _moot("tp_comm_overlap") for name in (
        "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs",
        "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend")},
    "cross_entropy_loss_fusion": Served("the native fusion is Megatron's own PyTorch (jit_fuser)"),
    "cross_entropy_fusion_impl": Unserved(
        _one_of("cross_entropy_fusion_impl", "te"), _TE,
        "cross_entropy_fusion_impl='native' (--cross-entropy-fusion-impl native)", "--cross-entropy-fusion-impl"),
    "overlap_moe_expert_parallel_comm": OWN,
    "delay_wgrad_compute": Unserved(
        _on("delay_wgrad_compute"),
        "only TransformerEngine's linear layers delay the weight-gradient GEMM; Megatron's local layers would "
        "silently ignore it (their backward_dw does nothing)", "delay_wgrad_compute=False",
        "--delay-wgrad-compute"),
    "ep_overlap_early_attn_memory_release": OWN,
    "pipeline_dtype": SHAPE,
    "variable_seq_lengths": LAYOUT,
    "overlap_p2p_comm": LAYOUT,
    "batch_p2p_comm": Served("batched isend/irecv, which devshim tags by direction (patch pipeline-p2p-tags)"),
    "batch_p2p_sync": OWN,
    "use_ring_exchange_p2p": Unserved(
        _on("use_ring_exchange_p2p"), "torch.distributed.ring_exchange exists only in a custom-built torch",
        "use_ring_exchange_p2p=False: batched isend/irecv", "--use-ring-exchange-p2p"),
    "deallocate_pipeline_outputs": LAYOUT,
    "defer_embedding_wgrad_compute": Served(
        "Megatron requires gradient_accumulation_fusion with it, which is refused without the device's "
        "wgrad_accumulate kernel"),
    "wgrad_deferral_limit": LAYOUT,
    "overlap_p2p_comm_warmup_flush": LAYOUT,
    "microbatch_group_size_per_vp_stage": LAYOUT,
    "mtp_standalone": Served("set by Megatron from the pipeline layout"),
    "cpu_offloading": Unserved(
        _on("cpu_offloading"),
        "megatron-core 0.16 offloads layer activations only through TransformerEngine's CPU-offload context "
        "(without TE it asserts when the model is built)",
        "fine_grained_activation_offloading=True with offload_modules (Megatron's own offloading), or recompute",
        None),
    **{name: _moot("cpu_offloading") for name in (
        "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations",
        "cpu_offloading_weights", "cpu_offloading_double_buffering")},
    "barrier_with_L1_time": OWN,
    # -- TransformerConfig --------------------------------------------------------------------------------------
    **{name: SHAPE for name in (
        "num_layers", "mtp_num_layers", "mtp_loss_scaling_factor", "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "hidden_size",
        "num_attention_heads", "softmax_scale",
        "num_query_groups", "ffn_hidden_size", "kv_channels", "hidden_dropout", "attention_dropout",
        "fp32_residual_connection", "apply_residual_connection_post_layernorm", "layernorm_epsilon", "add_bias_linear",
        "add_qkv_bias", "gated_linear_unit", "activation_func", "glu_linear_offset", "activation_func_clamp_value",
        "num_moe_experts", "rotary_interleaved", "qk_layernorm", "qk_l2_norm", "attention_output_gate", "test_mode",
        "calculate_per_token_loss", "multi_latent_attention", "no_rope_freq", "init_method", "output_layer_init_method",
        "init_method_std", "embedding_init_method", "embedding_init_method_std", "apply_query_key_layer_scaling",
        "attention_softmax_in_fp32", "mrope_section", "mlp_chunks_for_prefill", "heterogeneous_block_specs",
        "hetereogenous_dist_checkpoint", "config_logger_dir", "clone_scatter_output_in_embedding",
        "inference_rng_tracker", "inference_sampling_seed")},
    "attention_backend": Unserved(
        _one_of("attention_backend", "flash", "fused"),
        "it picks TransformerEngine's FlashAttention or cuDNN fused-attention kernel; without TE Megatron builds "
        "its local attention anyway, so the backend asked for would silently not run",
        "attention_backend=AttnBackend.auto, local or unfused (--attention-backend auto): Megatron's local "
        "attention, which devshim runs on the device's attention kernel", "--attention-backend"),
    "softmax_type": Served("Megatron's local attention implements off-by-one and learnable offsets"),
    "window_size": Served("Megatron's local attention masks the window (devshim leaves those calls to it)"),
    "window_attn_skip_freq": Served("Megatron's local attention masks the window (devshim leaves those calls to it)"),
    "layernorm_zero_centered_gamma": Unserved(
        _without_kernel("layernorm_zero_centered_gamma", "rms_norm"), _LOCAL_NORM,
        "layernorm_zero_centered_gamma=False, or a plugin with an rms_norm kernel", "--apply-layernorm-1p"),
    "activation_func_fp8_input_store": Served("Megatron's own PyTorch stores the input as torch.float8_e4m3fn"),
    "normalization": Unserved(
        _one_of("normalization", "L2Norm"),
        "megatron-core 0.16's local norm builds torch.nn.L2Norm, which torch does not have (only TE's spec has one)",
        "normalization='RMSNorm' or 'LayerNorm' (--normalization RMSNorm)", "--normalization"),
    "qk_clip": Unserved(_on("qk_clip"), _MAX_LOGITS, "qk_clip=False", "--qk-clip"),
    "qk_clip_alpha": _moot("qk_clip"),
    "qk_clip_threshold": _moot("qk_clip"),
    "log_max_attention_logit": Unserved(
        _on("log_max_attention_logit"), _MAX_LOGITS, "log_max_attention_logit=False", "--log-max-attention-logit"),
    "experimental_attention_variant": Unserved(
        _given("experimental_attention_variant"),
        "megatron-core 0.16 builds gated_delta_net and dsa only from TransformerEngine's spec (gated_delta_net also "
        "needs flash-linear-attention's Triton kernels)",
        "experimental_attention_variant=None: standard attention or multi_latent_attention",
        "--experimental-attention-variant"),
    **{name: _moot("experimental_attention_variant") for name in (
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")},
    "init_model_with_meta_device": Served("Megatron-FSDP materialises parameters with to_empty on the device"),
    "disable_bf16_reduced_precision_matmul": Served(
        "sets a CUDA matmul switch; the plugin's bf16 matmuls are the device's own"),
    "bias_activation_fusion": Served("the device's swiglu kernel, or Megatron's jit-fused PyTorch"),
    "masked_softmax_fusion": Served("the device's masked_softmax kernel, or Megatron's PyTorch softmax"),
    "persist_layer_norm": Unserved(
        _without_kernel("persist_layer_norm", "rms_norm"), _LOCAL_NORM,
        "persist_layer_norm=False (--no-persist-layer-norm), or a plugin with an rms_norm kernel",
        "--no-persist-layer-norm"),
    "memory_efficient_layer_norm": Unserved(
        _without_kernel("memory_efficient_layer_norm", "rms_norm"), _LOCAL_NORM,
        "memory_efficient_layer_norm=False, or a plugin with an rms_norm kernel", None),
    "bias_dropout_fusion": Served("Megatron's jit-fused PyTorch"),
    "apply_rope_fusion": Unserved(
        lambda c, d: bool(_get(c, "apply_rope_fusion")) and (
            bool(_get(c, "multi_latent_attention")) or _lacks(d, "rotary")),
        "fused RoPE is TransformerEngine's; devshim serves it on the device's rotary kernel, except for "
        "multi-latent attention, whose fused RoPE is Triton kernels written for CUDA GPUs (and except on a plugin "
        "without a rotary kernel)", "apply_rope_fusion=False (--no-rope-fusion)", "--no-rope-fusion"),
    "use_fused_weighted_squared_relu": Served(
        "only TEGroupedMLP (TransformerEngine's spec) reads it; the local spec's experts compute the same "
        "activation unfused"),
    "fused_single_qkv_rope": Unserved(_on("fused_single_qkv_rope"), _TE, "fused_single_qkv_rope=False", None),
    **{name: SHAPE for name in (
        "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
        "recompute_modules")},
    "fp8": Unserved(_given("fp8"), _TE, _BF16, "--fp8-format"),
    **{name: _moot("fp8 or fp4") for name in (
        "fp8_recipe", "fp8_quantizer_factory", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
        "fp8_amax_compute_algo", "fp8_wgrad", "tp_only_amax_red", "first_last_layers_bf16",
        "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp4_recipe", "fp4_quantizer_factory",
        "moe_router_padding_for_quantization", "moe_router_padding_for_fp8")},
    "fp8_param": Unserved(_on("fp8_param"), _TE, _BF16, "--fp8-param-gather"),
    "fp8_dot_product_attention": Unserved(_on("fp8_dot_product_attention"), _TE, _BF16, None),
    "fp8_multi_head_attention": Unserved(_on("fp8_multi_head_attention"), _TE, _BF16, None),
    "use_kitchen": Unserved(
        _on("use_kitchen"), "NVIDIA Kitchen's quantized layers are CUDA-only", _BF16,
        None),  # Megatron-LM sets it from --kitchen-config-file / --kitchen-recipe-number (unserved_args)
    "use_kitchen_attention": Unserved(
        _on("use_kitchen_attention"), "NVIDIA Kitchen's attention is CUDA-only",
        "use_kitchen_attention=False: Megatron's local attention on the device's kernel", "--use-kitchen-attention"),
    "kitchen_attention_backend": _moot("use_kitchen_attention"),
    "fp4": Unserved(_given("fp4"), _TE, _BF16, "--fp4-format"),
    "fp4_param": Unserved(_on("fp4_param"), _TE, _BF16, "--fp4-param-gather"),
    "quant_recipe": Unserved(
        _given("quant_recipe"),
        "a per-module quantization recipe is applied by TransformerEngine's or Kitchen's layers (finish_init); "
        "Megatron's local layers would silently ignore it", f"quant_recipe=None; {_BF16}",
        None),  # Megatron-LM builds it from --te-precision-config-file or Kitchen's flags (unserved_args)
    **{name: SHAPE for name in (
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq", "moe_ffn_hidden_size",
        "moe_router_load_balancing_type", "moe_router_topk", "moe_enable_routing_replay",
        "moe_router_topk_limited_devices", "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor", "moe_router_score_function", "moe_router_dtype",
        "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_force_load_balancing",
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_token_dropping", "moe_per_layer_logging",
        "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
        "moe_layer_recompute", "moe_apply_probs_on_input", "moe_latent_size")},
    "moe_shared_expert_overlap": OWN,
    "moe_grouped_gemm": Served(
        "without TransformerEngine the local spec builds the legacy GroupedMLP, whose grouped GEMMs run the "
        "device's grouped_gemm kernel (devshim_kernels' loop of matmuls for a plugin without one) through devshim's "
        "grouped_gemm module; Megatron's own asserts (bf16, no linear bias) still apply"),
    "moe_use_legacy_grouped_gemm": Served(
        "picks GroupedMLP over TEGroupedMLP; without TransformerEngine the local spec builds GroupedMLP either way"),
    "moe_token_dispatcher_type": Unserved(
        _one_of("moe_token_dispatcher_type", "flex"), _FLEX, _ALLTOALL, "--moe-token-dispatcher-type"),
    "moe_enable_deepep": Unserved(
        _on("moe_enable_deepep"), "DeepEP's dispatch and combine kernels are CUDA-only (NVSHMEM)", _ALLTOALL,
        "--moe-enable-deepep"),
    **{name: _moot("moe_token_dispatcher_type='flex'") for name in (
        "moe_flex_dispatcher_backend", "moe_deepep_num_sms", "moe_hybridep_num_sms")},
    "moe_permute_fusion": Unserved(
        _on("moe_permute_fusion"), _TE, "moe_permute_fusion=False: Megatron's PyTorch permutation",
        "--moe-permute-fusion"),
    "moe_router_fusion": Unserved(
        _on("moe_router_fusion"), _TE, "moe_router_fusion=False: Megatron's PyTorch router", "--moe-router-fusion"),
    "cp_comm_type": Served("how devshim's context-parallel attention communicates: 'p2p' and 'all_gather' ring "
                           "attention, 'a2a' Ulysses, 'a2a+p2p' both (context_parallel.py)"),
    "enable_cuda_graph": Unserved(_on("enable_cuda_graph"), _GRAPHS, _NO_GRAPHS, "--enable-cuda-graph"),
    "external_cuda_graph": Unserved(_on("external_cuda_graph"), _GRAPHS, _NO_GRAPHS, "--external-cuda-graph"),
    "cuda_graph_impl": Unserved(
        lambda c, d: _get(c, "cuda_graph_impl") not in (None, "none"), _GRAPHS, _NO_GRAPHS, "--cuda-graph-impl"),
    **{name: _moot("CUDA graphs") for name in (
        "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
        "cuda_graph_scope")},
    "disable_parameter_transpose_cache": Served("a TransformerEngine cache; Megatron's local layers keep none"),
    "flash_decode": Unserved(
        _on("flash_decode"), "flash decoding calls flash-attn's flash_attn_with_kvcache, which is CUDA-only",
        "flash_decode=False: Megatron's inference attention", "--flash-decode"),
    "batch_invariant_mode": Unserved(
        _on("batch_invariant_mode"),
        "megatron-core's batch-invariant kernels are Triton written for CUDA GPUs, and it requires "
        "attention_backend=flash (FlashAttention)", "batch_invariant_mode=False; deterministic_mode=True for "
        "deterministic execution", "--batch-invariant-mode"),
    "use_te_activation_func": Unserved(
        _on("use_te_activation_func"), _TE, "use_te_activation_func=False: Megatron's activations (bias_activation_"
        "fusion runs SwiGLU on the device's kernel)", "--use-te-activation-func"),
    "symmetric_ar_type": Unserved(
        _given("symmetric_ar_type"),
        "symmetric-memory all-reduce needs CUDA symmetric memory (NVLink multimem) and TransformerEngine",
        "symmetric_ar_type=None: the plugin's all-reduce", "--symmetric-ar-type"),
    "use_inference_optimized_layers": Served("not read by megatron-core 0.16 (transformer_impl chooses the layers)"),
    "inference_fuse_tp_communication": Unserved(
        _on("inference_fuse_tp_communication"),
        "the fused reduce-scatter/norm/all-gather runs in the inference-optimized layers, which need "
        "TransformerEngine", "inference_fuse_tp_communication=False", "--inference-fuse-tp-communication"),
    "is_hybrid_model": Unserved(
        _on("is_hybrid_model"),
        "Mamba layers run mamba-ssm's and causal-conv1d's CUDA/Triton kernels (megatron-core has no PyTorch path)",
        "a transformer (GPT) model", "--is-hybrid-model"),
    **{name: Served("Mamba layer shape; Mamba itself is refused (is_hybrid_model, or mamba-ssm missing at build)")
       for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
                    "use_mamba_mem_eff_path")},
    "transformer_impl": Unserved(
        _one_of("transformer_impl", "inference_optimized"),
        "the inference-optimized layers need TransformerEngine (and --sequence-parallel)",
        "transformer_impl='local' (--transformer-impl local); the default 'transformer_engine' is served too: "
        "without TE, Megatron-LM's layers are its local ones (devshim switches the flag) and megatron-core's come "
        "from the spec you pass", "--transformer-impl"),
    "fine_grained_activation_offloading": OWN,
    "offload_modules": OWN,
    "min_offloaded_tensor_size": OWN,
    # -- MLATransformerConfig -----------------------------------------------------------------------------------
    "max_position_embeddings": SHAPE,  # megatron-core 0.12's MLA (YaRN) config; later original_max_position_embeddings
    **{name: SHAPE for name in (
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base",
        "rotary_percent", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
        "mscale", "mscale_all_dim")},
    "cache_mla_latents": Unserved(
        _on("cache_mla_latents"), "caching MLA latents needs FlashMLA, which is CUDA-only",
        "cache_mla_latents=False", "--cache-mla-latents"),
}

UNSERVED: dict[str, Unserved] = {name: e for name, e in CONFIG_FIELDS.items() if isinstance(e, Unserved)}


def problems(config: Any, device: Device, table: dict[str, Unserved] | None = None) -> list[str]:
    """One line per field of ``config`` (a config, or any object with its attributes) set to a value ``device``
    cannot serve."""
    found = []
    for name, entry in (UNSERVED if table is None else table).items():
        if hasattr(config, name) and entry.refused(config, device):
            found.append(entry.describe(name, getattr(config, name)).replace("{plugin}", device.plugin))
    return found


def refusal(found: list[str], device: Device, where: str) -> ConfigError:
    lines = "\n".join(f"  - {line}" for line in found)
    return ConfigError(
        f"{len(found)} Megatron setting{'s' if len(found) > 1 else ''} cannot run on the {device.type} device "
        f"({device.plugin} plugin); devshim refuses {'them' if len(found) > 1 else 'it'} {where}, before the model "
        f"is built, instead of letting Megatron fail later or silently run something else:\n{lines}")


def refuse_unserved(config: Any, device: Device) -> None:
    """Raise a ConfigError naming every field of ``config`` set to a value ``device`` cannot serve."""
    found = problems(config, device)
    if found:
        raise refusal(found, device, f"when the {type(config).__name__} is built")


def checked_post_init(original: Callable[..., Any], device: Device) -> Callable[..., Any]:
    def __post_init__(self: Any) -> None:
        refuse_unserved(self, device)
        original(self)

    __post_init__.__devshim_original__ = original  # type: ignore[attr-defined]  # devshim's mark, read by patching
    return __post_init__
