"""devshim-emulation: emulated vendor devices, to test vendor code paths, and catch device mistakes, on a machine
without the hardware.

``DEVSHIM_EMULATE=ascend`` (or ``sophgo``) puts simulated vendor SDKs on ``sys.path``: a ``torch_npu`` (or
Sophgo's ``torch_tpu``) whose import turns PyTorch's PrivateUse1 device into a real ``npu`` (``tpu``) device
backed by host memory, with several device indices, streams, events, pinned memory, the vendor's collective
backend (``hccl``/``sccl``) and the vendor's ops, computed with plain torch (not ``devshim_kernels``, so that the
conformance kit compares two implementations). The vendor plugins then detect and drive it with the same code they
run on hardware. Emulation is strictly opt-in: renaming PrivateUse1 changes ``torch.accelerator`` for the whole
process, and only one device name can exist per process.

- :mod:`~devshim_emulation.sdks`: which vendor ``DEVSHIM_EMULATE`` names, and its simulated SDK made importable;
- :mod:`~devshim_emulation.vendors`: what the emulation knows about each vendor, one module per vendor;
- :mod:`~devshim_emulation.device`, :mod:`~devshim_emulation.device_module`, :mod:`~devshim_emulation.build`:
  the emulated device, its ``torch.<name>`` module, and the C++ emulator built once per machine (``csrc/``);
- :mod:`~devshim_emulation.collectives`: a vendor's collective backend, gloo on host aliases of device memory;
- :mod:`~devshim_emulation.hooks`: what devshim-core asks of its emulator (the ``devshim.emulation`` entry point);
- :mod:`~devshim_emulation.torch_backend`: the ``torch.backends`` entry point (``DEVSHIM_EMULATE`` in processes
  that never import devshim); :mod:`~devshim_emulation.pytest_plugin`: ``--devshim-emulate`` (``pytest11``).

Plugin authors can emulate their own device: :func:`enable_device` under any name, and
:func:`devshim_emulation.collectives.register_backend` for a backend name.

The names below are loaded on first use: the ``torch.backends`` entry point imports this package inside every
``import torch`` of the environment, where it must cost nothing unless ``DEVSHIM_EMULATE`` is set.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devshim_emulation.device import (
        DEFAULT_DEVICES,
        DEVICE_MEMORY,
        DEVICES_ENV,
        enable_device,
        enabled_device,
        host_alias,
        visible_device_count,
    )
    from devshim_emulation.errors import EmulationError
    from devshim_emulation.sdks import EMULATE_ENV, SDK_PATH, VENDORS, bring_up, install_sdk, requested_vendor

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("EMULATE_ENV", "SDK_PATH", "VENDORS", "bring_up", "install_sdk", "requested_vendor"),
                    "devshim_emulation.sdks"),
    **dict.fromkeys(("DEFAULT_DEVICES", "DEVICE_MEMORY", "DEVICES_ENV", "enable_device", "enabled_device",
                     "host_alias", "visible_device_count"), "devshim_emulation.device"),
    "EmulationError": "devshim_emulation.errors",
}

__all__ = [
    "DEFAULT_DEVICES",
    "DEVICES_ENV",
    "DEVICE_MEMORY",
    "EMULATE_ENV",
    "SDK_PATH",
    "VENDORS",
    "EmulationError",
    "__version__",
    "bring_up",
    "enable_device",
    "enabled_device",
    "host_alias",
    "install_sdk",
    "requested_vendor",
    "visible_device_count",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'devshim_emulation' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
