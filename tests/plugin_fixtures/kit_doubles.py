"""Plugins the conformance kit's specs run the kit on (``tests/test_conformance_kit.py``): host-CPU devices.

- ``one_device``: a selectable device that reports one device, as a 1-GPU machine does: the kit's 2-rank jobs must
  skip, saying why, and everything else run.
- ``cuda_kernels_on_host``: the CPU as a device, serving the ``cuda`` plugin's kernels (plain torch, so they run
  on host tensors): the kit's kernel checks hold them to ``devshim_kernels`` without a GPU.
"""

from __future__ import annotations

from devshim_core import DeviceReport, FusedKernels, OptimizerKernels, hookimpl
from plugin_fixtures import FakePlugin

one_device = FakePlugin(device_count=1, reason="a test double reporting one device, as a 1-GPU machine")


class _CudaKernelsOnHost(FakePlugin):
    @hookimpl
    def devshim_optimizer_kernels(self, report: DeviceReport) -> OptimizerKernels:
        import devshim_cuda

        return devshim_cuda.devshim_optimizer_kernels(report)

    @hookimpl
    def devshim_attention_kernels(self, report: DeviceReport) -> FusedKernels:
        import devshim_cuda

        return devshim_cuda.devshim_attention_kernels(report)


cuda_kernels_on_host = _CudaKernelsOnHost(device_count=1, reason="the host CPU serving the cuda plugin's kernels")
