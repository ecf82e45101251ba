"""Spec: every devshim variable, command-line flag and test a page of the docs names exists.

The guides (migration guides included) tell users which ``DEVSHIM_*`` variable to set, which ``devshim`` flag to
pass, and which test proves a claim. A renamed switch, a removed flag or a renamed test would leave a guide
pointing at nothing; this spec reads every page and checks each name against the code.
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from devshim_core import switches

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("plugins/*/README.md")])
# names a page shows on purpose although no switch has them, with why
NOT_SWITCHES = {"DEVSHIM_PLUGN": "the misspelling whose warning the user guide shows"}


def mentions(pattern: str) -> list[tuple[str, str]]:
    """``(page, match)`` for every match of ``pattern`` on every page."""
    return [(str(page.relative_to(ROOT)), found) for page in PAGES
            for found in re.findall(pattern, page.read_text(encoding="utf-8"))]


def test_every_devshim_variable_a_page_names_is_a_declared_switch():
    declared = {switch.name for switch in switches.SWITCHES}
    unknown = sorted({(page, name) for page, name in mentions(r"\bDEVSHIM_[A-Z0-9_]*[A-Z0-9]\b")
                      if name not in declared and name not in NOT_SWITCHES})
    assert not unknown, f"pages name variables no switch declares (devshim_core/switches.py): {unknown}"


@cache
def help_of(command: str) -> str:
    done = subprocess.run([sys.executable, "-m", "devshim_core", command, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_devshim_flag_a_page_names_exists():
    used = {(page, command, flag) for page, (command, rest) in mentions(r"`devshim (\w+)((?: [^`]*)?)`")
            if " / " not in rest  # a list of commands ("devshim info / plugins / ... / --version"), not a call
            for flag in re.findall(r"(--[a-z][a-z-]*)", rest)}
    assert used, "no page names a devshim flag: the pattern no longer matches the docs"
    unknown = sorted((page, f"devshim {command} {flag}") for page, command, flag in used
                     if flag not in help_of(command))
    assert not unknown, f"pages name flags the CLI does not have: {unknown}"


def test_every_test_of_ours_a_page_names_exists():
    ours = {path.name: path for path in ROOT.glob("tests/**/test_*.py")}
    named = {(page, file, test) for page, (file, test) in mentions(r"(test_\w+\.py)::(\w+)") if file in ours}
    assert len(named) > 10, "the pattern no longer finds the docs' test references"
    missing = sorted((page, f"{file}::{test}") for page, file, test in named
                     if not re.search(rf"\bdef {re.escape(test)}\b|\bclass {re.escape(test)}\b",
                                      ours[file].read_text(encoding="utf-8")))
    assert not missing, f"pages name tests that do not exist: {missing}"


@pytest.mark.parametrize("name", sorted(NOT_SWITCHES))
def test_the_deliberate_non_switches_are_still_shown(name):
    assert any(found == name for _, found in mentions(r"\bDEVSHIM_[A-Z0-9_]*[A-Z0-9]\b")), \
        f"{name} is no longer on any page: remove it from NOT_SWITCHES"
