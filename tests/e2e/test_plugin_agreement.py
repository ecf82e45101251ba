"""Spec: every rank of a job runs on the same plugin, or the job stops at ``init_process_group`` naming the rank.

A node with other devshim plugins installed, or a variable the launcher did not forward, makes one rank select
differently. Rank 1 here selects the emulated Ascend plugin while rank 0 selects ``cpu_reference``; both can
build the same gloo group, so only devshim's check stands between them and a mixed job.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .launch import run_job
from .platforms import ASCEND, CPU, build_emulator

pytestmark = pytest.mark.e2e

JOB = Path(__file__).resolve().parent / "mismatched_plugin_job.py"


def test_a_rank_that_selected_another_plugin_than_rank_0_stops_naming_both(tmp_path):
    build_emulator()
    env = ASCEND.job_env({**ASCEND.two_devices_env, "DEVSHIM_PLUGIN": "cpu_reference"})
    job = run_job("torchrun", ["--rank1-plugin", ASCEND.plugin], tmp_path, env=env, script=JOB, report=False,
                  timeout_s=240)
    assert job.returncode not in (0, None), job.tail()
    assert ("devshim_core.integrations.torch_distributed.agreement.PluginMismatchError: rank 1 selected the ascend "
            "plugin (npu devices), but rank 0 selected cpu_reference (cpu devices): every rank of a job must use "
            "the same devshim plugin.") in job.stderr, job.tail()
    assert "passed the barrier" not in job.stdout


def test_ranks_on_the_same_plugin_pass_the_check(tmp_path):
    env = CPU.job_env({**CPU.two_devices_env, "DEVSHIM_PLUGIN": CPU.plugin})
    job = run_job("torchrun", ["--rank1-plugin", "cpu_reference"], tmp_path, env=env, script=JOB, report=False,
                  timeout_s=240)
    assert job.returncode == 0, job.tail()
    passed = set(re.findall(r"rank \d passed the barrier", job.stdout))  # two ranks' lines may interleave
    assert passed == {"rank 0 passed the barrier", "rank 1 passed the barrier"}, job.tail()
