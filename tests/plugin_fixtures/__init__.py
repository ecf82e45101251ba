"""Plugins and helpers for the discovery, selection and failure-mode specs.

Well-behaved plugins are built to order with :class:`FakePlugin`; broken ones are modules of this package
(``raises_at_import``, ``raises_in_detect``, ...), exactly as a third party would ship them. In-process tests
pass them to ``discover(settings, extra=[(name, plugin)])``; tests that need entry points install them as
distributions with :func:`write_distribution` on a directory that goes on ``sys.path`` / ``PYTHONPATH``.
Nothing here activates devshim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from devshim_cpu_reference import memory
from devshim_cpu_reference.device_module import CpuDeviceModule

from devshim_core import AllocatorSpec, DeviceReport, DeviceTraits, hookimpl
from devshim_core.settings import Settings

TESTS_DIR = Path(__file__).resolve().parent.parent  # holds this package: put it on PYTHONPATH to import it
PROJECT_DIR = TESTS_DIR.parent
PYTHON = sys.executable
DEVSHIM_SCRIPT = Path(sys.executable).with_name("devshim")
INSTALLED_PLUGINS = ("ascend", "cpu_reference", "cuda", "sophgo")  # the project's own distributions, all installed


class FakePlugin:
    """A selectable plugin running on the host CPU, whose detection answer is given to it.

    ``detect_calls`` counts detection, so a spec can show that a plugin was never asked.
    """

    def __init__(self, *, priority: int = 0, available: bool = True, device_type: str = "cpu",
                 device_count: int = 1, reason: str | None = None) -> None:
        self.report = DeviceReport(available=available, device_type=device_type, priority=priority,
                                   device_count=device_count if available else 0,
                                   reason=reason or ("fake device present" if available else "fake device absent"))
        self.detect_calls = 0

    @hookimpl
    def devshim_detect(self) -> DeviceReport:
        self.detect_calls += 1
        return self.report

    @hookimpl
    def devshim_device_module(self, report: DeviceReport) -> CpuDeviceModule:
        return CpuDeviceModule(report.device_count)

    @hookimpl
    def devshim_device_traits(self, report: DeviceReport) -> DeviceTraits:
        return DeviceTraits(supported_dtypes=(torch.float32,), bf16_supported=False, fp16_supported=False,
                            host_synchronous=True, streams=False)

    @hookimpl
    def devshim_allocator(self, report: DeviceReport) -> AllocatorSpec:
        return memory.allocator_spec()


class RaisesInAllocator(FakePlugin):
    """Detects fine and is selectable, then breaks while the device facade is built."""

    @hookimpl
    def devshim_allocator(self, report: DeviceReport) -> AllocatorSpec:
        raise RuntimeError("allocator handle is stale")


class DetectOnly:
    """Detects an available device but implements nothing else (like a vendor plugin's first release)."""

    @hookimpl
    def devshim_detect(self) -> DeviceReport:
        return DeviceReport(available=True, reason="found one", device_type="xpu", device_count=1, priority=5)


class WrongTraits(FakePlugin):
    @hookimpl
    def devshim_device_traits(self, report: DeviceReport) -> Any:
        return {"bf16_supported": True}  # a dict, not a DeviceTraits


def only(*names: str, **env: str) -> Settings:
    """Settings that load nothing but ``names`` (DEVSHIM_DISABLE_PLUGIN_AUTOLOAD=1, DEVSHIM_PLUGINS=names)."""
    return Settings.from_env({"DEVSHIM_DISABLE_PLUGIN_AUTOLOAD": "1", "DEVSHIM_PLUGINS": ",".join(names), **env})


# -- distributions -----------------------------------------------------------------------------


def write_distribution(site: Path, distribution: str, version: str, entry_points: Mapping[str, str],
                       *, files: Mapping[str, str] | None = None, summary: str = "a devshim test plugin",
                       author: str = "devshim tests", top_level: str | None = None) -> Path:
    """Install a distribution into ``site`` the way pip leaves one: a ``.dist-info`` directory with
    ``METADATA`` and ``entry_points.txt`` (group ``devshim``), plus ``files`` (relative path -> text).

    ``importlib.metadata`` finds it as soon as ``site`` is on ``sys.path``.
    """
    site.mkdir(parents=True, exist_ok=True)
    for relative, text in (files or {}).items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
                                   f"Summary: {summary}\nAuthor: {author}\n")
    if entry_points:
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[devshim]\n{lines}")
    if top_level:
        (info / "top_level.txt").write_text(f"{top_level}\n")
    (info / "INSTALLER").write_text("devshim-tests\n")
    return info


