"""Spec: a plugin shipped by a third party is found through its distribution's ``devshim`` entry point alone.

The plugin here is a real distribution (pyproject.toml with ``[project.entry-points.devshim]``, its own
package) built and installed by pip into a throwaway virtual environment layered on the project's.

How the environment is layered: ``python -m venv --system-site-packages`` run from /work/main/.venv does
*not* see .venv's packages: "system" means the base interpreter's site-packages (pyenv's, which has neither
torch nor devshim, but an older pluggy). So the throwaway venv is created without system site-packages and
gets one ``.pth`` file that calls ``site.addsitedir`` on .venv's site-packages: .venv's own ``.pth`` files
run (the editable finders of the project's five distributions, devshim-auto.pth), its packages come
after the throwaway venv's own, and pip/setuptools come from .venv (so ``--no-build-isolation`` works
offline). pip installs into the throwaway venv (its ``sys.prefix``); the pytest process never sees the plugin.
"""

from __future__ import annotations

import importlib.metadata as metadata
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest
from plugin_fixtures import INSTALLED_PLUGINS, Background, checked_json, clean_env, layered_venv_with_wheel

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "devshim-acme"
version = "2.5.0"
description = "devshim plugin for the ACME accelerator (emulated on the host CPU)"
requires-python = ">=3.10"
dependencies = ["devshim-core>=0.1,<0.2", "devshim-cpu-reference>=0.1,<0.2"]

[project.entry-points.devshim]
acme = "devshim_acme"

[tool.setuptools]
packages = ["devshim_acme"]
"""

PLUGIN = '''\
"""ACME's devshim plugin: an accelerator emulated on the host CPU. ACME_PRIORITY overrides its priority."""

import os

from devshim_core import AllocatorSpec, DeviceReport, DeviceTraits, hookimpl
from devshim_core.patching import SetAttribute
from devshim_cpu_reference import memory
from devshim_cpu_reference.device_module import CpuDeviceModule
import torch


@hookimpl
def devshim_detect():
    priority = int(os.environ.get("ACME_PRIORITY", "10"))
    cards = int(os.environ.get("ACME_CARDS", "1"))
    return DeviceReport(available=True, reason=f"{cards} ACME card (emulated)", device_type="cpu",
                        device_count=cards, priority=priority)


@hookimpl
def devshim_device_module(report):
    return CpuDeviceModule(report.device_count)


@hookimpl
def devshim_device_traits(report):
    return DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported=False, fp16_supported=False,
                        host_synchronous=True, streams=False, name="ACME-1")


@hookimpl
def devshim_allocator(report) -> AllocatorSpec:
    return memory.allocator_spec()


INT64_ON_DEVICE = True


@hookimpl
def devshim_patches(report):
    return [SetAttribute(name="acme-narrow-int64", target="devshim_acme:INT64_ON_DEVICE",
                         make=lambda original, device: False, reason="ACME cards have no int64 arithmetic")]
