"""What every plugin serves the same way, because it runs on the host whatever the device: the file I/O of offloading
to local storage, and the host Adam of ZeRO-Offload. One implementation, ``devshim-kernels``', in one place.

``devshim_offload_io`` falls back to :func:`offload_io` for a plugin that does not implement it; a plugin whose
optimizer kernels are its own adds the host Adam with :func:`optimizer_kernels`. A plugin overrides either by
answering the hook itself (``OffloadIO(file_io=None, source=why)`` refuses the op, naming why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devshim_core.records import FusedKernels, OffloadIO, OptimizerKernels


def offload_io() -> OffloadIO:
    """devshim-kernels' asynchronous host file I/O, or a refusal saying why it is not there."""
    try:
        from devshim_kernels import file_io
    except ImportError as exc:
        return OffloadIO(file_io=None, source=f"devshim-kernels is not installed ({exc}): pip install devshim-kernels")
    return OffloadIO(file_io=file_io.AsyncFileIO if file_io.AVAILABLE else None, source=file_io.describe())


def optimizer_kernels(fused_adamw: Callable[..., Any] | None, fused_source: str) -> OptimizerKernels:
    """The plugin's device ``fused_adamw`` (``None``: it has none) with devshim-kernels' host Adam step and rollback;
    ``source`` says where each comes from, for ``devshim info``."""
    import devshim_kernels

    return OptimizerKernels(fused_adamw=fused_adamw, host_adam_step=devshim_kernels.host_adam_step,
                            host_adam_rollback=devshim_kernels.host_adam_rollback,
                            source=f"{fused_source}; host Adam: devshim_kernels, {devshim_kernels.implementation()}")


def reference_fused_kernels() -> FusedKernels:
    """devshim-kernels' portable ops, every one: what the ``cpu_reference`` plugin serves, and what
    ``DEVSHIM_REFERENCE_KERNELS=1`` puts in place of a plugin's own on its device (``devshim compare --reference
    kernels``). They are plain torch, so they run on any device."""
    import devshim_kernels

    return FusedKernels(attention=devshim_kernels.attention, rms_norm=devshim_kernels.rms_norm,
                        swiglu=devshim_kernels.swiglu, rotary=devshim_kernels.rotary,
                        masked_softmax=devshim_kernels.masked_softmax,
                        wgrad_accumulate=devshim_kernels.wgrad_accumulate, source="devshim_kernels")


def reference_optimizer_kernels() -> OptimizerKernels:
    """devshim-kernels' fused AdamW and host Adam (see :func:`reference_fused_kernels`)."""
    import devshim_kernels

    return optimizer_kernels(devshim_kernels.fused_adamw, "fused_adamw: devshim_kernels")
