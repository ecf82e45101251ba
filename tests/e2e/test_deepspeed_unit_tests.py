"""DeepSpeed's own unit tests, run from a DeepSpeed checkout with devshim active in every process they start.

Needs ``DEEPSPEED_SRC_PATH``: a checkout of deepspeedai/DeepSpeed (0.19.x; DeepSpeed's sdist does not ship its
tests). DeepSpeed's ``tests/conftest.py`` puts the checkout first on ``sys.path``, so the checkout's ``deepspeed``
is the one under test. Its distributed tests start their ranks with ``multiprocessing``, so devshim is switched on
by ``DEVSHIM_AUTO=1`` (the ``.pth`` start-up hook) rather than by an import line: every rank activates it first.
``DEVSHIM_CPU_DEVICE_COUNT=4`` gives the 4-rank tests their devices; ``DS_UNITTEST_TIMEOUT`` bounds DeepSpeed's
own wait for a rank that died (a pytest ``Failed`` kills a pool worker, which DeepSpeed's harness then awaits).

Each suite must pass at least its stated count, nothing may fail except ``EXPECTED_FAILURES`` (each with its
reason), and nothing may be compiled. Results and the reasons for what is not run: docs/deepspeed-unit-tests.md.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .launch import job_env
from .third_party import checkout, junit_outcome

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed", reason="DeepSpeed's unit tests need deepspeed's dependencies")

_DEVICE_IS_HOST = ("cpu_reference's device tensors are host tensors, so DeepSpeedCPUAdam has nothing to reject; "
                   "DeepSpeed's own CPU accelerator skips the test (it reports one device)")
EXPECTED_FAILURES = {
    "unit.ops.adam.test_cpu_adam.TestCPUAdamGPUError::test_cpu_adam_gpu_error": _DEVICE_IS_HOST,
}
# suite: (targets relative to the checkout's tests/, extra pytest arguments, minimum passed, timeout s).
# Counts measured on 2 cores (docs/deepspeed-unit-tests.md).
SUITES = {
    "accelerator": (("unit/v1/accelerator",), (), 11, 600),
    "adamw": (("unit/ops/adam/test_adamw.py",), (), 16, 900),
    # TestReal*/TestUneven*: the ones that load a Hugging Face model
    "checkpoint_reshape_autotp": (("unit/checkpoint/test_reshape_checkpoint.py",
                                   "unit/checkpoint/test_autotp_uc_checkpoint.py"),
                                  ("-k", "not TestReal and not TestUneven"), 40, 900),
    "zero_config_tiled_clip": (("unit/runtime/zero/test_zero_config.py", "unit/runtime/zero/test_zero_tiled.py",
                                "unit/runtime/zero/test_zero_grad_clip.py"), (), 16, 900),
    # slow: each case starts fresh ranks (minutes per suite on 2 cores)
    "zero": (("unit/v1/zero/test_zero.py",),
             ("-k", "TestZeroUnbalancedGradients or TestIncorectAllgatherBucketSize or TestZeroAdamOptimizerStepCount "
                    "or TestPartitionNcclAlignment or TestBF16OptimizerGradReduction"), 10, 1800),
    "moe_gating": (("unit/v1/moe/test_moe.py",), ("-k", "TestTopkGate or top1gating or topkgating or test_no_ep_group"),
                   11, 1800),
    "comm_init": (("unit/comm/test_dist.py",),
                  ("-k", "TestDistInitNoEnv or TestDistInitWithModel or (TestDistInit and test_no_init)"), 8, 1200),
}


def outcomes(report: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        found[f"{case.get('classname')}::{case.get('name')}"] = junit_outcome(case)
    return found


@pytest.mark.parametrize("suite", list(SUITES))
def test_deepspeed_unit_tests_pass_under_devshim(suite: str, tmp_path: Path) -> None:
    source = checkout("DEEPSPEED_SRC_PATH", "deepspeedai/DeepSpeed (0.19.x)", "tests/unit/common.py")
    targets, extra, min_passed, timeout_s = SUITES[suite]
    report = tmp_path / "junit.xml"
    env = job_env(tmp_path, {"DEVSHIM_AUTO": "1", "DEVSHIM_PLUGIN": "cpu_reference", "DEVSHIM_CPU_DEVICE_COUNT": "4",
                             "DEVSHIM_PATCH_MEGATRON": "0", "DS_UNITTEST_TIMEOUT": "120"})
    result = subprocess.run([sys.executable, "-m", "pytest", *targets, *extra, "-p", "no:cacheprovider", "-q",
                             f"--junitxml={report}"], cwd=source / "tests", env=env, capture_output=True, text=True,
                            timeout=timeout_s)
    assert report.exists(), f"no report\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    found = outcomes(report)
    counts = {k: sum(1 for v in found.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    print(f"{suite}: {counts}")
    unexpected = sorted(t for t, v in found.items() if v in ("failed", "error") and t not in EXPECTED_FAILURES)
    assert not unexpected, f"{suite}: unexpected failures {unexpected} ({counts})\n{result.stdout[-6000:]}"
    assert counts["passed"] >= min_passed, f"{suite}: {counts}\n{result.stdout[-4000:]}"
    compiled = sorted(str(p) for p in (tmp_path / "torch_extensions").rglob("*.so"))
    assert compiled == [], compiled
