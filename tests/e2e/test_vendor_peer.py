"""The same DeepSpeed training through devshim's ascend plugin and through DeepSpeed's own ``NPU_Accelerator``.

Two 2-rank ``torchrun`` jobs of ``examples/train_gpt.py`` (ZeRO-2, fp32, DeepSpeed's FusedAdam, 10 steps), both
on devshim's emulated ``npu`` device (``DEVSHIM_EMULATE=ascend``; not Ascend hardware):

- devshim: the script's ``import devshim_core.auto`` selects the ascend plugin, whose accelerator DeepSpeed uses;
- the peer: the script without that line (``DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM=1``) and ``DS_ACCELERATOR=npu``, so
  DeepSpeed runs its own ``accelerator/npu_accelerator.py`` and ``ops/op_builder/npu`` on the simulated
  ``torch_npu``. For this config the peer loads one op, ``FusedAdamBuilder``, whose ``load()`` returns a Python
  class stepping with ``torch._fused_adamw_``: nothing to compile.

Both jobs must succeed, each must really have run the accelerator it stands for (on ``npu:<local rank>``, over
``hccl``), neither may compile anything, and the losses must agree. They are not bit-identical kernels: the
forward and backward are the same ops on the same device, but the optimizer step differs (devshim's FusedAdamOp
calls ``torch_npu.npu_apply_adam_w``, the vendor formula ``sqrt(v / bc2) + eps`` composed of device ops; the
peer calls torch's fused AdamW kernel, ``sqrt(v) / sqrt(bc2) + eps``), so parameters may differ in the last
bit after a step. Measured: the first losses are equal (same seed, same forward), and over 10 steps the largest
relative difference was 1.0e-7, one float32 ulp of the loss at step 3. ``LOSS_RTOL = 1e-5`` leaves 100x that
for other machines' rounding and stays three orders of magnitude below one step's progress (the loss falls by
2-4% a step), so a skipped, repeated or differently scaled optimizer step could not pass.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from .launch import Job, assert_loss_fell, run_job
from .platforms import ASCEND, build_emulator
from .test_deepspeed_training import assert_trained_through_devshim

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="the end-to-end runs need the deepspeed extra")

STEPS = 10
ARGS = ["--zero-stage", "2", "--steps", str(STEPS)]  # fp32: the script's default precision
PEER_ENV = {"DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM": "1", "DS_ACCELERATOR": "npu"}
LOSS_RTOL = 1e-5
LOSS_DROP = 0.5  # as in test_deepspeed_training: these runs fall by 1.2-1.4 nats in 10 steps


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    build_emulator()
    tmp = tmp_path_factory.mktemp("vendor-peer")
    return {"devshim": run_job("torchrun", ARGS, tmp / "devshim", env=ASCEND.job_env()),
            "peer": run_job("torchrun", ARGS, tmp / "peer", env=ASCEND.job_env(PEER_ENV))}


def _report(job: Job) -> dict[str, Any]:
    # the peer runs without devshim, so without its exit fix: PyTorch's exit abort is not the peer's failure
    report = job.report(tolerate_upstream_exit_abort=job.env.get("DEVSHIM_EXAMPLE_WITHOUT_DEVSHIM") == "1")
    assert report["rank_count"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1], job.tail()
    assert report["zero_stage"] == 2 and report["optimizer"] == "DeepSpeedZeroOptimizer", job.tail()
    assert all(r["param_dtype"] == "torch.float32" for r in report["ranks"]), job.tail()
    return report


def test_devshim_trains_through_its_ascend_plugin(jobs: dict[str, Job]) -> None:
    job = jobs["devshim"]
    report = _report(job)
    assert_trained_through_devshim(job, report, optimizer_op="FusedAdamOp", platform=ASCEND)
    assert_loss_fell(report["losses"], STEPS, LOSS_DROP, job)


def test_the_peer_trains_on_deepspeeds_own_npu_accelerator(jobs: dict[str, Job]) -> None:
    """DeepSpeed's NPU_Accelerator, not devshim's, ran every rank, on its own npu index over hccl, and devshim's
    import line never ran; its FusedAdam came from DeepSpeed's NPU builder (no devshim op) and compiled nothing."""
    job = jobs["peer"]
    report = _report(job)
    context = f"\nreport: {report}\n{job.tail()}"
    assert "devshim: not imported; accelerator NPU_Accelerator" in job.stdout, context
    assert report["accelerator_module"] == "deepspeed.accelerator.npu_accelerator", context
    assert report["backend"] == "hccl", context
    for rank in report["ranks"]:
        own = f"npu:{rank['local_rank']}"
        assert rank["accelerator"] == "NPU_Accelerator" and rank["plugin"] is None, context
        assert rank["deepspeed_integration"] is None, context
        assert rank["dist_backend"] == "hccl", context
        assert rank["current_device"] == rank["local_rank"], context
        assert rank["device"] == own and rank["param_devices"] == [own] and rank["grad_devices"] == [own], context
        assert rank["optimizer_state_devices"] == [own], context
        assert rank["basic_optimizer"] == "FusedAdam" and rank["fused_op"] == "NoneType", context
    assert job.compiled_extensions() == [], f"the peer JIT-compiled: {job.compiled_extensions()}{context}"
    assert_loss_fell(report["losses"], STEPS, LOSS_DROP, job)


def test_both_compute_the_same_losses(jobs: dict[str, Job]) -> None:
    ours, peer = (_report(jobs[name])["losses"] for name in ("devshim", "peer"))
    assert len(ours) == len(peer) == STEPS, (ours, peer)
    assert ours[0] == peer[0], f"the first step (before any optimizer step) differs: {ours[0]} vs {peer[0]}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, peer, strict=True))
    assert worst <= LOSS_RTOL, (f"devshim's losses differ from the peer's by {worst:.2e} (> {LOSS_RTOL:.0e}):\n"
                                f"  devshim: {ours}\n  peer:    {peer}")
    assert all(math.isfinite(x) for x in ours + peer)
