"""What the CUDA redirect answers, as data: the patch set is built from it and ``devshim check`` reads it.

A name listed here is served on the selected device when the redirect is on; a CUDA-only name that is not
listed is not, and ``devshim check`` says what the user must change.
"""

from __future__ import annotations

import types

# torch.cuda functions answered by the device facade (same names, same signatures)
DEVICE_FUNCTIONS: frozenset[str] = frozenset({
    "is_available", "device_count", "current_device", "set_device", "synchronize",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "Stream", "Event", "stream", "current_stream", "default_stream", "set_stream",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_cached",
    "max_memory_cached", "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_stats", "empty_cache", "mem_get_info",
    "get_device_name", "get_device_properties", "get_device_capability", "is_bf16_supported",
    "is_initialized", "init", "is_current_stream_capturing", "ipc_collect", "device", "default_generators",
    "utilization",  # the vendor module's where it has one; refused, naming the call, where it has none
})

# torch.cuda internals that frameworks call and that must not queue work forever on a torch without CUDA
INTERNALS: frozenset[str] = frozenset({"_lazy_init", "_lazy_call"})

# torch.cuda.nvtx: markers become torch.profiler record_function ranges (visible in a trace, free otherwise)
NVTX_FUNCTIONS: frozenset[str] = frozenset({"range_push", "range_pop", "range", "mark"})

# torch.cuda.amp: the deprecated CUDA spellings of torch.amp, answered with device_type=<selected device>
AMP_NAMES: frozenset[str] = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})

# legacy typed-tensor names: constructors and isinstance() on the selected device; Tensor.type() reports them
TENSOR_TYPES: dict[str, str] = {
    "FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16", "BFloat16Tensor": "bfloat16",
    "LongTensor": "int64", "IntTensor": "int32", "ShortTensor": "int16", "CharTensor": "int8",
    "ByteTensor": "uint8", "BoolTensor": "bool",
}

# callables whose ``device=`` argument (or first positional device) is mapped from 'cuda'/'cuda:N'/N
FACTORIES: frozenset[str] = frozenset({
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "arange", "range",
    "linspace", "logspace", "eye", "tensor", "as_tensor", "asarray", "scalar_tensor", "tril_indices",
    "triu_indices", "normal", "frombuffer", "set_default_device",
})
# torch classes whose constructor's ``device=`` is mapped; they stay classes (isinstance keeps working)
CLASSES: frozenset[str] = frozenset({"Generator", "UntypedStorage"})
# storage methods whose ``device=`` is mapped (``storage.cuda()`` calls ``to``): a map_location function's
# ``lambda storage, loc: storage.cuda(1)`` reaches the selected device
STORAGE_METHODS: frozenset[str] = frozenset({"to"})
TENSOR_METHODS: frozenset[str] = frozenset({"to", "cuda", "type", "new_empty", "new_zeros", "new_ones",
                                           "new_full", "new_tensor"})
MODULE_METHODS: frozenset[str] = frozenset({"to", "cuda", "to_empty"})

# torch.distributed entry points whose backend='nccl' becomes the plugin's backend
DISTRIBUTED: frozenset[str] = frozenset({"init_process_group", "new_group", "new_subgroups",
                                        "new_subgroups_by_enumeration"})

# torch.distributed collectives whose two buffers NCCL reads flat, whatever their shapes
FLAT_BUFFER_COLLECTIVES: frozenset[str] = frozenset({"all_gather_into_tensor", "_all_gather_base",
                                                     "all_gather_single", "reduce_scatter_tensor",
                                                     "_reduce_scatter_base", "reduce_scatter_single"})

# torch.autocast / torch.amp.autocast / torch.amp.GradScaler with device_type='cuda'
AMP_DEVICE_TYPE: frozenset[str] = frozenset({"autocast", "GradScaler"})

