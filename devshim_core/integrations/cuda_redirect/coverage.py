"""What the CUDA redirect answers, as data: the patch set is built from it and ``devshim check`` reads it.

A name listed here is served on the selected device when the redirect is on; a CUDA-only name that is not
listed is not, and ``devshim check`` says what the user must change.
"""

from __future__ import annotations

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
