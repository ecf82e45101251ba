"""Suite-wide guards: no test may JIT-compile a DeepSpeed op, every test sees devshim's defaults, and with
``DEVSHIM_REQUIRE_NATIVE=1`` (CI) a native library that did not build fails the run instead of skipping tests."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

import pytest

# --devshim-emulate / DEVSHIM_EMULATE, the devshim_emulated marker and the emulated_device fixture: devshim-emulation's
# pytest plugin, registered by its pytest11 entry point (loaded before any conftest, so the device is up first)

# A JIT build would land here; the session fixture below fails the run if anything did. Fresh for each session:
# an op left prebuilt in a shared directory would load without compiling, and the guard would not see it.
_EXTENSIONS = pathlib.Path(tempfile.mkdtemp(prefix="devshim-tests-torch-extensions-"))
os.environ["TORCH_EXTENSIONS_DIR"] = str(_EXTENSIONS)
_DEVSHIM_SWITCHES = ("DEVSHIM_PLUGIN", "DEVSHIM_DISABLED_PLUGINS", "DEVSHIM_DISABLE_PLUGIN_AUTOLOAD", "DEVSHIM_PLUGINS",
                     "DEVSHIM_PATCH_DEEPSPEED", "DEVSHIM_PATCH_MEGATRON", "DEVSHIM_AUTO", "DEVSHIM_CPU_DEVICE_COUNT",
                     "DEVSHIM_KERNELS_NATIVE", "DS_ACCELERATOR", "DEVSHIM_EMULATE_DEVICES",
                     "DEVSHIM_REQUIRE_DEVICE", "DEVSHIM_DETECT_TIMEOUT", "DEVSHIM_CUDA_FACADE", "DEVSHIM_MIGRATION_LOG")
for _name in _DEVSHIM_SWITCHES:
    os.environ.pop(_name, None)


def native_libraries_missing() -> list[str]:
    """Why each native library devshim builds at install (host Adam, row-wise kernels, file I/O, CUDA-redirect
    wrappers, the shared-memory collectives' barrier) is not usable here; empty when all five load."""
    from devshim_kernels import _native, file_io
    from devshim_kernels._native import rowwise

    from devshim_core.integrations.cuda_redirect import wrappers
    from devshim_core.integrations.torch_distributed import shm_segment

    missing = [reason for reason in (_native.REASON, rowwise.REASON, file_io.REASON) if reason]
    if not wrappers.NATIVE:
        missing.append("devshim_core.integrations.cuda_redirect._native did not import")
    if not shm_segment.NATIVE:
        missing.append("devshim_core.integrations.torch_distributed._shm_sync did not import")
    return missing


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("DEVSHIM_REQUIRE_NATIVE") == "1" and (missing := native_libraries_missing()):
        raise pytest.UsageError("DEVSHIM_REQUIRE_NATIVE=1, but a native library is not usable, so its tests would "
                                f"skip: {'; '.join(missing)}. Reinstall with a C compiler (make clean install).")


@pytest.fixture(scope="session", autouse=True)
def no_jit_compilation():
    yield
    built = sorted(str(p) for p in _EXTENSIONS.rglob("*"))
    assert not built, f"a DeepSpeed/torch extension was JIT-compiled during the tests: {built[:5]}"


def pytest_unconfigure(config: pytest.Config) -> None:
    with contextlib.suppress(OSError):  # left in place when something was built: the failure above names it
        _EXTENSIONS.rmdir()