'''


class Env:
    """The throwaway environment, and its ``python -m devshim_core <command> --json`` runs."""

    def __init__(self, python: Path, site: Path) -> None:
        self.python, self.site = python, site
        self.commands = Background({
            "plugins": self._devshim("plugins"),
            "plugins, forced": self._devshim("plugins", ACME_PRIORITY="-2000", DEVSHIM_PLUGIN="acme"),
            "info": self._devshim("info"),
            # devshim's conformance kit, as ACME would run it against its plugin (2 cards: the 2-rank jobs run)
            "kit": ([python, "-m", "pytest", "-p", "devshim_core.testing", "--devshim-plugin=acme",
                     "-p", "no:cacheprovider", "-rs", f"--junitxml={site.parent / 'kit.xml'}"],
                    clean_env(ACME_CARDS="2")),
        })

    def _devshim(self, command: str, **env: str):
        return [self.python, "-m", "devshim_core", command, "--json"], clean_env(**env)

    def devshim(self, key: str) -> dict:
        return checked_json(self.commands[key])


@pytest.fixture(scope="module")
def acme(tmp_path_factory):
    root = tmp_path_factory.mktemp("third_party")
    source = root / "devshim-acme"
    (source / "devshim_acme").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "devshim_acme" / "__init__.py").write_text(PLUGIN)

    python, site = layered_venv_with_wheel(root, source, "devshim_acme-2.5.0-*.whl")
    env = Env(python, site)
    yield env
    env.commands.close()


def test_the_plugin_is_installed_as_a_distribution_of_the_throwaway_environment_only(acme):
    dist_info = acme.site / "devshim_acme-2.5.0.dist-info"
    assert textwrap.dedent((dist_info / "entry_points.txt").read_text()).split() == ["[devshim]", "acme", "=",
                                                                                      "devshim_acme"]
    assert (dist_info / "INSTALLER").read_text().strip() == "pip"
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("devshim-acme")  # this process is not in the throwaway venv


def test_devshim_plugins_lists_it_with_its_distribution_and_selects_it_for_its_higher_priority(acme):
    report = acme.devshim("plugins")
    plugins = {p["name"]: p for p in report["plugins"]}
    assert set(plugins) == {"acme", *INSTALLED_PLUGINS}
    assert plugins["acme"] == {
        "name": "acme", "distribution": "devshim-acme", "version": "2.5.0", "entry_point": "devshim_acme",
        "available": True, "reason": "1 ACME card (emulated)", "priority": 10, "device_type": "cpu",
        "device_count": 1, "error": None,
    }
    assert report["selected"] == "acme"
    assert report["reason"] == "highest priority (10) of the available plugins; also available: cpu_reference"
    assert report["patches"] == []


def test_a_third_party_plugin_that_would_not_win_can_be_forced_with_devshim_plugin(acme):
    report = acme.devshim("plugins, forced")
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["acme"]["priority"] < -1000  # below cpu_reference's, which is not even loaded: only acme is
    assert plugins["cpu_reference"]["reason"] == ("not loaded: DEVSHIM_PLUGIN=acme is forced, and only it is loaded "
                                                  "and detected")
    assert (report["selected"], report["reason"]) == ("acme", "forced by DEVSHIM_PLUGIN=acme")


def test_devshim_info_shows_it_selected_with_deepspeed_patched_for_its_device(acme):
    report = acme.devshim("info")
    assert report["selected"] == "acme"
    assert report["device"]["plugin"] == "acme"
    assert report["device"]["name"] == "ACME-1"
    assert report["device"]["supported_dtypes"] == ["float32"]
    assert {(p["set"], p["name"]) for p in report["patches"]} >= {("deepspeed", "accelerator"),
                                                                  ("plugin-acme", "acme-narrow-int64")}
    [vendor_patch] = [p for p in report["patches"] if p["set"] == "plugin-acme"]
    assert vendor_patch["target"] == "devshim_acme:INT64_ON_DEVICE"
    assert vendor_patch["reason"] == "ACME cards have no int64 arithmetic"


# what ACME's plugin does not provide, so the kit skips its checks, naming the missing kernel
ACME_LACKS = ("attention", "rms_norm", "swiglu", "rotary", "masked_softmax", "wgrad_accumulate", "fused_adamw",
              "host Adam")


def test_devshims_conformance_kit_passes_on_it_skipping_only_what_it_does_not_provide(acme):
    """The kit, run as a vendor runs it, in the environment the wheel was installed into: the hook contract, the
    accelerator table, the kernels it provides, and the 2-rank DeepSpeed and Megatron jobs."""
    result = acme.commands["kit"]
    assert result.returncode == 0, f"the kit failed on acme:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert "devshim conformance kit: plugin 'acme' on cpu x2" in result.stdout
    suite = ElementTree.parse(acme.site.parent / "kit.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    ran = {case.get("name", "").split("[")[0] for case in cases if case.find("skipped") is None}
    assert ran >= {"test_the_collectives_backend_reduces_device_tensors",  # hook contract
                   "test_the_accelerator_method_behaves_as_declared",  # DeepSpeed's accelerator table
                   "test_the_losses_and_final_parameters_match_one_host_process",  # 2-rank DeepSpeed
                   "test_the_tensor_parallel_mlp_trains_as_the_full_mlp_on_the_host"}, ran  # 2-rank Megatron
    skips = {case.find("skipped").get("message", "") for case in cases if case.find("skipped") is not None}
    unexplained = [m for m in skips if not any(f"provides no {op}" in m for op in ACME_LACKS)]
    assert unexplained == [], unexplained
    assert int(suite.get("failures")) == int(suite.get("errors")) == 0