# -- subprocesses ------------------------------------------------------------------------------

_SCRUBBED_PREFIXES = ("DEVSHIM_", "ASCEND_", "PYTORCH_NPU_", "DS_ACCELERATOR")
_SCRUBBED = ("PYTHONPATH", "CHIP_ARCH", "LD_LIBRARY_PATH", "ACME_PRIORITY")


def clean_env(pythonpath: list[Path | str] | None = None, **overrides: str) -> dict[str, str]:
    """This process's environment without any devshim/vendor switch, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_PREFIXES) and k not in _SCRUBBED}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.update(overrides)
    return env


def run(args: list[str | Path], env: Mapping[str, str], *, timeout: float = 120,
        cwd: Path | str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; by default outside the source tree, so that only what is installed is importable."""
    return subprocess.run([str(a) for a in args], env=dict(env), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or tempfile.gettempdir())


def checked_json(result: subprocess.CompletedProcess[str], expect_rc: int = 0) -> Any:
    """The JSON a command printed; fail with its output if it exited otherwise than expected."""
    assert result.returncode == expect_rc, (f"{result.args} exited {result.returncode}, expected {expect_rc}\n"
                                            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def run_json(args: list[str | Path], env: Mapping[str, str], *, expect_rc: int = 0, **kwargs: Any) -> Any:
    """Run a command that prints JSON on stdout (see :func:`checked_json`)."""
    return checked_json(run(args, env, **kwargs), expect_rc)


def layered_venv_with_wheel(root: Path, source: Path, wheel_glob: str) -> tuple[Path, Path]:
    """A throwaway venv in ``root`` layered on the project's (see tests/test_third_party_plugin.py for why a ``.pth``
    and not ``--system-site-packages``), with the distribution at ``source`` built as a wheel and installed from it,
    as a third party ships it. Returns the venv's python and its site-packages."""
    import sysconfig

    venv = root / "venv"
    result = run([PYTHON, "-m", "venv", "--without-pip", venv], clean_env())
    assert result.returncode == 0, result.stderr
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    clean_env()).stdout.strip())
    project_site = sysconfig.get_paths()["purelib"]  # .venv's, as this process runs in it
    (site / "_layer_on_project_venv.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    wheels = root / "wheels"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    result = run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, source],
                 clean_env(), timeout=180)
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    [wheel] = wheels.glob(wheel_glob)
    result = run([*pip, "install", "--no-deps", "--no-index", wheel], clean_env(), timeout=180)
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    return python, site


class Background:
    """Commands started together, at most one per core, each collected when a spec asks for it (every one
    pays for ``import torch``: overlapping them halves the wait on a two-core machine)."""

    def __init__(self, commands: Mapping[str, tuple[list[str | Path], Mapping[str, str]]]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
        self._futures = {key: self._pool.submit(run, args, env) for key, (args, env) in commands.items()}

    def __getitem__(self, key: str) -> subprocess.CompletedProcess[str]:
        return self._futures[key].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


#: The broken plugins of this package as separate distributions: entry-point name -> (distribution, entry point).
BROKEN_DISTRIBUTIONS: dict[str, tuple[str, str]] = {
    "raises_at_import": ("devshim-broken-import", "plugin_fixtures.raises_at_import"),
    "raises_in_detect": ("devshim-broken-detect", "plugin_fixtures.raises_in_detect"),
    "exits_in_detect": ("devshim-exits-in-detect", "plugin_fixtures.exits_in_detect"),
    "nonsense_detect": ("devshim-nonsense-detect", "plugin_fixtures.nonsense_detect"),
    "invalid_report": ("devshim-invalid-report", "plugin_fixtures.invalid_report"),
    "typo_hook": ("devshim-typo-hook", "plugin_fixtures.typo_hook"),
}


def install_broken_plugins(site: Path) -> Path:
    """Install every broken plugin above, plus two distributions that both register ``twin``, into ``site``."""
    for name, (distribution, entry_point) in BROKEN_DISTRIBUTIONS.items():
        write_distribution(site, distribution, "0.0.1", {name: entry_point})
    write_distribution(site, "devshim-twin-a", "1.0", {"twin": "plugin_fixtures.twin:from_a"})
    write_distribution(site, "devshim-twin-b", "2.0", {"twin": "plugin_fixtures.twin:from_b"})
    return site
