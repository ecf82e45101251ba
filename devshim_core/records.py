"""Small typed records that plugins return from their hooks and that the core passes along.

Plugins build these; the core checks their types (a detection answer of another type marks the plugin
broken; any later hook's stops activation with a PluginError). Everything here is plain data or plain
callables, so that the facade can bind each callable once and the frameworks call the vendor's function
with no dispatch in between.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceReport:
    """What a plugin found on this machine (the answer to ``devshim_detect``).

    ``reason`` is always filled: why the device is usable ("torch_npu 2.13.0, 8 devices") or why not
    ("torch_npu is not installed"). ``priority`` orders available plugins: higher wins; the
    always-available CPU fallback uses the lowest.
    """

    available: bool
    reason: str
    device_type: str
    device_count: int = 0
    priority: int = 0

    def validate(self) -> None:
        if not isinstance(self.available, bool):
            raise TypeError(f"available must be a bool, got {self.available!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise TypeError(f"reason must be a non-empty str, got {self.reason!r}")
        if not isinstance(self.device_type, str) or not self.device_type.isidentifier():
            raise TypeError(f"device_type must be a torch device type such as 'npu', got {self.device_type!r}")
        if not isinstance(self.device_count, int) or isinstance(self.device_count, bool) or self.device_count < 0:
            raise TypeError(f"device_count must be an int >= 0, got {self.device_count!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise TypeError(f"priority must be an int, got {self.priority!r}")
        if self.available and self.device_count < 1:
            raise ValueError("an available device must report device_count >= 1")


@runtime_checkable
class DeviceModule(Protocol):
    """The torch-style device module a plugin serves (``torch.npu``, ``torch.tpu`` or its own).

    It follows ``torch.cuda``'s names and signatures, so a vendor plugin can usually return the
    vendor's module as it is and wrap only what differs.
    """

    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def current_device(self) -> int: ...
    def set_device(self, device: Any) -> None: ...
    def synchronize(self, device: Any = None) -> None: ...
    def manual_seed(self, seed: int) -> None: ...
    def manual_seed_all(self, seed: int) -> None: ...
    def initial_seed(self) -> int: ...
    def get_rng_state(self, device: Any = ...) -> Any: ...
    def set_rng_state(self, new_state: Any, device: Any = ...) -> None: ...
    def current_stream(self, device: Any = None) -> Any: ...
    def default_stream(self, device: Any = None) -> Any: ...
    def stream(self, stream: Any) -> Any: ...


DEVICE_MODULE_API: tuple[str, ...] = (
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "synchronize",
    "manual_seed",
    "manual_seed_all",
    "initial_seed",
    "get_rng_state",
    "set_rng_state",
)
"""Attribute names every device module must provide (checked when the facade is built)."""
STREAM_API: tuple[str, ...] = ("Stream", "Event", "stream", "current_stream", "default_stream")
"""Attribute names a device module must also provide unless its traits say ``streams=False``."""


@dataclass(frozen=True)
class DeviceTraits:
    """Facts about the device that change how frameworks drive it (``devshim_device_traits``).

    ``host_synchronous``: kernels complete before the call returns (CPU); DeepSpeed then uses host timers
    and skips side streams. ``int64_supported``: False where the vendor narrows int64 to int32 (Sophgo); DeepSpeed's
    ``accelerator.LongTensor`` then makes int32 tensors, as the vendor's own does.
    ``streams``: False where the device has no stream/event API of its own: frameworks then get host-side
    streams and events whose waits are already satisfied (right for host-synchronous devices).
    """

    supported_dtypes: tuple[torch.dtype, ...]
    bf16_supported: bool
    fp16_supported: bool
    fp64_supported: bool = True
    host_synchronous: bool = False
    streams: bool = True
    int64_supported: bool = True
    pin_memory: bool = True
    name: str = ""


@dataclass(frozen=True)
class CollectivesSpec:
    """How ranks talk on this device (``devshim_collectives``).

    ``backend``: the ``torch.distributed`` backend name (``gloo``, ``hccl``, ``sccl``).
    ``init_kwargs``: extra keyword arguments for ``init_process_group`` (e.g. vendor ``pg_options``); devshim
    patches ``torch.distributed.init_process_group`` to add them, as defaults, to every call that chooses this
    backend or none (reported as the ``torch.distributed`` patch set).
    ``export_env_prefixes``: environment-variable prefixes a launcher must forward to remote ranks.
    ``visible_devices_envs``: variables that restrict which devices a rank sees, first one canonical.
    ``prepare``: called exactly once in each process, at activation, before any process group is created
    (register an out-of-tree backend, set vendor environment); a later re-activation does not call it again.
    ``None`` when nothing is needed.
    """

    backend: str
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)
    export_env_prefixes: tuple[str, ...] = ()
    visible_devices_envs: tuple[str, ...] = ()
    prepare: Callable[[], None] | None = None


@dataclass(frozen=True)
class AllocatorSpec:
    """Memory accounting and allocator control (``devshim_allocator``).

    Every callable but ``empty_cache`` takes an optional device index, like ``torch.cuda``'s.
    ``config_env``: the variable the vendor allocator reads its settings from (``PYTORCH_NPU_ALLOC_CONF``), or ``None``.
    ``validate_config``: raises ``ValueError`` with an actionable message for a bad settings string.
    """

    memory_allocated: Callable[..., int]
    max_memory_allocated: Callable[..., int]
    memory_reserved: Callable[..., int]
    max_memory_reserved: Callable[..., int]
    reset_peak_memory_stats: Callable[..., None]
    memory_stats: Callable[..., Mapping[str, Any]]
    empty_cache: Callable[[], None]
    total_memory: Callable[..., int]
    available_memory: Callable[..., int]
    config_env: str | None = None
    validate_config: Callable[[str], None] | None = None

    @classmethod
    def from_module(cls, module: Any, config_env: str | None = None,
                    validate_config: Callable[[str], None] | None = None) -> AllocatorSpec:
        """The spec of a ``torch.cuda``-shaped device module (``torch.npu``, ``torch.tpu``): its own memory
        functions, total memory from ``get_device_properties`` and free memory from ``mem_get_info``."""

        def total_memory(device: Any = None) -> int:
            return module.get_device_properties(module.current_device() if device is None else device).total_memory

        def available_memory(device: Any = None) -> int:
            return module.mem_get_info(module.current_device() if device is None else device)[0]

        return cls(memory_allocated=module.memory_allocated, max_memory_allocated=module.max_memory_allocated,
                   memory_reserved=module.memory_reserved, max_memory_reserved=module.max_memory_reserved,
                   reset_peak_memory_stats=module.reset_peak_memory_stats, memory_stats=module.memory_stats,
                   empty_cache=module.empty_cache, total_memory=total_memory, available_memory=available_memory,
                   config_env=config_env, validate_config=validate_config)


class FusedAdamW(Protocol):
    """Multi-tensor Adam/AdamW over device tensors, updated in place.

    ``step`` is the step number after this update (1 for the first). ``adamw_mode`` selects decoupled
    weight decay (AdamW) over L2 added to the gradient (Adam). Bias correction, when on, is
    ``1 - beta ** step`` exactly as ``torch.optim.AdamW``. Optional keyword arguments a kernel should
    accept: ``max_exp_avg_sqs`` (amsgrad when given) and ``param_copies`` (bf16/fp16 tensors, or ``None``
    entries, that receive the updated params in the same pass, for mixed-precision training).
    """

    def __call__(
        self,
        params: Sequence[Any],
        grads: Sequence[Any],
        exp_avgs: Sequence[Any],
        exp_avg_sqs: Sequence[Any],
        *,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw_mode: bool,
        bias_correction: bool,
    ) -> None: ...


class HostAdamStep(Protocol):
    """One Adam/AdamW step on host tensors for optimizer offload, in place; same arguments as one
    tensor of :class:`FusedAdamW` (``max_exp_avg_sq``, ``param_copy``). Params may be fp32, bf16 or fp16;
    states fp32 or the param dtype. ``param_copy`` (bf16 or fp16, the params' size), when given, receives
    the updated params converted as ``Tensor.to`` would, bit for bit: ZeRO-Offload's step passes it so that
    the device copy is written in the same pass. As a rollback it undoes exactly one step and may refuse
    amsgrad, whose running maximum cannot be undone."""

    def __call__(
        self,
        param: Any,
        grad: Any,
        exp_avg: Any,
        exp_avg_sq: Any,
        *,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw_mode: bool,
        bias_correction: bool,
        param_copy: Any = None,
    ) -> None: ...


@dataclass(frozen=True)
class OptimizerKernels:
    """Optimizer kernels (``devshim_optimizer_kernels``).

    ``fused_adamw`` runs on the device; ``host_adam_step`` / ``host_adam_rollback`` run on the host for
    ZeRO-Offload whatever the device (rollback undoes exactly one step, given the same gradient).
    ``None`` means the plugin has no such kernel: DeepSpeed's FusedAdam/CPUAdam then refuse to load with an
    error naming the plugin (devshim never lets DeepSpeed JIT-compile its own).
    """

    fused_adamw: FusedAdamW | None = None
    host_adam_step: HostAdamStep | None = None
    host_adam_rollback: HostAdamStep | None = None
    source: str = ""


class AsyncFileIO(Protocol):
    """Asynchronous transfers between contiguous host tensors and files, made by :class:`OffloadIO`.

    ``submit`` queues a read of ``target`` into ``buffer`` (``read=True``) or a write of ``buffer`` to it, at
    ``file_offset``, and returns at once; ``target`` is a path (opened, created for a write, and closed by the
    engine) or an open file descriptor (left open). ``wait`` blocks until every queued transfer is done and
    returns how many there were, raising :class:`OSError` naming the file if one failed. ``close`` finishes
    queued work and releases the engine's threads. ``threads`` is how many transfers run at once.
    """

    threads: int

    def submit(self, read: bool, buffer: Any, target: str | int, file_offset: int = 0) -> None: ...

    def wait(self) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class OffloadIO:
    """Host file I/O for offloading to local storage (``devshim_offload_io``).

    ``file_io(threads, block_size)`` makes an :class:`AsyncFileIO` that moves ``block_size``-byte chunks on
    ``threads`` threads. DeepSpeed's ``async_io`` op (ZeRO-Infinity's NVMe offload, the fast checkpoint writer)
    runs on it. ``None`` means the plugin has none: the op then refuses to load naming the plugin and
    ``source``, which should say why.
    """

    file_io: Callable[[int, int], AsyncFileIO] | None = None
    source: str = ""


@dataclass(frozen=True)
class FusedKernels:
    """Attention and the fused ops that ride with it (``devshim_attention_kernels``: rms_norm, swiglu, rotary, masked
    softmax, wgrad accumulation, grouped GEMM, attention with its log-sum-exp), each ``None`` when
    the plugin has no such op. The signatures are PyTorch's conventions, whatever the vendor's are:

    - ``attention(q, k, v, *, layout, num_heads=None, attn_mask=None, mask_true_means_masked=False, causal=False,
      dropout_p=0.0, scale=None, cu_seqlens_q=None, cu_seqlens_kv=None, causal_alignment="top_left") -> Tensor``;
      layouts ``BNSD``, ``BSND``, ``BSH``, ``SBH`` and packed ``TND`` (cumulative lengths with or without the
      leading 0); the output has ``q``'s layout. A boolean mask keeps ``True`` unless
      ``mask_true_means_masked`` (Ascend's convention); a float mask is added to the scores. ``scale=None``
      means ``1/sqrt(head_dim)`` (a vendor whose default differs converts inside its plugin). Grouped-query
      key/value heads divide the query heads. ``dropout_p`` is the drop probability (vendors' ``keep_prob``
      is ``1 - p``). ``causal_alignment``: ``"top_left"`` (SDPA, ``sparse_mode=2``) or ``"bottom_right"``
      (flash-attn, ``sparse_mode=3``). Differentiable in q, k and v.
    - ``rms_norm(x, weight, eps) -> Tensor``: statistics in fp32; ``weight`` may be ``None``.
    - ``swiglu(x) -> Tensor`` = ``silu(a) * b`` for ``a, b = x.chunk(2, -1)``
    - ``rotary(x, cos, sin, *, interleaved=False) -> Tensor``: ``cos``/``sin`` broadcast against ``x`` as
      Megatron ([S,1,1,D]) and the vendors ([1,S,1,D], [1,1,S,D]) pass them; only the first
      ``cos.shape[-1]`` channels rotate.
    - ``masked_softmax(scores, mask, scale, *, causal=False) -> Tensor``: ``softmax(scores * scale)`` over the
      last dimension of [b, np, sq, sk] scores, masked positions filled with -10000.0 after scaling (Megatron's
      fill, fused and unfused); ``mask`` boolean with ``True`` = masked (Megatron's convention), broadcastable to
      the scores, or ``None``; ``causal`` also masks the upper triangle (key j > query i). A row with every
      position masked is zeros (as Megatron's CUDA kernel). Statistics in fp32; the result has the scores' dtype.
      Differentiable in ``scores``.
    - ``wgrad_accumulate(total_input, grad_output, main_grad) -> None``: ``main_grad += grad_output^T @
      total_input`` in place, leading dimensions flattened ([..., in], [..., out] -> [out, in]), products summed
      in fp32 and rounded once to ``main_grad``'s dtype (fp32, fp16 or bf16), as Megatron's gradient-accumulation
      fusion.
    - ``grouped_gemm(x, weight, group_sizes, *, trans_b=False) -> Tensor``: MoE experts' grouped GEMM (Megatron's
      ``grouped_gemm.ops.gmm``, MindSpeed's ``npu_grouped_matmul``): ``x`` [T, K] holds the groups' rows one group
      after another, ``weight`` [G, K, N] ([G, N, K] with ``trans_b``, multiplied transposed), ``group_sizes`` G
      non-negative row counts summing to T (a 1-D integer tensor on the host or the device, or a sequence of
      ints); the result [T, N] holds ``x_g @ weight[g]`` for each group in order. ``x`` and ``weight`` share a
      floating dtype (fp32, fp16, bf16), which the result has. Differentiable in ``x`` and ``weight`` (a group with no
      rows gets a zero weight gradient). The device facade fills a plugin's ``None`` with ``devshim_kernels``'
      loop of matmuls, so it is never ``None`` where ``devshim_kernels`` is installed.

    - ``attention_lse(q, k, v, *, attn_mask=None, mask_true_means_masked=False, causal=False, scale=None,
      dropout_p=0.0) -> (out, lse)``: attention on [B, N, S, D] tensors (BNSD only; boolean or integer masks; GQA
      as ``attention``; dropout on the probabilities, not on ``lse``) that also returns ``lse`` [B, N, Sq], fp32
      (fp64 for fp64 inputs): each query's log-sum-exp of its scaled, unmasked scores (``-inf`` for a query with
      no key, whose output is zeros). ``causal`` is top-left. Both outputs are differentiable in ``q``,
      ``k`` and ``v``: ring attention (context parallelism) merges key/value blocks by these statistics. The
      device facade fills a plugin's ``None`` with ``devshim_kernels.attention_with_lse`` where the plugin has
      ``attention``.

    ``devshim_kernels`` implements every op with these semantics; a vendor plugin may answer some ops with
    its SDK and the rest with ``devshim_kernels``' (op by op), and tests compare a vendor op against it.
    """

    attention: Callable[..., Any] | None = None
    rms_norm: Callable[..., Any] | None = None
    swiglu: Callable[..., Any] | None = None
    rotary: Callable[..., Any] | None = None
    masked_softmax: Callable[..., Any] | None = None
    wgrad_accumulate: Callable[..., None] | None = None
    grouped_gemm: Callable[..., Any] | None = None
    attention_lse: Callable[..., Any] | None = None
    source: str = ""


AttentionKernels = FusedKernels
"""The name :class:`FusedKernels` had before 0.1 (it carries more than attention); kept so that plugins written
against it keep working."""


EnvironmentConverter = Callable[[str], "tuple[str | None, str]"]
"""Converts a CUDA/NCCL variable's value to the vendor variable's format: ``(value, note)``; ``value`` is ``None``
when nothing of it carries over, ``note`` says what was dropped or why (``""`` when nothing was)."""


@dataclass(frozen=True)
class EnvironmentMap:
    """How a job's CUDA/NCCL environment maps to the plugin's own variables (``devshim_environment_map``).

    ``variables``: CUDA/NCCL name -> the vendor's (``{"CUDA_VISIBLE_DEVICES": "ASCEND_RT_VISIBLE_DEVICES"}``); values
    are copied as they are unless ``convert`` has a converter for the CUDA/NCCL name.
    ``convert``: CUDA/NCCL name -> an :data:`EnvironmentConverter`, for formats that differ (allocator keys the vendor
    does not read, log levels written otherwise).
    ``ignored``: names, or prefixes ending in ``_``, that mean nothing on this device (NCCL settings on a device whose
    collectives are gloo's): reported by ``devshim info`` but not warned about. Every other ``CUDA_VISIBLE_DEVICES``,
    ``PYTORCH_CUDA_ALLOC_CONF``, ``NCCL_*`` or ``TORCH_NCCL_*`` setting is untranslatable, named in one warning.
    """

    variables: Mapping[str, str] = field(default_factory=dict)
    convert: Mapping[str, EnvironmentConverter] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
