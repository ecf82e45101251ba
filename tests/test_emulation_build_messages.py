"""Spec: the emulated device's first build tells the user on stderr what it builds, for which vendor and device, where,
and that it takes about a minute once; then how long it took. A process that finds another one building says which
process it waits for, and how long it waits at most.

The compiler is replaced in these specs: what they check is what the user reads around the compile step, in a
fresh DEVSHIM_CACHE_DIR. The real build happens at most once per machine, in the shared cache (tests/test_emulation.py
and the emulated suites load it); the e2e spec here reads ``devshim info`` over it."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from devshim_emulation import build
from plugin_fixtures import DEVSHIM_SCRIPT, PYTHON, clean_env, run


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A fresh cache, nothing loaded, build tools present, a compile step that writes the library it would."""
    monkeypatch.setenv("DEVSHIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DEVSHIM_EMULATE", "ascend")
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "missing_build_tools", list)
    compiled = []

    def compile_step(directory, name):  # directory: the build's private one, inside the build directory
        compiled.append(directory)
        (directory / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(build, "_compile", compile_step)
    monkeypatch.setattr(build, "_import_library", lambda path, name: path)
    return compiled


def test_the_first_build_says_what_it_builds_where_and_how_long_before_and_how_long_it_took_after(fresh, capsys):
    library = build.load_extension()
    directory = build.build_directory()
    assert [private.parent for private in fresh] == [directory] and library.parent == directory
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"devshim: building devshim's emulated npu device for ascend (DEVSHIM_EMULATE=ascend) into "
                        f"{directory}: a C++ extension compiled once per machine and torch version, which takes "
                        "about a minute on 2 cores; later runs load it")
    assert lines[1].startswith("devshim: built devshim's emulated npu device for ascend (DEVSHIM_EMULATE=ascend) in ")
    assert lines[1].endswith(" s") and lines[1].split()[-2].isdigit()
    assert len(lines) == 2


def test_a_later_run_loads_the_build_silently(fresh, capsys, monkeypatch):
    build.load_extension()
    capsys.readouterr()
    monkeypatch.setattr(build, "_loaded", None)  # a new process
    build.load_extension()
    assert [private.parent for private in fresh] == [build.build_directory()]  # compiled once
    assert capsys.readouterr().err == ""


def test_the_message_names_the_sophgo_device_or_no_vendor_when_none_was_asked_for(fresh, capsys, monkeypatch):
    monkeypatch.setenv("DEVSHIM_EMULATE", "sophgo")
    assert build._what() == "devshim's emulated tpu device for sophgo (DEVSHIM_EMULATE=sophgo)"
    monkeypatch.delenv("DEVSHIM_EMULATE")  # a plugin author's own enable_device()
    build.load_extension()
    assert capsys.readouterr().err.startswith("devshim: building devshim's emulated device into ")


OTHER_PROCESS = """\
import sys, time
from pathlib import Path
from devshim_emulation import build

go = Path(sys.argv[1])

def compile_step(directory, name):  # this process's build: done when the test says so
    while not go.exists():
        time.sleep(0.05)
    (directory / f"{name}.so").write_bytes(b"")

build.missing_build_tools = list
build._compile = compile_step
build._import_library = lambda path, name: path
build.load_extension()
"""


def test_a_process_that_finds_another_building_names_it_waits_then_loads_that_build(fresh, capsys, tmp_path):
    directory, go = build.build_directory(), tmp_path / "go"
    env = clean_env(pythonpath=[Path(build.__file__).resolve().parents[1]],
                    DEVSHIM_CACHE_DIR=os.environ["DEVSHIM_CACHE_DIR"])
    other = subprocess.Popen([PYTHON, "-c", OTHER_PROCESS, str(go)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    loaded, said = [], []
    try:
        deadline = time.monotonic() + 60
        while build.build_state()[0] != "building" or not (directory / ".lock").read_text():  # its pid, recorded
            assert other.poll() is None and time.monotonic() < deadline, "the other process never started building"
            time.sleep(0.05)
        waiter = threading.Thread(target=lambda: loaded.append(build.load_extension()))
        waiter.start()
        while "devshim: waiting" not in "".join(said):
            assert time.monotonic() < deadline, "load_extension never said that it waits"
            time.sleep(0.05)
            said.append(capsys.readouterr().err)
        assert waiter.is_alive()
        go.touch()  # the other process's build is done
        waiter.join(30)
        assert other.wait(30) == 0
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert loaded and fresh == []  # it loaded the other process's build and compiled nothing
    said.append(capsys.readouterr().err)
    assert "".join(said) == (f"devshim: waiting for process {other.pid} on host {socket.gethostname()} that is "
                             f"building devshim's emulated npu device for ascend (DEVSHIM_EMULATE=ascend) in "
                             f"{directory} (about a minute, once; devshim waits up to 10 minutes)\n")


@pytest.mark.e2e
def test_under_devshim_emulate_devshim_info_reports_the_machines_emulator_built_and_the_emulated_cann_version():
    """The user's path, compiler and all, on the machine's shared cache: the emulator is compiled at most once per
    machine (and so per CI run), so this run builds it only if nothing did before, and then announces it in the two
    lines specified above."""
    env = clean_env(DEVSHIM_EMULATE="ascend", DEVSHIM_CACHE_DIR=str(build.cache_root()))
    result = run([DEVSHIM_SCRIPT, "info"], env, timeout=900)
    assert result.returncode == 0, result.stderr
    announced = [line for line in result.stderr.splitlines() if line.startswith("devshim: buil")]
    assert len(announced) in (0, 2), announced
    if announced:
        assert announced[0].startswith("devshim: building devshim's emulated npu device for ascend ")
        assert announced[1].startswith("devshim: built devshim's emulated npu device for ascend")
    directory = build.build_directory()
    assert f"  emulator       built: {directory}/devshim_emulated_device_" in result.stdout
    assert "  runtime        (ascend) CANN emulated-by-devshim, torch_npu 2.13.0+devshim.emulated" in result.stdout
