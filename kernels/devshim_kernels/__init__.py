"""Portable reference kernels: the numerical truth for every devshim plugin, and what runs on CPU."""

from devshim_kernels.adam import fused_adamw, host_adam_rollback, host_adam_step
from devshim_kernels.attention import attention
from devshim_kernels.fused import rms_norm, rotary, swiglu

__all__ = ["attention", "fused_adamw", "host_adam_rollback", "host_adam_step", "rms_norm", "rotary", "swiglu"]
