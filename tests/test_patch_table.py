"""``devshim patches --markdown`` lists every applied patch from the registry, and docs/patches.md is its output."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.launch import REPO, job_env, venv_bin


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> str:
    result = subprocess.run([str(venv_bin("devshim")), "patches", "--markdown"], capture_output=True, text=True,
                            env=job_env(tmp_path_factory.mktemp("patches")), timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_the_table_has_a_row_for_every_declared_set_that_fires_on_the_cpu(table: str) -> None:
    sets = {line.split("|")[1].strip() for line in table.splitlines()[2:]}
    assert {"cuda-redirect", "deepspeed", "megatron-extension-modules", "megatron-core"} <= sets
    assert all(line.count("|") >= 6 for line in table.splitlines())  # set, patch, target, versions, why


def test_every_megatron_core_patch_names_its_version_range_and_a_reason(table: str) -> None:
    rows = [line.split("|") for line in table.splitlines()[2:] if line.split("|")[1].strip() == "megatron-core"]
    assert len(rows) >= 15
    for row in rows:
        assert re.fullmatch(r" megatron-core >=0\.\d+(\.\d+)?,<0\.\d+ ", row[4]), row  # one range: the set's or a gate
        assert len(row[5].strip()) > 20, row
    ranges = {row[4].strip() for row in rows}
    assert "megatron-core >=0.12.1,<0.17" in ranges and "megatron-core >=0.12.1,<0.13" in ranges, ranges


def test_docs_patches_md_is_the_generated_table(table: str) -> None:
    doc = (Path(REPO) / "docs" / "patches.md").read_text()
    assert table in doc, "docs/patches.md is stale: regenerate it with `.venv/bin/devshim patches --markdown`"
