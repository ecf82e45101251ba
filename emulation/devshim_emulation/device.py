"""The emulated device: PyTorch's PrivateUse1 device renamed (``npu``, ``tpu``, or a plugin author's own name) and
backed by the compiled emulator (:mod:`devshim_emulation.build`), with its ``torch.<name>`` module
(:mod:`devshim_emulation.device_module`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from devshim_emulation.errors import EmulationError

DEVICES_ENV = "DEVSHIM_EMULATE_DEVICES"
DEFAULT_DEVICES = 8  # one node's worth, as on an 8-NPU Atlas server
DEVICE_MEMORY = 32 << 30  # what each emulated device reports as its capacity

_enabled: Any = None


def visible_device_count(variable: str) -> int:
    """How many emulated devices this process sees: ``DEVSHIM_EMULATE_DEVICES`` (default 8), narrowed by the
    vendor's visible-devices variable as the real runtime narrows it."""
    raw = os.environ.get(DEVICES_ENV, "").strip()
    if raw and (not raw.isdigit() or not 1 <= int(raw) <= 64):
        raise EmulationError(f"{DEVICES_ENV}={raw!r} must be a device count from 1 to 64.")
    physical = int(raw) if raw else DEFAULT_DEVICES
    visible = os.environ.get(variable, "").strip()
    if not visible:
        return physical
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    bad = [i for i in ids if not i.isdigit() or int(i) >= physical]
    if bad:
        raise EmulationError(f"{variable}={visible!r} names devices {', '.join(bad)} that the emulated node does not "
                             f"have (it has {physical}: 0..{physical - 1}; set {DEVICES_ENV} for more).")
    return len(ids)


def enable_device(name: str, *, device_count: int | Callable[[], int], device_name: str, bf16: bool = True,
                  unsupported_dtypes: tuple[Any, ...] = ()) -> Any:
    """Turn PyTorch's PrivateUse1 device into the emulated device ``name``; return its ``torch.<name>`` module.

    ``device_count`` may be a function (of the visible-devices variable, say): the module then counts again at
    each ``device_count()`` until the process first sets a device, as a runtime that initializes lazily counts
    (CUDA reads CUDA_VISIBLE_DEVICES then, so a launcher may still change the variable before). Idempotent for the
    same name. A process has one PrivateUse1 name: asking for another raises.
    """
    global _enabled
    import torch

    if _enabled is not None:
        if _enabled.type != name:
            raise EmulationError(f"this process already emulates the {_enabled.type!r} device; PyTorch allows one "
                                 f"PrivateUse1 device per process, so {name!r} needs a process of its own.")
        return _enabled
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", name):
        raise EmulationError(f"PyTorch's PrivateUse1 device is already {current!r} in this process (another "
                             f"backend registered it), so it cannot be emulated as {name!r}.")

    from devshim_emulation import build
    from devshim_emulation.device_module import EmulatedDeviceModule

    extension = build.load_extension()
    recount = device_count if callable(device_count) else None
    extension.configure(recount() if recount else device_count, DEVICE_MEMORY)
    if current != name:
        torch.utils.rename_privateuse1_backend(name)
    module = EmulatedDeviceModule(name, extension, device_name=device_name, bf16=bf16, recount=recount)
    torch._register_device_module(name, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_packed_sequence=True,
                                                         for_storage=True, unsupported_dtype=list(unsupported_dtypes))
    _enabled = module
    return module


def enabled_device() -> Any:
    """The emulated device module of this process, or ``None``."""
    return _enabled


def host_alias(tensor: Any) -> Any:
    """A CPU tensor sharing an emulated-device tensor's memory (zero-copy)."""
    from devshim_emulation import build

    return build.load_extension().host_alias(tensor)
