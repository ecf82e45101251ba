"""Emulated vendor devices: test vendor code paths, and catch device mistakes, on a machine without the hardware.

``DEVSHIM_EMULATE=ascend`` (or ``sophgo``) puts simulated vendor SDKs on ``sys.path``: a ``torch_npu`` (or
Sophgo's ``torch_tpu``) whose import turns PyTorch's PrivateUse1 device into a real ``npu`` (``tpu``) device
backed by host memory, with several device indices, streams, events, pinned memory, the vendor's collective
backend (``hccl``/``sccl``) and the vendor's ops. The vendor plugins then detect and drive it with the same
code they run on hardware. Emulation is strictly opt-in: renaming PrivateUse1 changes
``torch.accelerator`` for the whole process, and only one device name can exist per process.

Plugin authors can emulate their own device: :func:`enable_device` under any name, and
:func:`~devshim_core.emulation.collectives.register_backend` for a backend name.

Nothing here is imported unless emulation is asked for; the C++ emulator is compiled on first use only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devshim_core.errors import ConfigError

#: vendor -> the device type its SDK registers
VENDORS = {"ascend": "npu", "sophgo": "tpu"}
#: vendor -> (import name, distribution metadata folder) of its simulated SDK
_SDKS = {"ascend": ("torch_npu", "torch_npu-2.13.0.dist-info"), "sophgo": ("torch_tpu", "torch_tpu-2.13.0.dist-info")}
SDK_PATH = Path(__file__).with_name("sdk")
EMULATE_ENV = "DEVSHIM_EMULATE"
DEVICES_ENV = "DEVSHIM_EMULATE_DEVICES"
DEFAULT_DEVICES = 8  # one node's worth, as on an 8-NPU Atlas server
DEVICE_MEMORY = 32 << 30  # what each emulated device reports as its capacity

_enabled: Any = None


class EmulationError(ConfigError):
    """Emulation was asked for in a way that cannot work; the message says what to change."""


def requested_vendor(environ: Any = None) -> str | None:
    """The vendor ``DEVSHIM_EMULATE`` names, or ``None`` when emulation is off."""
    env = os.environ if environ is None else environ
    raw = env.get(EMULATE_ENV, "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return None
    if raw not in VENDORS:
        raise EmulationError(f"{EMULATE_ENV}={env.get(EMULATE_ENV)!r} names no emulated vendor: use one of "
                             f"{', '.join(sorted(VENDORS))} (or unset it to run on real hardware).")
    return raw


def install_sdk(vendor: str) -> None:
    """Make the simulated SDK of ``vendor`` importable, as if the vendor's packages were installed.

    It only edits ``sys.path`` and the vendor's runtime-location variables; nothing is imported or built.
    """
    if vendor not in VENDORS:
        raise EmulationError(f"no simulated SDK for {vendor!r}; known: {', '.join(sorted(VENDORS))}")
    if not any(isinstance(f, _SimulatedSdkFinder) and f.package == _SDKS[vendor][0] for f in sys.meta_path):
        # last on the meta path: a real SDK, if one is installed, still wins
        sys.meta_path.append(_SimulatedSdkFinder(*_SDKS[vendor]))
        importlib.invalidate_caches()
    if vendor == "ascend":
        os.environ.setdefault("ASCEND_HOME_PATH", str(SDK_PATH / "cann"))


class _SimulatedSdkFinder(importlib.abc.MetaPathFinder):
    """Serves one vendor's simulated package and its distribution metadata, and nothing else: the other
    vendor's SDK stays invisible, as it would be on a machine of this vendor."""

    def __init__(self, package: str, dist_info: str) -> None:
        self.package = package
        self.distribution = importlib.metadata.PathDistribution(SDK_PATH / dist_info)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.package:
            return None  # its submodules are found through the package's own __path__
        return importlib.machinery.PathFinder.find_spec(fullname, [str(SDK_PATH)])

    def find_distributions(self, context: Any = None) -> Any:
        name = getattr(context, "name", None)
        wanted = self.distribution.metadata["Name"]
        if name is None or name.replace("_", "-").lower() == wanted.lower():
            yield self.distribution


def bring_up(vendor: str) -> Any:
    """Install ``vendor``'s simulated SDK and import it, which brings the emulated device up (building the
    emulator on a machine's first use). A build failure raises here, where it is the user's to fix, instead
    of reading as a broken vendor install in the plugin's detection."""
    install_sdk(vendor)
    return importlib.import_module(_SDKS[vendor][0])


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

    from devshim_core.emulation import build
    from devshim_core.emulation.device_module import EmulatedDeviceModule

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
    from devshim_core.emulation import build

    return build.load_extension().host_alias(tensor)
