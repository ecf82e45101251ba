"""Build every devshim distribution the way a release does and check the result in a fresh venv.

`make install` installs everything editable, which hides packaging mistakes: a file missing from a wheel or an
sdist, a start-up ``.pth`` that pip does not install or uninstall, metadata a wheel does not carry, a dependency
that only the development venv happens to have. This script builds each distribution with ``python -m build``
(the sdist, then the wheel from that sdist, in isolated build environments), installs the wheels, not editable,
with the ``deepspeed`` extra into a new venv, and checks there: where the packages are imported from, each
distribution's metadata, ``devshim info``, the ``DEVSHIM_AUTO`` start-up switch, the 2-rank DeepSpeed demo, the
conformance kit (``pytest --devshim-plugin=cpu_reference``), ``DEVSHIM_EMULATE=ascend devshim info`` (the emulator
from its wheel, devshim-emulation), and that uninstalling devshim-core removes the switch.
pip's cache is reused, so a second run is faster.

    python release/check_wheels.py [--keep DIR]

Exits non-zero, saying what to fix, when any check fails; the work directory is then kept for inspection.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from xml.etree import ElementTree

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from devshim_core.testing.launch import free_port  # the project venv runs this script

ROOT = Path(__file__).resolve().parent.parent
BUILD_VERSION = "1.6.1"  # the PEP 517 frontend the wheels are built with (pinned in requirements-dev.txt)
PIP = "pip==26.3"  # the fresh venv's pip, the development venv's, so both resolve alike
TROVE_CLASSIFIERS = "trove-classifiers==2026.9.21.13"  # PyPI rejects an upload with an unknown classifier
LICENSE_EXPRESSION = "Apache-2.0"
PTH = "devshim-auto.pth"
CORE = "devshim-core"
EMULATION = "devshim-emulation"
# each distribution's directory and the top-level modules its wheel must install, nothing more
LAYOUT: dict[str, tuple[str, ...]] = {
    ".": ("devshim_core", "_devshim_startup"),  # the second: the DEVSHIM_AUTO start-up module the .pth imports
    "kernels": ("devshim_kernels",),
    "plugins/cpu_reference": ("devshim_cpu_reference",),
    "plugins/ascend": ("devshim_ascend",),
    "plugins/sophgo": ("devshim_sophgo",),
    "plugins/cuda": ("devshim_cuda",),
    "emulation": ("devshim_emulation",),
}
# what the emulator's wheel must carry beside its modules: the C++ source compiled on first use, and the simulated
# SDKs (packages, distribution metadata that detection reads, the CANN stand-in); none of it in devshim-core's
EMULATION_FILES = (
    "devshim_emulation/csrc/emulated_device.cpp",
    "devshim_emulation/sdk/README.md",
    "devshim_emulation/sdk/cann/version.info",
    "devshim_emulation/sdk/torch_npu/__init__.py",
    "devshim_emulation/sdk/torch_npu/_ops.py",
    "devshim_emulation/sdk/torch_npu/amp.py",
    "devshim_emulation/sdk/torch_npu/optim/__init__.py",
    "devshim_emulation/sdk/torch_npu-2.13.0.dist-info/METADATA",
    "devshim_emulation/sdk/torch_npu-2.13.0.dist-info/top_level.txt",
    "devshim_emulation/sdk/torch_tpu/__init__.py",
    "devshim_emulation/sdk/torch_tpu/_ops.py",
    "devshim_emulation/sdk/torch_tpu/tpu/__init__.py",
    "devshim_emulation/sdk/torch_tpu-2.13.0.dist-info/METADATA",
    "devshim_emulation/sdk/torch_tpu-2.13.0.dist-info/top_level.txt",
)
# the entry points each distribution must declare, and those it must not (devshim-core runs nothing on
# `import torch`: the torch.backends entry point is the emulator's, present only where it is installed)
ENTRY_POINTS: dict[str, tuple[set[str], set[str]]] = {
    CORE: ({"console_scripts:devshim", "pytest11:devshim_core.testing"}, {"torch.backends", "devshim.emulation"}),
    EMULATION: ({"devshim.emulation:emulator", "torch.backends:devshim_emulation",
                 "pytest11:devshim_emulation.pytest_plugin"}, set()),
}
# a wheel without these silently falls back to PyTorch or Python code: a release must carry them
NATIVE_LIBRARIES: dict[str, tuple[str, ...]] = {
    CORE: ("devshim_core/integrations/cuda_redirect/_native.",
           "devshim_core/integrations/torch_distributed/_shm_sync."),
    "devshim-kernels": ("devshim_kernels/_native/_adam.", "devshim_kernels/_native/_rowwise.",
                        "devshim_kernels/_native/_aio."),
}
PLUGINS = ("cpu_reference", "ascend", "sophgo", "cuda")
DEMO_STEPS = 5
INSTALL_TIMEOUT = 1800  # a cold pip cache downloads DeepSpeed's dependencies and builds its sdist
DEMO_TIMEOUT = 600

T = TypeVar("T")


class CheckFailed(Exception):
    """What is wrong, and what to do about it."""


class Aborted(Exception):
    """A check that later ones depend on failed."""


@dataclass(frozen=True)
class Distribution:
    directory: str  # relative to ROOT
    name: str
    version: str
    requires_python: str
    modules: tuple[str, ...]

    @property
    def file_stem(self) -> str:  # how sdist and wheel file names spell the project name
        return self.name.replace("-", "_")


@dataclass(frozen=True)
class Artifacts:
    sdist: Path
    wheel: Path


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str
    seconds: float


class Checks:
    """Runs named checks, records each outcome, and stops the run when a fatal one fails."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    def run(self, name: str, check: Callable[[], T], *, fatal: bool = False) -> T | None:
        print(f"-- {name}", flush=True)
        start = time.perf_counter()
        try:
            result = check()
        except Exception as failure:  # CheckFailed, or output a check did not expect: either fails the run
            detail = str(failure) if isinstance(failure, CheckFailed) else f"{type(failure).__name__}: {failure}"
            self.outcomes.append(Outcome(name, False, detail, time.perf_counter() - start))
            print(f"   FAILED: {detail}", flush=True)
            if fatal:
                raise Aborted(name) from failure
            return None
        detail = result if isinstance(result, str) else ""
        self.outcomes.append(Outcome(name, True, detail, time.perf_counter() - start))
        return result

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self, total_seconds: float) -> str:
        lines = ["", "summary:"]
        for o in self.outcomes:
            mark = "ok  " if o.ok else "FAIL"
            first = o.detail.splitlines()[0] if o.detail else ""
            lines.append(f"  {mark} {o.name:<48} {o.seconds:6.1f} s  {first}")
        for o in self.failed:
            lines += ["", f"{o.name} failed:", *(f"  {line}" for line in o.detail.splitlines())]
        verdict = f"{len(self.failed)} of {len(self.outcomes)} checks failed" if self.failed else "all checks passed"
        lines.append(f"{verdict} in {total_seconds:.0f} s")
        return "\n".join(lines)


