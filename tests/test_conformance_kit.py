"""Spec: how devshim's conformance kit (``devshim_core.testing``) is switched on, and what it collects.

Each spec runs pytest in a fresh process in an empty directory holding one test of its own, as a vendor's
repository would. (The kit's checks themselves run in ``make test-conformance`` on devshim's three plugins, and
on a third-party plugin in ``test_third_party_plugin.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from plugin_fixtures import PYTHON, clean_env, run

KIT_MODULES = {"test_accelerator.py", "test_deepspeed_smoke.py", "test_hook_contract.py", "test_kernels.py",
               "test_megatron_smoke.py"}


@pytest.fixture
def vendor_repo(tmp_path: Path) -> Path:
    (tmp_path / "test_own.py").write_text("def test_own():\n    assert 1 + 1 == 2\n")
    (tmp_path / "conftest.py").write_text(  # the vendor's own conftest: says whether devshim is active
        "import devshim_core\n\n\ndef pytest_collection_finish(session):\n"
        "    print('devshim active:', devshim_core.active_session() is not None)\n")
    return tmp_path


def collect(repo: Path, *args: str, **env: str) -> tuple[int, str]:
    done = run([PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
               clean_env(**env), cwd=repo, timeout=300)
    return done.returncode, done.stdout + done.stderr


def modules(output: str) -> set[str]:
    return {Path(m).name for m in re.findall(r"^(\S+\.py)::", output, re.MULTILINE)}


def test_without_a_plugin_named_the_kit_collects_nothing_and_activates_nothing(vendor_repo: Path):
    code, output = collect(vendor_repo)
    assert code == 0, output
    assert modules(output) == {"test_own.py"}
    assert "devshim active: False" in output


def test_naming_a_plugin_collects_the_kit_instead_of_the_directory(vendor_repo: Path):
    code, output = collect(vendor_repo, "--devshim-plugin=cpu_reference")
    assert code == 0, output
    assert modules(output) == KIT_MODULES
    assert "test_the_accelerator_method_behaves_as_declared[device_count]" in output
    assert "devshim active: True" in output


def test_paths_given_on_the_command_line_are_collected_beside_the_kit(vendor_repo: Path):
    code, output = collect(vendor_repo, "--devshim-plugin=cpu_reference", "test_own.py")
    assert code == 0, output
    assert modules(output) == KIT_MODULES | {"test_own.py"}


def test_the_ini_option_names_the_plugin_too(vendor_repo: Path):
    (vendor_repo / "pytest.ini").write_text("[pytest]\ndevshim_plugin = cpu_reference\n")
    code, output = collect(vendor_repo)
    assert code == 0, output
    assert modules(output) == KIT_MODULES


def test_a_plugin_that_cannot_be_selected_is_a_usage_error_naming_it_and_the_installed_ones(vendor_repo: Path):
    code, output = collect(vendor_repo, "--devshim-plugin=acme")
    assert code == 4, output  # pytest's usage error: nothing ran
    assert "devshim's conformance kit could not activate plugin 'acme'" in output
    assert "cpu_reference" in output  # the selection error lists what is installed


def test_a_python_files_setting_that_hides_the_kits_modules_is_a_usage_error(vendor_repo: Path):
    (vendor_repo / "pytest.ini").write_text("[pytest]\npython_files = check_*.py\n")
    code, output = collect(vendor_repo, "--devshim-plugin=cpu_reference")
    assert code == 4, output
    assert "collected none of its tests" in output and "python_files" in output
