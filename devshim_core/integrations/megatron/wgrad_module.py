"""The ``fused_weight_gradient_mlp_cuda`` extension Megatron imports for ``gradient_accumulation_fusion``, on the
device's ``wgrad_accumulate`` kernel.

``megatron.core.tensor_parallel.layers`` imports the extension once, at import time, and calls
``wgrad_gemm_accum_fp32`` (fp32 ``main_grad``) or ``wgrad_gemm_accum_fp16`` (fp16/bf16 ``main_grad``) in its
backward; both mean ``main_grad += grad_output^T @ total_input``.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from devshim_core.device import Device

MODULE_NAME = "fused_weight_gradient_mlp_cuda"


def make_module(device: Device) -> types.ModuleType:
    """A module named ``fused_weight_gradient_mlp_cuda`` whose two functions run ``device.attention.wgrad_accumulate``
    (or, if the plugin has none, raise a RuntimeError naming ``gradient_accumulation_fusion``)."""
    module = types.ModuleType(MODULE_NAME, f"Megatron's gradient-accumulation fusion on devshim's {device.plugin} "
                                           "device (device.attention.wgrad_accumulate).")
    kernel = device.attention.wgrad_accumulate

    if kernel is None:
        def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
            raise RuntimeError(
                f"gradient_accumulation_fusion=True needs a weight-gradient accumulation kernel, and devshim's "
                f"{device.plugin} plugin provides none (its FusedKernels.wgrad_accumulate is None): set "
                "gradient_accumulation_fusion=False (Megatron-LM: --no-gradient-accumulation-fusion)")
    else:
        def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
            kernel(total_input, grad_output, main_grad)

    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """``main_grad`` (fp32) += ``grad_output^T @ total_input``, summed in fp32."""
        accumulate(total_input, grad_output, main_grad)

    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """``main_grad`` (fp16/bf16) += ``grad_output^T @ total_input``, summed in fp32 and rounded once."""
        accumulate(total_input, grad_output, main_grad)

    for function in (wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16):
        function.__module__ = MODULE_NAME
        setattr(module, function.__name__, function)
    module.devshim_plugin = device.plugin  # type: ignore[attr-defined]  # for reports: whose kernel this is
    return module
