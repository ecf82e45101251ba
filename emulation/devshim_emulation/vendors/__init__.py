"""What the emulation knows about each vendor, one module per vendor: :mod:`~devshim_emulation.vendors.ascend`,
:mod:`~devshim_emulation.vendors.sophgo`.

Each module declares the same names, so that nothing else branches on a vendor's name:

- ``NAME`` (``DEVSHIM_EMULATE``'s value), ``DEVICE_TYPE`` (the device its SDK registers), ``BACKEND`` (its collective
  library's ``torch.distributed`` name), ``SDK_PACKAGE`` and ``SDK_METADATA`` (the simulated SDK's import name and
  its distribution-metadata folder under ``devshim_emulation/sdk``), ``VISIBLE_DEVICES`` (the runtime's
  visible-devices variable);
- ``device_name()``, ``unsupported_dtypes()`` (what ``Tensor.<device>()`` refuses), ``prepare_environment(sdk_path)``
  (the runtime-location variables the vendor's software reads), ``collective_rules()`` (what its collective library
  refuses and how its adaptor narrows dtypes: a :class:`~devshim_emulation.collectives.VendorRules`).

Importing a vendor module imports neither torch nor devshim_core: ``DEVSHIM_EMULATE`` is validated against them in
processes that have imported neither yet.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: the vendors devshim emulates, each a module of this package
NAMES = ("ascend", "sophgo")


def get(name: str) -> ModuleType:
    """The module of vendor ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")


def device_types() -> dict[str, str]:
    """vendor -> the device type its SDK registers."""
    return {name: get(name).DEVICE_TYPE for name in NAMES}


def enable(name: str) -> ModuleType:
    """Bring up vendor ``name``'s emulated device and register its collective backend, as the import of the vendor's
    SDK does (the simulated SDKs call this first); returns the ``torch.<device>`` module."""
    from devshim_emulation.collectives import register_backend
    from devshim_emulation.device import enable_device, host_alias, visible_device_count

    vendor = get(name)
    module = enable_device(vendor.DEVICE_TYPE, device_count=lambda: visible_device_count(vendor.VISIBLE_DEVICES),
                           device_name=vendor.device_name(), unsupported_dtypes=vendor.unsupported_dtypes())
    register_backend(vendor.collective_rules(), host_alias)
    return module
