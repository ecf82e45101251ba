"""Suite-wide guards: no test may JIT-compile a DeepSpeed op, and every test sees devshim's defaults."""

from __future__ import annotations

import os
import pathlib

import pytest

# --devshim-emulate / DEVSHIM_EMULATE, the devshim_emulated marker and the emulated_device fixture
pytest_plugins = ["devshim_core.emulation.pytest_plugin"]

# A JIT build would land here; the session fixture below fails the run if anything did.
_EXTENSIONS = pathlib.Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/devshim-tests-torch-extensions"))
_DEVSHIM_SWITCHES = ("DEVSHIM_PLUGIN", "DEVSHIM_DISABLED_PLUGINS", "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD", "DEVSHIM_PLUGINS",
                     "DEVSHIM_PATCH_DEEPSPEED", "DEVSHIM_PATCH_MEGATRON", "DEVSHIM_AUTO", "DEVSHIM_CPU_DEVICE_COUNT",
                     "DEVSHIM_KERNELS_NATIVE", "DS_ACCELERATOR", "DEVSHIM_EMULATE_DEVICES")
for _name in _DEVSHIM_SWITCHES:
    os.environ.pop(_name, None)


@pytest.fixture(scope="session", autouse=True)
def no_jit_compilation():
    before = set(_EXTENSIONS.rglob("*")) if _EXTENSIONS.exists() else set()
    yield
    after = set(_EXTENSIONS.rglob("*")) if _EXTENSIONS.exists() else set()
    built = sorted(str(p) for p in after - before)
    assert not built, f"a DeepSpeed/torch extension was JIT-compiled during the tests: {built[:5]}"