# CUDA-only facilities that no plugin serves: a script using them must change
UNSERVED_CUDA: dict[str, str] = {
    "CUDAGraph": "CUDA graphs have no equivalent on other devices; run the captured code eagerly",
    "graph": "CUDA graphs have no equivalent on other devices; run the captured code eagerly",
    "graphs": "CUDA graphs have no equivalent on other devices; run the captured code eagerly",
    "make_graphed_callables": "CUDA graphs have no equivalent on other devices; call the module directly",
    "graph_pool_handle": "CUDA graph memory pools have no equivalent; remove the pool handle",
    "jiterator": "jiterator compiles CUDA C at run time; write the op in PyTorch",
    "nccl": "torch.cuda.nccl calls NCCL directly; use torch.distributed collectives",
    "comm": "torch.cuda.comm is CUDA peer-to-peer; use torch.distributed collectives",
    "cudart": "the CUDA runtime is not present; remove the call",
    "MemPool": "CUDA memory pools have no equivalent; use the default allocator",
    "use_mem_pool": "CUDA memory pools have no equivalent; use the default allocator",
    "CUDAPluggableAllocator": "a CUDA allocator cannot drive another device; use the plugin's allocator settings",
    "change_current_allocator": "a CUDA allocator cannot drive another device; use the plugin's allocator settings",
    "ExternalStream": "a raw CUDA stream pointer has no meaning on another device; use torch.cuda.Stream()",
    "tunable": "TunableOp tunes CUDA GEMMs only; remove it",
    "_sleep": "a CUDA spin kernel; remove it",
}

# torch.cuda calls that cannot run off CUDA (they reach torch._C's CUDA bindings, the CUDA runtime, its caching
# allocator or NVML); with UNSERVED_CUDA's callables the redirect replaces each with one that raises, naming the call.
# Keyed by what follows torch.cuda (``memory.x``: the torch.cuda.memory module's, which ``devshim check`` reports).
_ALLOCATOR = "the CUDA caching allocator is not present; use the plugin's memory settings and torch.cuda.memory_stats"
_ALLOCATOR_HISTORY = ("the CUDA caching allocator's history and snapshots do not exist off CUDA; use torch.profiler "
                      "with profile_memory=True")
_NVML = "NVML queries NVIDIA's driver; remove the call"
_HOST_ALLOCATOR = "the CUDA pinned-host allocator is not present; remove the call"
CUDA_ONLY_CALLS: dict[str, str] = {
    "memory._record_memory_history": _ALLOCATOR_HISTORY,
    "memory._snapshot": _ALLOCATOR_HISTORY,
    "memory._dump_snapshot": _ALLOCATOR_HISTORY,
    "memory.memory_snapshot": _ALLOCATOR_HISTORY,
    "memory_snapshot": _ALLOCATOR_HISTORY,
    "memory_summary": "the CUDA caching allocator's summary does not exist off CUDA; print torch.cuda.memory_stats()",
    "check_error": "checks a CUDA runtime status code, and the CUDA runtime is not present; remove the call",
    "get_allocator_backend": _ALLOCATOR,
    "set_per_process_memory_fraction": _ALLOCATOR,
    "get_per_process_memory_fraction": _ALLOCATOR,
    "caching_allocator_alloc": _ALLOCATOR,
    "caching_allocator_delete": _ALLOCATOR,
    "reset_accumulated_memory_stats": "CUDA's accumulated allocator counters do not exist off CUDA; use "
                                      "torch.cuda.reset_peak_memory_stats",
    "reset_accumulated_host_memory_stats": _HOST_ALLOCATOR,
    "reset_peak_host_memory_stats": _HOST_ALLOCATOR,
    "memory_usage": _NVML,
    "temperature": _NVML,
    "power_draw": _NVML,
    "clock_rate": _NVML,
    "device_memory_used": f"{_NVML}, or use torch.cuda.mem_get_info",
    "can_device_access_peer": "CUDA peer access has no equivalent; use torch.distributed collectives between devices",
    "current_blas_handle": "a cuBLAS handle does not exist off CUDA; remove the call",
    "current_solver_handle": "a cuSOLVER handle does not exist off CUDA; remove the call",
    "get_stream_from_external": UNSERVED_CUDA["ExternalStream"],
    "get_sync_debug_mode": "CUDA's synchronisation debug mode does not exist off CUDA; remove the call",
    "set_sync_debug_mode": "CUDA's synchronisation debug mode does not exist off CUDA; remove the call",
}

