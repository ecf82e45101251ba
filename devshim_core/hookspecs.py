"""The contract between devshim and a device plugin: eleven hooks, detection first.

Detection (``devshim_detect``); the job's CUDA/NCCL environment in the vendor's variables
(``devshim_environment_map``); the device (``devshim_device_module``, ``devshim_device_traits``); collectives,
allocator, optimizer kernels, offload file I/O, attention and fused ops (one hook each); the vendor runtime's
versions for reports; and the plugin's own patches.

A plugin is one module (or object) whose functions carry ``@devshim_core.hookimpl`` and whose
distribution registers it in the ``devshim`` entry-point group: one entry point, one registered object,
so one implementation of each hook per plugin. Every plugin must implement ``devshim_detect``; a plugin
that can be selected must also implement ``devshim_device_module`` and ``devshim_allocator``.

How the core calls the hooks:

- ``devshim_detect`` is called on every installed plugin that the settings load (the forced one alone under
  ``DEVSHIM_PLUGIN``), one at a time, each on a daemon thread with a time limit (``DEVSHIM_DETECT_TIMEOUT``, 10 s by
  default); a plugin that raises, returns anything but a valid :class:`~devshim_core.records.DeviceReport` or
  does not answer in time is recorded as broken and skipped, and named on stderr if a lower-priority plugin is
  selected instead. It must be cheap and must never import a vendor SDK speculatively: some of them abort the
  interpreter when their runtime is missing.
- ``devshim_environment_map`` is called on the *selected* plugin only, once per activation, before the device
  facade is built (so before the vendor runtime reads its variables).
- Every other hook is called on the *selected* plugin only, once, when the device facade is built;
  the facade binds the returned callables and never calls the hook again. A ``None`` answer (or no
  implementation) means "not provided": the core falls back as each hook says, or stops with a
  :class:`~devshim_core.errors.PluginError` where the hook is required. So does an answer of the wrong
  type, a record with a field whose value does not have the field's declared type (``bf16_supported="no"``, a
  dtype written as a string), or a hook that raises; the error names the plugin, the hook and the field.
- Every hook after detection receives the plugin's own ``report`` so it need not detect again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from devshim_core.patching import Patch
    from devshim_core.records import (
        AllocatorSpec,
        CollectivesSpec,
        DeviceModule,
        DeviceReport,
        DeviceTraits,
        EnvironmentMap,
        FusedKernels,
        OffloadIO,
        OptimizerKernels,
    )

PROJECT = "devshim"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# ``firstresult=True`` below only makes a call return the plugin's one answer instead of a one-item list:
# the core calls each hook on a single plugin object (PluginRegistry.call), so there is nothing to rank.


# -- detection ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_detect() -> DeviceReport | None:
    """Report whether this plugin's device is usable here, and why.

    Contract: return a :class:`DeviceReport` whose ``reason`` explains the answer in words a user can
    act on ("torch_npu is installed but CANN was not found: set ASCEND_HOME_PATH"). Must not raise for
    an absent device (raising marks the plugin broken), must not import a vendor SDK before checking
    that it is the right one and that its runtime is present, and must not initialise the device more
    than needed to count it. It runs on a daemon thread and must answer within ``DEVSHIM_DETECT_TIMEOUT``
    seconds (10 by default), or the plugin is recorded as "detection timed out" and passed over; the call is not
    interrupted, its answer is ignored.

    Return: the report; ``device_count`` >= 1 when ``available``. ``None`` marks the plugin broken.
    """


# -- the job's environment -----------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_environment_map(report: DeviceReport) -> EnvironmentMap | None:
    """Map the CUDA/NCCL variables of a job script to the vendor runtime's own (``CUDA_VISIBLE_DEVICES`` ->
    ``ASCEND_RT_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF`` -> ``PYTORCH_NPU_ALLOC_CONF``, ``NCCL_*`` and
    ``TORCH_NCCL_*`` -> ``HCCL_*``), which the vendor runtime reads and the CUDA names never reach.

    Contract: map only what the vendor documents an equivalent for, and convert values whose format differs (drop
    allocator keys the vendor does not read, saying so in the converter's note). Pure data: read nothing, set
    nothing; the core sets each mapped variable at activation, before the device facade is built, unless the user
    set the vendor variable already (theirs wins), reverts what it set when devshim deactivates, and detects the
    device again when it set anything, so the report counts what the runtime now sees. ``devshim info`` reports
    every translation; the CUDA/NCCL settings present that the map neither translates nor ignores are named in one
    warning.

    Return: an :class:`EnvironmentMap`. ``None`` (the ``cuda`` plugin's answer: CUDA reads its own variables) means
    the core translates nothing and warns about nothing.
    """


# -- device ------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_device_module(report: DeviceReport) -> DeviceModule | None:
    """Return the torch-style device module that drives the device.

    Contract: an object with ``torch.cuda``'s names and signatures for device selection
    (``is_available, device_count, current_device, set_device, synchronize``), RNG (``manual_seed,
    manual_seed_all, initial_seed, get_rng_state, set_rng_state``) and, unless the traits say
    ``streams=False``, streams/events (``Stream, Event, stream, current_stream, default_stream``); see
    :data:`~devshim_core.records.DEVICE_MODULE_API` and :data:`~devshim_core.records.STREAM_API`, checked when
    the facade is built. A vendor plugin usually returns the vendor module (``torch.npu``) after registering it,
    wrapping only what differs.

    Return: the module. Required for a selectable plugin.
    """


@hookspec(firstresult=True)
def devshim_device_traits(report: DeviceReport) -> DeviceTraits | None:
    """Describe what the device supports: dtypes, bf16/fp16/fp64, host-synchronous execution, streams,
    int64, pinned memory and a human-readable device name.

    Return: a :class:`DeviceTraits`. ``None`` means ``DeviceTraits(supported_dtypes=(torch.float32,),
    bf16_supported=False, fp16_supported=False)``: float32 as the only listed dtype, asynchronous, with
    streams, every other field at its default.
    """


# -- collectives -------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_collectives(report: DeviceReport) -> CollectivesSpec | None:
    """Describe how ranks communicate: backend name, extra ``init_process_group`` arguments,
    environment prefixes a launcher forwards, visible-device variables, and a per-process
    ``prepare`` step (register an out-of-tree backend, set vendor environment), run once when devshim
    activates in the process.

    Return: a :class:`CollectivesSpec`. ``None`` means ``CollectivesSpec("gloo")``: no prefixes to forward
    beyond devshim's own ``DEVSHIM``, and ``DEVSHIM_VISIBLE_DEVICES`` as the visible-devices variable.
    """


# -- allocator ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_allocator(report: DeviceReport) -> AllocatorSpec | None:
    """Expose memory accounting (allocated/reserved and their peaks, ``memory_stats``, total and
    available memory), ``empty_cache`` and the allocator-settings variable with its validator.

    Return: an :class:`AllocatorSpec`. Required for a selectable plugin. A value of ``config_env`` that
    ``validate_config`` rejects stops activation with a ConfigError.
    """


# -- optimizer kernels -------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_optimizer_kernels(report: DeviceReport) -> OptimizerKernels | None:
    """Provide the fused multi-tensor AdamW for the device and the host-side Adam step/rollback that
    ZeRO-Offload runs on the CPU whatever the device. Both must match ``torch.optim.AdamW``
    (bias correction ``1 - beta**step``, decoupled decay in AdamW mode).

    Return: an :class:`OptimizerKernels`; any field may be ``None``. Without ``fused_adamw`` DeepSpeed's
    FusedAdam, and without ``host_adam_step`` its DeepSpeedCPUAdam, cannot be created: the op builder's
    ``load()`` raises a RuntimeError naming the plugin (DeepSpeedCPUAdam raises its own from it) and
    nothing is compiled; Megatron's ``optimizer='adam'`` runs ``fused_adamw`` as its FusedAdam, and without it
    keeps ``torch.optim.AdamW``. ``None`` overall means all three are absent. Without ``host_adam_rollback``, the
    ``cpu_adam`` op's ``adam_rollback`` raises a KernelCallError naming the missing kernel. ``host_adam_step``
    must accept ``param_copy``: ZeRO-Offload's bf16/fp16 step passes the host buffer of the device copy, to
    be written bit for bit as ``Tensor.to`` converts, in the same pass.
    """


# -- offload to local storage -----------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_offload_io(report: DeviceReport) -> OffloadIO | None:
    """Provide the host file I/O that offloading to local storage runs on, whatever the device: ZeRO-Infinity
    swaps parameters and optimizer state between host buffers and files on it.

    Return: an :class:`OffloadIO`. devshim serves DeepSpeed's ``async_io`` op with its ``file_io`` (handles,
    synchronous and asynchronous reads and writes, ``wait``, pinned host buffers); a transfer that fails raises
    :class:`OSError` naming the file, never DeepSpeed's -1. ``None`` (or no implementation) means devshim's host
    default, the same for every device (:func:`devshim_core.host_defaults.offload_io`: devshim-kernels' file I/O).
    ``file_io=None`` means the op refuses to load with a RuntimeError naming the plugin and ``source``, so
    ``offload_param``/``offload_optimizer`` with ``device: nvme`` fail at engine creation; nothing is compiled.
    """


# -- attention ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_attention_kernels(report: DeviceReport) -> FusedKernels | None:
    """Provide attention and the fused ops that ride with it (rms_norm, swiglu, rotary, masked_softmax,
    wgrad_accumulate, grouped_gemm, attention_lse), with the conventions
    :class:`~devshim_core.records.FusedKernels` states at the boundary: a vendor whose mask polarity, default scale
    or return shape differ converts inside the plugin, never in the caller.

    Return: an :class:`FusedKernels`; any field may be ``None``. ``devshim info`` reports them, and
    devshim's Megatron integration calls them in place of Megatron's CUDA-only and unfused paths: ``attention``
    in ``DotProductAttention``, ``rms_norm`` in the local spec's norm, ``swiglu`` in the bias-SwiGLU fusion and the
    MoE experts' weighted SwiGLU, ``rotary`` for rotary embeddings (fused and unfused), ``masked_softmax`` in
    ``FusedScaleMaskSoftmax`` and the fused-softmax extension modules, ``wgrad_accumulate`` for
    ``gradient_accumulation_fusion``, ``grouped_gemm`` for ``moe_grouped_gemm``'s ``GroupedMLP``, and, with
    ``context_parallel_size > 1``, ``attention`` for Ulysses context parallelism and ``attention_lse`` for ring
    attention. An op that is ``None`` leaves Megatron's own path in place (``gradient_accumulation_fusion`` then
    fails with an error naming the flag; context parallelism without ``attention`` is refused by name), and so
    does a call the op cannot serve as Megatron would (e.g. attention with a bias, packed sequences or a sliding
    window); a ``grouped_gemm`` that is ``None`` is devshim_kernels' loop of matmuls, and so is an
    ``attention_lse`` that is ``None`` beside an ``attention``: devshim_kernels' ``attention_with_lse``.
    DeepSpeed keeps its own attention and fused ops whatever the answer.
    """


# -- runtime versions --------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_runtime_versions(report: DeviceReport) -> dict[str, str] | None:
    """Name the versions of the vendor software under the device (driver, toolkit, collective library), for
    ``devshim info``: what ``ds_report`` and ``accelerate env`` print, and what a bug report needs.

    Contract: read them without initialising the device (version files, environment, package metadata); a piece
    that cannot be read is left out, never guessed. Called on the selected plugin only, when a report is made.

    Return: ``{name: version}`` with string keys and values (``{"CANN": "8.1.RC1", "driver": "24.1.0"}``), or
    ``None`` when the plugin reads none.
    """


# -- vendor patches ----------------------------------------------------------------------------


# not firstresult: the core receives ``[the plugin's list]`` (``[]`` for ``None``) and takes its items
@hookspec
def devshim_patches(report: DeviceReport) -> list[Patch] | None:
    """Declare vendor-specific patches (device gaps, workarounds) to apply with the core's.

    Contract: each :class:`~devshim_core.patching.Patch` names its target, why it exists and, in
    ``requires``, the version ranges it is valid for. The core applies the plugin's patches as one set,
    ``plugin-<name>``, before any framework integration: all of them or none (an unmet ``requires`` or a
    failing patch stops activation with a PatchError naming the patch), reported by ``devshim info`` and
    reverted by the core's registry. Never patch anything from this hook directly.

    Return: the plugin's list of patches, or ``None`` for none; an item that is not a ``Patch`` is a
    PluginError.
    """
