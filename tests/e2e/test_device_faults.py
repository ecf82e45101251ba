"""Spec: a fault after selection fails the job clearly, on every rank, and leaves nothing half patched.

The emulated ``npu`` fails to set up one device index (``DEVSHIM_EMULATE_FAULTY_DEVICES=1``), as a vendor runtime
fails on a broken or busy device. The rank given that device gets devshim's ``DeviceSetupError`` naming its rank,
the device, the plugin and the visible-devices variable, with the runtime's words; the launcher then ends the
other rank, and every process exits long before any collective timeout.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from devshim_emulation.device_module import FAULTY_DEVICES_ENV

from .launch import run_job
from .platforms import ASCEND, build_emulator
from .test_hung_collective import processes_with

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

JOB = Path(__file__).resolve().parent / "device_fault_job.py"
WALL_LIMIT_S = 120  # start-up and teardown on a loaded machine; DeepSpeed's collective timeout is 10 minutes


def test_a_rank_whose_device_fails_to_set_up_fails_clearly_and_every_rank_exits(tmp_path):
    build_emulator()
    marker = f"fault-{uuid.uuid4().hex}"
    env = ASCEND.job_env({**ASCEND.two_devices_env, "DEVSHIM_PLUGIN": ASCEND.plugin, FAULTY_DEVICES_ENV: "1"})
    job = run_job("torchrun", ["--marker", marker], tmp_path, env=env, script=JOB, report=False,
                  timeout_s=WALL_LIMIT_S * 2)
    assert job.returncode not in (0, None), job.tail()
    assert "rank 0 trained a step" not in job.stdout  # rank 0 never got past the collectives rank 1 missed
    assert ("devshim_core.errors.DeviceSetupError: rank 1 (local rank 1): the ascend plugin's runtime could not set "
            "up npu device 1: RuntimeError: npu runtime: initializing device 1 failed (emulated fault: "
            f"{FAULTY_DEVICES_ENV}='1'). This process sees 2 npu device(s); ") in job.stderr, job.tail()
    [state] = [json.loads(line) for line in job.stderr.splitlines() if line.startswith('{"rank": 1')]
    # the failing rank's patch sets: each one whole, every patch it declares applied
    assert {"cuda-redirect", "torch.distributed-exit", "torch.distributed-timeouts"} <= set(state["applied"]), state
    assert any(name.startswith("deepspeed") for name in state["applied"]), state
    assert all(declared == applied for declared, applied in state["applied"].values()), state
    assert job.elapsed_s < WALL_LIMIT_S, job.tail()
    assert processes_with(marker) == [], "ranks outlived their launcher"