# torch.cuda names served with a difference from CUDA's answer (the rest of DEVICE_FUNCTIONS answer as CUDA does)
MODIFIED: dict[str, str] = {
    "Stream": "the device's stream class; isinstance() accepts what it makes",
    "Event": "the device's event class; isinstance() accepts what it makes (the host event, cpu_reference's, takes "
             "CUDA's IPC-only external= by keyword only)",
    "get_device_capability": "(0, 0): no CUDA architecture, so architecture-gated CUDA paths stay off",
    "get_device_properties": "CUDA's field names; major/minor 0, warp_size 1, fields without meaning 0 or ''",
    "get_device_name": "the device's name (its type where the plugin reports none)",
    "is_bf16_supported": "the device's bf16 trait; including_emulation is ignored",
    "is_current_stream_capturing": "always False: CUDA graphs are not served",
    "is_initialized": "always True: the device needs no lazy CUDA initialisation",
    "init": "a no-op: the device needs no lazy CUDA initialisation",
    "ipc_collect": "a no-op: there are no CUDA IPC handles",
    "synchronize": "synchronizes the selected device; the index is ignored",
    "utilization": "the vendor module's; refused, naming the call, where the device module has none",
    "seed": "the vendor module's, else a random 63-bit seed through manual_seed",
    "seed_all": "the vendor module's, else a random 63-bit seed through manual_seed_all",
    "default_generators": "the device's generators (torch.default_generator on the CPU)",
}

# public names left as torch defines them: modules, constants, exceptions and calls that work without CUDA
_SUBMODULE = "a submodule: its names are redirected where listed above, else as torch defines them"
_STORAGE = "a legacy typed storage class, as torch defines it (torch.UntypedStorage's device= is redirected)"
AS_TORCH: dict[str, str] = {
    **{name: _SUBMODULE for name in ("amp", "random", "nvtx", "memory", "streams", "profiler", "sparse", "gds",
                                     "green_contexts", "graphs", "jiterator", "nccl", "comm", "tunable")},
    **{f"{kind}Storage": _STORAGE for kind in ("BFloat16", "Bool", "Byte", "Char", "ComplexDouble", "ComplexFloat",
                                                "Double", "Float", "Half", "Int", "Long", "Short")},
    "CudaError": "an exception class, as torch defines it",
    "DeferredCudaCallError": "an exception class, as torch defines it",
    "cudaStatus": "CUDA status constants, as torch defines them",
    "GreenContext": "torch's class; its create() needs CUDA green contexts and raises torch's error",
    "StreamContext": "torch's context manager; torch.cuda.stream(), the device's, is what scripts use",
    "device_of": "torch's; it builds the redirected torch.cuda.device",
    "has_half": "a constant, as torch defines it",
    "has_magma": "a constant, as torch defines it (False: MAGMA is CUDA's)",
    "get_arch_list": "[]: no CUDA architectures, as torch answers without CUDA",
    "get_gencode_flags": "'': no CUDA architectures, as torch answers without CUDA",
    "is_tf32_supported": "torch's answer; TF32 is a CUDA matmul mode and has no effect off CUDA",
    "caching_allocator_enable": "torch's: sets a flag of the CUDA allocator, which is not used off CUDA",
    "caching_allocator_disabled": "torch's context manager: the CUDA allocator flag it sets is not used off CUDA",
    "host_memory_stats": "torch's: empty, as the CUDA pinned-host allocator is not used",
    "host_memory_stats_as_nested_dict": "torch's: empty, as the CUDA pinned-host allocator is not used",
    "memory_stats_as_nested_dict": "torch's: empty (torch.cuda.memory_stats, redirected, has the device's figures)",
    "list_gpu_processes": "torch's: says NVML is not available",
}
AS_TORCH_AMP: dict[str, str] = {
    **{name: _SUBMODULE for name in ("autocast_mode", "common", "grad_scaler")},
    "amp_definitely_not_available": "torch's; False, as the redirected torch.cuda.is_available() is True",
}

