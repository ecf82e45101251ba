"""pytest support for emulated devices: ``pytest --devshim-emulate=ascend``.

Registered under pytest's ``pytest11`` entry point by devshim-emulation (named after this module, so that
``-p devshim_emulation.pytest_plugin``, with pytest's plugin autoload off, finds it registered, not twice):
installing the emulator is all a test suite needs.

- ``--devshim-emulate=VENDOR`` (or ``DEVSHIM_EMULATE=VENDOR`` in the environment) brings the vendor's emulated
  device up before collection, in the pytest process, and exports the variable so that the jobs a test
  launches emulate the same vendor.
- ``@pytest.mark.devshim_emulated("ascend")`` runs a test only in a process that emulates that vendor (a
  process can emulate one device name), and skips it, saying why, elsewhere.
- The ``emulated_device`` fixture is the emulated ``torch.<device>`` module; it skips without emulation.

Nothing happens unless emulation is asked for.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import devshim_emulation as emulation


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--devshim-emulate", default=None, choices=sorted(emulation.VENDORS),
                     help="emulate this vendor's device in the test process (same as DEVSHIM_EMULATE)")


def emulated_vendor(config: pytest.Config) -> str | None:
    return config.getoption("--devshim-emulate") or emulation.requested_vendor()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "devshim_emulated(vendor): run only where this vendor's device is emulated")
    vendor = emulated_vendor(config)
    if vendor is None:
        return
    os.environ[emulation.EMULATE_ENV] = vendor  # launched jobs emulate the same vendor
    emulation.bring_up(vendor)


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("devshim_emulated")
    if marker is None:
        return
    wanted = marker.args[0]
    vendor = emulated_vendor(item.config)
    if vendor != wanted:
        pytest.skip(f"needs the emulated {wanted} device; this process "
                    f"{'emulates ' + vendor if vendor else 'emulates no device'}")


@pytest.fixture(scope="session")
def emulated_device(pytestconfig: pytest.Config) -> Any:
    """The emulated device's ``torch.<device>`` module."""
    if emulated_vendor(pytestconfig) is None:
        pytest.skip("no emulated device: run with --devshim-emulate=VENDOR or DEVSHIM_EMULATE=VENDOR")
    return emulation.enabled_device()
