"""The contract between devshim and a device plugin: five areas, one hook each, plus detection.

A plugin is a module (or object) whose functions carry ``@devshim_core.hookimpl`` and whose
distribution registers it in the ``devshim`` entry-point group. Only ``devshim_detect`` is required.

How the core calls the hooks:

- ``devshim_detect`` is called on *every* installed plugin, one at a time, and a plugin that raises
  or returns anything but a :class:`~devshim_core.records.DeviceReport` is recorded as broken and
  skipped. It must be cheap and must never import a vendor SDK speculatively: some of them abort the
  interpreter when their runtime is missing.
- Every other hook is called on the *selected* plugin only, once, when the device facade is built;
  the facade binds the returned callables and never calls the hook again. All of them are
  ``firstresult``: the first non-``None`` answer wins (a plugin may split its answers across several
  registered objects). A ``None`` answer means "not provided": the core falls back as each hook says.
- Every hook after detection receives the plugin's own ``report`` so it need not detect again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from devshim_core.patching import Patch
    from devshim_core.records import (
        AllocatorSpec,
        AttentionKernels,
        CollectivesSpec,
        DeviceModule,
        DeviceReport,
        DeviceTraits,
        OptimizerKernels,
    )

PROJECT = "devshim"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- detection ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_detect() -> DeviceReport | None:
    """Report whether this plugin's device is usable here, and why.

    Contract: return a :class:`DeviceReport` whose ``reason`` explains the answer in words a user can
    act on ("torch_npu is installed but CANN was not found: set ASCEND_HOME_PATH"). Must not raise for
    an absent device (raising marks the plugin broken), must not import a vendor SDK before checking
    that it is the right one and that its runtime is present, and must not initialise the device more
    than needed to count it.

    Return: the report; ``device_count`` >= 1 when ``available``. First non-None result wins.
    """


# -- device ------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_device_module(report: DeviceReport) -> DeviceModule | None:
    """Return the torch-style device module that drives the device.

    Contract: an object with ``torch.cuda``'s names and signatures for device selection
    (``device_count, current_device, set_device, synchronize``), RNG (``manual_seed, manual_seed_all,
    initial_seed, get_rng_state, set_rng_state``) and streams/events (``Stream, Event, stream,
    current_stream, default_stream``); see ``records.DEVICE_MODULE_API``. A vendor plugin usually
    returns the vendor module (``torch.npu``) after registering it, wrapping only what differs.

    Return: the module. Required for a selectable plugin; first non-None result wins.
    """


@hookspec(firstresult=True)
def devshim_device_traits(report: DeviceReport) -> DeviceTraits | None:
    """Describe what the device supports: dtypes, bf16/fp16, host-synchronous execution, streams,
    int64, pinned memory and a human-readable device name.

    Return: a :class:`DeviceTraits`. ``None`` means fp32 only, asynchronous, with streams.
    First non-None result wins.
    """


# -- collectives -------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_collectives(report: DeviceReport) -> CollectivesSpec | None:
    """Describe how ranks communicate: backend name, extra ``init_process_group`` arguments,
    environment prefixes a launcher forwards, visible-device variables, and a per-process
    ``prepare`` step (register an out-of-tree backend, set vendor environment).

    Return: a :class:`CollectivesSpec`. ``None`` means ``gloo`` with nothing to forward.
    First non-None result wins.
    """


# -- allocator ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_allocator(report: DeviceReport) -> AllocatorSpec | None:
    """Expose memory accounting (allocated/reserved and their peaks, ``memory_stats``, total and
    available memory), ``empty_cache`` and the allocator-settings variable with its validator.

    Return: an :class:`AllocatorSpec`. Required for a selectable plugin; first non-None result wins.
    """


# -- optimizer kernels -------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_optimizer_kernels(report: DeviceReport) -> OptimizerKernels | None:
    """Provide the fused multi-tensor AdamW for the device and the host-side Adam step/rollback that
    ZeRO-Offload runs on the CPU whatever the device. Both must match ``torch.optim.AdamW``
    (bias correction ``1 - beta**step``, decoupled decay in AdamW mode).

    Return: an :class:`OptimizerKernels`; any field may be ``None``. ``None`` overall means none:
    DeepSpeed then refuses FusedAdam/CPUAdam rather than compiling them. First non-None result wins.
    """


# -- attention ---------------------------------------------------------------------------------


@hookspec(firstresult=True)
def devshim_attention_kernels(report: DeviceReport) -> AttentionKernels | None:
    """Provide attention and the fused ops that ride with it (rms_norm, swiglu, rotary), with
    PyTorch's conventions at the boundary: a vendor whose mask polarity, default scale or return
    shape differ converts inside the plugin, never in the caller.

    Return: an :class:`AttentionKernels`; any field may be ``None`` (the framework keeps its own
    implementation of that op). First non-None result wins.
    """


# -- vendor patches ----------------------------------------------------------------------------


@hookspec
def devshim_patches(report: DeviceReport) -> list[Patch] | None:
    """Declare vendor-specific patches (device gaps, workarounds) to apply with the core's.

    Contract: each :class:`~devshim_core.patching.Patch` names its target, the version range it is
    valid for and why it exists; it is applied, reported and reverted by the core's registry, all or
    nothing. Never patch anything from this hook directly.

    Return: a list of patches, or ``None``. Results of all the selected plugin's registered objects
    are collected (not first-result).
    """
