"""Spec: with ``DEVSHIM_REQUIRE_NATIVE=1`` (CI sets it), a native library that did not build fails the test run at
start, naming why, instead of letting the tests of the native paths skip."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def collect(tmp_path: pathlib.Path, *plugin: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEVSHIM_REQUIRE_NATIVE": "1", "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", *plugin, "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_settings.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_native_library_that_did_not_build_fails_the_run_naming_why(tmp_path):
    # what a machine without a C compiler at install time would see
    (tmp_path / "unbuilt_adam.py").write_text("import devshim_kernels._native as n\nn.REASON = 'simulated: no _adam'\n")
    proc = collect(tmp_path, "-p", "unbuilt_adam")
    assert proc.returncode != 0
    assert "DEVSHIM_REQUIRE_NATIVE=1, but a native library is not usable" in proc.stderr
    assert "simulated: no _adam" in proc.stderr


def test_with_every_native_library_built_the_run_goes_ahead(tmp_path):
    proc = collect(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
