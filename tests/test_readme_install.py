"""Spec: the README's install commands, run exactly as written from a copy of this checkout into a fresh venv (not
``make``'s ``.venv``, no system site-packages), give a working devshim: ``devshim --version``, ``devshim info`` with
``cpu_reference`` selected, and ``import devshim_core.auto``.

The commands are the lines of the code block between ``<!-- install-from-checkout -->`` and
``<!-- /install-from-checkout -->`` in README.md, each run by bash with the fresh venv first on PATH (so ``pip`` is
that venv's pip). The checkout is copied first (tracked and untracked, not ignored, files: a fresh clone plus local
edits), so pip's in-tree build leaves nothing in the working tree. pip reads this machine's own configuration (its
local wheel mirrors); torch's wheel is the bulk of the time (a few minutes in all on two cores).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugin_fixtures import PROJECT_DIR, checked_json, clean_env, run

README = PROJECT_DIR / "README.md"
BEGIN, END = "<!-- install-from-checkout -->", "<!-- /install-from-checkout -->"
COMMAND_TIMEOUT = 1200  # seconds for one pip command (torch's wheel, cold)


def readme_install_commands(text: str) -> list[str]:
    """The command lines of the one fenced code block between the markers (blank lines dropped)."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    block = re.fullmatch(r"\s*```[a-z]*\n(.*?)```\s*", text[start:end], re.DOTALL)
    assert block, f"README.md: the text between {BEGIN} and {END} must be one fenced code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_gives_two_install_commands_and_names_every_device_plugin():
    text = README.read_text()
    commands = readme_install_commands(text)
    assert len(commands) == 2, commands
    assert commands[0].startswith("pip install torch==")
    assert commands[1].split("#")[0].split() == ["pip", "install", "./", "./kernels", "./plugins/cpu_reference"]
    for plugin in ("ascend", "sophgo", "cuda"):
        assert f"pip install ./plugins/{plugin}" in text
    assert "pip install devshim-core devshim-ascend" in text


def copy_checkout(destination: Path) -> None:
    """This checkout's tracked and untracked-but-not-ignored files, as a fresh clone with local edits would have."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=PROJECT_DIR,
                            capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = PROJECT_DIR / name
        if source.is_file():  # a tracked file deleted in the working tree is listed too
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def venv_env(venv: Path) -> dict[str, str]:
    """A shell in which ``pip`` and ``python`` are the fresh venv's: no project venv, no PYTHONPATH, no switches."""
    env = clean_env()
    project_venv = str(PROJECT_DIR / ".venv")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(project_venv)]
    env.update(PATH=os.pathsep.join([str(venv / "bin"), *path]), VIRTUAL_ENV=str(venv))
    env.pop("PYTHONHOME", None)
    return env


@pytest.mark.e2e
def test_the_readme_install_commands_give_a_working_devshim_in_a_fresh_venv(tmp_path):
    commands = readme_install_commands(README.read_text())
    checkout, venv = tmp_path / "checkout", tmp_path / "venv"
    copy_checkout(checkout)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = venv_env(venv)

    timings = []
    for command in commands:
        started = time.monotonic()
        result = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT)
        timings.append(f"{command.split('#')[0].strip()}: {time.monotonic() - started:.0f} s")
        assert result.returncode == 0, (f"README command failed: {command}\nstdout:\n{result.stdout[-3000:]}\n"
                                        f"stderr:\n{result.stderr[-3000:]}")
    print("README install:", "; ".join(timings))

    # outside the copied checkout, so that only what pip installed is importable
    version = run([venv / "bin" / "devshim", "--version"], env, cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.splitlines()[0] == "devshim-core 0.1.0"
    assert {"devshim-kernels 0.1.0", "devshim-cpu-reference 0.1.0 (plugin cpu_reference)"} <= set(
        version.stdout.splitlines())

    info = checked_json(run([venv / "bin" / "devshim", "info", "--json"], env, cwd=tmp_path))
    assert (info["selected"], info["reason"]) == ("cpu_reference", "the only available plugin")
    assert info["versions"]["torch"].startswith(commands[0].split("==")[1].split()[0])
    assert (info["host"]["runtime"]["plugin"], info["host"]["runtime"]["error"]) == ("cpu_reference", None)
    text = run([venv / "bin" / "devshim", "info"], env, cwd=tmp_path)
    assert text.returncode == 0 and "selected: cpu_reference" in text.stdout, text.stderr

    auto = run([venv / "bin" / "python", "-c", "import devshim_core.auto, devshim_core, devshim_kernels\n"
                                               "print(devshim_core.__file__)\nprint(devshim_kernels.__file__)"],
               env, cwd=tmp_path)
    assert auto.returncode == 0, auto.stderr
    for location in auto.stdout.splitlines():
        assert location.startswith(str(venv)) and "site-packages" in location, auto.stdout