# -- helpers ---------------------------------------------------------------------------------------


def load_distributions() -> list[Distribution]:
    distributions = []
    for directory, modules in LAYOUT.items():
        project = tomllib.loads((ROOT / directory / "pyproject.toml").read_text())["project"]
        distributions.append(Distribution(directory, project["name"], project["version"],
                                          project["requires-python"], modules))
    return distributions


def dev_pin(name: str) -> str:
    """The ``name==version`` line of requirements-dev.txt: the one place the dev and CI pins are written."""
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if requirement.lower().startswith(f"{name}=="):
            return requirement
    raise CheckFailed(f"requirements-dev.txt pins no {name}==VERSION")


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without what would leak the work tree or the dev venv into the fresh one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR")
           and not k.startswith("DEVSHIM_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["DS_BUILD_OPS"] = "0"  # DeepSpeed, if pip builds its sdist, precompiles no ops
    return {**env, **extra}


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run(command: list[str], *, log: Path, cwd: Path, env: dict[str, str], timeout: float,
        what_to_do: str = "") -> str:
    """Runs a command, writes its output to ``log``, and returns it; a failure quotes the end of the output."""
    try:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as timeout_error:
        raise CheckFailed(f"`{shlex.join(command)}` did not finish in {timeout:.0f} s (log: {log})") from timeout_error
    output = result.stdout + ("\n--- stderr ---\n" + result.stderr if result.stderr else "")
    log.write_text(f"$ {shlex.join(command)}\n(cwd {cwd})\n{output}")
    if result.returncode != 0:
        advice = f"\n   {what_to_do}" if what_to_do else ""
        raise CheckFailed(f"`{shlex.join(command)}` exited with {result.returncode}; its output ends:\n"
                          f"{tail(output)}\n   full log: {log}{advice}")
    return result.stdout


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# -- build -----------------------------------------------------------------------------------------


def check_build_frontend() -> str:
    try:
        version = importlib.metadata.version("build")
    except importlib.metadata.PackageNotFoundError:
        version = None
    expect(version == BUILD_VERSION, f"this interpreter has build {version}, not {BUILD_VERSION}: "
           f"{sys.executable} -m pip install build=={BUILD_VERSION}")
    return f"build {version}"


def stage_sources(destination: Path) -> str:
    """Copies what a checkout would hold (tracked and new, unignored files) so that stale build/ and egg-info
    directories of the work tree cannot leak into the wheels, and the builds write nothing into the work tree."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                 cwd=ROOT, capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as error:
        raise CheckFailed(f"cannot list the repository's files with git ({error}); run from a git checkout") from error
    copied = 0
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if (ROOT / name.split("/")[0] / "pyvenv.cfg").exists():  # an unignored venv: nothing a build reads
            continue
        if source.is_file():  # a tracked file deleted in the work tree is listed but absent
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied += 1
    return f"{copied} files"


def build_one(dist: Distribution, sources: Path, out: Path, logs: Path) -> Artifacts:
    target = out / dist.name
    # no --wheel: the sdist is built first and the wheel from it, so a file missing from the sdist fails here
    run([sys.executable, "-m", "build", "--outdir", str(target), str(sources / dist.directory)],
        log=logs / f"build-{dist.name}.log", cwd=sources, env=clean_env(), timeout=900,
        what_to_do=f"fix {dist.directory}/pyproject.toml (or MANIFEST.in, when a file is missing from the sdist)")
    [sdist] = target.glob(f"{dist.file_stem}-{dist.version}.tar.gz")
    [wheel] = target.glob(f"{dist.file_stem}-{dist.version}-*.whl")
    return Artifacts(sdist, wheel)


def build_all(distributions: list[Distribution], sources: Path, out: Path, logs: Path) -> dict[str, Artifacts]:
    with ThreadPoolExecutor(max_workers=len(distributions)) as pool:
        futures = {d.name: pool.submit(build_one, d, sources, out, logs) for d in distributions}
    failures = [f"{name}: {future.exception()}" for name, future in futures.items() if future.exception()]
    if failures:
        raise CheckFailed("\n".join(failures))
    return {name: future.result() for name, future in futures.items()}


def check_archives(distributions: list[Distribution], artifacts: dict[str, Artifacts]) -> str:
    """What each wheel holds, before pip sees it: license, top-level names, the .pth, the native libraries."""
    license_text = (ROOT / "LICENSE").read_bytes()
    problems = []
    for dist in distributions:
        wheel = artifacts[dist.name].wheel
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            dist_info = f"{dist.file_stem}-{dist.version}.dist-info"
            licence = f"{dist_info}/licenses/LICENSE"
            if licence not in names:
                problems.append(f"{wheel.name} has no {licence}: set license-files in "
                                f"{dist.directory}/pyproject.toml")
            elif archive.read(licence) != license_text:
                problems.append(f"{wheel.name}'s LICENSE differs from the repository's: copy LICENSE to "
                                f"{dist.directory}/")
            expected = {*dist.modules, dist_info, *([PTH] if dist.name == CORE else [])}
            top_level = {name.split("/")[0].removesuffix(".py") for name in names}
            if top_level != expected:
                problems.append(f"{wheel.name} installs {sorted(top_level)} at the top of site-packages, "
                                f"expected {sorted(expected)}: check packages.find / py-modules")
            if dist.name == CORE and (emulation := [n for n in names if n.startswith("devshim_core/emulation/")]):
                problems.append(f"{wheel.name} carries the emulator ({emulation[0]}, ...): it is devshim-emulation's "
                                "(emulation/); devshim-core's pyproject must not package it")
            if dist.name == EMULATION and (missing := [f for f in EMULATION_FILES if f not in names]):
                problems.append(f"{wheel.name} lacks {missing}: check emulation/pyproject.toml's package-data")
            for prefix in NATIVE_LIBRARIES.get(dist.name, ()):
                if not any(n.startswith(prefix) and n.endswith((".so", ".pyd", ".dylib")) for n in names):
                    problems.append(f"{wheel.name} has no {prefix}* native library: the build did not compile it "
                                    f"(is a C compiler installed? see build-{dist.name}.log)")
            if dist.name == CORE:
                record = archive.read(f"{dist_info}/RECORD").decode()
                if PTH not in names or not any(line.startswith(f"{PTH},") for line in record.splitlines()):
                    problems.append(f"{wheel.name} lacks {PTH} or its RECORD line (build_support/devshim_build.py "
                                    "adds both; pip uninstall removes only what RECORD lists)")
                elif archive.read(PTH) != (ROOT / "build_support" / PTH).read_bytes():
                    problems.append(f"{wheel.name}'s {PTH} differs from build_support/{PTH}")
    if problems:
        raise CheckFailed("\n".join(problems))
    return ", ".join(a.wheel.name for a in artifacts.values())


# -- the fresh venv ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Venv:
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name


def create_venv(venv: Venv, logs: Path, cwd: Path) -> str:
    run([sys.executable, "-m", "venv", str(venv.path)], log=logs / "venv.log", cwd=cwd, env=clean_env(), timeout=300)
    run([str(venv.python), "-m", "pip", "install", "--quiet", PIP], log=logs / "pip-upgrade.log", cwd=cwd,
        env=clean_env(), timeout=300)
    return str(venv.path)


def install(venv: Venv, distributions: list[Distribution], artifacts: dict[str, Artifacts], logs: Path,
            cwd: Path) -> str:
    constraints = ["-c", str(ROOT / "constraints.txt")]
    pip = [str(venv.python), "-m", "pip", "install", *constraints]
    # torch first and pinned: unpinned, pip would resolve torch to a multi-GB CUDA build
    run([*pip, dev_pin("torch"), TROVE_CLASSIFIERS], log=logs / "install-torch.log", cwd=cwd, env=clean_env(),
        timeout=INSTALL_TIMEOUT, what_to_do="torch's pin must match a wheel pip can find (requirements-dev.txt)")
    wheels = [f"{artifacts[d.name].wheel}[deepspeed]" if d.name == CORE else str(artifacts[d.name].wheel)
              for d in distributions]
    run([*pip, dev_pin("deepspeed"), *wheels], log=logs / "install-wheels.log", cwd=cwd, env=clean_env(),
        timeout=INSTALL_TIMEOUT, what_to_do="a dependency range in a pyproject.toml may exclude the pinned versions")
    run([str(venv.python), "-m", "pip", "check"], log=logs / "pip-check.log", cwd=cwd, env=clean_env(), timeout=120,
        what_to_do="an installed distribution's requirements are not met")
    return f"torch, deepspeed and the {len(distributions)} wheels; pip check is clean"


PROBE = r"""
import importlib, importlib.metadata as md, json, sys, sysconfig
names, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
import trove_classifiers
out = {"site_packages": sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}),
       "files": {m: importlib.import_module(m).__file__ for m in modules}, "metadata": {}}
