"""devshim's conformance kit: a pytest plugin that checks a devshim plugin against devshim's contracts.

A vendor runs it against its own plugin, on its own device::

    pytest --devshim-plugin=acme            # or: ini option  devshim_plugin = acme

It is registered under pytest's ``pytest11`` entry point, so installing ``devshim-core`` makes the option
available; it does nothing unless the option (or the ini value) names a plugin. With pytest's plugin
autoload off, load it with ``-p devshim_core.testing``. It then activates devshim in the pytest process with
that plugin forced (``DEVSHIM_PLUGIN``), as ``import devshim_core.auto`` would, and runs its suite
(``devshim_core/testing/suite``):

- ``test_hook_contract``: what each hook answered, against the hook specs;
- ``test_accelerator``: one expectation per abstract method of DeepSpeed's accelerator interface;
- ``test_kernels``: every kernel the plugin provides against ``devshim_kernels`` on the host, forward and
  backward, over layouts, masks and dtypes (an op the plugin does not provide is skipped, saying so);
- ``test_deepspeed_smoke`` and ``test_megatron_smoke``: 2-rank jobs under ``torchrun``, matched against a
  single-process PyTorch reference on the host; skipped, saying why, where the plugin reports fewer than 2 devices
  (a 1-GPU machine), everything else still checked.

The kit checks devshim's facade, so it sets ``DEVSHIM_CUDA_FACADE=1`` before it activates: on a CUDA device, where
devshim would otherwise stand aside, DeepSpeed then runs on devshim's accelerator and op builders (the plugin's
kernels), in the pytest process and in the jobs. Megatron keeps its own CUDA paths there either way.

The kit's suite replaces the test paths pytest would have collected (``testpaths``, the current directory);
paths given on the command line are collected as well. Everything the kit launches inherits the environment,
so a device that needs a switch to appear (``DEVSHIM_EMULATE=ascend``) is set up the same way in the jobs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

SUITE = Path(__file__).parent / "suite"
OPTION = "--devshim-plugin"
INI = "devshim_plugin"
CUDA_FACADE = "DEVSHIM_CUDA_FACADE"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("devshim", "devshim's plugin conformance kit")
    group.addoption(OPTION, default=None, metavar="NAME",
                    help="run devshim's conformance kit against the devshim plugin NAME (its entry-point name)")
    parser.addini(INI, default=None, help="the devshim plugin the conformance kit checks (like --devshim-plugin)")


def plugin_under_test(config: pytest.Config) -> str | None:
    """The plugin named by ``--devshim-plugin`` or the ini option, or ``None`` (the kit is off)."""
    name = str(config.getoption(OPTION) or config.getini(INI) or "").strip()
    return name or None


def pytest_configure(config: pytest.Config) -> None:
    name = plugin_under_test(config)
    if name is None:
        return
    # the directory, not its files: node ids are then relative to it (test_kernels.py::...), where a file given
    # alone would have an empty path; the suite is a package, so its modules never clash with a vendor's
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(str(SUITE))
    else:  # testpaths or the current directory: the vendor asked for the kit, not for its own tests
        config.args[:] = [str(SUITE)]
    os.environ["DEVSHIM_PLUGIN"] = name  # the jobs the kit launches select the same plugin
    # on a CUDA device devshim stands aside unless asked: the kit checks devshim's accelerator and op builders, so it
    # asks, for this process and the jobs it launches (no effect on any other device type)
    os.environ[CUDA_FACADE] = "1"
    _activate(name)


def _activate(name: str) -> None:
    from devshim_core import api
    from devshim_core.errors import DevshimError

    try:
        info = api.activate()
    except DevshimError as exc:
        raise pytest.UsageError(f"devshim's conformance kit could not activate plugin {name!r}:\n{exc}") from exc
    if info.plugin != name:  # an activation earlier in this process (a conftest) chose another plugin
        raise pytest.UsageError(f"devshim was already active with plugin {info.plugin!r} in this process before the "
                                f"kit could force {name!r}; remove the earlier `import devshim_core.auto`")
    from devshim_core import session

    active = session.current()
    if info.device_type == "cuda" and active is not None and not getattr(active.settings, "cuda_facade", True):
        raise pytest.UsageError(f"devshim was already active on {name!r} in this process, standing aside for CUDA, "
                                f"before the kit could set {CUDA_FACADE}=1 (DEVSHIM_AUTO=1 activates it at start-up): "
                                f"set {CUDA_FACADE}=1 too, or unset DEVSHIM_AUTO, so that the kit checks devshim's "
                                "DeepSpeed accelerator")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if plugin_under_test(config) is not None and not any(SUITE in item.path.parents for item in items):
        raise pytest.UsageError(f"devshim's conformance kit collected none of its tests from {SUITE}: does the "
                                "ini option python_files exclude its test_*.py files?")


def pytest_report_header(config: pytest.Config) -> list[str]:
    name = plugin_under_test(config)
    if name is None:
        return []
    from devshim_core import api

    info = api.active_session()
    if info is None:
        return [f"devshim conformance kit: plugin {name!r} (not active)"]
    lines = [f"devshim conformance kit: plugin {info.plugin!r} on {info.device_type} "
             f"x{info.device['device_count']}, backend {info.device['backend']}"]
    if info.emulation:
        lines.append(info.emulation)
    return lines


@pytest.fixture(scope="session")
def devshim_plugin_name(request: pytest.FixtureRequest) -> str:
    """The plugin under test; the kit's tests skip when the kit is off."""
    name = plugin_under_test(request.config)
    if name is None:
        pytest.skip(f"devshim's conformance kit is off: pass {OPTION}=NAME")
    return name


@pytest.fixture(scope="session")
def devshim_session(devshim_plugin_name: str) -> Any:
    """The active session (``devshim_core.session.Session``), with the plugin under test selected."""
    from devshim_core import session

    active = session.current()
    assert active is not None and active.selection.plugin.name == devshim_plugin_name
    return active


@pytest.fixture(scope="session")
def devshim_device(devshim_session: Any) -> Any:
    """The device facade built from the plugin's hook answers (``devshim_core.device.Device``)."""
    return devshim_session.device
