"""Portable reference kernels: the numerical truth for every devshim plugin, and what runs on CPU."""

from devshim_kernels.adam import fused_adamw, host_adam_rollback, host_adam_step, implementation
from devshim_kernels.attention import attention
from devshim_kernels.attention_lse import attention_with_lse
from devshim_kernels.fused import rms_norm, rotary, swiglu
from devshim_kernels.grouped import grouped_gemm
from devshim_kernels.layouts import LAYOUTS, convert_layout, from_bnsd, to_bnsd
from devshim_kernels.softmax import masked_softmax
from devshim_kernels.wgrad import wgrad_accumulate

__all__ = ["LAYOUTS", "attention", "attention_with_lse", "convert_layout", "from_bnsd", "fused_adamw", "grouped_gemm",
           "host_adam_rollback", "host_adam_step", "implementation", "masked_softmax", "rms_norm", "rotary", "swiglu",
           "to_bnsd", "wgrad_accumulate"]