for name in names:
    dist = md.distribution(name)
    meta = dist.metadata
    classifiers = meta.get_all("Classifier") or []
    out["metadata"][name] = {
        "location": str(dist.locate_file("")),
        "fields": {key: meta.get_all(key) for key in set(meta.keys())},
        "license_files": [str(f) for f in dist.files or () if ".dist-info/licenses/" in str(f).replace("\\", "/")],
        "license_text": next((f.read_text() for f in dist.files or () if str(f).endswith("licenses/LICENSE")), None),
        "unknown_classifiers": [c for c in classifiers if c not in trove_classifiers.classifiers],
        "deprecated_classifiers": [c for c in classifiers if c in trove_classifiers.deprecated_classifiers],
        "entry_points": sorted(f"{ep.group}:{ep.name}" for ep in dist.entry_points),
    }
import devshim_kernels.adam, devshim_kernels.file_io
from devshim_core.integrations.cuda_redirect import wrappers
from devshim_core.integrations.torch_distributed import shm_segment
out["native"] = {"adam": devshim_kernels.adam.implementation(), "file_io": devshim_kernels.file_io.AVAILABLE,
                 "cuda_redirect": wrappers.IMPLEMENTATION, "shared_memory_barrier": shm_segment.NATIVE}
print(json.dumps(out))
"""


def probe(venv: Venv, distributions: list[Distribution], logs: Path, cwd: Path) -> dict[str, Any]:
    modules = [m for d in distributions for m in d.modules]
    stdout = run([str(venv.python), "-c", PROBE, json.dumps([d.name for d in distributions]), json.dumps(modules)],
                 log=logs / "probe.log", cwd=cwd, env=clean_env(), timeout=300)
    return json.loads(stdout)


def check_import_locations(facts: dict[str, Any], venv: Venv) -> str:
    site_packages = [Path(p).resolve() for p in facts["site_packages"]]
    expect(all(p.is_relative_to(venv.path.resolve()) for p in site_packages),
           f"the venv's site-packages {site_packages} is not inside {venv.path}")
    files = {module: Path(file).resolve() for module, file in facts["files"].items()}
    wrong = {module: str(file) for module, file in files.items()
             if file.is_relative_to(ROOT) or not any(file.is_relative_to(p) for p in site_packages)}
    expect(not wrong, f"imported from outside the venv's site-packages: {wrong} (an editable install, a .pth or "
           "PYTHONPATH pointing at the work tree?)")
    for name, meta in facts["metadata"].items():
        location = Path(meta["location"]).resolve()
        expect(any(location == p for p in site_packages), f"{name}'s metadata is read from {location}, "
               "not the venv's site-packages (a stray egg-info in the working directory?)")
    return f"{len(facts['files'])} modules from {site_packages[0]}"


def check_native(facts: dict[str, Any]) -> str:
    native = facts["native"]
    expect(native["adam"].startswith("native") and native["file_io"] and native["cuda_redirect"] == "native"
           and native["shared_memory_barrier"],
           f"a native library of the installed wheels did not load: {native}")
    return native["adam"]


def meta_field(meta: dict[str, Any], key: str) -> list[str]:
    return meta["fields"].get(key) or []


def check_metadata(facts: dict[str, Any], distributions: list[Distribution]) -> str:
    """Each installed distribution says what pip and PyPI need: version, Python, license, ranges, extras."""
    license_text = (ROOT / "LICENSE").read_text()
    versions = {d.name: Version(d.version) for d in distributions}
    deepspeed_version = Version(dev_pin("deepspeed").split("==")[1])
    problems: list[str] = []
    for dist in distributions:
        meta = facts["metadata"][dist.name]
        where = f"{dist.name} ({dist.directory}/pyproject.toml)"
        if meta_field(meta, "Version") != [dist.version]:
            problems.append(f"{where}: Version {meta_field(meta, 'Version')}, pyproject says {dist.version}")
        if meta_field(meta, "Requires-Python") != [dist.requires_python]:
            problems.append(f"{where}: Requires-Python {meta_field(meta, 'Requires-Python')}")
        if meta_field(meta, "License-Expression") != [LICENSE_EXPRESSION]:
            problems.append(f"{where}: License-Expression {meta_field(meta, 'License-Expression')}, "
                            f"expected {LICENSE_EXPRESSION}")
        if meta["license_text"] != license_text:
            problems.append(f"{where}: no dist-info/licenses/LICENSE equal to the repository's "
                            f"({meta['license_files']})")
        for key in ("Summary", "Author", "Keywords", "Description-Content-Type"):
            if not meta_field(meta, key):
                problems.append(f"{where}: no {key}")
        classifiers = meta_field(meta, "Classifier")
        if not classifiers or meta["unknown_classifiers"] or meta["deprecated_classifiers"]:
            problems.append(f"{where}: classifiers missing, unknown {meta['unknown_classifiers']} or deprecated "
                            f"{meta['deprecated_classifiers']}")
        if any(c.startswith("License ::") for c in classifiers):
            problems.append(f"{where}: a License :: classifier beside License-Expression (PEP 639 forbids both)")
        requirements = [Requirement(r) for r in meta_field(meta, "Requires-Dist")]
        unbounded = [str(r) for r in requirements if not r.specifier]
        if unbounded:
            problems.append(f"{where}: Requires-Dist without a version range: {unbounded}")
        for requirement in requirements:  # sibling distributions must accept the versions built with them
            if requirement.name in versions and versions[requirement.name] not in requirement.specifier:
                problems.append(f"{where}: requires {requirement}, which excludes the {requirement.name} "
                                f"{versions[requirement.name]} built beside it")
        if dist.name == CORE:
            extras = set(meta_field(meta, "Provides-Extra"))
            if not {"deepspeed", "megatron"} <= extras:
                problems.append(f"{where}: Provides-Extra {sorted(extras)}, expected deepspeed and megatron")
            by_extra = {str(r.marker): r for r in requirements if r.marker}
            deepspeed = by_extra.get('extra == "deepspeed"')
            if deepspeed is None or deepspeed.name != "deepspeed" or deepspeed_version not in deepspeed.specifier:
                problems.append(f"{where}: the deepspeed extra ({deepspeed}) excludes the pinned {deepspeed_version}")
            if 'extra == "megatron"' not in by_extra:
                problems.append(f"{where}: the megatron extra requires nothing")
        wanted, unwanted = ENTRY_POINTS.get(dist.name, (set(), set()))
        declared = set(meta["entry_points"])
        if not wanted <= declared:
            problems.append(f"{where}: entry points {sorted(wanted - declared)} are missing ({sorted(declared)})")
        if stray := sorted(e for e in declared if e.split(":")[0] in unwanted):
            problems.append(f"{where}: declares {stray}, which belong to {EMULATION} (emulation/pyproject.toml)")
    if problems:
        raise CheckFailed("\n".join(problems))
    return f"{len(distributions)} distributions"


def check_info(venv: Venv, distributions: list[Distribution], logs: Path, cwd: Path) -> str:
    stdout = run([str(venv.bin("devshim")), "info", "--json"], log=logs / "devshim-info.log", cwd=cwd,
                 env=clean_env(DEVSHIM_CPU_DEVICE_COUNT="2"), timeout=300)
    info = json.loads(stdout)
    expect(info["selected"] == "cpu_reference", f"devshim info selected {info['selected']!r}: {info['reason']}")
    found = {p["name"]: p for p in info["plugins"]}
    expect(set(PLUGINS) <= set(found), f"devshim info found the plugins {sorted(found)}, expected {list(PLUGINS)}")
    expected_versions = {d.name: d.version for d in distributions}
    wrong = {n: (p["distribution"], p["version"]) for n, p in found.items()
             if expected_versions.get(p["distribution"]) != p["version"]}
    expect(not wrong, f"plugins found in distributions other than the wheels just built: {wrong}")
    expect(info["versions"][CORE] == expected_versions[CORE], f"devshim info reports {CORE} {info['versions'][CORE]}")
    return f"selected cpu_reference ({info['reason']})"


# DEVSHIM_AUTO activates devshim inside the process's first `import torch` (_devshim_startup), not before
STARTUP_PROBE = "import json, sys, torch; print(json.dumps('devshim_core.auto' in sys.modules))"


def check_startup_switch(venv: Venv, logs: Path, cwd: Path) -> str:
    for value, expected in (("1", True), ("", False)):
        env = clean_env(DEVSHIM_AUTO=value) if value else clean_env()
        stdout = run([str(venv.python), "-c", STARTUP_PROBE], log=logs / f"startup-{value or 'unset'}.log", cwd=cwd,
                     env=env, timeout=300)
        expect(json.loads(stdout) is expected, f"with DEVSHIM_AUTO={value!r}, devshim_core.auto imported by the "
               f"first `import torch`: {not expected}, expected {expected}: is {PTH} in the venv's site-packages?")
    return f"{PTH} activates devshim at the first `import torch` only when DEVSHIM_AUTO=1"


def check_demo(venv: Venv, logs: Path, cwd: Path) -> str:
    """The Makefile's demo, from the venv: 2 ranks of ZeRO-2 through the launcher, sized by devshim."""
    extensions = cwd / "torch_extensions"
    extensions.mkdir()
    report_path = cwd / "demo-report.json"
    env = clean_env(DEVSHIM_AUTO="1", DEVSHIM_CPU_DEVICE_COUNT="2", OMP_NUM_THREADS="1",
                    TORCH_EXTENSIONS_DIR=str(extensions), PATH=f"{venv.path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    script = ROOT / "examples" / "train_gpt.py"
    stdout = run([str(venv.bin("deepspeed")), "--master_port", str(free_port()), str(script),
                  "--zero-stage", "2", "--steps", str(DEMO_STEPS), "--report", str(report_path)],
                 log=logs / "demo.log", cwd=cwd, env=env, timeout=DEMO_TIMEOUT)
    expect(report_path.is_file(), f"the demo exited 0 but wrote no report; its output ends:\n{tail(stdout)}")
    report = json.loads(report_path.read_text())
    ranks = report["ranks"]
    expect(report["rank_count"] == 2 and [r["rank"] for r in ranks] == [0, 1],
           f"the demo ran {report['rank_count']} ranks, expected 2 (did DEVSHIM_AUTO size the launcher?)")
    through_devshim = all(r["plugin"] == "cpu_reference" and r["accelerator"] == "DevshimAccelerator"
                          # armed by the first line, applied when the script imported deepspeed
                          and str(r["deepspeed_integration"]).startswith("applied when deepspeed is imported")
                          for r in ranks)
    expect(through_devshim and report["accelerator_module"] == "devshim_core.integrations.deepspeed.accelerator",
           "a rank did not train through devshim: " + json.dumps([{k: r[k] for k in (
               "rank", "plugin", "accelerator", "deepspeed_integration")} for r in ranks]))
    expect(report["optimizer_steps"] == DEMO_STEPS and len(report["losses"]) == DEMO_STEPS,
           f"the demo took {report['optimizer_steps']} optimizer steps, expected {DEMO_STEPS}")
    built = sorted(str(p.relative_to(extensions)) for p in extensions.rglob("*"))  # a JIT build leaves anything
    expect(not built, f"TORCH_EXTENSIONS_DIR is no longer empty after the demo, something was JIT-compiled: {built}")
    return f"2 ranks, loss {report['losses'][0]:.3f} -> {report['losses'][-1]:.3f}, nothing JIT-compiled"


def check_conformance_kit(venv: Venv, logs: Path, cwd: Path) -> str:
    """devshim's conformance kit as a vendor runs it on an installed devshim-core: pytest finds it through the
    wheel's pytest11 entry point, and its suite and job scripts are in the wheel. megatron-core is not installed
    here (only the deepspeed extra), so the Megatron job is skipped, saying so."""
    run([str(venv.python), "-m", "pip", "install", "--quiet", dev_pin("pytest"), "-c", str(ROOT / "constraints.txt")],
        log=logs / "kit-install.log", cwd=cwd, env=clean_env(), timeout=600)
    report = cwd / "kit.xml"
    run([str(venv.python), "-m", "pytest", "--devshim-plugin=cpu_reference", "-p", "no:cacheprovider", "-q",
         f"--junitxml={report}"], log=logs / "kit.log", cwd=cwd, env=clean_env(DEVSHIM_CPU_DEVICE_COUNT="2"),
        timeout=DEMO_TIMEOUT)
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    ran = {c.get("name", "").split("[")[0] for c in cases if c.find("skipped") is None}
    expect({"test_the_losses_and_final_parameters_match_one_host_process",
            "test_the_accelerator_method_behaves_as_declared"} <= ran,
           f"the kit did not run its DeepSpeed checks from the wheel; it ran {sorted(ran)}")
    skips = sorted({skip.get("message", "") for c in cases if (skip := c.find("skipped")) is not None})
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    return f"{len(cases) - skipped} passed, {skipped} skipped: {'; '.join(skips)}"


def check_emulated_info(venv: Venv, logs: Path, cwd: Path) -> str:
    """``DEVSHIM_EMULATE=ascend devshim info`` from the wheels: devshim-core finds the emulator through its
    ``devshim.emulation`` entry point, the simulated torch_npu (package data of devshim-emulation's wheel) comes up
    on the emulated device, built from the wheel's C++ source (or loaded from this machine's cache, keyed by that
    source's hash), and the ascend plugin is selected on it."""
    stdout = run([str(venv.bin("devshim")), "info", "--json"], log=logs / "devshim-info-emulated.log", cwd=cwd,
                 env=clean_env(DEVSHIM_EMULATE="ascend", DEVSHIM_EMULATE_DEVICES="2"), timeout=DEMO_TIMEOUT,
                 what_to_do="see the log: a compiler missing for the emulator's first build is named there")
    info = json.loads(stdout)
    expect(info["selected"] == "ascend", f"DEVSHIM_EMULATE=ascend devshim info selected {info['selected']!r}: "
           f"{info['reason']}")
    expect(str(info.get("emulation", "")).startswith("EMULATED DEVICE -- NOT HARDWARE"),
           f"no emulation notice in devshim info: {info.get('emulation')!r}")
    emulator = info["host"]["emulator"]
    expect(emulator["state"] == "built", f"the emulator is {emulator['state']} after an emulated run: {emulator}")
    return f"selected ascend on {info['device']['device_count']} emulated npu devices ({emulator['library']})"


def check_uninstall(venv: Venv, facts: dict[str, Any], logs: Path, cwd: Path) -> str:
    site_packages = [Path(p) for p in facts["site_packages"]]
    expect(any((p / PTH).is_file() for p in site_packages), f"{PTH} is not in site-packages after install")
    run([str(venv.python), "-m", "pip", "uninstall", "-y", CORE], log=logs / "uninstall.log", cwd=cwd,
        env=clean_env(), timeout=300)
    left = [str(p / name) for p in site_packages for name in (PTH, "devshim_core")
            if (p / name).exists()] + [str(s) for s in (venv.bin("devshim"),) if s.exists()]
    expect(not left, f"pip uninstall {CORE} left {left} behind (a file the wheel's RECORD does not list)")
    return f"{PTH} installed and removed with {CORE}"


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="build and install in DIR (new or empty) and keep it: sources, dist/, venv/, logs/")
    args = parser.parse_args(argv)
    if args.keep:
        if args.keep.exists() and any(args.keep.iterdir()):
            parser.error(f"--keep {args.keep} is not empty")
        work = args.keep.resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="devshim-wheels-"))
    logs, scratch = work / "logs", work / "run"
    logs.mkdir()
    scratch.mkdir()  # the cwd of every command in the venv: not the work tree, so nothing imports from it
    venv = Venv(work / "venv")
    checks = Checks()
    started = time.perf_counter()
    try:
        distributions = load_distributions()
        checks.run("build frontend", check_build_frontend, fatal=True)
        checks.run("stage the sources", lambda: stage_sources(work / "src"), fatal=True)
        artifacts = checks.run("build sdists and wheels", lambda: build_all(distributions, work / "src",
                                                                             work / "dist", logs), fatal=True)
        assert artifacts is not None
        checks.run("wheel contents", lambda: check_archives(distributions, artifacts))
        checks.run("fresh venv", lambda: create_venv(venv, logs, scratch), fatal=True)
        checks.run("install the wheels (not editable)", lambda: install(venv, distributions, artifacts, logs, scratch),
                   fatal=True)
        facts = checks.run("probe the installed packages", lambda: probe(venv, distributions, logs, scratch),
                           fatal=True)
        assert facts is not None
        checks.run("imported from the venv's site-packages", lambda: check_import_locations(facts, venv))
        checks.run("native libraries load", lambda: check_native(facts))
        checks.run("installed metadata", lambda: check_metadata(facts, distributions))
        checks.run("devshim info --json", lambda: check_info(venv, distributions, logs, scratch))
        checks.run("DEVSHIM_AUTO start-up switch", lambda: check_startup_switch(venv, logs, scratch))
        checks.run("2-rank DeepSpeed demo", lambda: check_demo(venv, logs, scratch))
        checks.run("conformance kit from the wheel", lambda: check_conformance_kit(venv, logs, scratch))
        checks.run("DEVSHIM_EMULATE=ascend devshim info", lambda: check_emulated_info(venv, logs, scratch))
        checks.run(f"pip uninstall {CORE} removes {PTH}", lambda: check_uninstall(venv, facts, logs, scratch))
    except Aborted as aborted:
        print(f"   (stopped: the checks after '{aborted}' depend on it)")
    print(checks.summary(time.perf_counter() - started))
    if checks.failed:
        print(f"work directory kept for inspection: {work}")
        return 1
    if args.keep:
        print(f"kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