# torch.backends.cuda is left as torch defines it: its settings select CUDA kernels, which never run off CUDA, and
# ``devshim check`` reports their use for review. Each name is listed, so that a new torch forces a decision.
_CUDA_SETTING = "a CUDA kernel setting: accepted, no effect off CUDA"
_CUDA_QUERY = "torch's answer without CUDA (False)"
BACKENDS_AS_TORCH: dict[str, str] = {
    **{name: _CUDA_SETTING for name in (
        "cuFFTPlanCacheAttrContextProp", "cuFFTPlanCache", "cuFFTPlanCacheManager", "cuBLASModule",
        "preferred_linalg_library", "preferred_blas_library", "preferred_rocm_fa_library", "cufft_plan_cache",
        "matmul", "enable_cudnn_sdp", "cudnn_sdp_enabled", "enable_flash_sdp", "flash_sdp_enabled",
        "enable_mem_efficient_sdp", "mem_efficient_sdp_enabled", "math_sdp_enabled", "enable_math_sdp",
        "allow_fp16_bf16_reduction_math_sdp", "fp16_bf16_reduction_math_sdp_allowed", "sdp_kernel",
        "cublas_workspace_size", "cublaslt_workspace_size", "blas_workspace_size")},
    **{name: _CUDA_QUERY for name in (
        "is_built", "is_ck_sdpa_available", "is_flash_attention_available", "can_use_flash_attention",
        "can_use_efficient_attention", "can_use_cudnn_attention")},
    "SDPAParams": "torch's class, as torch defines it",
}

Kind = str  # "served", "modified", "as torch", "refused"
FACADE_MODULES: tuple[str, ...] = ("torch.cuda", "torch.cuda.amp", "torch.cuda.random", "torch.backends.cuda")


def refused_names() -> dict[str, str]:
    """torch.cuda attribute -> why it is refused: the callables of UNSERVED_CUDA and CUDA_ONLY_CALLS (submodules
    stay modules; ``devshim check`` reports their use)."""
    return {n: why for n, why in {**UNSERVED_CUDA, **CUDA_ONLY_CALLS}.items() if "." not in n and n not in AS_TORCH}


def classify(module: str, name: str) -> tuple[Kind, str] | None:
    """How the redirect answers ``module.name`` (a public name of one of FACADE_MODULES): ``(kind, note)``, or
    ``None`` where nothing decides it (a name a newer torch added)."""
    if module == "torch.backends.cuda":
        return ("as torch", BACKENDS_AS_TORCH[name]) if name in BACKENDS_AS_TORCH else None
    if module == "torch.cuda.amp":
        if name in AMP_NAMES:
            return "served", "torch.amp's, on the selected device (device_type='cuda' is mapped)"
        return ("as torch", AS_TORCH_AMP[name]) if name in AS_TORCH_AMP else None
    if module == "torch.cuda.random" and name not in DEVICE_FUNCTIONS:
        return None
    if name in MODIFIED:
        return "modified", MODIFIED[name]
    if name in DEVICE_FUNCTIONS:
        return "served", "answered by the device facade"
    if name in TENSOR_TYPES:
        return "served", f"the {TENSOR_TYPES[name]} tensor type on the selected device"
    if name in refused_names():
        return "refused", refused_names()[name]
    if name in AS_TORCH:
        return "as torch", AS_TORCH[name]
    return None


def public_names(module: types.ModuleType) -> list[str]:
    """The public names of ``module`` (one of FACADE_MODULES): its ``__all__`` and what it defines itself
    (submodules included), not the helpers it imports (``os``, ``typing.Any``, ``torch``)."""
    declared = set(getattr(module, "__all__", ()))

    def own(name: str) -> bool:
        value = vars(module)[name]
        home = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        return isinstance(home, str) and home.startswith(module.__name__)

    return sorted(n for n in vars(module) if not n.startswith("_") and (n in declared or own(n)))
