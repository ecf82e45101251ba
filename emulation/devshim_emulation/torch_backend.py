"""devshim-emulation's ``torch.backends`` entry point: the emulated vendor SDK, for processes that never import
devshim.

PyTorch calls :func:`autoload` on ``import torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), the hook a real
vendor SDK such as ``torch_npu`` registers too; it exists only where devshim-emulation is installed. With
``DEVSHIM_EMULATE`` unset it reads that one variable and returns, having imported nothing but this module and its
(lazy) package: ``import torch`` never imports ``devshim_core`` for it. With ``DEVSHIM_EMULATE=ascend`` (or
``sophgo``) it makes the simulated SDK importable, as if the vendor's package were installed, so that a script
using DeepSpeed's own ``npu`` accelerator without devshim (the vendor-peer benchmark, the deepspeed launcher)
finds it. Nothing is built or imported here; a failure is one line on stderr, never a broken ``import torch``.
"""

import os
import sys


def autoload() -> None:
    if not os.environ.get("DEVSHIM_EMULATE", "").strip():
        return
    try:
        from devshim_emulation.sdks import install_sdk, requested_vendor

        vendor = requested_vendor()
        if vendor is not None:
            install_sdk(vendor)
    except Exception as exc:
        print(f"devshim: DEVSHIM_EMULATE is set but the simulated SDK was not installed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
