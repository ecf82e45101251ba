"""Tests that run inside an emulated vendor process: ``DEVSHIM_EMULATE=ascend pytest tests/emulated`` (or sophgo).

A process can emulate one PrivateUse1 device, and renaming it changes ``torch.accelerator`` for the whole
process, so these tests never run in the main suite's process: without emulation they are not collected,
and ``make test`` runs this folder once per vendor in a process of its own. The device is brought up by
devshim-emulation's pytest plugin (``devshim_emulation.pytest_plugin``, registered under pytest's ``pytest11``
entry point, so it is loaded, and the device up, before this conftest is imported).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import devshim_emulation as emulation
import pytest

VENDOR = emulation.requested_vendor()
if VENDOR is None:
    collect_ignore_glob = ["test_*.py"]
DEVICE_TYPE = emulation.VENDORS.get(VENDOR or "", "")


@pytest.fixture(scope="session")
def vendor() -> str:
    assert VENDOR is not None
    return VENDOR


@pytest.fixture(scope="session")
def device_type(emulated_device: object) -> str:
    return DEVICE_TYPE


PLUGIN_KERNELS = {"ascend": "devshim_ascend.kernels", "sophgo": "devshim_sophgo.kernels"}


@pytest.fixture(scope="module")
def plugin() -> ModuleType:
    """The emulated vendor's plugin kernel module (its FusedKernels and OptimizerKernels answers)."""
    return importlib.import_module(PLUGIN_KERNELS[VENDOR or ""])


def only(vendor_name: str) -> pytest.MarkDecorator:
    """Mark a test that exercises one vendor's API (the plugin's marker)."""
    return pytest.mark.devshim_emulated(vendor_name)
