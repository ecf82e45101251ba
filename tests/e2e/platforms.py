"""The devices the end-to-end jobs run on: the host CPU, and the emulated Ascend ``npu`` and Sophgo ``tpu``.

Each emulated job is a process tree of its own (one PrivateUse1 device name per process) started with
``DEVSHIM_EMULATE``; the emulator is built once, before the first job, by :func:`build_emulator`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest


@dataclass(frozen=True)
class Platform:
    """What a job on this platform must show: its plugin, device type, collective backend and variables."""

    id: str
    plugin: str
    device_type: str
    backend: str
    visible_devices_env: str
    env: dict[str, str] = field(default_factory=dict)
    #: how the ``deepspeed`` launcher is told the node has 2 devices
    two_devices_env: dict[str, str] = field(default_factory=dict)

    @property
    def emulated(self) -> bool:
        return "DEVSHIM_EMULATE" in self.env

    def device_of_rank(self, local_rank: int) -> str:
        return "cpu" if self.device_type == "cpu" else f"{self.device_type}:{local_rank}"

    def job_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(self.env)
        if self.emulated and os.environ.get("DEVSHIM_CACHE_DIR"):
            env["DEVSHIM_CACHE_DIR"] = os.environ["DEVSHIM_CACHE_DIR"]  # jobs get no DEVSHIM_* from outside
        env.update(extra or {})
        return env


CPU = Platform("cpu", "cpu_reference", "cpu", "gloo", "DEVSHIM_CPU_VISIBLE_DEVICES",
               two_devices_env={"DEVSHIM_CPU_DEVICE_COUNT": "2"})
ASCEND = Platform("npu", "ascend", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", env={"DEVSHIM_EMULATE": "ascend"},
                  two_devices_env={"DEVSHIM_EMULATE_DEVICES": "2"})
SOPHGO = Platform("tpu", "sophgo", "tpu", "sccl", "TPU_VISIBLE_DEVICES", env={"DEVSHIM_EMULATE": "sophgo"},
                  two_devices_env={"DEVSHIM_EMULATE_DEVICES": "2"})
ALL = (CPU, ASCEND, SOPHGO)

_built: list[str] = []


def build_emulator() -> None:
    """Build (or find in the cache) the emulated device once per test session, in a child process: loading it
    here would register a PrivateUse1 backend in the test process itself."""
    if _built:
        return
    result = subprocess.run([sys.executable, "-c", "from devshim_emulation import build; build.load_extension()"],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"the emulated device did not build:\n{result.stdout}\n{result.stderr}")
    _built.append("built")
