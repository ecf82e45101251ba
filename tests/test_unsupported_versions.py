"""An unsupported DeepSpeed is refused with an error that says what is installed and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def _fake_deepspeed(root: Path, version: str) -> None:
    """DeepSpeed ``version`` as pip installs it, found first on sys.path: its metadata, and a ``deepspeed`` package
    whose code says the same version (devshim goes by the code that runs: metadata alone does not count)."""
    info = root / f"deepspeed-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    package = root / "deepspeed"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "git_version_info_installed.py").write_text(f"version='{version}'\ngit_hash='unknown'\n")


def _run(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path), **env})


def test_auto_refuses_an_unsupported_deepspeed_with_an_actionable_message(tmp_path):
    _fake_deepspeed(tmp_path, "0.15.4")
    result = _run("""
        from devshim_core.errors import PatchError
        try:
            import devshim_core.auto
        except PatchError as exc:
            print(exc)
        else:
            raise SystemExit("an unsupported deepspeed was accepted")
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert "deepspeed 0.15.4 is installed" in message
    assert ">=0.16,<0.20" in message
    assert "DEVSHIM_PATCH_DEEPSPEED=0" in message


def test_the_deepspeed_integration_can_be_switched_off_to_run_beside_an_unsupported_version(tmp_path):
    _fake_deepspeed(tmp_path, "0.15.4")
    result = _run("""
        import devshim_core.auto
        print(devshim_core.auto.session.integrations["deepspeed"])
    """, tmp_path, DEVSHIM_PATCH_DEEPSPEED="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "skipped: DEVSHIM_PATCH_DEEPSPEED=0"
