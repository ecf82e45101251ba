"""Simulated ``torch.npu.amp`` (torch_npu's ``torch_npu.npu.amp``): the ``GradScaler`` and ``autocast`` that
Accelerate's ``get_grad_scaler`` and CUDA-style scripts reach as ``torch.npu.amp.*``, on torch's device-generic
``torch.amp``. Not Huawei's code."""

import torch


class GradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True):
        super().__init__("npu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)


class autocast(torch.amp.autocast_mode.autocast):
    def __init__(self, enabled=True, dtype=torch.float16, cache_enabled=True):
        super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


__all__ = ["GradScaler", "autocast"]
