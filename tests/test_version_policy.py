"""Spec: ``docs/versions.md`` states the ranges the code declares and the versions CI installs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

from devshim_core import __version__
from devshim_core.cli import _supported
from devshim_core.integrations.torch_distributed import TORCH

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "versions.md").read_text()


def pinned(requirements: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}==(\S+)", (ROOT / requirements).read_text(), re.MULTILINE)
    assert match, f"{name} is not pinned in {requirements}"
    return match.group(1)


def test_the_support_table_row_of_this_release_is_what_the_code_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    supported = _supported()
    row = (f"| {__version__} (unreleased) | {project['requires-python']} | {TORCH.spec} | "
           f"{supported['deepspeed']} | {supported['megatron-core']} |")
    assert row in DOC, f"docs/versions.md lacks the row {row!r}"
    assert f"torch{TORCH.spec}" in project["dependencies"]
    assert project["version"] == __version__


def test_the_hf_libraries_ranges_and_tested_versions_are_the_ones_declared_and_installed():
    from devshim_core.integrations.huggingface.patches import ACCELERATE, TRANSFORMERS

    paragraph = " ".join(DOC.split("**HF Accelerate and transformers**", 1)[1].split("\n\n", 1)[0].split())
    assert f"Accelerate {ACCELERATE.spec} and transformers {TRANSFORMERS.spec}" in paragraph
    assert (f"CI runs Accelerate {pinned('requirements-dev.txt', 'accelerate')} and transformers "
            f"{pinned('requirements-dev.txt', 'transformers')}") in paragraph


def test_the_tested_versions_are_the_ones_ci_installs():
    tested = " ".join(DOC.split("**Tested in CI**", 1)[1].split("\n\n", 1)[0].split())
    oldest = re.search(r"^OLDEST_DEEPSPEED := (\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    oldest_megatron = re.search(r"^OLDEST_MEGATRON := (\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    expected = [f"Python {sys.version_info.major}.{sys.version_info.minor}",
                f"torch {pinned('requirements-dev.txt', 'torch')}",
                f"DeepSpeed {pinned('requirements-dev.txt', 'deepspeed')} and {oldest}",
                f"megatron-core {pinned('requirements-dev.txt', 'megatron-core')} and {oldest_megatron}"]
    for version in expected:
        assert version in tested, f"{version!r} is not named among the tested versions: {tested!r}"
