"""Spec: every devshim distribution declares the metadata a release needs, and the seven agree with each other
and with the version ranges devshim's code enforces at run time.

Read from the pyproject.toml files, so it is cheap; ``release/check_wheels.py`` checks the same on built and
installed wheels.
"""

from __future__ import annotations

import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from plugin_fixtures import PROJECT_DIR

from devshim_core.integrations.deepspeed.patches import DEEPSPEED
from devshim_core.integrations.megatron.flavor import MEGATRON_CORE
from devshim_core.integrations.torch_distributed import TORCH

PLUGINS = ("plugins/cpu_reference", "plugins/ascend", "plugins/sophgo", "plugins/cuda")
DIRECTORIES = (".", "kernels", *PLUGINS, "emulation")
PYTHON_CLASSIFIER = re.compile(r"Programming Language :: Python :: (3\.\d+)$")


def pyproject(directory: str) -> dict:
    return tomllib.loads((PROJECT_DIR / directory / "pyproject.toml").read_text())


PROJECTS = {directory: pyproject(directory)["project"] for directory in DIRECTORIES}
VERSIONS = {project["name"]: Version(project["version"]) for project in PROJECTS.values()}


def requirements(project: dict) -> list[Requirement]:
    extras = [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return [Requirement(r) for r in [*project.get("dependencies", []), *extras]]


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_each_distribution_declares_what_a_release_needs(directory):
    project = PROJECTS[directory]
    for key in ("name", "version", "description", "readme", "requires-python", "authors", "keywords",
                "classifiers"):
        assert project.get(key), f"{directory}/pyproject.toml: no {key}"
    assert (PROJECT_DIR / directory / project["readme"]).is_file()
    assert "dynamic" not in project  # nothing left for the build backend to fill in


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_each_distribution_is_apache_2_and_ships_the_license_text(directory):
    project = PROJECTS[directory]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not the legacy table
    assert project["license-files"] == ["LICENSE"]  # relative to the distribution: each ships its own copy
    assert (PROJECT_DIR / directory / "LICENSE").read_bytes() == (PROJECT_DIR / "LICENSE").read_bytes()
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]  # PEP 639 forbids both
    # setuptools reads `license` as an SPDX expression and knows `license-files` from 77 on
    [setuptools] = [Requirement(r) for r in pyproject(directory)["build-system"]["requires"]
                    if Requirement(r).name == "setuptools"]
    assert "76.99" not in setuptools.specifier and "77.0" in setuptools.specifier


def test_all_distributions_require_the_same_python_and_list_only_versions_it_allows():
    [requires_python] = {project["requires-python"] for project in PROJECTS.values()}
    lowest = min(Version(v) for v in re.findall(r">=\s*(\d+\.\d+)", requires_python))
    for directory, project in PROJECTS.items():
        listed = [Version(m.group(1)) for c in project["classifiers"] if (m := PYTHON_CLASSIFIER.match(c))]
        assert listed, directory
        assert min(listed) == lowest, directory  # the oldest Python listed is the oldest allowed
        assert all(v in SpecifierSet(requires_python) for v in listed), directory


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_every_requirement_has_a_version_range(directory):
    assert [str(r) for r in requirements(PROJECTS[directory]) if not r.specifier] == []


@pytest.mark.parametrize("directory", PLUGINS)
def test_each_plugin_accepts_the_core_and_kernels_released_beside_it(directory):
    by_name = {r.name: r for r in requirements(PROJECTS[directory])}
    for sibling in ("devshim-core", "devshim-kernels"):
        assert VERSIONS[sibling] in by_name[sibling].specifier, f"{directory}: {by_name[sibling]}"


def test_core_extras_require_the_framework_ranges_devshim_patches():
    extras = PROJECTS["."]["optional-dependencies"]
    assert [Requirement(r) for r in extras["deepspeed"]] == [Requirement(f"deepspeed{DEEPSPEED.spec}")]
    assert [Requirement(r) for r in extras["megatron"]] == [Requirement(f"{MEGATRON_CORE.distribution}"
                                                                        f"{MEGATRON_CORE.spec}")]


@pytest.mark.parametrize("directory", DIRECTORIES)  # each imports torch itself
def test_every_distribution_requires_the_torch_range_devshim_patches(directory):
    [torch] = [r for r in requirements(PROJECTS[directory]) if r.name == "torch"]
    assert torch.specifier == SpecifierSet(TORCH.spec)


def test_the_core_sdist_carries_the_build_backend_its_pyproject_names():
    """pyproject's backend-path is build_support/: an sdist without it cannot build the wheel (or the .pth)."""
    [backend_path] = pyproject(".")["build-system"]["backend-path"]
    included = {name for line in (PROJECT_DIR / "MANIFEST.in").read_text().splitlines()
                if line.startswith("include ") for name in line.split()[1:]}
    needed = {f"{backend_path}/devshim_build.py", f"{backend_path}/devshim-auto.pth"}
    assert all((PROJECT_DIR / name).is_file() for name in needed)
    assert needed <= included


def test_only_the_emulation_registers_a_torch_backend_and_the_core_never_packages_it():
    """``import torch`` runs devshim's code only where devshim-emulation is installed: the core declares no
    ``torch.backends`` entry point, installs no top-level module beside ``devshim_core`` but ``_devshim_startup``
    (which only ``devshim-auto.pth`` imports, and only with DEVSHIM_AUTO set) and packages nothing of the emulator;
    the emulation registers the entry points the core and pytest look for."""
    core = pyproject(".")
    assert "torch.backends" not in core["project"].get("entry-points", {})
    assert core["tool"]["setuptools"].get("py-modules", []) == ["_devshim_startup"]
    assert not [data for data in core["tool"]["setuptools"]["package-data"]["devshim_core"] if "emulation" in data]
    assert not (PROJECT_DIR / "devshim_core" / "emulation").exists()
    emulation = pyproject("emulation")
    entry_points = emulation["project"]["entry-points"]
    assert entry_points["devshim.emulation"] == {"emulator": "devshim_emulation.hooks"}
    assert entry_points["torch.backends"] == {"devshim_emulation": "devshim_emulation.torch_backend:autoload"}
    assert entry_points["pytest11"] == {"devshim_emulation.pytest_plugin": "devshim_emulation.pytest_plugin"}
    assert "devshim-core" in {Requirement(r).name for r in emulation["project"]["dependencies"]}
