"""Spec: how devshim's conformance kit (``devshim_core.testing``) is switched on, and what it collects.

Each spec runs pytest in a fresh process in an empty directory holding one test of its own, as a vendor's
repository would. (The kit's checks themselves run in ``make test-conformance`` on devshim's three plugins, and
on a third-party plugin in ``test_third_party_plugin.py``; on the ``cuda`` plugin where a GPU is,
``release/gpu_check.sh``.) What the kit does on a 1-device machine, and the ``cuda`` plugin's kernels under the kit's
kernel checks, are specified here on host-CPU test doubles (``plugin_fixtures.kit_doubles``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from plugin_fixtures import PYTHON, TESTS_DIR, clean_env, run, write_distribution

KIT_MODULES = {"test_accelerator.py", "test_deepspeed_smoke.py", "test_hook_contract.py", "test_kernels.py",
               "test_megatron_smoke.py"}


@pytest.fixture
def vendor_repo(tmp_path: Path) -> Path:
    (tmp_path / "test_own.py").write_text("def test_own():\n    assert 1 + 1 == 2\n")
    (tmp_path / "conftest.py").write_text(  # the vendor's own conftest: says whether devshim is active, and how
        "import os\n\nimport devshim_core\nfrom devshim_core import session as devshim_session\n\n\n"
        "def pytest_collection_finish(session):\n"
        "    print('devshim active:', devshim_core.active_session() is not None)\n"
        "    active = devshim_session.current()\n"
        "    print('cuda facade:', os.environ.get('DEVSHIM_CUDA_FACADE'),\n"
        "          getattr(active.settings, 'cuda_facade', None) if active else None)\n")
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


def test_the_kit_asks_for_devshims_facade_on_cuda_before_it_activates(vendor_repo: Path):
    """On a CUDA device devshim stands aside unless DEVSHIM_CUDA_FACADE=1; the kit checks the facade, so it sets the
    switch before activating, for itself and for the jobs it launches (no effect on other device types)."""
    code, output = collect(vendor_repo, "--devshim-plugin=cpu_reference")
    assert code == 0, output
    assert "cuda facade: 1 True" in output


# -- the kit on test doubles ---------------------------------------------------------------------------------------

DOUBLES = "plugin_fixtures.kit_doubles"


@pytest.fixture(scope="module")
def doubles_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory where the kit's test-double plugins are installed distributions (found by entry point)."""
    site = tmp_path_factory.mktemp("kit-doubles-site")
    write_distribution(site, "devshim-kit-doubles", "0.0.1", {
        "one_device": f"{DOUBLES}:one_device", "cuda_kernels_on_host": f"{DOUBLES}:cuda_kernels_on_host"})
    return site


def run_kit(site: Path, workdir: Path, plugin: str, *args: str) -> tuple[int, str]:
    done = run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", f"--devshim-plugin={plugin}", *args],
               clean_env(pythonpath=[site, TESTS_DIR]), cwd=workdir, timeout=600)
    return done.returncode, done.stdout + done.stderr


def test_on_a_one_device_machine_the_2_rank_jobs_skip_saying_why(doubles_site: Path, tmp_path: Path):
    code, output = run_kit(doubles_site, tmp_path, "one_device", "-k", "smoke")
    assert code == 0, output
    reasons = re.findall(r"^SKIPPED \[(\d+)\] \S+test_(deepspeed|megatron)_smoke\.py:\d+: (.*)$", output, re.MULTILINE)
    assert {(job, reason) for _, job, reason in reasons} == {
        (job, f"the 2-rank run needs 2 cpu devices; plugin 'one_device' reports 1 (the {job}_smoke job runs where 2 "
              "or more are visible)") for job in ("deepspeed", "megatron")}, output
    assert sum(int(n) for n, _, _ in reasons) == 5, output  # 2 DeepSpeed checks, 3 Megatron checks
    assert re.search(r"\b5 skipped\b", output) and "failed" not in output, output


def test_the_cuda_plugins_kernels_pass_the_kits_kernel_checks_on_host_tensors(doubles_site: Path, tmp_path: Path):
    """The kit holds a plugin's kernels to devshim_kernels; the cuda plugin's are plain torch, so the same checks run
    on the host here (on a GPU, release/gpu_check.sh runs them on the device)."""
    code, output = run_kit(doubles_site, tmp_path, "cuda_kernels_on_host", "-k", "test_kernels.py")
    assert code == 0, output
    summary = re.search(r"(\d+) passed(?:, (\d+) skipped)?", output)
    assert summary and int(summary.group(1)) >= 100 and summary.group(2) is None, output
